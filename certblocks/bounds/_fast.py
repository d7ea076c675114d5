"""The fast spectral bound's machinery: a float64 Gram matrix (by row chunks and upper blocks), a Krylov estimate of
its largest eigenvalue, a Cholesky factorization that proves it (raised) an upper bound, and the split of one
matrix's work between CPU threads.

The derivation and every rounding term: the module docstring of :mod:`certblocks.bounds.norms` ("The fast bound",
"Two threads on one matrix", "Why the Gram matrix stays in float64").  :func:`certblocks.bounds.norms.op_norm` and
its siblings are the API; nothing here is public but :data:`UNIT_ROUNDOFF` and :data:`FAST_STEPS`, which they
re-export.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

#: float64 unit roundoff.
UNIT_ROUNDOFF = 2.0**-53
#: The relative raises ``tau`` of the Krylov estimate tried in turn by the fast bound (``t = theta (1 + tau)``).
FAST_STEPS = (1e-4, 1e-3, 1e-2, 1e-1, 0.5)
#: Krylov iteration of the fast bound: at most this many steps, stopped when the estimate moved by less than
#: ``_KRYLOV_TOL`` (relative) over the last ``_KRYLOV_EVERY`` steps; when the first factorization fails (the
#: estimate stalled on a second eigenvalue), run again with at least twice the steps and a 100x tighter tolerance
#: before raising ``tau``.
_KRYLOV_STEPS = 96
_KRYLOV_TOL = 1e-5
_KRYLOV_EVERY = 4
#: Block size of the blocked Cholesky factorization on the CPU.
_CHOL_BLOCK = 192
#: Rows of the Cholesky panel solved in one triangular solve (the pieces split between threads).
_PANEL_ROWS = 512
#: Absolute error of one float64 operation that underflows (the smallest normal: covers flush-to-zero too).
_ETA = 2.0**-1022


def _gamma(n: int) -> float:
    nu = n * UNIT_ROUNDOFF
    return nu / (1.0 - nu)


def _up(x: float, ops: int = 1) -> float:
    """``x >= 0`` raised past the rounding of ``ops`` float64 operations that produced it."""
    return x * (1.0 + 2.0 * (ops + 1) * UNIT_ROUNDOFF)


#: The pool that splits one matrix's float64 work (Gram blocks, Cholesky updates) between the caller's CPU threads,
#: set by :func:`_split_work` around one fast bound; ``None``: every task in the calling thread.
_POOL: contextvars.ContextVar[Optional[ThreadPoolExecutor]] = contextvars.ContextVar("certblocks_norms_pool",
                                                                                      default=None)
_WORKERS: contextvars.ContextVar[int] = contextvars.ContextVar("certblocks_norms_workers", default=1)


@contextlib.contextmanager
def _split_work(workers: int) -> Iterator[None]:
    """Inside the block, :func:`_run` spreads its tasks over ``workers`` threads (none when ``workers <= 1``).

    Entered inside :func:`one_thread`: each worker reads the thread count (one) when it starts, so every torch op
    runs on one thread, as in the calling thread.  The tasks write disjoint parts of their outputs, each computed by
    the same operations as in one thread: the values are the same, bit for bit, whatever the number of workers.
    """
    if workers <= 1:
        yield
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="certblocks-gram", initializer=torch.get_num_threads) as pool:
        token, count = _POOL.set(pool), _WORKERS.set(workers)
        try:
            yield
        finally:
            _WORKERS.reset(count)
            _POOL.reset(token)


def _run(tasks: Sequence[Callable[[], Any]]) -> None:
    """Run ``tasks`` (independent, writing disjoint memory) on the pool of :func:`_split_work`, or in order here."""
    pool = _POOL.get()
    if pool is None or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    inference = torch.is_inference_mode_enabled()  # an inference tensor is written in inference mode only

    def call(task: Callable[[], Any]) -> None:
        with torch.inference_mode(inference), torch.no_grad():
            task()

    for future in [pool.submit(call, task) for task in tasks]:
        future.result()


def _workers() -> int:
    """How many threads :func:`_run` may use: ``torch.get_num_threads()`` (read before `norms.one_thread`)."""
    return _WORKERS.get()


def _copy_by_rows(dst: torch.Tensor, src: torch.Tensor, scale: Optional[torch.Tensor] = None,
                  negate: bool = False) -> None:
    """``dst[:] = src`` (times ``scale``, broadcast over the batch, when given; negated with ``negate``) for batches
    ``(B, r, k)``, the rows split between the threads of :func:`_split_work`."""
    r = dst.shape[1]
    step = -(-r // _workers())

    def rows(r0: int) -> None:
        part = dst[:, r0:r0 + step]
        if negate:
            torch.neg(src[:, r0:r0 + step], out=part)
        else:
            part.copy_(src[:, r0:r0 + step])
        if scale is not None:
            part.mul_(scale)

    _run([functools.partial(rows, r0) for r0 in range(0, r, step)])


def _block_rows(k: int) -> List[Tuple[int, int]]:
    """The block rows ``[i0, i1)`` of a ``k x k`` Gram matrix (up to 8 of about 192 columns or more)."""
    parts = min(8, max(1, round(k / 192)))
    width = -(-k // parts)
    return [(i0, min(i0 + width, k)) for i0 in range(0, k, width)]


def _gram_upper_into(a: torch.Tensor, g: torch.Tensor, accumulate: bool) -> None:
    """``g``'s upper block triangle ``(+)= A^T A`` for a float64 batch ``a`` ``(B, r, k)``; block row ``i`` paired
    with block row ``-1 - i`` (the same work in each task: the triangle's short and long rows)."""
    rows = _block_rows(a.shape[-1])

    def block_row(i0: int, i1: int) -> None:
        g[..., i0:i1, i0:].baddbmm_(a[..., i0:i1].mT, a[..., i0:], beta=1.0 if accumulate else 0.0)

    def pair_rows(pair: List[Tuple[int, int]]) -> None:
        for r in pair:
            block_row(*r)

    pairs = [[rows[i], rows[-1 - i]] if 2 * i + 1 < len(rows) else [rows[i]] for i in range((len(rows) + 1) // 2)]
    _run([functools.partial(pair_rows, pair) for pair in pairs])


def _gram_mirror(g: torch.Tensor) -> None:
    """Copy ``g``'s upper triangle to its lower one (each lower block the transpose of its upper one, and inside each
    diagonal block the same): ``g`` exactly symmetric.  A product ``X^T X`` alone is not on every CPU (the BLAS
    kernels' order of summation can differ between the two triangles of a diagonal block)."""
    rows = _block_rows(g.shape[-1])
    k = g.shape[-1]

    def mirror(i0: int, i1: int) -> None:
        if i1 < k:
            g[..., i1:, i0:i1] = g[..., i0:i1, i1:].mT
        d = g[..., i0:i1, i0:i1]
        d.copy_(d.triu() + d.triu(1).mT)  # exact: each entry plus a zero

    _run([functools.partial(mirror, *r) for r in rows])


def _block_gram(a: torch.Tensor) -> torch.Tensor:
    """``fl(A^T A)`` for a float64 batch ``(B, m, k)``: only the upper block triangle multiplied (up to 8 column
    blocks, split between the threads of :func:`_split_work`), each lower block the transpose of its upper one; every
    entry an inner product of length ``m`` (module docstring, fast bound step 1)."""
    if len(_block_rows(a.shape[-1])) == 1:
        g = a.mT @ a
        _gram_mirror(g)
        return g
    g = a.new_empty(a.shape[0], a.shape[-1], a.shape[-1])
    _gram_upper_into(a, g, accumulate=False)
    _gram_mirror(g)
    return g


#: Rows read into float64 at a time for a Gram matrix (about 64 MB of float64 per chunk): a large matrix (an
#: embedding table) is never copied whole into float64.
GRAM_CHUNK_ELEMENTS = 1 << 23


def _row_chunked_gram(a: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fl(A^T A)`` of a batch ``(B, m, k)`` read into float64 in chunks of rows (each multiplied by ``scale``, a
    power of two per matrix of shape ``(B, 1, 1)``, when given), the chunks' products accumulated into the upper
    block triangle.  Every entry is still an inner product of length ``m``, summed in another order: the rounding
    bound of step 1 (``gamma_m |A|^T |A|``) holds for any order of summation.  On the CPU the conversion and the
    blocks are split between the threads of :func:`_split_work`."""
    B, m, k = a.shape
    rows = max(1, GRAM_CHUNK_ELEMENTS // max(B * k, 1))
    if rows >= m and a.dtype == torch.float64 and scale is None:
        return _block_gram(a)
    buf = torch.empty((B, min(rows, m), k), dtype=torch.float64, device=a.device)
    g = torch.empty((B, k, k), dtype=torch.float64, device=a.device)
    for r0 in range(0, m, rows):
        chunk = a[:, r0:r0 + rows]
        part = buf[:, :chunk.shape[1]]
        _copy_by_rows(part, chunk, scale)  # exact: a wider dtype, times a power of two
        _gram_upper_into(part, g, accumulate=r0 > 0)
    _gram_mirror(g)
    return g


def _cholesky_completes(shifted: torch.Tensor) -> List[bool]:
    """Whether the float64 Cholesky factorization of each matrix of ``shifted`` (overwritten) runs to completion.

    On the CPU a right-looking blocked factorization (diagonal blocks by LAPACK, the panel by a triangular solve,
    the trailing lower block columns by matrix products: the same inner products in another order, so the same
    error bound, module docstring step 3), about 1.5x faster than one LAPACK call on one thread; elsewhere one call.
    The panel's rows and the trailing block columns are split between the threads of :func:`_split_work` (disjoint
    writes, the same operations: the same factor).
    """
    n = shifted.shape[-1]
    if shifted.device.type != "cpu" or n <= 2 * _CHOL_BLOCK:
        return [i == 0 for i in torch.linalg.cholesky_ex(shifted)[1].cpu().tolist()]
    ok = torch.ones(shifted.shape[0], dtype=torch.bool)
    workers = _workers()
    for j in range(0, n, _CHOL_BLOCK):
        e = min(j + _CHOL_BLOCK, n)
        l11, info = torch.linalg.cholesky_ex(shifted[..., j:e, j:e])
        ok &= info.cpu() == 0
        if not bool(ok.any()):
            break  # no matrix of the batch factors: nothing left to decide
        if e < n:
            panel = shifted[..., e:, j:e]

            def solve(r0: int, l11: torch.Tensor = l11, panel: torch.Tensor = panel) -> None:
                # L21 = A21 L11^{-T}, by pieces of rows of a fixed size (the same pieces for any number of workers)
                r1 = r0 + _PANEL_ROWS
                panel[..., r0:r1, :] = torch.linalg.solve_triangular(l11.mT, panel[..., r0:r1, :], upper=True,
                                                                     left=False)

            _run([functools.partial(solve, r0) for r0 in range(0, n - e, _PANEL_ROWS)])
            cols = list(range(e, n, _CHOL_BLOCK))

            def update(c0s: List[int], e: int = e, panel: torch.Tensor = panel) -> None:
                for c0 in c0s:  # in place: A22 - L21 L21^T, no product allocated
                    c1 = min(c0 + _CHOL_BLOCK, n)
                    shifted[..., c0:, c0:c1].baddbmm_(panel[..., c0 - e:, :], panel[..., c0 - e:c1 - e, :].mT,
                                                      alpha=-1.0)

            # block column c0 costs (n - c0): dealt round-robin from both ends, the workers get about the same work
            order = [cols[i // 2] if i % 2 == 0 else cols[-1 - i // 2] for i in range(len(cols))]
            _run([functools.partial(update, order[w::workers]) for w in range(min(workers, len(cols)))])
    return ok.tolist()


def _krylov_top(g: torch.Tensor, *, tol: float = _KRYLOV_TOL, min_steps: int = 0,
                max_steps: int = _KRYLOV_STEPS) -> Tuple[List[float], int]:
    """Estimates of ``lambda_max`` of each symmetric ``(k, k)`` matrix of the batch ``g``: Lanczos with full
    reorthogonalization (classical Gram-Schmidt twice), in float32 (an estimate needs no more: the Cholesky
    factorization decides), the largest eigenvalue of the tridiagonal matrix every :data:`_KRYLOV_EVERY` steps.

    A fixed pseudo-random start (the same values every run).  An exhausted direction (an invariant subspace: an
    orthogonal matrix, a low-rank one: what is left after the orthogonalization is rounding) continues from a fresh
    pseudo-random direction with ``beta = 0``: the tridiagonal matrix splits there, each block a subspace's.
    Stops after ``min_steps`` at the earliest.  Returns the estimates and the number of steps taken.
    """
    B, k = g.shape[0], g.shape[-1]
    steps = min(max_steps, k)
    # float32 after dividing by the largest diagonal entry (|g_ij| <= max g_ii for a Gram matrix): no underflow; a
    # plain conversion (faster) when every top entry lies in [2^-60, 2^60] (nothing the estimate needs underflows)
    top = g.diagonal(dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)
    G = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    if bool(((top >= 2.0**-60) & (top <= 2.0**60)).all()):
        _copy_by_rows(G, g)
        top = torch.ones_like(top)
    else:
        G.copy_(g / top[:, None, None])
    gen = torch.Generator(device=g.device)
    gen.manual_seed(0x5EED)
    V = G.new_zeros(B, steps + 1, k)  # the basis, one vector per row
    v = torch.randn(B, k, generator=gen, dtype=torch.float32, device=g.device)
    V[:, 0] = v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    alphas: List[torch.Tensor] = []
    betas: List[torch.Tensor] = []
    prev: Optional[torch.Tensor] = None
    theta = torch.zeros(B, dtype=torch.float64)
    def orthogonalized(x: torch.Tensor, basis: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` ``(B, k, 1)`` less its components along ``basis``' rows, twice (``c``: the first coefficients)."""
        x = torch.baddbmm(x, basis.mT, torch.bmm(basis, x) if c is None else c, alpha=-1.0)
        return torch.baddbmm(x, basis.mT, torch.bmm(basis, x), alpha=-1.0)

    for j in range(steps):  # a few fused batched products a step: the loop's cost is per-call overhead
        basis = V[:, :j + 1]
        w = torch.bmm(G, V[:, j, :, None])  # (B, k, 1)
        c = torch.bmm(basis, w)  # (B, j + 1, 1): the coefficients along the basis, alpha_j the last
        alphas.append(c[:, j, 0])
        size = torch.linalg.vector_norm(w, dim=(-2, -1))
        w = orthogonalized(w, basis, c)
        b = torch.linalg.vector_norm(w, dim=(-2, -1))
        spent = b <= 1e-5 * size  # what is left is rounding: restart from a fresh direction, beta = 0
        if j + 1 < steps and bool(spent.any()):
            fresh = orthogonalized(torch.randn(B, k, 1, generator=gen, dtype=torch.float32, device=g.device), basis)
            w = torch.where(spent[:, None, None], fresh, w)
            b = torch.where(spent, torch.zeros_like(b), b)
        betas.append(b)
        V[:, j + 1] = (w / torch.linalg.vector_norm(w, dim=(-2, -1), keepdim=True).clamp_min(1e-30))[..., 0]
        if (j + 1) % _KRYLOV_EVERY == 0 or j + 1 == steps:
            t = torch.diag_embed(torch.stack(alphas, -1).to(device="cpu", dtype=torch.float64))
            if j:
                off = torch.diag_embed(torch.stack(betas[:-1], -1).to(device="cpu", dtype=torch.float64), 1)
                t = t + off + off.mT
            theta = torch.linalg.eigvalsh(t)[..., -1]
            if j + 1 >= min_steps and prev is not None and bool(((theta - prev).abs() <= tol * theta.abs()).all()):
                break
            prev = theta
    return [max(float(x), 0.0) * float(f) for x, f in zip(theta, top.cpu())], j + 1


def _fast_bounds(a: torch.Tensor, tight_sq: Callable[[torch.Tensor, torch.Tensor], float]) -> List[float]:
    """The fast bounds of ``||A_i||_2`` for a real floating batch ``(B, m, k)`` with ``k <= m`` (the norms module
    docstring, "The fast bound", steps 1 to 4); ``inf`` for a matrix with a NaN or an infinity.  ``tight_sq(A, G)``:
    the tight bound of ``||A||_2^2`` from a float64 matrix and its Gram matrix, for a matrix no step factors."""
    B, m, k = a.shape
    u = UNIT_ROUNDOFF
    out: List[Optional[float]] = [None] * B
    exps = [0] * B
    if a.dtype == torch.float64:  # only a float64 matrix can overflow or underflow its float64 Gram matrix
        for i, x in enumerate(a.abs().amax(dim=(-2, -1)).cpu().tolist()):
            if not math.isfinite(x):
                out[i] = math.inf
            elif x != 0.0 and abs(math.frexp(x)[1]) > 300:
                exps[i] = math.frexp(x)[1]
    todo = [i for i in range(B) if out[i] is None]
    if not todo:
        return [float(x) for x in out]  # type: ignore[arg-type]
    src = a if len(todo) == B else a[todo]
    scale = torch.tensor([2.0 ** -exps[i] for i in todo], dtype=torch.float64, device=a.device).reshape(-1, 1, 1) \
        if any(exps[i] for i in todo) else None

    g = _row_chunked_gram(src, scale)
    # a NaN or an infinity reaches the diagonal (a sum of squares); >= the exact sum of the computed diagonal
    fro2 = (g.diagonal(dim1=-2, dim2=-1).sum(-1) * (1.0 + _gamma(k) + u)).cpu().tolist()
    live = []
    for j, f in enumerate(fro2):
        if not math.isfinite(f):
            out[todo[j]] = math.inf
        elif f == 0.0:
            out[todo[j]] = 0.0
        else:
            live.append(j)
    if not live:
        return [float(x) for x in out]  # type: ignore[arg-type]
    if len(live) < len(todo):
        todo, src, g, fro2 = [todo[j] for j in live], src[live], g[live], [fro2[j] for j in live]
        scale = None if scale is None else scale[live]
    d_gram = [_up(_gamma(m) * f / (1.0 - _gamma(m)) + 2.0 * k * m * _ETA, 4) for f in fro2]
    theta, used = _krylov_top(g)
    pending = list(range(len(todo)))
    c_k = _gamma(k + 1) / (1.0 - _gamma(k + 1))
    schedule = [(FAST_STEPS[0], False), (FAST_STEPS[0], True)] + [(tau, False) for tau in FAST_STEPS[1:]]
    for tau, refine in schedule:
        if not pending:
            break
        gp = g if len(pending) == len(todo) else g[pending]
        if refine:  # the estimate stalled: a longer, tighter Krylov run on what is left
            again = _krylov_top(gp, tol=_KRYLOV_TOL / 100, min_steps=min(k, 2 * used + 16),
                                max_steps=4 * _KRYLOV_STEPS)[0]
            for idx, j in enumerate(pending):
                theta[j] = max(theta[j], again[idx])
        ts = [theta[j] * (1.0 + tau) + 1e-300 for j in pending]  # > 0: a zero estimate still shifts
        shifted = torch.empty_like(gp)
        _copy_by_rows(shifted, gp, negate=True)
        shifted.diagonal(dim1=-2, dim2=-1).add_(torch.tensor(ts, dtype=g.dtype, device=g.device).reshape(-1, 1))
        sd = shifted.diagonal(dim1=-2, dim2=-1).abs()
        trace = (sd.sum(-1) * (1.0 + _gamma(k) + u)).cpu().tolist()
        top = sd.amax(-1).cpu().tolist()
        completes = _cholesky_completes(shifted)
        still = []
        for idx, j in enumerate(pending):
            if not completes[idx]:
                still.append(j)
                continue
            d_eta = 16.0 * k * (k + 2.0 + max(1.0, top[idx])) * _ETA
            lam = _up(ts[idx] + u * top[idx] + c_k * trace[idx] + d_eta + d_gram[j], 8)
            out[todo[j]] = _unscale(lam, m, k, exps[todo[j]])
        pending = still
    for j in pending:  # no step factored: the tight path on the same Gram matrix (its float64 matrix read again)
        a64 = src[j].to(torch.float64) * (1.0 if scale is None else float(scale[j]))
        out[todo[j]] = _unscale(tight_sq(a64, g[j]), m, k, exps[todo[j]])
    return [float(x) for x in out]  # type: ignore[arg-type]


def _unscale(lam: float, m: int, k: int, e: int) -> float:
    """``2^e (sqrt(lam) + sqrt(m k) eta)`` rounded up: the bound of the unscaled matrix (fast bound step 4)."""
    root = _up(math.sqrt(lam), 1)
    if e:
        root = _up(root + math.sqrt(m * k) * _ETA, 1)
    return math.ldexp(root, e)

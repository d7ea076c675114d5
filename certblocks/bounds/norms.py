"""Operator norms read from weights, as rigorous upper bounds (the one place they are computed).

Every function here returns a Python float that is an UPPER bound of the quantity it names, never
an estimate from below, so certificates built from them are sound.  All arithmetic is float64 on
the CPU, on one thread per operation (:func:`one_thread`: multi-threaded LAPACK and BLAS on these problems
were measured 3-1000x slower than one thread on the 2-core development machine, idle or busy); independent
computations -- a model's update certificates -- run side by side instead (:func:`concurrent_calls`: the same
values, bit for bit, about twice as fast on two cores).

**The safety margin.**  Each computed norm carries one stated relative margin, derived from the
rounding errors of the computation that produced it (``u = 2^-53``, the float64 unit roundoff):

* a sum of ``n`` non-negative float64 terms (a vector norm, a Frobenius norm) is within a relative
  ``gamma_n = n u / (1 - n u)`` of the exact sum (Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., section 3.1);
* the spectral norm of an ``m x k`` matrix (``k <= m``) is ``sqrt(lambda_max(G))`` of its small Gram
  matrix ``G = W^T W``.  Forming ``G`` in float64 perturbs it by at most ``gamma_m ||W||_F^2 <=
  gamma_m k ||W||_2^2`` in the 2-norm (Higham, section 3.5), and the symmetric eigensolver is
  backward stable: the computed eigenvalue is exact for ``G_hat + E`` with ``||E||_2 <= p(k) u
  ||G_hat||_2``; Householder tridiagonalization gives ``p(k)`` of order ``k^2`` (Higham, section
  19.3), taken here as ``p(k) = 16 k^2``.  With ``delta = gamma_m k + p(k) u (1 + gamma_m k)``,
  ``||W||_2^2 <= lambda_hat + delta ||W||_2^2``, hence ``||W||_2 <= sqrt(lambda_hat / (1 - delta))``.

:func:`margin` returns that ``delta`` for a shape; every bound here applies it.  For a 768 x 3072
matrix it is ``1.3e-9`` (``6.5e-10`` on the norm): a sound bound that is tight to nine digits.

Above :data:`EXACT_LIMIT` on the smaller side the eigenvalue problem gets slow (``k^3``); there the
Gram-power bound ``||W||_2 <= ||G^p||_F^(1/(2p))`` (``p = 2^6``) is used: rigorous, at most a factor
``k^(1/(4p))`` above the exact norm (``1.03`` at ``k = 8192``), with its own rounding margin.

Nothing is cached here: a weight can change without its version counter moving (FSDP2 gathers into
reused storage), so every call computes; callers cache whole certificates where they can tell.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "EXACT_LIMIT",
    "UNIT_ROUNDOFF",
    "concurrent_calls",
    "margin",
    "op_norm",
    "op_norm_tensor",
    "op_norms",
    "product_norm",
    "product_norms",
    "sandwich_norm",
    "vec_norm",
    "vec_inf_norm",
    "row_norm_max",
    "inf_norm",
    "rounded_up",
    "one_thread",
]

#: float64 unit roundoff.
UNIT_ROUNDOFF = 2.0**-53
#: Largest smaller side for which the spectral norm is computed exactly (symmetric eigensolver).
EXACT_LIMIT = 4096
#: Number of squarings in the Gram-power bound used above :data:`EXACT_LIMIT`.
_SQUARINGS = 6


def _gamma(n: int) -> float:
    nu = n * UNIT_ROUNDOFF
    return nu / (1.0 - nu)


def margin(m: int, k: int) -> float:
    """Relative margin ``delta`` on the squared spectral norm of an ``m x k`` matrix (see the module docstring).

    The bound returned by :func:`op_norm` is ``sqrt(lambda_hat / (1 - delta))``.
    """
    m, k = max(m, k), min(m, k)
    g = _gamma(m) * k
    return g + 16.0 * k * k * UNIT_ROUNDOFF * (1.0 + g)


def rounded_up(value: float, terms: int = 1) -> float:
    """``value`` raised by ``gamma_terms``: an upper bound of an exact non-negative sum of ``terms`` float64 terms."""
    return value * (1.0 + _gamma(max(int(terms), 1)) + UNIT_ROUNDOFF)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.complex128 if t.is_complex() else torch.float64)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread inside the block (restored after): how every certificate computes its norms."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


def _distributed() -> bool:
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def concurrent_calls(tasks: Sequence[Callable[[], Any]], *, return_exceptions: bool = False) -> List[Any]:
    """``[task() for task in tasks]``, computed on up to ``torch.get_num_threads()`` threads, every torch op on one.

    The norms' float64 linear algebra (Gram products, eigenvalues, QR) releases the GIL, so independent tasks (the
    certificates of a model's updates) run in parallel.  One thread per op is also how each runs alone
    (:func:`one_thread`), so every task computes the same values, bit for bit, as when the tasks ran one after
    another.  The thread count is process-wide state: it is set to 1 once around the pool, not per task, and each
    worker reads it when it starts (torch applies it to a new thread lazily: a worker that had not read it would
    run MKL's LAPACK on every core).  The workers run in the caller's grad mode and on its current CUDA stream (a
    weight on a GPU is read in the order the caller's stream gives).  With one thread allowed
    (``torch.get_num_threads() == 1``), or in a process of a ``torch.distributed`` group (a task may gather a
    sharded weight, a collective that every rank must issue in the same order), the tasks run in the calling
    thread, in order.

    Args:
        tasks: zero-argument callables.
        return_exceptions: put a task's exception in its place in the result instead of raising it.

    Raises:
        Exception: without ``return_exceptions``, the first task's exception in task order (after every task ran).
    """
    tasks = list(tasks)
    workers = min(torch.get_num_threads(), len(tasks))
    if workers > 1 and _distributed():
        workers = 1
    grad = torch.is_grad_enabled()
    # a worker starts on CUDA's default stream: keep the caller's (weights written on a side stream)
    stream = torch.cuda.current_stream() if workers > 1 and torch.cuda.is_initialized() else None

    def call(task: Callable[[], Any]) -> Tuple[bool, Any]:
        try:
            with torch.set_grad_enabled(grad), (contextlib.nullcontext() if stream is None
                                                else torch.cuda.stream(stream)):
                return True, task()
        except Exception as exc:  # noqa: BLE001 -- handed back, raised below in task order
            return False, exc

    with one_thread():
        if workers <= 1:
            done = [call(task) for task in tasks]
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="certblocks-norms",
                                    initializer=torch.get_num_threads) as pool:
                done = list(pool.map(call, tasks))
    if not return_exceptions:
        failure = next((value for ok, value in done if not ok), None)
        if failure is not None:
            raise failure
    return [value for _, value in done]


# ---------------------------------------------------------------------------------------------- vectors
def vec_norm(v: Optional[torch.Tensor]) -> float:
    """Euclidean norm of all entries (``0`` for ``None``), rounded up."""
    if v is None or v.numel() == 0:
        return 0.0
    return rounded_up(float(torch.linalg.vector_norm(_f64(v))), v.numel())


def vec_inf_norm(v: Optional[torch.Tensor]) -> float:
    """Largest absolute entry (``0`` for ``None``); exact."""
    if v is None or v.numel() == 0:
        return 0.0
    return float(_f64(v).abs().max())


def row_norm_max(w: torch.Tensor) -> float:
    """``||W||_{2->inf}``: the largest Euclidean norm over the last dimension (a row of a matrix), rounded up."""
    if w.numel() == 0:
        return 0.0
    if w.ndim == 0:
        return float(abs(float(w)))
    return rounded_up(float(torch.linalg.vector_norm(w.detach(), dim=-1, dtype=torch.float64).max()), w.shape[-1])


def inf_norm(w: torch.Tensor) -> float:
    """``||W||_{inf->inf}``: the largest absolute row sum over the last dimension, rounded up."""
    if w.numel() == 0:
        return 0.0
    if w.ndim == 0:
        return float(abs(float(w)))
    return rounded_up(float(_f64(w).abs().sum(-1).max()), w.shape[-1])


# ---------------------------------------------------------------------------------------------- matrices
def _gram_lambda_max(a: torch.Tensor) -> float:
    """``lambda_max`` of the small Gram matrix of each matrix in the batch ``a`` (float64), the largest."""
    m, n = a.shape[-2], a.shape[-1]
    with one_thread():
        g = a @ a.mH if m <= n else a.mH @ a
        ev = torch.linalg.eigvalsh(g)[..., -1]
    return max(float(ev.max()), 0.0)


def _gram_power_bound(w: torch.Tensor) -> float:
    """Rigorous ``||W||_2 <= ||G^p||_F^(1/(2p))``, ``G`` the small Gram matrix, ``p = 2^_SQUARINGS``.

    The Frobenius norm is pulled out before each squaring (``H_{j+1} = (H_j / f_j)^2``) and its
    logarithm kept.  Rounding: each squaring of a matrix of Frobenius norm 1 errs by at most
    ``gamma_k`` in the Frobenius norm, and the error of step ``j`` reaches the result as the power
    ``2^-(j+1)``: a relative margin ``2 k gamma_k`` on the norm covers all of them.
    """
    m, k = max(w.shape), min(w.shape)
    g = w.mT @ w if w.shape[0] >= w.shape[1] else w @ w.mT
    log_factor = 0.0
    for j in range(_SQUARINGS):
        f = float(torch.linalg.matrix_norm(g))
        if f == 0.0:
            return 0.0
        log_factor += math.log(f) * 2.0 ** (_SQUARINGS - j)
        g = g / f
        g = g @ g
    f = float(torch.linalg.matrix_norm(g))
    if f == 0.0:
        return 0.0
    p = 2.0**_SQUARINGS
    value = math.exp((math.log(f) + log_factor) / (2.0 * p))
    return value * (1.0 + margin(m, k) + 2.0 * k * _gamma(k))


def _op_norm_uncached(w: torch.Tensor) -> float:
    a = _f64(w)
    a = a.reshape(-1, a.shape[-2], a.shape[-1])
    m, k = max(a.shape[-2:]), min(a.shape[-2:])
    if k > EXACT_LIMIT:
        return max(_gram_power_bound(mat) for mat in a)
    return math.sqrt(_gram_lambda_max(a) / (1.0 - margin(m, k)))


def op_norm(w: torch.Tensor) -> float:
    """Upper bound of the spectral norm ``||W||_2`` (the largest over a batch of matrices in the last two dims).

    A 1-D tensor is a vector (its Euclidean norm), a 0-d tensor a scalar (its absolute value).  Exact up to
    the stated margin (module docstring) while the smaller side is at most :data:`EXACT_LIMIT`.

    Args:
        w: a tensor of any dtype and device (computed in float64 on the CPU).
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"op_norm expects a tensor, got {type(w).__name__}")
    if w.ndim == 0:
        return float(_f64(w).abs())
    if w.ndim == 1:
        return vec_norm(w)
    if w.numel() == 0:
        return 0.0
    return _op_norm_uncached(w)


def op_norm_tensor(w: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``||W||_2`` as a float64 0-d tensor on ``W``'s device (for parametrizations).

    Same bound as :func:`op_norm` (eigenvalue of the small Gram matrix, the same margin), computed where ``W``
    lives and without a graph: usable inside a forward without a device-to-host synchronization.
    """
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=w.device)
    a = w.detach().to(torch.float64)
    if a.ndim == 1:
        return torch.linalg.vector_norm(a) * (1.0 + _gamma(a.numel()) + UNIT_ROUNDOFF)
    m, k = max(a.shape), min(a.shape)
    with one_thread():
        g = a.mT @ a if a.shape[0] >= a.shape[1] else a @ a.mT
        lam = torch.linalg.eigvalsh(g)[-1].clamp_min(0.0)
    return torch.sqrt(lam / (1.0 - margin(m, k)))


def op_norms(w: torch.Tensor) -> List[float]:
    """Upper bounds of ``||W_i||_2`` for each matrix of a batch ``(..., m, n)``, in one eigensolver call."""
    a = _f64(w)
    a = a.reshape(-1, a.shape[-2], a.shape[-1])
    m, k = max(a.shape[-2:]), min(a.shape[-2:])
    if a.numel() == 0:
        return [0.0] * a.shape[0]
    if k > EXACT_LIMIT:
        return [_gram_power_bound(mat) for mat in a]
    with one_thread():
        g = a @ a.mH if a.shape[-2] <= a.shape[-1] else a.mH @ a
        ev = torch.linalg.eigvalsh(g)[..., -1].clamp_min(0.0)
    scale = 1.0 / (1.0 - margin(m, k))
    return [math.sqrt(float(e) * scale) for e in ev]


def product_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Upper bound of ``||A B||_2``; exact (with the margin) for a thin product through its ``k x k`` core.

    For ``A`` of shape ``(p, k)`` and ``B`` of shape ``(k, r)`` with ``k`` smaller than both outer sides (the
    heads' ``W_O^h W_V^h`` and ``W_Q^{hT} W_K^h`` are ``d x d`` of rank ``d_k``), the reduced QR factors
    ``A = Q_a R_a``, ``B^T = Q_b R_b`` give ``||A B|| = ||R_a R_b^T||`` (see :func:`product_norms`).
    """
    a64, b64 = _f64(a), _f64(b)
    if a64.ndim != 2 or b64.ndim != 2 or a64.shape[-1] != b64.shape[-2]:
        raise ValueError(f"product_norm: inner sizes differ, {tuple(a64.shape)} @ {tuple(b64.shape)}")
    p, k, r = a64.shape[0], a64.shape[1], b64.shape[1]
    if k >= min(p, r):
        fa, fb = vec_norm(a64), vec_norm(b64)
        return op_norm(a64 @ b64) + _gamma(k) * fa * fb  # |fl(AB) - AB| <= gamma_k |A| |B| entrywise
    return product_norms(a64[None], b64[None])[0]


def product_norms(a: torch.Tensor, b: torch.Tensor) -> List[float]:
    """Upper bounds of ``||A_i B_i||_2`` for batches ``(H, p, k)`` and ``(H, k, r)`` of thin products (``k`` small).

    The reduced QR factors ``A_i = Q R_a``, ``B_i^T = Q' R_b`` give ``||A_i B_i|| = ||R_a R_b^T||``, a ``k x k``
    problem, all heads in one batched call.  The QR factorization is backward stable (Higham, Thm 19.4): ``R_a``
    is exact for ``A + dA`` with ``||dA||_F <= 8 p k u ||A||_F`` (columnwise), likewise ``R_b``; the bound adds
    ``||dA|| ||B|| + ||A + dA|| ||dB||`` and the core product's rounding to the core's norm, with
    ``||A|| <= ||R_a|| + ||dA||``.
    """
    a64, b64 = _f64(a), _f64(b)
    H, p, k = a64.shape
    r = b64.shape[-1]
    with one_thread():
        ra = torch.linalg.qr(a64, mode="r")[1]
        rb = torch.linalg.qr(b64.mT, mode="r")[1]
        core = ra @ rb.mT
    fa = torch.linalg.vector_norm(a64, dim=(-2, -1)) * (1.0 + _gamma(p * k) + UNIT_ROUNDOFF)
    fb = torch.linalg.vector_norm(b64, dim=(-2, -1)) * (1.0 + _gamma(k * r) + UNIT_ROUNDOFF)
    ea, eb = 8.0 * p * k * UNIT_ROUNDOFF, 8.0 * r * k * UNIT_ROUNDOFF
    cores, nra, nrb = op_norms(core), op_norms(ra), op_norms(rb)
    out = []
    for i in range(H):
        fai, fbi = float(fa[i]), float(fb[i])
        na, nb = nra[i] + ea * fai, nrb[i] + eb * fbi
        err = ea * fai * nb + eb * (na + ea * fai) * fbi + _gamma(k) * (1.0 + ea) * (1.0 + eb) * fai * fbi
        out.append(cores[i] + err)
    return out


def sandwich_norm(a: torch.Tensor, b: torch.Tensor, lo: float, hi: float, *, a_norm: Optional[float] = None,
                  b_norm: Optional[float] = None, ab_norm: Optional[float] = None) -> float:
    """Upper bound of ``sup ||A diag(d) B||_2`` over diagonals with ``lo <= d_k <= hi``.

    Writes ``diag(d) = m I + E`` with ``m = (lo + hi) / 2`` and ``||E|| <= h = (hi - lo) / 2``: the bound is
    ``min(|m| ||A B|| + h ||A|| ||B||, max(|lo|, |hi|) ||A|| ||B||)``.

    Args:
        a: left matrix ``(p, k)``.
        b: right matrix ``(k, r)``.
        lo, hi: the range of the diagonal entries.
        a_norm, b_norm, ab_norm: precomputed upper bounds of ``||A||``, ``||B||``, ``||A B||``.
    """
    na = op_norm(a) if a_norm is None else a_norm
    nb = op_norm(b) if b_norm is None else b_norm
    mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
    crude = max(abs(lo), abs(hi)) * na * nb
    if mid == 0.0:
        return crude
    ab = product_norm(a, b) if ab_norm is None else ab_norm
    return min(abs(mid) * ab + half * na * nb, crude)

"""Operator norms read from weights, as rigorous upper bounds (the one place they are computed).

Every function here returns a Python float that is an UPPER bound of the quantity it names, never
an estimate from below, so certificates built from them are sound (``docs/theory.md section 1``: the
coefficients must be sound upper bounds).  Every norm is computed in float64 on the device the weights are on
(a GPU when the model is there; a float of the result is the only transfer).  On the CPU every operation runs on
one thread (:func:`one_thread`: multi-threaded LAPACK, the fast bound's Krylov steps and its blocked factorization
were measured 3-1000x slower than one thread on the 2-core development machine when other jobs share it);
independent computations -- a model's update certificates -- run side by side instead (:func:`concurrent_calls`:
the same values, bit for bit, about twice as fast on two cores).

**Two precisions.**  A spectral norm is computed in one of two ways (:data:`PRECISIONS`), chosen per call
(``precision=``) or for a whole computation (:func:`norm_precision`); ``"fast"`` is the default:

* ``"tight"``: the largest eigenvalue of the float64 Gram matrix from the symmetric eigensolver, raised by
  the margin below (at most ``1e-8`` relative for the shapes of today's models); above :data:`EXACT_LIMIT`
  the Gram-power bound.
* ``"fast"``: the same float64 Gram matrix, an estimate of its largest eigenvalue from a Krylov iteration, and a
  Cholesky factorization that *proves* the estimate (raised by :data:`FAST_STEPS`) an upper bound; at most a
  factor ``sqrt(1 + 1e-4)`` (plus the margins, ``1e-8``) above the tight value when the first factorization
  succeeds, which is the rule (every matrix of the benchmarks and the tests), about ``1.23`` at the last step,
  and the tight value itself when no factorization succeeds.  Matrices whose smaller side is at most
  :data:`FAST_MIN` always take the tight path (the eigensolver is as fast there).  The module
  section "The fast bound" below states its derivation.

The policy for callers: certify with the default; when a verdict or a fix is decided by less than the fast
slack (``1e-4`` relative per norm, compounded over the norms of a coefficient), recompute the segments that
decide it under ``norm_precision("tight")``.  :func:`op_norm_tensor` (used inside forwards, without a
device-to-host synchronization) is always tight.

**The safety margin of the tight path.**  Each computed norm carries one stated relative margin, derived from
the rounding errors of the computation that produced it (``u = 2^-53``, the float64 unit roundoff):

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

:func:`margin` returns that ``delta`` for a shape; every tight bound here applies it.  For a 768 x 3072
matrix it is ``1.3e-9`` (``6.5e-10`` on the norm): a sound bound that is tight to nine digits.

Above :data:`EXACT_LIMIT` on the smaller side the eigenvalue problem gets slow (``k^3``); there the
Gram-power bound ``||W||_2 <= ||G^p||_F^(1/(2p))`` (``p = 2^6``) is used: rigorous, at most a factor
``k^(1/(4p))`` above the exact norm (``1.03`` at ``k = 8192``), with its own rounding margin.

**The fast bound** (`certblocks.bounds._fast`).  ``W`` (``m x k``, ``k <= m``, any float dtype) is read in
float64 (exact); a float64 ``W`` whose largest entry lies outside ``[2^-300, 2^300]`` is multiplied by a power of
two ``2^-e`` (exact unless an entry underflows: an error of at most ``eta`` per entry, ``eta = 2^-1022``, which
also covers a flush-to-zero of a subnormal; a matrix of a narrower dtype never needs it: its products neither
overflow nor underflow in float64), and its Gram matrix ``G_hat = fl(W^T W)`` is formed blockwise (upper block row by
upper block row, the lower triangle a copy: every entry an inner product of length ``m``).  Then:

1. ``|G_hat - G| <= gamma_m |W|^T |W| + m eta`` entrywise (any order of summation, FMA or not; an underflowed
   product errs by at most ``eta``), so ``||G_hat - G||_2 <= gamma_m ||W||_F^2 + k m eta =: d_G``, with
   ``||W||_F^2 <= sum_i g_hat_ii / (1 - gamma_m)`` (the sum rounded up).
2. A Krylov iteration (Lanczos with full reorthogonalization in float32, a fixed pseudo-random start) gives
   ``theta``, an estimate of ``lambda_max(G_hat)``.  Nothing depends on its accuracy but the tightness.
3. For ``t = theta (1 + tau)``, ``tau`` the steps of :data:`FAST_STEPS` (the first one tried again after a longer
   Krylov run): ``A = t I - G_hat`` is formed (the
   diagonal ``fl(t - g_hat_ii)`` errs by at most ``u |a_ii|``, a diagonal error ``D`` with
   ``||D||_2 <= u max |a_ii|``) and factored by Cholesky in float64.  If the factorization runs to completion,
   the computed factor satisfies ``R^T R = A + dA`` with ``|dA| <= gamma_{k+1} |R^T| |R|`` (Higham, Theorem
   10.3, any order of the inner products, the blocked LAPACK variants included; Rump, "Verification of positive
   definiteness", BIT 46 (2006), for a symmetric ``A`` not known to be definite, and for underflow), hence
   ``||dA||_2 <= c_k tr(A) + d_eta`` with ``c_k = gamma_{k+1} / (1 - gamma_{k+1})`` and an underflow term
   ``d_eta = 16 k (k + 2 + max(1, max a_ii)) eta`` (generous: ``eta`` is 2^52 times the subnormal spacing).
   ``R^T R >= 0`` gives ``lambda_max(G_hat) <= t + ||D|| + ||dA||``, and Weyl's inequality
   ``lambda_max(G) <= t + ||D|| + ||dA|| + d_G``.
4. ``||W||_2 <= 2^e (sqrt(that) + sqrt(m k) eta)``, every float operation of the sum rounded up.

When no step of :data:`FAST_STEPS` factors, the tight path runs on the same ``G_hat`` (its margin covers the
blockwise Gram: the same ``gamma_m`` bound); a matrix with a NaN or an infinity has the bound ``inf``.

**Two threads on one matrix.**  On the CPU the fast bound of one matrix uses the caller's threads
(``torch.get_num_threads()``, one torch op per thread, `_fast._split_work`): the Gram matrix's block rows (row ``i``
paired with row ``-1 - i``: equal work), the row chunks' conversion to float64, the Cholesky panel (fixed pieces of
`_fast._PANEL_ROWS` rows) and its trailing block columns.  Every task writes its own entries with the operations it
would run alone, so the bound is the same, bit for bit, for any number of threads; inside :func:`concurrent_calls`
(already one matrix per thread) nothing is split.  The Krylov iteration stays on one thread (many small steps).

**Why the Gram matrix stays in float64.**  A float32 Gram matrix (half the bytes, about twice the matrix-product
rate) needs its own rounding term.  Formed from chunks of ``c`` rows in float32 (``u' = 2^-24``) and summed in
float64, ``|G_32 - G| <= gamma'_c |A|^T |A|`` entrywise (Higham, section 3.1, any order of summation; the float64
sum adds ``gamma_{m/c}`` of the same), so ``||G_32 - G||_2 <= gamma'_c rho(|A|^T |A|)``, the Perron root of
``|A|^T |A|`` (bounded from above by Collatz-Wielandt with any positive vector).  For a dense matrix with entries of
both signs this root is large against ``||A||_2^2``: about ``(2/pi) m k s^2`` against ``(sqrt(m) + sqrt(k))^2 s^2``
for i.i.d. entries of scale ``s``, a ratio of 120 to 510 on the shapes of GPT-2 and a 1B Llama at their
initialization.  The rigorous slack on the norm is then ``sqrt(1 + gamma'_c ratio) - 1``: ``2e-2`` to ``8e-2`` for
one float32 product (``c = m``), ``2e-3`` to ``8e-3`` for ``c = 512``, ``5e-4`` to ``2e-3`` for ``c = 128``, against
``5e-5`` for this bound; and on one CPU thread a float32 product per chunk took 0.86 to 1.27 times the float64
Gram matrix's time at ``c = 512`` and 1.25 to 2.9 times at ``c = 128`` (the float64 accumulation of every chunk's
``k x k`` product; computing only its upper blocks would save at most about a fifth: ``benchmarks/results/norms.md``).
A float32 Cholesky factorization is worse still: its term ``gamma'_{k+1} tr(A)`` is at most about ``k^2 u' t``
(``0.25 t`` for ``k = 2048``), ``0.02 t`` (``k = 768``) to ``0.19 t`` (``k = 2048``) on these matrices.  So the
Gram matrix and the factorization stay in float64, and the speed comes from the threads above.

Nothing is cached here: a weight can change without its version counter moving (FSDP2 gathers into
reused storage), so every call computes; callers cache whole certificates where they can tell.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from . import _fast
from ._fast import FAST_STEPS, UNIT_ROUNDOFF, _gamma, _up

__all__ = [
    "EXACT_LIMIT",
    "FAST_MIN",
    "FAST_STEPS",
    "PRECISIONS",
    "UNIT_ROUNDOFF",
    "concurrent_calls",
    "get_norm_precision",
    "margin",
    "norm_precision",
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

#: Largest smaller side for which the spectral norm is computed exactly (symmetric eigensolver).
EXACT_LIMIT = 4096
#: Number of squarings in the Gram-power bound used above :data:`EXACT_LIMIT`.
_SQUARINGS = 6
#: The precisions of a spectral norm (module docstring): ``"fast"`` (Cholesky-verified) and ``"tight"``.
PRECISIONS = ("fast", "tight")
#: Largest smaller side for which ``"fast"`` takes the tight path (the eigensolver costs no more there).
FAST_MIN = 256

_PRECISION: contextvars.ContextVar[str] = contextvars.ContextVar("certblocks_norm_precision", default="fast")


def _check_precision(precision: Optional[str]) -> str:
    if precision is None:
        return _PRECISION.get()
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    return precision


def get_norm_precision() -> str:
    """The precision a norm computed now uses when its call names none (``"fast"`` unless set by
    :func:`norm_precision`)."""
    return _PRECISION.get()


@contextlib.contextmanager
def norm_precision(precision: str) -> Iterator[None]:
    """Compute every spectral norm inside the block with ``precision`` (one of :data:`PRECISIONS`), unless a call
    names its own; restored after.  Per thread and per task (a context variable): :func:`concurrent_calls` hands it
    to its workers.

    Example: ``with norm_precision("tight"): cert = certify(model, x)`` recomputes a certificate with the
    eigensolver's bounds.

    Raises:
        ValueError: ``precision`` is not one of :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    token = _PRECISION.set(precision)
    try:
        yield
    finally:
        _PRECISION.reset(token)


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
    """``t`` in float64 (complex128 for a complex tensor) on its own device, detached."""
    return t.detach().to(dtype=torch.complex128 if t.is_complex() else torch.float64)


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
    precision = _PRECISION.get()  # a worker thread starts with the context variable's default
    # a worker starts on CUDA's default stream: keep the caller's (weights written on a side stream)
    stream = torch.cuda.current_stream() if workers > 1 and torch.cuda.is_initialized() else None

    def call(task: Callable[[], Any]) -> Tuple[bool, Any]:
        try:
            with torch.set_grad_enabled(grad), norm_precision(precision), (
                    contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)):
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


def _gram_power_bound(w: torch.Tensor, g: Optional[torch.Tensor] = None) -> float:
    """Rigorous ``||W||_2 <= ||G^p||_F^(1/(2p))``, ``G`` the small Gram matrix, ``p = 2^_SQUARINGS``.

    The Frobenius norm is pulled out before each squaring (``H_{j+1} = (H_j / f_j)^2``) and its
    logarithm kept.  Rounding: each squaring of a matrix of Frobenius norm 1 errs by at most
    ``gamma_k`` in the Frobenius norm, and the error of step ``j`` reaches the result as the power
    ``2^-(j+1)``: a relative margin ``2 k gamma_k`` on the norm covers all of them.  ``g``: the float64 Gram
    matrix of ``w`` when already formed (any order of summation: the same ``gamma_m`` bound).
    """
    m, k = max(w.shape), min(w.shape)
    if g is None:
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


def _tight_op_norms(a: torch.Tensor) -> List[float]:
    """The tight bounds of ``||A_i||_2`` for a float64 (or complex128) batch ``(B, m, n)``: eigensolver and margin,
    the Gram-power bound above :data:`EXACT_LIMIT`."""
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


def _tight_sq(a64: torch.Tensor, g: torch.Tensor) -> float:
    """The tight bound of ``||A||_2^2`` from ``A`` (``m x k``) and its float64 Gram matrix ``g`` (fallback)."""
    m, k = a64.shape
    if k > EXACT_LIMIT:
        return _up(_gram_power_bound(a64, g) ** 2, 1)
    lam = max(float(torch.linalg.eigvalsh(g)[-1]), 0.0)
    return _up(lam / (1.0 - margin(m, k)), 1)


def _matrices(w: torch.Tensor) -> torch.Tensor:
    """``w`` as a batch ``(B, m, n)`` of its last two dimensions (detached)."""
    a = w.detach()
    return a.reshape(-1, a.shape[-2], a.shape[-1])


def _fast_op_norms(a: torch.Tensor) -> Optional[List[float]]:
    """The fast bounds of a batch ``(B, m, n)``, or ``None`` where the tight path applies (a complex or integer
    tensor, a small side of at most :data:`FAST_MIN`)."""
    if a.is_complex() or not a.is_floating_point() or min(a.shape[-2:]) <= FAST_MIN or a.numel() == 0:
        return None
    if a.shape[-2] < a.shape[-1]:
        a = a.mT
    workers = torch.get_num_threads() if a.device.type == "cpu" else 1  # inside concurrent_calls: one
    with one_thread(), _fast._split_work(workers):
        return _fast._fast_bounds(a, _tight_sq)


def op_norm(w: torch.Tensor, *, precision: Optional[str] = None) -> float:
    """Upper bound of the spectral norm ``||W||_2`` (the largest over a batch of matrices in the last two dims).

    A 1-D tensor is a vector (its Euclidean norm), a 0-d tensor a scalar (its absolute value).

    Args:
        w: a tensor of any dtype and device (computed in float64 on its device).
        precision: ``"fast"`` (Cholesky-verified, at most ``sqrt(1 + 1e-4)`` above the tight value when its first
            step factors) or ``"tight"`` (the eigensolver, exact up to the stated margin while the smaller side is at
            most :data:`EXACT_LIMIT`); ``None``: :func:`get_norm_precision` (module docstring).

    Raises:
        TypeError: ``w`` is not a tensor.
        ValueError: ``precision`` is not one of :data:`PRECISIONS` or ``None``.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"op_norm expects a tensor, got {type(w).__name__}")
    mode = _check_precision(precision)
    if w.ndim == 0:
        return float(_f64(w).abs())
    if w.ndim == 1:
        return vec_norm(w)
    if w.numel() == 0:
        return 0.0
    if mode == "fast":
        fast = _fast_op_norms(_matrices(w))
        if fast is not None:
            return max(fast)
    return _op_norm_uncached(w)


def _op_norm_uncached(w: torch.Tensor) -> float:
    a = _f64(w)
    a = a.reshape(-1, a.shape[-2], a.shape[-1])
    m, k = max(a.shape[-2:]), min(a.shape[-2:])
    if k > EXACT_LIMIT:
        return max(_gram_power_bound(mat) for mat in a)
    return math.sqrt(_gram_lambda_max(a) / (1.0 - margin(m, k)))


def op_norm_tensor(w: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``||W||_2`` as a float64 0-d tensor on ``W``'s device (for parametrizations).

    The tight bound of :func:`op_norm` (eigenvalue of the small Gram matrix, the same margin), computed where ``W``
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


def op_norms(w: torch.Tensor, *, precision: Optional[str] = None) -> List[float]:
    """Upper bounds of ``||W_i||_2`` for each matrix of a batch ``(..., m, n)``, all in one batched computation.

    Args:
        w: the batch (any dtype and device).
        precision: as for :func:`op_norm`.
    """
    mode = _check_precision(precision)
    a = _matrices(w)
    if mode == "fast" and a.numel():
        fast = _fast_op_norms(a)
        if fast is not None:
            return fast
    return _tight_op_norms(_f64(a))


def product_norm(a: torch.Tensor, b: torch.Tensor, *, precision: Optional[str] = None) -> float:
    """Upper bound of ``||A B||_2``; exact (with the margin) for a thin product through its ``k x k`` core.

    For ``A`` of shape ``(p, k)`` and ``B`` of shape ``(k, r)`` with ``k`` smaller than both outer sides (the
    heads' ``W_O^h W_V^h`` and ``W_Q^{hT} W_K^h`` are ``d x d`` of rank ``d_k``), the reduced QR factors
    ``A = Q_a R_a``, ``B^T = Q_b R_b`` give ``||A B|| = ||R_a R_b^T||`` (see :func:`product_norms`).  ``precision``:
    as for :func:`op_norm`, for the spectral norms it takes.

    Raises:
        ValueError: the inner sizes differ, or ``precision`` is not one of :data:`PRECISIONS` or ``None``.
    """
    a64, b64 = _f64(a), _f64(b)
    if a64.ndim != 2 or b64.ndim != 2 or a64.shape[-1] != b64.shape[-2]:
        raise ValueError(f"product_norm: inner sizes differ, {tuple(a64.shape)} @ {tuple(b64.shape)}")
    p, k, r = a64.shape[0], a64.shape[1], b64.shape[1]
    if k >= min(p, r):
        fa, fb = vec_norm(a64), vec_norm(b64)
        # |fl(AB) - AB| <= gamma_k |A| |B| entrywise
        return op_norm(a64 @ b64, precision=precision) + _gamma(k) * fa * fb
    return product_norms(a64[None], b64[None], precision=precision)[0]


def product_norms(a: torch.Tensor, b: torch.Tensor, *, precision: Optional[str] = None) -> List[float]:
    """Upper bounds of ``||A_i B_i||_2`` for batches ``(H, p, k)`` and ``(H, k, r)`` of thin products (``k`` small).

    The reduced QR factors ``A_i = Q R_a``, ``B_i^T = Q' R_b`` give ``||A_i B_i|| = ||R_a R_b^T||``, a ``k x k``
    problem, all heads in one batched call.  The QR factorization is backward stable (Higham, Thm 19.4): ``R_a``
    is exact for ``A + dA`` with ``||dA||_F <= 8 p k u ||A||_F`` (columnwise), likewise ``R_b``; the bound adds
    ``||dA|| ||B|| + ||A + dA|| ||dB||`` and the core product's rounding to the core's norm, with
    ``||A|| <= ||R_a|| + ||dA||``.  ``precision``: as for :func:`op_norm`, for the spectral norms of the factors.
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
    cores, nra, nrb = (op_norms(x, precision=precision) for x in (core, ra, rb))
    out = []
    for i in range(H):
        fai, fbi = float(fa[i]), float(fb[i])
        na, nb = nra[i] + ea * fai, nrb[i] + eb * fbi
        err = ea * fai * nb + eb * (na + ea * fai) * fbi + _gamma(k) * (1.0 + ea) * (1.0 + eb) * fai * fbi
        out.append(cores[i] + err)
    return out


def sandwich_norm(a: torch.Tensor, b: torch.Tensor, lo: float, hi: float, *, a_norm: Optional[float] = None,
                  b_norm: Optional[float] = None, ab_norm: Optional[float] = None,
                  precision: Optional[str] = None) -> float:
    """Upper bound of ``sup ||A diag(d) B||_2`` over diagonals with ``lo <= d_k <= hi``.

    Writes ``diag(d) = m I + E`` with ``m = (lo + hi) / 2`` and ``||E|| <= h = (hi - lo) / 2``: the bound is
    ``min(|m| ||A B|| + h ||A|| ||B||, max(|lo|, |hi|) ||A|| ||B||)``.

    Args:
        a: left matrix ``(p, k)``.
        b: right matrix ``(k, r)``.
        lo, hi: the range of the diagonal entries.
        a_norm, b_norm, ab_norm: precomputed upper bounds of ``||A||``, ``||B||``, ``||A B||``.
        precision: as for :func:`op_norm`, for the norms computed here.
    """
    na = op_norm(a, precision=precision) if a_norm is None else a_norm
    nb = op_norm(b, precision=precision) if b_norm is None else b_norm
    mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
    crude = max(abs(lo), abs(hi)) * na * nb
    if mid == 0.0:
        return crude
    ab = product_norm(a, b, precision=precision) if ab_norm is None else ab_norm
    return min(abs(mid) * ab + half * na * nb, crude)

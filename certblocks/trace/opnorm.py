"""Sound upper bounds of matrix operator norms read from parameters.

``op_norm(W)`` bounds the spectral norm ``||W||_2`` of a matrix (or the largest over a
batch of matrices) by the square root of the largest eigenvalue of the Gram matrix ``W W^T``
(of the smaller side): in float64 when the smaller side is at most 256 (exact up to rounding,
covered by the relative safety factor :data:`SAFETY`), in float32 with explicit rounding
margins for larger ones (Gram error ``<= gamma_n ||W||_F^2``, eigensolver backward error).
Results are cached per tensor version.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

__all__ = ["op_norm", "inf_norm", "SAFETY"]

#: Relative safety factor applied to every computed norm (covers float64 rounding).
SAFETY = 1.0 + 1e-6

_CACHE: Dict[Tuple[int, int, Tuple[int, ...], int], float] = {}


def _key(t: torch.Tensor) -> Tuple[int, int, Tuple[int, ...], int]:
    return (id(t), t.data_ptr(), tuple(t.shape), getattr(t, "_version", 0))


def op_norm(W: torch.Tensor) -> float:
    """Upper bound of ``max_b ||W_b||_2`` over the matrices ``W_b`` in the last two dimensions.

    A 1-D tensor is a row vector (its Euclidean norm); a 0-d tensor its absolute value.
    """
    W = W.detach()
    if W.dim() == 0:
        return float(W.abs()) * SAFETY
    if W.dim() == 1:
        return float(torch.linalg.vector_norm(W.double() if not W.is_complex() else W.cdouble())) * SAFETY
    k = _key(W)
    hit = _CACHE.get(k)
    if hit is not None:
        return hit
    A = W.reshape(-1, W.shape[-2], W.shape[-1])
    m, n = A.shape[-2], A.shape[-1]
    if A.numel() == 0:
        val = 0.0
    else:
        # one thread: LAPACK's threaded eigensolver is orders of magnitude slower on a loaded machine
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                val = _gram_bound(A, m, n)
        finally:
            torch.set_num_threads(threads)
    val *= SAFETY
    if len(_CACHE) > 4096:
        _CACHE.clear()
    _CACHE[k] = val
    return val


def _gram_bound(A: torch.Tensor, m: int, n: int) -> float:
    """sqrt of an upper bound of lambda_max(A A^H) (A: batch of m x n matrices)."""
    k, inner = min(m, n), max(m, n)
    if k <= 256 or A.dtype == torch.float64 or A.is_complex():
        A = A.cdouble() if A.is_complex() else A.double()
        G = A @ A.mH if m <= n else A.mH @ A
        ev = torch.linalg.eigvalsh(G).max()
        return math.sqrt(max(float(ev.real if ev.is_complex() else ev), 0.0))
    # float32 Gram matrix and eigensolver, with rigorous rounding margins:
    # |G_hat - G| <= gamma_inner |A|^T|A| entrywise, so ||G_hat - G||_2 <= gamma_inner ||A||_F^2, and the
    # symmetric eigensolver is backward stable (eigenvalues of G_hat + E, ||E|| <= c k u ||G_hat||);
    # c = 64 is generous.
    A32 = A.float()
    G = A32 @ A32.mT if m <= n else A32.mT @ A32
    lam = float(torch.linalg.eigvalsh(G).max())
    u = 2.0**-24
    gamma = inner * u / (1 - inner * u)
    fro2 = float(torch.linalg.vector_norm(A32, dim=(-2, -1), dtype=torch.float64).max()) ** 2
    lam = max(lam, 0.0) * (1 + 64 * k * u) + gamma * fro2
    return math.sqrt(lam)


def inf_norm(W: torch.Tensor) -> float:
    """Largest absolute row sum over the last dimension (the operator norm ``inf -> inf``)."""
    W = W.detach()
    if W.dim() == 0:
        return float(W.abs())
    return float(W.abs().double().sum(-1).max()) * SAFETY

"""Operator-norm helpers and activation constants for the blocks' certificates.

Every function returns a Python float that is an UPPER bound of the quantity it
names (never an estimate from below): certificates built from them are sound.

* :func:`op_norm` -- spectral norm ``||W||_2``: exact (``torch.linalg.matrix_norm(ord=2)``
  in float64) when the smaller side of ``W`` is at most ``exact_limit``, otherwise the
  Gram-power bound ``||(W^T W)^p||_F^(1/(2p))``, which is above ``||W||_2`` and within a
  factor ``m^(1/(4p))`` of it (``m`` the smaller side).
* :func:`row_norm_max` -- ``||W||_{2->inf}``, the largest Euclidean row norm: the bound of
  ``max_k |(W x)_k|`` over ``||x||_2 <= 1`` (exact).
* :func:`sandwich_norm` -- ``sup ||A diag(d) B||_2`` over diagonals with ``lo <= d_k <= hi``.

Activation constants (derivative ranges ``phi'(R)`` and ratio ranges ``phi(z)/z``) were
computed on a fine grid in float64 and rounded outward; ``tests/blocks`` re-checks them.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..certificate import Peak

__all__ = [
    "ACT_DERIVATIVE_RANGE",
    "ACT_RATIO_RANGE",
    "SIGMOID_DERIVATIVE_MAX",
    "op_norm",
    "row_norm_max",
    "vec_norm",
    "vec_inf_norm",
    "sandwich_norm",
    "act_lipschitz",
    "fold_peak",
    "peak_poly",
    "normalized_peak",
]

#: Relative slack on every computed float64 norm (rounding of the SVD / sums).
_SLACK = 1.0 + 1e-10

#: ``[inf phi', sup phi']`` over the real line, rounded outward.
ACT_DERIVATIVE_RANGE: Dict[str, Tuple[float, float]] = {
    "relu": (0.0, 1.0),
    "gelu": (-0.128905, 1.128905),  # sup = Phi(sqrt 2) + sqrt 2 phi(sqrt 2) = 1.1289041...
    "gelu_tanh": (-0.128994, 1.128994),
    "silu": (-0.099840, 1.099840),  # sup at z = 2.3994: 1.0998393...
    "sigmoid": (0.0, 0.25),
}

#: ``[inf phi(z)/z, sup phi(z)/z]``: each of these activations is ``phi(z) = z g(z)`` with ``0 <= g <= 1``.
ACT_RATIO_RANGE: Dict[str, Tuple[float, float]] = {
    "relu": (0.0, 1.0),
    "gelu": (0.0, 1.0),
    "gelu_tanh": (0.0, 1.0),
    "silu": (0.0, 1.0),
}

#: ``sup sigmoid' = 1/4``.
SIGMOID_DERIVATIVE_MAX = 0.25


def act_lipschitz(act: str) -> float:
    """``sup |phi'|`` of a named activation."""
    lo, hi = ACT_DERIVATIVE_RANGE[act]
    return max(abs(lo), abs(hi))


def _f64(w: torch.Tensor) -> torch.Tensor:
    return w.detach().to(device="cpu", dtype=torch.float64)


def vec_norm(b: Optional[torch.Tensor]) -> float:
    """Euclidean norm of a vector (``0`` for ``None``)."""
    if b is None:
        return 0.0
    return float(torch.linalg.vector_norm(_f64(b))) * _SLACK


def vec_inf_norm(b: Optional[torch.Tensor]) -> float:
    """Largest absolute entry of a vector (``0`` for ``None``)."""
    if b is None or b.numel() == 0:
        return 0.0
    return float(_f64(b).abs().max())


def row_norm_max(w: torch.Tensor) -> float:
    """``||W||_{2->inf}``: the largest Euclidean norm of a row of ``W`` (2-D)."""
    if w.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(_f64(w), dim=-1).max()) * _SLACK


def op_norm(w: torch.Tensor, *, exact_limit: int = 2048, squarings: int = 6) -> float:
    """Spectral norm ``||W||_2`` of a matrix (or Euclidean norm of a vector), as an upper bound.

    Args:
        w: a 1-D or 2-D tensor (any dtype or device; computed in float64 on the CPU).
        exact_limit: when ``min(W.shape) <= exact_limit`` the norm is computed exactly
            with ``torch.linalg.matrix_norm(ord=2)``; above, a Gram-power upper bound is used.
        squarings: number of squarings of the Gram matrix in the bound (``p = 2^squarings``).
    """
    if w.ndim == 1:
        return vec_norm(w)
    if w.ndim != 2:
        raise ValueError(f"op_norm expects a 1-D or 2-D tensor, got shape {tuple(w.shape)}")
    if w.numel() == 0:
        return 0.0
    w64 = _f64(w)
    if min(w64.shape) <= exact_limit:
        return float(torch.linalg.matrix_norm(w64, ord=2)) * _SLACK
    return _gram_power_bound_exact(w64, squarings)


def _gram_power_bound_exact(w: torch.Tensor, squarings: int) -> float:
    """``||W||_2 <= ||G^p||_F^(1/(2p))`` with ``G = W^T W`` (small side), ``p = 2^squarings``.

    Rescales by the Frobenius norm before each squaring and keeps the logarithm of the
    pulled-out factors: if ``H_0 = G`` and ``H_{k+1} = (H_k / f_k)^2``, ``f_k = ||H_k||_F``,
    then ``G^(2^K) = H_K * prod_k f_k^(2^(K-k))``.
    """
    g = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
    log_factor = 0.0
    for k in range(squarings):
        f = float(torch.linalg.matrix_norm(g))
        if f == 0.0:
            return 0.0
        log_factor += math.log(f) * 2.0 ** (squarings - k)
        g = g / f
        g = g @ g
    f = float(torch.linalg.matrix_norm(g))
    if f == 0.0:
        return 0.0
    p = 2.0**squarings
    return math.exp((math.log(f) + log_factor) / (2.0 * p)) * (1.0 + 1e-8)


def sandwich_norm(a: torch.Tensor, b: torch.Tensor, lo: float, hi: float, *,
                  a_norm: Optional[float] = None, b_norm: Optional[float] = None) -> float:
    """Upper bound of ``sup ||A diag(d) B||_2`` over ``d`` with ``lo <= d_k <= hi``.

    Writes ``diag(d) = m I + E`` with ``m = (lo + hi) / 2`` and ``||E|| <= h = (hi - lo) / 2``:
    the bound is ``min(|m| ||A B|| + h ||A|| ||B||, max(|lo|, |hi|) ||A|| ||B||)``.

    Args:
        a: left matrix ``(p, k)``.
        b: right matrix ``(k, r)``.
        lo, hi: the range of the diagonal entries.
        a_norm, b_norm: precomputed ``||A||``, ``||B||`` (upper bounds), to avoid recomputing.
    """
    na = op_norm(a) if a_norm is None else a_norm
    nb = op_norm(b) if b_norm is None else b_norm
    mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
    crude = max(abs(lo), abs(hi)) * na * nb
    if mid == 0.0:
        return crude
    ab = op_norm(_f64(a) @ _f64(b))
    return min(abs(mid) * ab + half * na * nb, crude)


def product_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Exact ``||A B||_2`` for a thin product (``A`` is ``(p, k)``, ``B`` is ``(k, r)``, ``k`` small).

    Uses reduced QR factors, ``A = Q_a R_a`` and ``B^T = Q_b R_b``, so that
    ``||A B|| = ||R_a R_b^T||``, a ``k x k`` problem (the heads' ``W_O^h W_V^h`` and
    ``W_Q^{hT} W_K^h`` are ``d x d`` of rank ``d_k``).
    """
    a64, b64 = _f64(a), _f64(b)
    if a64.shape[1] != b64.shape[0]:
        raise ValueError(f"product_norm: inner sizes differ, {tuple(a64.shape)} @ {tuple(b64.shape)}")
    if a64.shape[1] >= min(a64.shape[0], b64.shape[1]):
        return op_norm(a64 @ b64)
    ra = torch.linalg.qr(a64, mode="r")[1]
    rb = torch.linalg.qr(b64.T, mode="r")[1]
    return op_norm(ra @ rb.T)


def fold_peak(polys: Sequence[Mapping[float, float]], what: str) -> Peak:
    """One :class:`~certblocks.certificate.Peak` bounding several polynomial bounds in ``R = ||x||``.

    Each mapping ``{power: coefficient}`` (non-negative) bounds one intermediate; the peak is their
    coefficient-wise maximum, with the middle powers folded into the top one and the constant by
    ``R^p <= R^top + 1`` (``0 < p < top``, any ``R >= 0``), so it stays a sound bound for every ``R``.

    Args:
        polys: the intermediates' bounds.
        what: the intermediate that dominates at large ``R`` (reports).
    """
    merged: Dict[float, float] = {}
    for poly in polys:
        for p, coef in poly.items():
            if p < 0 or coef < 0 or not math.isfinite(coef):
                raise ValueError(f"peak polynomial terms must be finite and non-negative, got {p}: {coef}")
            merged[float(p)] = max(merged.get(float(p), 0.0), float(coef))
    top = max((p for p, coef in merged.items() if coef > 0), default=0.0)
    middle = math.fsum(coef for p, coef in merged.items() if 0.0 < p < top)
    c = merged.get(top, 0.0) + middle if top > 0 else 0.0
    b = merged.get(0.0, 0.0) + middle if top > 0 else merged.get(0.0, 0.0)
    return Peak(top, c * _SLACK, b * _SLACK, what=what)


def peak_poly(peak: Optional[Peak], q: Optional[float] = None, c: float = 0.0, b: float = 0.0) -> Dict[float, float]:
    """``{power: coefficient}`` of a block's peak, or of its growth bound ``c R^q + b`` when it has none."""
    if peak is not None:
        return {peak.q: peak.c, 0.0: peak.b}
    if q is None:
        raise ValueError("a block without exponents has no intermediate bound")
    return {q: c, 0.0: b}


def normalized_peak(branch_peak: Optional[Peak], branch_q: Optional[float], branch_c: float, branch_b: float,
                    a_in: float, c_out: float, what: str) -> Peak:
    """Peak of a normalized update ``N_out(F(N_in(x)))``: every intermediate is a constant.

    ``N_in(x)`` is at most ``a_in``; the branch's intermediates at most its peak (or growth bound) at
    radius ``a_in``; the output at most ``c_out``.  The normalization itself is a primitive: its sum
    of squares runs in float32 or wider (torch's kernels, certblocks' norms), and should it overflow
    (past ``||x|| ~ 1.8e19``) the normalized value becomes 0, not inf or NaN.
    """
    poly = peak_poly(branch_peak, branch_q, branch_c, branch_b)
    inner = math.fsum(coef * (a_in ** p if p != 0.0 else 1.0) for p, coef in poly.items())
    return Peak(0.0, 0.0, max(a_in, inner, c_out) * _SLACK, what=what)

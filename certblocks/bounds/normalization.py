"""Normalization bounds: the output norm ``A`` and the Jacobian norm ``G`` of a per-token normalization.

For ``N(x) = g * (x - mean(x)) / sqrt(var(x) + eps) + beta`` (LayerNorm), ``g * x / sqrt(mean(x^2) + eps)``
(RMSNorm) or ``g * x / sqrt(||x||^2 + eps)`` (l2), over ``d`` features, whatever ``x`` is:

* ``||N(x)||_2 <= A = ||g||_inf sqrt(d) + ||beta||_2`` (``||g||_inf`` for l2: the normalized vector has
  norm below 1, not ``sqrt(d)``);
* ``||dN(x)||_2 <= G = ||g||_inf / sqrt(eps)`` (RMS and LayerNorm: the Jacobian of ``x / sqrt(mean x^2 +
  eps)`` is ``(I - x x^T / (d ms + d eps)) / sqrt(ms + eps)``; l2 likewise with ``||x||^2``).

A normalization over several trailing dimensions (``normalized_shape`` of ``numel`` entries, the last
of size ``d``) is bounded in the row norm over the last dimension by the same formulas with ``numel``
in place of ``d`` for ``A`` and a factor ``sqrt(numel / d)`` on ``G`` (a row is part of the normalized
group).

:func:`prenorm_jacobian` bounds ``sup_x ||J_F(N(x))|| ||J_N(x)||`` for a branch ``F`` behind ``N`` more
tightly than ``L_F(A) G``: the branch sees a large input only where the normalization's Jacobian is small.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union, cast

import torch

from .._validation import check_choice, check_real
from .norms import vec_inf_norm, vec_norm

__all__ = ["NORM_KINDS", "norm_bounds", "scalar_norm_bounds", "module_norm_bounds", "prenorm_jacobian"]

#: The normalizations bounded here.
NORM_KINDS = ("layer", "rms", "l2")


def norm_bounds(kind: str, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, *,
                numel: int, d: Optional[int] = None) -> Tuple[float, float]:
    """``(A, G)``: bounds of the output's row norm and of the Jacobian (see the module docstring).

    Args:
        kind: ``"layer"``, ``"rms"`` or ``"l2"``.
        weight: the scale ``g`` (``None``: 1).
        bias: the shift ``beta`` (``None``: 0).
        eps: the normalization's ``eps`` (must be > 0).
        numel: the number of entries normalized together.
        d: the size of the last dimension (default ``numel``).
    """
    g = 1.0 if weight is None else vec_inf_norm(weight)
    return scalar_norm_bounds(kind, g, vec_norm(bias), eps, numel=numel, d=d)


def scalar_norm_bounds(kind: str, gamma: float, beta: float, eps: float, *, numel: int,
                       d: Optional[int] = None) -> Tuple[float, float]:
    """``(A, G)`` from ``gamma >= ||g||_inf`` and ``beta >= ||beta||_2`` (see :func:`norm_bounds`)."""
    check_choice("kind", kind, NORM_KINDS)
    check_real("eps", eps, gt=0.0, note="a normalization with eps 0 has an unbounded Jacobian")
    d = numel if d is None else d
    g = gamma
    a = (g if kind == "l2" else g * math.sqrt(numel)) + beta
    jac = g / math.sqrt(eps) * math.sqrt(numel / d)
    return a * (1.0 + 2.0**-50), jac * (1.0 + 2.0**-50)


def module_norm_bounds(norm: torch.nn.Module) -> Tuple[float, float]:
    """``(A, G)`` of an ``nn.LayerNorm`` or ``nn.RMSNorm`` over its ``normalized_shape``."""
    if isinstance(norm, torch.nn.LayerNorm):
        kind = "layer"
    elif isinstance(norm, torch.nn.RMSNorm):
        kind = "rms"
    else:
        raise TypeError(f"expected nn.LayerNorm or nn.RMSNorm, got {type(norm).__name__}")
    shape = tuple(norm.normalized_shape)
    numel = math.prod(shape)
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return norm_bounds(kind, norm.weight, getattr(norm, "bias", None), eps, numel=numel, d=shape[-1])


def prenorm_jacobian(norm: torch.nn.Module, branch_jacobian: Callable[[float], float]) -> float:
    """Sound bound of ``sup_x ||J_F(N(x))|| ||J_N(x)||`` for a LayerNorm/RMSNorm ``N`` and a branch ``F``.

    With ``t = var(x) / eps`` (LayerNorm; mean square for RMSNorm), ``||N(x)|| <= rho(t) =
    ||g||_inf sqrt(d t / (1 + t)) + ||beta||`` and ``||J_N(x)|| <= ||g||_inf / sqrt(eps (1 + t))``.  On each
    interval ``[t_a, t_b]`` of a grid the product is at most ``L_F(rho(t_b)) ||g||_inf / sqrt(eps (1 + t_a))``
    (``rho`` increases, the other factor decreases), and the last interval runs to infinity; the bound is the
    largest over the grid and never above the plain product ``L_F(A) G``.

    Args:
        norm: an ``nn.LayerNorm`` or ``nn.RMSNorm`` over the last dimension.
        branch_jacobian: ``R -> L_F(R)``, nondecreasing.
    """
    ln = cast(Union[torch.nn.LayerNorm, torch.nn.RMSNorm], norm)
    d = ln.normalized_shape[-1]
    eps = ln.eps if ln.eps is not None else torch.finfo(torch.float32).eps
    g = 1.0 if ln.weight is None else vec_inf_norm(ln.weight)
    beta = vec_norm(getattr(norm, "bias", None))

    def rho(t: float) -> float:
        return g * math.sqrt(d * t / (1.0 + t)) + beta

    grid = [0.0] + [10.0 ** (k / 20.0) for k in range(-160, 161)]  # 1e-8 .. 1e8
    best = branch_jacobian(g * math.sqrt(d) + beta) * g / math.sqrt(eps * (1.0 + grid[-1]))  # tail
    for ta, tb in zip(grid[:-1], grid[1:]):
        best = max(best, branch_jacobian(rho(tb)) * g / math.sqrt(eps * (1.0 + ta)))
    return best * (1.0 + 2.0**-50)

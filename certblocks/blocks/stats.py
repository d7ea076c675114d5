"""What an attention block reports about itself: ``attention_stats()`` (the query-key coefficient, the largest logit).

Every certified attention exposes ``attention_stats(x=None, *, samples=8, kappa=True, warm=None, iters=50,
generator=None) -> dict`` (:class:`~certblocks.Attention`, :class:`~certblocks.QKNormAttention`,
:class:`~certblocks.RotaryQKNormAttention` and their adapters); the monitor and the on-data certificate read it
instead of recognizing attention classes.  The figures are diagnostics, not bounds:

* ``kappa = max_h ||W_Q^{hT} W_K^h||`` (docs/theory.md section 5: it drives the Jacobian of attention without
  QK-norm, sigma = 2) by power iteration on ``A^T A`` -- each value is ``||A v||`` for a unit ``v``, below the
  norm, reached from below; ``warm`` keeps the vectors across calls;
* ``max_logit``: the largest ``|s q_i . k_j|`` over the causal pairs (all pairs without a causal mask) of the first
  ``samples`` samples of ``x``, in float64 (user masks are not applied: the largest over a superset);
* ``qk_norm``: queries and keys are normalized (then ``kappa`` does not drive the Jacobian).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["power_norm", "query_key_kappa", "max_logit", "stats"]


def power_norm(mv: Callable[[Tensor], Tensor], rmv: Callable[[Tensor], Tensor], v: Tensor, iters: int
               ) -> Tuple[Tensor, Tensor]:
    """``iters`` power iterations on ``A^T A`` (batched over the first axis); ``(||A v||, v)`` with ``||v|| = 1``."""
    for _ in range(iters):
        v = rmv(mv(v))
        n = v.norm(dim=-1, keepdim=True)
        v = torch.where(n > 0, v / n.clamp_min(1e-300), v)
    return mv(v).norm(dim=-1), v


@torch.no_grad()
def query_key_kappa(wq: Tensor, wk: Tensor, *, warm: Optional[Dict[str, Tensor]] = None, iters: int = 50,
                    generator: Optional[torch.Generator] = None) -> float:
    """``max_h ||W_Q^{hT} W_K^h||`` from per-head weights ``wq``, ``wk`` of shape ``(H, d_k, D)`` (float64, CPU).

    ``warm["kappa"]`` (shape ``(H, D)``), when present, is the start; the vectors reached are written back.
    """
    H, _, D = wq.shape
    mv = lambda v: torch.einsum("hkd,hk->hd", wq, torch.einsum("hkd,hd->hk", wk, v))  # Wq_h^T Wk_h v
    rmv = lambda u: torch.einsum("hkd,hk->hd", wk, torch.einsum("hkd,hd->hk", wq, u))
    v0 = None if warm is None else warm.get("kappa")
    if v0 is None or tuple(v0.shape) != (H, D):
        v0 = torch.randn(H, D, generator=generator, dtype=torch.float64)
        v0 = v0 / v0.norm(dim=-1, keepdim=True)
    sigma, v = power_norm(mv, rmv, v0, iters)
    if warm is not None:
        warm["kappa"] = v
    return float(sigma.max())


@torch.no_grad()
def max_logit(q: Tensor, k: Tensor, scale: float, causal: bool) -> float:
    """Largest ``|s q_i . k_j|`` of ``q``, ``k`` ``(B, H, T, d_k)`` over the causal pairs (all pairs when not
    ``causal``), in float64; NaN counts as ``inf``."""
    logits = q.double() @ k.double().transpose(-2, -1)
    if logits.numel() == 0:
        return 0.0
    if causal:  # the pairs a query does not see count as 0 (in place: no mask, no second tensor)
        logits.tril_(logits.shape[-1] - logits.shape[-2])
    lo, hi = torch.aminmax(logits)  # max |x| = max(-min, max); times scale > 0 after (a monotone rounding)
    v = float(torch.maximum(-lo, hi) * scale)
    return math.inf if math.isnan(v) else v


def stats(head_weights: Callable[[], Dict[str, Any]], qk: Callable[[Tensor], Tuple[Tensor, Tensor]], scale: float,
          causal: bool, qk_norm: bool, x: Optional[Tensor], *, samples: int, kappa: bool,
          warm: Optional[Dict[str, Tensor]], iters: int, generator: Optional[torch.Generator]) -> Dict[str, Any]:
    """The ``attention_stats`` dict of a block (module docstring): ``head_weights()`` its per-head float64 weights
    (``wq``, ``wk``), ``qk(x)`` its queries and keys as its forward computes them (keys repeated per group)."""
    out: Dict[str, Any] = {"kappa": None, "max_logit": None, "qk_norm": qk_norm}
    if kappa:
        hw = head_weights()
        out["kappa"] = query_key_kappa(hw["wq"], hw["wk"], warm=warm, iters=iters, generator=generator)
    if x is not None:
        xs = x.detach()[:samples]
        if xs.ndim != 3:
            out["max_logit"] = math.nan
        else:
            with torch.no_grad():
                q, k = qk(xs)
            out["max_logit"] = max_logit(q, k, scale, causal)
    return out

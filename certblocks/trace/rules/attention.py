"""Attention rules: softmax, log_softmax, scaled dot-product attention, and the softmax recognizer.

A softmax is row-stochastic: bounded (``q = 0``) and its rows are probability vectors, which the
matmul rule uses (``N(P @ V) <= N(V)``).  Fused attention is an atom: ``q = q_V`` and
``sigma = max(sigma_logits + q_V, sigma_V)`` (THEORY.md section 2).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly
from ...exponents import Exponents
from ..nodes import bind_args, is_same, strip_casts, target_name
from ..values import AValue
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["SOFTMAX_JACOBIAN_MAX", "softmax_value", "recognize_softmax"]

Args = Dict[str, Any]
Shape = Tuple[int, ...]

#: ``||d softmax(z)||_2 = ||diag(p) - p p^T||_2 <= 1/2`` for every ``z``.
SOFTMAX_JACOBIAN_MAX = 0.5


def softmax_value(z: AValue, shape: Sequence[int], dim: int, name: str, deps: Tuple[str, ...] = ()) -> AValue:
    """``softmax(z)`` along ``dim`` (non-negative): row-stochastic along ``dim``."""
    nd = max(len(shape), 1)
    if dim == nd - 1:
        growth, jf = Poly.const(1.0), SOFTMAX_JACOBIAN_MAX
    else:  # a row holds entries of different distributions; a column along dim is one
        d = shape[-1]
        growth, jf = Poly.const(math.sqrt(d)), SOFTMAX_JACOBIAN_MAX * math.sqrt(d * shape[dim])
    return AValue(exps=E.compose(E.SOFTMAX, z.exps), shape=shape, growth=growth, max_abs=Poly.const(1.0),
                  jacobian=None if z.jacobian is None else z.jacobian.scale(jf), sign="+", stochastic_dim=dim - nd,
                  rule=f"{name} (row-stochastic)", deps=tuple(deps))


@register_rule("aten.softmax", "aten._softmax", "aten.special_softmax")
def softmax(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    return softmax_value(a["self"], shape, int(a["dim"]) % max(len(shape), 1), "softmax")


@register_rule("aten.log_softmax", "aten._log_softmax")
def log_softmax(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a["self"]
    dim = int(a["dim"]) % max(len(shape), 1)
    k = shape[dim]
    d = shape[-1]
    entries = x.entry_bound()
    # |z_i - logsumexp(z)| <= 2 max|z| + log k
    m = None if entries is None else entries.scale(2.0) + Poly.const(math.log(k))
    jf = (1 + math.sqrt(k)) * (math.sqrt(d * k) if dim != len(shape) - 1 else 1.0)
    return AValue(exps=E.compose(E.LIPSCHITZ, x.exps), shape=shape, growth=None if m is None else m.scale(math.sqrt(d)),
                  max_abs=m, jacobian=None if x.jacobian is None else x.jacobian.scale(jf), sign="-",
                  rule="log_softmax (Lipschitz)")


@register_rule("aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
               "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
               "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_attention_math",
               "aten._scaled_dot_product_fused_attention_overrideable")
def scaled_dot_product_attention(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    q, k, v = a["query"], a["key"], a["value"]
    mask = a.get("attn_mask", a.get("attn_bias"))
    conc = it.g.env.get(n.name)
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else shape
    extra = [] if not isinstance(conc, (tuple, list)) else \
        [AValue.unknown(tuple(c.shape) if isinstance(c, torch.Tensor) else (), "attention auxiliary output")
         for c in conc[1:]]
    if isinstance(mask, AValue) and not mask.const:
        out = AValue.unknown(out_shape, "sdpa", "attention mask depends on the input")
        return [out] + extra if extra else out
    p = float(a.get("dropout_p", 0.0) or 0.0)
    s = a.get("scale")
    s = 1.0 / math.sqrt(q.shape[-1]) if s is None else float(s)
    logits = E.product(*[t.exps for t in (q, k) if not t.const]) if not (q.const and k.const) else E.CONSTANT
    if v.const:
        ex = Exponents(0.0, logits.sigma)
    else:
        ex = Exponents(v.exps.q, None if (logits.sigma is None or v.exps.q is None or v.exps.sigma is None)
                       else max(logits.sigma + v.exps.q, v.exps.sigma))
    drop = 1.0 / (1.0 - p) if p > 0 else 1.0
    growth = None if v.growth is None else v.growth.scale(drop)
    jacobian = None
    if None not in (q.growth, k.growth, v.growth, q.jacobian, k.jacobian, v.jacobian):
        logit_jac = (q.jacobian * k.growth + q.growth * k.jacobian) * v.growth * Poly.const(2.0 * abs(s))
        jacobian = (v.jacobian + logit_jac).scale(drop)
    out = AValue(exps=ex, shape=out_shape, growth=growth, max_abs=growth, jacobian=jacobian,
                 rule="attention atom: q = q_V, sigma = max(sigma_logits + q_V, sigma_V)")
    return [out] + extra if extra else out


def recognize_softmax(it: VelocityInterpreter, n: torch.fx.Node, shape: Sequence[int]) -> Optional[AValue]:
    """exp(z) / sum(exp(z), dim, keepdim) -> softmax of z along dim."""
    e, s = n.args[0], strip_casts(n.args[1])
    if target_name(s) != "aten.sum" or not is_same(s.args[0], e):
        return None
    e0 = strip_casts(e)
    if target_name(e0) != "aten.exp":
        return None
    nd = it.g.env[e0.name].dim()
    b = bind_args(s) or {}
    dims = b.get("dim")
    if dims is None or len(dims) != 1 or not b.get("keepdim", False):
        return None
    z = e0.args[0]
    zv = it.value(z)
    if not isinstance(zv, AValue) or zv.const:
        return None
    zs = strip_casts(z)
    return softmax_value(zv, tuple(shape), int(dims[0]) % nd, "softmax written as exp/sum (recognized)",
                         deps=(zs.name if isinstance(zs, torch.fx.Node) else "",))

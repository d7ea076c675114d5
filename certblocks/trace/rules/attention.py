"""Attention rules: softmax, log_softmax, scaled dot-product attention, and the softmax recognizer.

A softmax is row-stochastic: bounded (``q = 0``) and its rows are probability vectors, which the
matmul rule uses (``N(P @ V) <= N(V)``).  Fused attention is an atom: ``q = q_V`` and
``sigma = max(sigma_logits + q_V, sigma_V)`` (docs/theory.md section 2).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ... import exponents as E
from ...bounds.norms import op_norm
from ...bounds.poly import Poly
from ...exponents import Exponents
from ..nodes import bind_args, is_same_value, strip_exact_casts, target_name
from ..values import AValue
from .common import rounding_factor, unit_roundoff
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


def _coarser(it: VelocityInterpreter, n: torch.fx.Node, k: int) -> float:
    """The relative rounding of a softmax computed in a coarser dtype than its input's (``dtype=``): ``(k + 2) u``
    for ``k`` terms (an exponential, a sum and a division per entry), else 0."""
    src = it.g.env.get(getattr(n.args[0], "name", "")) if n.args else None
    out = it.g.env.get(n.name)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return 0.0
    return 0.0 if rounding_factor(src.dtype, out.dtype) == 1.0 else (k + 2) * unit_roundoff(out.dtype)


def _maybe_minus_inf(it: VelocityInterpreter, node: Any, shape: Sequence[int]) -> Optional[torch.Tensor]:
    """The entries of ``node`` (broadcast to ``shape``) that may be ``-inf`` whatever the input, as a bool tensor;
    ``None`` when an entry may be ``+inf`` or NaN, or where the graph does not tell (an input-dependent value without
    a finite entry bound that is not one of the masking patterns below).

    Masking patterns: a constant (its ``-inf`` entries), ``z + mask`` with a constant mask, ``where(cond, z, m)``
    and ``masked_fill(z, mask, -inf)`` with a constant condition (the union where it depends on the input), each
    operand read the same way; an input-dependent value with a finite entry bound is never infinite.
    """
    if not isinstance(node, torch.fx.Node):
        v = torch.as_tensor(node, dtype=torch.float64)
        return None if bool(torch.isnan(v).any() or (v == math.inf).any()) else torch.broadcast_to(v == -math.inf,
                                                                                                   tuple(shape))
    node = strip_exact_casts(node, it.g.env)
    av = it.value_of(node.name)
    conc = it.g.env.get(node.name)
    if av is not None and av.const and isinstance(conc, torch.Tensor):
        return _maybe_minus_inf(it, conc.detach(), shape)
    if av is not None and av.entry_bound() is not None and av.entry_bound().is_finite():
        return torch.zeros(tuple(shape), dtype=torch.bool)
    name = target_name(node)
    args = bind_args(node) or {}
    try:
        if name == "aten.add" and args.get("alpha", 1) == 1:
            x, y = _maybe_minus_inf(it, args["self"], shape), _maybe_minus_inf(it, args["other"], shape)
            return None if x is None or y is None else x | y
        if name in ("aten.where", "aten.masked_fill"):
            cond_arg = args["condition"] if name == "aten.where" else args["mask"]
            a, b = (args["self"], args["other"]) if name == "aten.where" else (args["value"], args["self"])
            x, y = _maybe_minus_inf(it, a, shape), _maybe_minus_inf(it, b, shape)
            if x is None or y is None:
                return None
            cv = it.value_of(cond_arg.name) if isinstance(cond_arg, torch.fx.Node) else None
            if cv is not None and cv.const:
                return torch.where(torch.broadcast_to(it.g.env[cond_arg.name].bool(), tuple(shape)), x, y)
            return x | y
    except RuntimeError:  # shapes that do not broadcast to the softmax's input: not a mask of it
        return None
    return None


def _row_may_be_nan(it: VelocityInterpreter, n: torch.fx.Node, z: AValue, shape: Sequence[int], dim: int
                    ) -> Optional[str]:
    """Why a (log-)softmax row along ``dim`` may be NaN (every entry ``-inf``, or a ``+inf`` or NaN entry); ``None``
    when every row has a finite entry and no ``+inf`` whatever the input (``softmax`` of such a row is finite)."""
    entries = z.entry_bound()
    if entries is not None and entries.is_finite():
        return None
    pattern = _maybe_minus_inf(it, n.args[0] if n.args else None, shape)
    if pattern is None:
        return "its input has no finite entry bound and is not a constant mask of a bounded value: an entry may be " \
               "+inf or NaN, or a whole row -inf (the softmax is then NaN)"
    if bool(pattern.all(dim=dim).any()):
        return "a row of its input is -inf at every entry (a fully masked row: the softmax is NaN)"
    return None


@register_rule("aten.softmax", "aten._softmax", "aten.special_softmax", reads=("self", "dim", "dtype", "half_to_float"))
def softmax(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Probabilities along ``dim``; computed in a coarser dtype they sum to at most ``1 + (k + 2) u``.  A row that may
    be NaN (:func:`_row_may_be_nan`) is refused."""
    dim = int(a["dim"]) % max(len(shape), 1)
    why = _row_may_be_nan(it, n, a["self"], shape, dim)
    if why:
        return AValue.unknown(tuple(shape), "softmax", f"softmax: {why}")
    out = softmax_value(a["self"], shape, dim, "softmax")
    slack = _coarser(it, n, shape[dim] if shape else 1)
    if slack:
        out.row_sum = 1.0 + slack
        out.growth, out.max_abs = out.growth.scale(out.row_sum), out.max_abs.scale(out.row_sum)
    return out


@register_rule("aten.log_softmax", "aten._log_softmax", reads=("self", "dim", "dtype", "half_to_float"))
def log_softmax(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a["self"]
    dim = int(a["dim"]) % max(len(shape), 1)
    k = shape[dim] if shape else 1  # a 0-d input is one entry
    d = shape[-1] if shape else 1
    entries = x.entry_bound()
    if entries is None or not entries.is_finite():  # a -inf entry gives -inf, a row of them NaN
        return AValue.unknown(tuple(shape), "log_softmax", "log_softmax of an input without a finite entry bound: a "
                              "masked (-inf) entry gives -inf, a fully masked row NaN")
    rf = 1.0 + _coarser(it, n, k)
    # |z_i - logsumexp(z)| <= 2 max|z| + log k
    m = None if entries is None else (entries.scale(2.0) + Poly.const(math.log(k))).scale(rf)
    jf = (1 + math.sqrt(k)) * (math.sqrt(d * k) if dim != len(shape) - 1 else 1.0)
    return AValue(exps=E.compose(E.LIPSCHITZ, x.exps), shape=shape, growth=None if m is None else m.scale(math.sqrt(d)),
                  max_abs=m, jacobian=None if x.jacobian is None else x.jacobian.scale(jf), sign="-",
                  rule="log_softmax (Lipschitz)")


@register_rule("aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
               "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
               "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_attention_math",
               "aten._scaled_dot_product_fused_attention_overrideable", overloads=("default",),
               reads=("query", "key", "value", "attn_mask", "attn_bias", "dropout_p", "is_causal", "scale",
                      "enable_gqa", "return_debug_mask", "compute_log_sumexp"), default_only=("dropout_mask",))
def scaled_dot_product_attention(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> Any:
    q, k, v = a["query"], a["key"], a["value"]
    mask = a.get("attn_mask", a.get("attn_bias"))
    conc = it.g.env.get(n.name)
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else shape
    extra = [] if not isinstance(conc, (tuple, list)) else _auxiliary_outputs(it, n, a, conc)
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
        # d(P v)_i = sum_j P_ij dv_j + sum_j P_ij dz_ij (v_j - vbar_i) with dz = s (dq k^T + q dk^T): by
        # Cauchy-Schwarz in the weights P_i the second term is at most max_j |dz_ij| times the spread
        # sqrt(sum_j P_ij ||v_j - vbar_i||^2) <= max_j ||v_j - c|| for any c (_value_spread).  Dropout on P
        # breaks the centring: then sum_j |dP_ij| ||v_j|| <= 2 max_j |dz_ij| max_j ||v_j||.
        spread = v.growth if p > 0 else _value_spread(it, (bind_args(n) or {}).get("value"), v)
        logit_jac = (q.jacobian * k.growth + q.growth * k.jacobian) * spread * Poly.const((2.0 if p > 0 else 1.0)
                                                                                            * abs(s))
        jacobian = (v.jacobian + logit_jac).scale(drop)
    out = AValue(exps=ex, shape=out_shape, growth=growth, max_abs=growth, jacobian=jacobian,
                 rule="attention atom: q = q_V, sigma = max(sigma_logits + q_V, sigma_V)")
    return [out] + extra if extra else out


def _auxiliary_outputs(it: VelocityInterpreter, n: torch.fx.Node, a: Args, conc: Sequence[Any]) -> List[AValue]:
    """The outputs of a fused attention after the first: the row-wise ``logsumexp`` of the logits (the second
    output, kept for the backward), then integer seeds, offsets and sizes (constants; they never overflow a float).

    ``|s q_i . k_j| <= |s| N(q) N(k)``, so ``logsumexp_j`` of the logits plus a constant mask lies within
    ``|s| N(q) N(k) + max |mask| + log(keys)`` of zero (docs/theory.md section 2); a mask with infinite entries can
    make a row's ``logsumexp`` ``-inf`` (every key masked), so the bound is not derived then.
    """
    out: List[AValue] = []
    for k, c in enumerate(conc[1:], start=1):
        if not isinstance(c, torch.Tensor) or not (c.is_floating_point() or c.is_complex()):
            out.append(AValue.constant(c) if isinstance(c, torch.Tensor) else
                       AValue.unknown((), "attention auxiliary output"))
            continue
        out.append(_logsumexp_bound(it, n, a, tuple(c.shape)) if k == 1 else
                   AValue.unknown(tuple(c.shape), "attention auxiliary output", "a fused attention's debug output"))
    return out


def _logsumexp_bound(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Tuple[int, ...]) -> AValue:
    q, k, mask = a["query"], a["key"], a.get("attn_mask", a.get("attn_bias"))
    why = ""
    if q.growth is None or k.growth is None:
        why = "the query or key bound is not derived"
    elif isinstance(mask, AValue) and not mask.const:
        why = "the attention mask depends on the input"
    m = 0.0
    if not why and isinstance(mask, AValue):
        m = float(mask.value.double().abs().max()) if mask.value.numel() else 0.0
        if not math.isfinite(m):
            why = "the mask has infinite entries (a row of masked keys has logsumexp -inf)"
    s = a.get("scale")
    s = 1.0 / math.sqrt(q.shape[-1]) if s is None else abs(float(s))
    if why:
        return AValue.unknown(shape, "attention logsumexp", f"the logsumexp output of {n.name}: {why}")
    keys = k.shape[-2] if k.ndim >= 2 else 1
    bound = (q.growth * k.growth).scale(s) + Poly.const(m + math.log(max(keys, 1)))
    logits = E.product(*[t.exps for t in (q, k) if not t.const]) if not (q.const and k.const) else E.CONSTANT
    rows = math.sqrt(shape[-1]) if shape else 1.0
    return AValue(exps=Exponents(logits.q, None), shape=shape, growth=bound.scale(rows), max_abs=bound,
                  rule="attention logsumexp (|lse| <= |s| N(q) N(k) + max|mask| + log keys)")


#: Ops that move whole rows, or split each row into sub-rows, without mixing tokens: followed back from the
#: values of an attention to the linear map that produced them (:func:`_value_spread`).
_ROW_MOVES = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.transpose", "aten.permute", "aten.unbind",
              "aten.select", "aten.slice", "aten.clone", "aten.contiguous", "aten.alias", "aten._to_copy", "aten.to",
              "aten.expand", "getitem")


def _bias_axes(g: Any, n: torch.fx.Node, depth: int = 0) -> Optional[Tuple[torch.fx.Node, Set[int]]]:
    """Follow ``n`` back over :data:`_ROW_MOVES` to an ``aten.linear`` with a constant bias.

    Returns the linear node and the axes of ``n`` (leading, non-negative) along which the bias's image varies:
    ``n = chain(W y) + chain(bias)``, the second term a constant that depends only on those axes (each
    ``chain`` moves rows or splits them into sub-rows: ``N(chain(W y)) <= ||W|| N(y)``).  ``None`` when ``n``
    is not such a chain.
    """
    if not isinstance(n, torch.fx.Node) or n.op != "call_function" or depth > 32:
        return None
    name = target_name(n)
    out = g.env.get(n.name)
    if name == "aten.linear":
        b = (bind_args(n) or {}).get("bias")
        if b is None:  # no bias: its image is 0, constant along every axis
            return n, set()
        return (n, set()) if isinstance(b, torch.fx.Node) and b.op == "placeholder" else None
    if name not in _ROW_MOVES or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return None
    src = g.env.get(n.args[0].name)
    if name == "getitem":  # an element of unbind (or split along a leading axis): the rule of its producer
        prod = n.args[0]
        if target_name(prod) not in ("aten.unbind", "aten.split", "aten.split_with_sizes", "aten.chunk"):
            return None
        found = _bias_axes(g, prod.args[0], depth + 1)
        if found is None or not isinstance(out, torch.Tensor):
            return None
        a = bind_args(prod) or {}
        dim = int(a.get("dim", 0) or 0) % max(g.env[prod.args[0].name].dim(), 1)
        if target_name(prod) != "aten.unbind":
            return found if dim != g.env[prod.args[0].name].dim() - 1 else None
        return found[0], {x - (x > dim) for x in found[1] if x != dim}
    if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
        return None
    if name == "aten.unbind":
        return None  # its elements are followed through getitem
    found = _bias_axes(g, n.args[0], depth + 1)
    if found is None:
        return None
    lin, axes = found
    a = bind_args(n) or {}
    nd_in, nd = src.dim(), out.dim()
    if name in ("aten.view", "aten.reshape", "aten._unsafe_view"):
        shp_in, shp = tuple(src.shape), tuple(out.shape)
        if shp == shp_in:
            return found
        # split the last dimension only: (..., D) -> (..., D1, .., Dk)
        if nd <= nd_in or shp[:nd_in - 1] != shp_in[:-1] or math.prod(shp[nd_in - 1:]) != shp_in[-1]:
            return None
        return lin, axes | set(range(nd_in - 1, nd - 1))
    if name in ("aten.transpose", "aten.permute"):
        perm = list(range(nd))
        if name == "aten.transpose":
            d0, d1 = int(a["dim0"]) % nd, int(a["dim1"]) % nd
            perm[d0], perm[d1] = perm[d1], perm[d0]
        else:
            perm = [int(d) % nd for d in a["dims"]]
        if perm[-1] != nd - 1:
            return None
        return lin, {perm.index(x) for x in axes}
    if name == "aten.select":
        dim = int(a["dim"]) % nd_in
        return (lin, {x - (x > dim) for x in axes if x != dim}) if dim != nd_in - 1 else None
    if name == "aten.slice":
        return found if int(a.get("dim", 0) or 0) % nd_in != nd_in - 1 else None
    if name == "aten.expand":
        return found if nd == nd_in else None
    return found  # copies and casts


def _value_spread(it: VelocityInterpreter, node: Any, v: AValue) -> Poly:
    """A bound of ``max_j ||v_j - c_i||`` over the keys ``j`` of every query row ``i``, one ``c_i`` per row.

    ``c_i = 0`` gives ``v``'s row bound.  When the values are a linear map with a constant bias followed by row
    moves and head splits (:func:`_bias_axes`) whose bias image does not vary along the key axis, ``c_i`` is
    that image and the spread is at most ``||W|| N(y)`` (the bias cancels, as in ``v_j - vbar_i``).
    """
    found = _bias_axes(it.g, node) if isinstance(node, torch.fx.Node) else None
    if found is None or v.growth is None or len(v.shape) < 2 or (len(v.shape) - 2) in found[1]:
        return v.growth
    lin = found[0]
    b = bind_args(lin) or {}
    y, w = it.value(b.get("input")), it.value(b.get("weight"))
    if not isinstance(y, AValue) or not isinstance(w, AValue) or not w.const or y.growth is None:
        return v.growth
    return y.growth.scale(op_norm(w.value))


def recognize_softmax(it: VelocityInterpreter, n: torch.fx.Node, shape: Sequence[int]) -> Optional[AValue]:
    """exp(z) / sum(exp(z), dim, keepdim) -> softmax of z along dim."""
    e, s = n.args[0], strip_exact_casts(n.args[1], it.g.env)
    if target_name(s) != "aten.sum" or not is_same_value(s.args[0], e, it.g.env):
        return None
    e0 = strip_exact_casts(e, it.g.env)
    if target_name(e0) != "aten.exp":
        return None
    nd = it.g.env[e0.name].dim()
    b = bind_args(s) or {}
    dims = b.get("dim")
    if dims is None or len(dims) != 1 or not b.get("keepdim", False) or b.get("dtype") is not None:
        return None
    z = e0.args[0]
    zv = it.value(z)
    if not isinstance(zv, AValue) or zv.const:
        return None
    zs = strip_exact_casts(z, it.g.env)
    return softmax_value(zv, tuple(shape), int(dims[0]) % nd, "softmax written as exp/sum (recognized)",
                         deps=(zs.name if isinstance(zs, torch.fx.Node) else "",))

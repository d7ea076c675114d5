"""Division rules: ``div`` and ``addcdiv``, by a constant or by a denominator with a proven positive minimum.

A division by an input-dependent tensor ``d`` is outside the class in general (``1/d`` is unbounded near
``d = 0``).  When every entry of ``d`` is provably ``>= m > 0`` for every input (linear attention's
``num / (sum of non-negative terms + eps)``), the reciprocal ``r = 1/d`` is bounded, ``|r| <= 1/m``, and
``|dr| = |dd| / d^2 <= |dd| / m^2`` entrywise: ``r`` has exponents ``(0, sigma_d)`` (a bounded Lipschitz map of
``d``), and ``num / d = num * r`` follows the product rule of docs/theory.md section 2.

:func:`lower_bound` proves the minimum from the graph: constants (their smallest entry), values with a
proven sign ``"+"`` (minimum 0), sums ``a + alpha b`` (``alpha >= 0``), clamps and maxima from below, positive
multiples, means, and the ops that only move or copy entries.  Every minimum is carried through the rounding of
the node that computes it: round to nearest is monotone, so a value ``>= m`` computed or cast into a dtype is
``>=`` the largest number of that dtype below ``m`` (:func:`~.common.floor_in`; an ``eps`` that a cast to float16
rounds to 0 proves nothing), and a mean of ``n`` entries loses at most ``n`` roundings.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

import torch

from ... import exponents as E
from ...bounds.poly import Poly
from ..nodes import IDENTITY_OPS, VIEW_OPS, bind_args, target_name
from ..values import AValue
from .arithmetic import as_value, hadamard, linear_sum, multiply, product_shape
from .attention import recognize_softmax
from .common import floor_in, scalar_arg, sqrt_last, unit_roundoff, unknown
from .normalizations import recognize_norm
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["lower_bound", "reciprocal"]

Args = Dict[str, Any]
Shape = Tuple[int, ...]

#: Ops whose entries are entries of their first argument (a lower bound of those bounds theirs); ``copy`` and
#: ``fill_`` return their second argument's values.
_ENTRY_OPS = (IDENTITY_OPS - {"aten.copy", "aten.fill_"}) | VIEW_OPS | frozenset({
    "aten.expand", "aten.expand_as", "aten.broadcast_to", "aten.permute", "aten.transpose", "aten.t",
    "aten.slice", "aten.select", "aten.narrow", "aten.index_select", "aten.repeat", "aten.flip", "aten.roll",
    "aten.amax", "aten.amin",
})
#: How deep :func:`lower_bound` follows a denominator's producers.
_DEPTH = 24


def _const_min(v: AValue) -> Optional[float]:
    """The smallest entry of a real constant (``None`` for a complex or empty one)."""
    t = v.value
    if t is None or t.is_complex() or t.numel() == 0:
        return None
    return float(t.double().min())


def lower_bound(it: VelocityInterpreter, n: Any, depth: int = 0) -> Optional[float]:
    """A number ``m`` with every entry of ``n`` ``>= m`` for every input (``None``: none is proven).

    Args:
        it: the interpreter (abstract values of the nodes before ``n`` are known).
        n: a node argument (a node or a Python number).
        depth: the recursion depth (the search stops at a fixed depth).
    """
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return float(n)
    if not isinstance(n, torch.fx.Node) or depth > _DEPTH:
        return None
    av = it.value(n)
    if isinstance(av, AValue) and av.const:
        return _const_min(av)
    t = target_name(n)
    b = bind_args(n) or {}
    found: Optional[float] = None
    if t == "aten.add":
        alpha = 1 if b.get("alpha") is None else b["alpha"]
        if isinstance(alpha, (int, float)) and alpha >= 0:
            lo, hi = lower_bound(it, b.get("self"), depth + 1), lower_bound(it, b.get("other"), depth + 1)
            found = None if lo is None or hi is None else lo + float(alpha) * hi
    elif t in ("aten.clamp", "aten.clamp_min", "aten.maximum", "aten.fmax", "aten.max"):
        # max(a, m) >= m and >= min(a): the largest bound proven for one of the operands
        arg = b.get("min") if t in ("aten.clamp", "aten.clamp_min") else b.get("other")
        cands = [lower_bound(it, v, depth + 1) for v in (b.get("self"), arg) if v is not None]
        cands = [c for c in cands if c is not None]
        found = max(cands) if cands else None
        if t == "aten.clamp" and b.get("max") is not None and found is not None:
            top = lower_bound(it, b["max"], depth + 1)  # clamp returns max where max < min
            found = None if top is None else min(found, top)
    elif t == "aten.mul":
        lo, hi = lower_bound(it, b.get("self"), depth + 1), lower_bound(it, b.get("other"), depth + 1)
        if lo is not None and hi is not None and lo >= 0 and hi >= 0:
            found = lo * hi  # a product of entries >= lo >= 0 and >= hi >= 0
    elif t in ("aten.copy", "aten.fill_"):
        found = lower_bound(it, b.get("src", b.get("value")), depth + 1)
    elif t == "aten.mean" and n.args:
        found = lower_bound(it, n.args[0], depth + 1)
        src, out = it.g.env.get(getattr(n.args[0], "name", "")), it.g.env.get(n.name)
        if found is not None and isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor):
            # a sum of k terms >= m and a division: at most k + 1 roundings of relative size u each
            k = max(src.numel() // max(out.numel(), 1), 1)
            slack = (k + 1) * unit_roundoff(out.dtype)
            found = found * (1 - slack) if found > 0 else found * (1 + slack)
    elif t in _ENTRY_OPS and n.args:
        found = lower_bound(it, n.args[0], depth + 1)
    sign = av.sign if isinstance(av, AValue) else None
    if sign in ("+", "0"):
        found = max(found if found is not None else 0.0, 0.0)
    out = it.g.env.get(n.name)
    if found is not None and isinstance(out, torch.Tensor):
        found = floor_in(found, out.dtype)  # the node's own rounding (a cast, or the op computed in its dtype)
    return found


def reciprocal(den: AValue, m: float, rule: str) -> AValue:
    """``1 / den`` for a ``den`` whose entries are all ``>= m > 0``: bounded by ``1/m``, slope ``<= 1/m^2``."""
    return AValue(exps=E.compose(E.SATURATING, den.exps), shape=den.shape,
                  growth=Poly.const(sqrt_last(den.shape) / m), max_abs=Poly.const(1.0 / m),
                  jacobian=None if den.jacobian is None else den.jacobian.scale(1.0 / (m * m)), sign="+", rule=rule)


def _inverse(it: VelocityInterpreter, node: Any, den: Union[AValue, float]) -> Union[AValue, str]:
    """The abstract value of ``1 / den`` (``node`` its graph argument), or why it has none."""
    if not isinstance(den, AValue):
        if den == 0:
            return "division by zero"
        return AValue.constant(torch.as_tensor(1.0 / den))
    if den.const:
        if bool((den.value == 0).any()):
            return "division by a constant with zeros"
        return AValue.constant(1.0 / den.value)
    m = lower_bound(it, node)
    name = node.name if isinstance(node, torch.fx.Node) else "the denominator"
    if m is None or not m > 0 or not math.isfinite(m):
        return (f"division by an input-dependent tensor ({name}) with no proven positive lower bound is outside the "
                "certified class (not recognized as a normalization or a softmax)")
    return reciprocal(den, m, f"reciprocal of {name} >= {m:.4g} (bounded, Lipschitz)")


@register_rule("aten.reciprocal", "aten.rsqrt", reads=("self",))
def inverse_power(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``1 / z`` and ``1 / sqrt(z)`` of a ``z`` whose entries are provably ``>= m > 0`` (:func:`lower_bound`): bounded
    by ``1/m`` and ``m^(-1/2)``, with slopes ``1/m^2`` and ``m^(-3/2) / 2``: ``(0, sigma_z)``, a bounded Lipschitz map
    of ``z`` (docs/theory.md section 2).  That is how a normalization written out (HF's RMSNorm:
    ``x * rsqrt(mean(x^2) + eps)``) bounds its ``rsqrt`` node, whose value counts in the peak.  Without a proven
    minimum the op is unbounded near 0: refused."""
    z = a["self"]
    m = lower_bound(it, n.args[0] if n.args else None)
    op = target_name(n).split(".")[-1]
    if m is None or not m > 0 or not math.isfinite(m):
        out = unknown(shape, f"{op} of an input-dependent tensor with no proven positive lower bound is outside the "
                             "certified class (unbounded near 0)")
        out.sign = "+" if z.sign == "+" else None
        return out
    if op == "reciprocal":
        return reciprocal(z, m, f"reciprocal of an argument >= {m:.4g} (bounded, Lipschitz)")
    top = m ** -0.5
    return AValue(exps=E.compose(E.SATURATING, z.exps), shape=tuple(shape), growth=Poly.const(sqrt_last(shape) * top),
                  max_abs=Poly.const(top), jacobian=None if z.jacobian is None else z.jacobian.scale(0.5 * m ** -1.5),
                  sign="+", rule=f"rsqrt of an argument >= {m:.4g} (bounded by {top:.4g}, Lipschitz)")


@register_rule("aten.div", "aten.divide", "aten.true_divide", reads=("self", "other", "rounding_mode"))
def div(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x, y = a["self"], a["other"]
    if a.get("rounding_mode") is not None:
        return unknown(shape, f"div with rounding_mode={a['rounding_mode']!r} (discontinuous)")
    rec = recognize_norm(it, n, shape) or recognize_softmax(it, n, shape)
    if rec is not None:
        return rec
    inv = _inverse(it, n.args[1], y)
    if isinstance(inv, str):
        return unknown(shape, inv)
    if not isinstance(y, AValue):
        return multiply(n, x, 1.0 / y, shape)
    out = multiply(n, x, inv, shape)
    if not y.const:
        out.rule = f"div by a denominator >= a proven minimum (product with its reciprocal; {inv.rule})"
    return out


@register_rule("aten.addcdiv", reads=("self", "tensor1", "tensor2", "value"))
def addcdiv(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``self + value * tensor1 / tensor2``: the denominator is a constant without zeros, or has a proven minimum."""
    value = scalar_arg(a.get("value"), 1.0)
    if value is None or isinstance(a.get("value"), complex):
        return unknown(shape, f"addcdiv with value={a.get('value')!r} (a tensor or a complex number)")
    t1 = as_value(a["tensor1"])
    inv = _inverse(it, (bind_args(n) or {}).get("tensor2"), a["tensor2"])
    if isinstance(inv, str):
        return unknown(shape, f"addcdiv: {inv}")
    quot = hadamard(t1, inv, product_shape(t1, inv), "addcdiv")
    return linear_sum(as_value(a["self"]), quot, float(value), shape, f"addcdiv ({quot.rule}, sum rule)")

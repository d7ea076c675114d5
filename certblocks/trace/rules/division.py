"""Division rules: ``div`` and ``addcdiv``, by a constant or by a denominator with a proven positive minimum, and
the inverses of such a denominator (``reciprocal``, ``rsqrt``, ``sqrt``).

A division by an input-dependent tensor ``d`` is outside the class in general (``1/d`` is unbounded near
``d = 0``).  When every entry of ``d`` is provably ``>= m > 0`` for every input (linear attention's
``num / (sum of non-negative terms + eps)``, a router's top-k weights over their sum, RWKV's running sums), the
reciprocal ``r = 1/d`` is bounded, ``|r| <= 1/m``, and ``|dr| = |dd| / d^2 <= |dd| / m^2`` entrywise: ``r`` has
exponents ``(0, sigma_d)`` (a bounded Lipschitz map of ``d``), and ``num / d = num * r`` follows the product rule
of docs/theory.md section 2.  Likewise ``rsqrt(d) <= 1/sqrt(m)`` with slope ``<= 1 / (2 m^(3/2))`` (an RMSNorm written
out: ``rsqrt(mean(x^2) + eps)``, ``m`` the rounded ``eps``), and ``sqrt(d) <= sqrt(max |d|)`` with slope
``<= 1 / (2 sqrt(m))``.  Without a positive minimum all three are refused.

:func:`~.lower_bounds.lower_bound` proves the minimum from the graph (:mod:`.lower_bounds` lists the forms, each
carried through the rounding of the node that computes it).  A quotient recognized as a normalization, a softmax
or a normalized linear attention (:mod:`.linear_attention`) gets that primitive's tighter bound instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Tuple, Union

import torch

from ... import exponents as E
from ...bounds.poly import Poly
from ..nodes import bind_args, op_name
from ..values import AValue
from .arithmetic import as_value, hadamard, linear_sum, multiply, product_shape
from .attention import recognize_softmax
from .common import scalar_arg, sqrt_last, unknown
from .linear_attention import recognize_linear_attention
from .lower_bounds import lower_bound
from .normalizations import recognize_norm
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["lower_bound", "reciprocal"]  # lower_bound lives in .lower_bounds

Args = Dict[str, Any]
Shape = Tuple[int, ...]

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


@register_rule("aten.div", "aten.divide", "aten.true_divide", reads=("self", "other", "rounding_mode"))
def div(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x, y = a["self"], a["other"]
    if a.get("rounding_mode") is not None:
        return unknown(shape, f"div with rounding_mode={a['rounding_mode']!r} (discontinuous)")
    rec = recognize_norm(it, n, shape) or recognize_softmax(it, n, shape) or recognize_linear_attention(it, n, shape)
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


@register_rule("aten.reciprocal", "aten.rsqrt", "aten.sqrt", reads=("self",))
def inverse(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``1/d``, ``1/sqrt(d)`` and ``sqrt(d)`` of a ``d`` whose entries are all ``>= m > 0`` (proven): bounded (``sqrt``:
    by ``sqrt(max |d|)``) and Lipschitz.  Without such a minimum they are outside the class (unbounded, or not
    Lipschitz, near 0)."""
    d = a["self"]
    name = op_name(n.target).split(".")[-1]
    m = lower_bound(it, n.args[0])
    src = n.args[0].name if isinstance(n.args[0], torch.fx.Node) else "?"
    if m is None or not math.isfinite(m) or not m > 0:
        out = unknown(shape, f"{name} of an input-dependent tensor ({src}) with no proven positive lower bound is "
                             "outside the certified class (not Lipschitz or unbounded near a point)")
        out.sign = "+" if d.sign == "+" else None
        return out
    if name == "reciprocal":
        return reciprocal(d, m, f"reciprocal of {src} >= {m:.4g} (bounded, Lipschitz)")
    if name == "rsqrt":
        top = 1.0 / math.sqrt(m)
        return AValue(exps=E.compose(E.SATURATING, d.exps), shape=shape, growth=Poly.const(sqrt_last(shape) * top),
                      max_abs=Poly.const(top), jacobian=None if d.jacobian is None else d.jacobian.scale(0.5 / m**1.5),
                      sign="+", rule=f"rsqrt of {src} >= {m:.4g} (bounded by 1/sqrt(m), Lipschitz)")
    entries = d.entry_bound()
    root = None if entries is None else entries.power(0.5)
    return AValue(exps=E.compose(E.Exponents(0.5, 0.0), d.exps), shape=shape,
                  growth=None if root is None else root.scale(sqrt_last(shape)), max_abs=root,
                  jacobian=None if d.jacobian is None else d.jacobian.scale(0.5 / math.sqrt(m)), sign="+",
                  rule=f"sqrt of {src} >= {m:.4g} (|sqrt(d)| <= sqrt(max |d|), Lipschitz)")

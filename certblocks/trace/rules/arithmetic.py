"""Arithmetic rules: add/sub (the sum rule), mul (the product rule), div, where.

A product of two input-dependent tensors adds their exponents (THEORY.md section 2); a division by one
is outside the class unless it is recognized as a normalization (``x * rsqrt(mean(x^2) + eps)``,
``x / ||x||``, ...) or a softmax written as ``exp(z) / sum(exp(z))``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly, psum
from ..nodes import is_same, op_name, strip_casts
from ..values import AValue, max_abs, row_norm
from .common import broadcast_factor, flip_sign, scaled, sign_mul, switched, unknown
from .normalizations import recognize_norm
from .registry import register_rule

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["add", "hadamard"]

Args = Dict[str, Any]
Shape = Tuple[int, ...]


def hadamard(x: AValue, y: AValue, shape: Sequence[int], name: str) -> AValue:
    """Entrywise product (with broadcasting)."""
    sign = sign_mul(x.sign, y.sign)
    if y.const or x.const:
        act, c = (x, y) if y.const else (y, x)
        m = max_abs(c.value)
        entries = act.entry_bound()
        if broadcast_factor(act.shape, shape) != 1.0:
            # act broadcast along rows: N(out) <= max|act| * N(c)
            growth = None if entries is None else entries.scale(row_norm(c.value))
            jacobian = None if act.jacobian is None else act.jacobian.scale(row_norm(c.value))
        else:
            growth = None if act.growth is None else act.growth.scale(m)
            jacobian = None if act.jacobian is None else act.jacobian.scale(m)
        return AValue(exps=act.exps, shape=shape, growth=growth, max_abs=None if entries is None else entries.scale(m),
                      jacobian=jacobian, sign=sign, rule=f"{name} by a constant (affine)")
    fx, fy = broadcast_factor(x.shape, shape), broadcast_factor(y.shape, shape)
    xm, ym = x.entry_bound(), y.entry_bound()
    growth = jacobian = None
    if None not in (x.growth, y.growth, xm, ym):
        # N(x*y) <= N(x) max|y| (x's rows), with broadcast factors
        c1 = x.growth.scale(fx) * ym
        c2 = xm * y.growth.scale(fy)
        growth = c1 if c1.total() <= c2.total() else c2
    if None not in (x.jacobian, y.jacobian, xm, ym):
        jacobian = x.jacobian.scale(fx) * ym + xm * y.jacobian.scale(fy)
    return AValue(exps=E.product(x.exps, y.exps), shape=shape, growth=growth,
                  max_abs=None if None in (xm, ym) else xm * ym, jacobian=jacobian,
                  sign="+" if x is y else sign, rule=f"{name} of two input-dependent tensors (product)")


def multiply(n: torch.fx.Node, x: Any, y: Any, shape: Shape) -> AValue:
    """``x * y`` once no normalization was recognized (either side may be a Python number)."""
    if not isinstance(y, AValue):
        s = abs(float(y))
        sg = x.sign if float(y) > 0 else (flip_sign(x.sign) if float(y) < 0 else "0")
        out = scaled(x, shape, s, rule="mul by a scalar (affine)", sign=sg)
        out.max_abs = None if x.entry_bound() is None else x.entry_bound().scale(s)
        return out
    if not isinstance(x, AValue):
        return multiply(n, y, x, shape)
    out = hadamard(x, y, shape, "mul")
    if is_same(n.args[0], n.args[1]):
        out.sign = "+"
    return out


@register_rule("aten.mul", "aten.multiply")
def mul(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    return recognize_norm(it, n, shape) or multiply(n, a["self"], a["other"], shape)


def sum_term(v: AValue, factor: float, scale: float = 1.0) -> Optional[Poly]:
    """Row-norm bound of ``scale * v`` broadcast by ``factor`` (through its entries when broadcast)."""
    if v.const:
        return Poly.const(row_norm(v.value) * scale) if factor == 1.0 else Poly.const(max_abs(v.value) * factor * scale)
    if v.growth is None:
        return None
    if factor == 1.0:
        return v.growth.scale(scale)
    return None if v.entry_bound() is None else v.entry_bound().scale(factor * scale)


def as_value(v: Any) -> AValue:
    """An operand as an abstract value (a Python number becomes a 0-d constant)."""
    return v if isinstance(v, AValue) else AValue.constant(torch.as_tensor(float(v)))


def linear_sum(x: AValue, y: AValue, alpha: float, shape: Shape, rule: str) -> AValue:
    """``x + alpha * y`` (with broadcasting) by the sum rule: bounds add, exponents are the larger ones."""
    fx, fy = broadcast_factor(x.shape, shape), broadcast_factor(y.shape, shape)
    aa = abs(alpha)
    ysign = y.sign if alpha > 0 else (flip_sign(y.sign) if alpha < 0 else "0")
    if x.sign in ("+", "0") and ysign in ("+", "0"):
        sign = "+" if "+" in (x.sign, ysign) else "0"
    elif x.sign in ("-", "0") and ysign in ("-", "0"):
        sign = "-" if "-" in (x.sign, ysign) else "0"
    else:
        sign = None
    acts = [v.exps for v in (x, y) if not v.const]
    return AValue(exps=E.add(*acts) if acts else E.CONSTANT, shape=shape,
                  growth=psum([sum_term(x, fx), sum_term(y, fy, aa)]),
                  max_abs=psum([x.entry_bound(), None if y.entry_bound() is None else y.entry_bound().scale(aa)]),
                  jacobian=psum([None if x.jacobian is None else x.jacobian.scale(fx),
                                 None if y.jacobian is None else y.jacobian.scale(fy * aa)]),
                  sign=sign, rule=rule)


@register_rule("aten.add", "aten.sub", "aten.subtract", "aten.rsub")
def add(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x, y = a["self"], a["other"]
    alpha = a.get("alpha", 1) or 1
    name = op_name(n.target)
    if name == "aten.rsub":
        x, y = y, x
    sub = name in ("aten.sub", "aten.subtract", "aten.rsub")
    if isinstance(alpha, AValue):
        return unknown(shape, "add with a tensor alpha")
    x, y = as_value(x), as_value(y)
    if x.const and y.const:
        return AValue.constant(it.g.env[n.name])
    out = linear_sum(x, y, -float(alpha) if sub else float(alpha), shape,
                     "sub (sum rule)" if sub else "add (sum rule)")
    # x - max(x) along a dim is <= 0
    if sub and _is_max_of(*((n.args[1], n.args[0]) if name != "aten.rsub" else (n.args[0], n.args[1]))):
        out.sign = "-"
    return out


def _is_max_of(m: Any, x: Any) -> bool:
    """``m`` is amax/max(x, dim, keepdim) (possibly cast/expanded) of the same ``x``."""
    m = strip_casts(m)
    if not isinstance(m, torch.fx.Node) or m.op != "call_function":
        return False
    nm = op_name(m.target)
    if nm == "getitem":
        src = m.args[0]
        if isinstance(src, torch.fx.Node) and op_name(src.target) == "aten.max" and m.args[1] == 0:
            return strip_casts(src.args[0]) is strip_casts(x)
        return False
    if nm in ("aten.amax", "aten.max"):
        return strip_casts(m.args[0]) is strip_casts(x)
    return False


@register_rule("aten.where")
def where(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Every entry of ``where(c, x, y)`` is the entry of ``x`` or of ``y``: the sum rule bounds it whatever ``c``.
    A condition that depends on the input switches discontinuously: q is kept, sigma is not derived."""
    cond, x, y = a["condition"], a["self"], a["other"]
    xs = [v if isinstance(v, AValue) else AValue.constant(torch.as_tensor(float(v))) for v in (x, y)]
    out = add(it, n, {"self": xs[0], "other": xs[1], "alpha": 1}, shape)
    out.sign = xs[0].sign if xs[0].sign == xs[1].sign else None
    if isinstance(cond, AValue) and not cond.const:
        return switched(out, "where() with a condition that depends on the input (a discontinuous switch)")
    out.rule = "where with a constant condition (sum rule)"
    return out



def _scalar(v: Any) -> Optional[float]:
    """A Python-number argument as a float (``None`` for a tensor)."""
    if isinstance(v, AValue):
        return None
    return 1.0 if v is None else float(v)


def product_shape(x: Any, y: Any) -> Shape:
    """The broadcast shape of two operands (numbers are 0-d)."""
    return tuple(torch.broadcast_shapes(*[v.shape if isinstance(v, AValue) else () for v in (x, y)]))


@register_rule("aten.addcmul")
def addcmul(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``self + value * tensor1 * tensor2``: the product rule for the product, the sum rule for the sum.

    With one constant factor (ResMLP's affine ``addcmul(beta, alpha, x)``) the product is affine: its bound is
    the other factor's times ``max |constant|`` (:func:`hadamard`), so the result keeps the input's exponents.
    """
    value = _scalar(a.get("value", 1))
    if value is None:
        return unknown(shape, "addcmul with a tensor value")
    t1, t2 = as_value(a["tensor1"]), as_value(a["tensor2"])
    prod = hadamard(t1, t2, product_shape(t1, t2), "addcmul")
    return linear_sum(as_value(a["self"]), prod, value, shape, f"addcmul ({prod.rule}, sum rule)")


@register_rule("aten.lerp")
def lerp(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``self + weight * (end - self)``: the sum rule, and the product rule when the weight is a tensor."""
    x, end, w = as_value(a["self"]), as_value(a["end"]), a["weight"]
    diff = linear_sum(end, x, -1.0, product_shape(end, x), "lerp difference")
    if isinstance(w, AValue):
        step = hadamard(w, diff, product_shape(w, diff), "lerp")
    else:
        step = multiply(n, diff, float(w), diff.shape)
    return linear_sum(x, step, 1.0, shape, "lerp (sum rule)")

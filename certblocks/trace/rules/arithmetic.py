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
from .attention import recognize_softmax
from .common import broadcast_factor, flip_sign, scaled, sign_mul, unknown
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


def _multiply(n: torch.fx.Node, x: Any, y: Any, shape: Shape) -> AValue:
    """``x * y`` once no normalization was recognized (either side may be a Python number)."""
    if not isinstance(y, AValue):
        s = abs(float(y))
        sg = x.sign if float(y) > 0 else (flip_sign(x.sign) if float(y) < 0 else "0")
        out = scaled(x, shape, s, rule="mul by a scalar (affine)", sign=sg)
        out.max_abs = None if x.entry_bound() is None else x.entry_bound().scale(s)
        return out
    if not isinstance(x, AValue):
        return _multiply(n, y, x, shape)
    out = hadamard(x, y, shape, "mul")
    if is_same(n.args[0], n.args[1]):
        out.sign = "+"
    return out


@register_rule("aten.mul", "aten.multiply")
def mul(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    return recognize_norm(it, n, shape) or _multiply(n, a["self"], a["other"], shape)


@register_rule("aten.div", "aten.divide", "aten.true_divide")
def div(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x, y = a["self"], a["other"]
    if a.get("rounding_mode") is not None:
        return unknown(shape, "div with rounding (discontinuous)")
    rec = recognize_norm(it, n, shape) or recognize_softmax(it, n, shape)
    if rec is not None:
        return rec
    if not isinstance(y, AValue):
        y = float(y)
        if y == 0:
            return unknown(shape, "division by zero")
        return _multiply(n, x, 1.0 / y, shape)
    if y.const:
        if not isinstance(x, AValue):
            return unknown(shape, "scalar / tensor")
        v = y.value
        if bool((v == 0).any()):
            return unknown(shape, "division by a constant with zeros")
        return _multiply(n, x, AValue.constant(1.0 / v), shape)
    return unknown(shape, "division by an input-dependent tensor is outside the certified class "
                          "(not recognized as a normalization or a softmax)")


def _sum_term(v: AValue, factor: float, scale: float = 1.0) -> Optional[Poly]:
    """Row-norm bound of ``scale * v`` broadcast by ``factor`` (through its entries when broadcast)."""
    if v.const:
        return Poly.const(row_norm(v.value) * scale) if factor == 1.0 else Poly.const(max_abs(v.value) * factor * scale)
    if v.growth is None:
        return None
    if factor == 1.0:
        return v.growth.scale(scale)
    return None if v.entry_bound() is None else v.entry_bound().scale(factor * scale)


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
    alpha = float(alpha)
    if not isinstance(x, AValue):
        x = AValue.constant(torch.as_tensor(float(x)))
    if not isinstance(y, AValue):
        y = AValue.constant(torch.as_tensor(float(y)))
    ysign = y.sign if alpha > 0 else flip_sign(y.sign)
    if sub:
        ysign = flip_sign(ysign)
    if x.const and y.const:
        return AValue.constant(it.g.env[n.name])
    fx, fy = broadcast_factor(x.shape, shape), broadcast_factor(y.shape, shape)
    aa = abs(alpha)
    if x.sign in ("+", "0") and ysign in ("+", "0"):
        sign = "+" if "+" in (x.sign, ysign) else "0"
    elif x.sign in ("-", "0") and ysign in ("-", "0"):
        sign = "-" if "-" in (x.sign, ysign) else "0"
    else:
        sign = None
    # x - max(x) along a dim is <= 0
    if sub and _is_max_of(*((n.args[1], n.args[0]) if name != "aten.rsub" else (n.args[0], n.args[1]))):
        sign = "-"
    return AValue(exps=E.add(*[v.exps for v in (x, y) if not v.const]), shape=shape,
                  growth=psum([_sum_term(x, fx), _sum_term(y, fy, aa)]),
                  max_abs=psum([x.entry_bound(), None if y.entry_bound() is None else y.entry_bound().scale(aa)]),
                  jacobian=psum([None if x.jacobian is None else x.jacobian.scale(fx),
                                 None if y.jacobian is None else y.jacobian.scale(fy * aa)]),
                  sign=sign, rule="sub (sum rule)" if sub else "add (sum rule)")


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
    cond, x, y = a["condition"], a["self"], a["other"]
    if isinstance(cond, AValue) and not cond.const:
        return unknown(shape, "where() with a condition that depends on the input (a discontinuous switch)")
    xs = [v if isinstance(v, AValue) else AValue.constant(torch.as_tensor(float(v))) for v in (x, y)]
    out = add(it, n, {"self": xs[0], "other": xs[1], "alpha": 1}, shape)
    out.rule = "where with a constant condition (sum rule)"
    out.sign = xs[0].sign if xs[0].sign == xs[1].sign else None
    return out


@register_rule("aten.addcmul", "aten.addcdiv", "aten.lerp")
def addcmul(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    return unknown(shape, f"{op_name(n.target)} has no rule (rewrite it as mul/add)")

"""Arithmetic rules: add/sub (the sum rule), mul (the product rule), div, where.

A product of two input-dependent tensors adds their exponents (docs/theory.md section 2); a division by one
is outside the class unless it is recognized as a normalization (``x * rsqrt(mean(x^2) + eps)``,
``x / ||x||``, ...) or a softmax written as ``exp(z) / sum(exp(z))``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.poly import Poly, psum
from ..nodes import bind_args, is_same, op_name, strip_exact_casts, target_name
from ..values import AValue, max_abs, row_norm
from .common import broadcast_factor, flip_sign, same_computation, scalar_arg, scaled, sign_mul, unknown
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
        s = scalar_arg(y, 1.0)
        if isinstance(y, complex):
            sg = "0" if s == 0 else None
        else:
            sg = x.sign if float(y) > 0 else (flip_sign(x.sign) if float(y) < 0 else "0")
        fb = broadcast_factor(x.shape, shape)
        return scaled(x, shape, abs(s) * fb, entry_factor=abs(s), via_entries=fb != 1.0,
                      rule="mul by a scalar (affine)", sign=sg)
    if not isinstance(x, AValue):
        return multiply(n, y, x, shape)
    out = hadamard(x, y, shape, "mul")
    if len(n.args) > 1 and is_same(n.args[0], n.args[1]):
        out.sign = "+"  # x * x (up to casts, which keep signs)
    return out


@register_rule("aten.mul", "aten.multiply", reads=("self", "other"))
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
    return v if isinstance(v, AValue) else AValue.constant(torch.as_tensor(v))


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


@register_rule("aten.add", "aten.sub", "aten.subtract", "aten.rsub", reads=("self", "other", "alpha"))
def add(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``self + alpha * other`` (``self - alpha * other``; ``rsub``: ``other - alpha * self``) by the sum rule, with
    broadcasting; ``x - max(x)`` (``alpha = 1``, the maximum kept along the reduced dims) is ``<= 0``."""
    x, y = a["self"], a["other"]
    alpha = 1 if a.get("alpha") is None else a["alpha"]
    name = op_name(n.target)
    if name == "aten.rsub":
        x, y = y, x
    sub = name in ("aten.sub", "aten.subtract", "aten.rsub")
    if isinstance(alpha, AValue):
        return unknown(shape, "add with a tensor alpha")
    if isinstance(alpha, complex):
        return unknown(shape, f"add with a complex alpha={alpha!r}")
    x, y = as_value(x), as_value(y)
    out = linear_sum(x, y, -float(alpha) if sub else float(alpha), shape,
                     "sub (sum rule)" if sub else "add (sum rule)")
    b = bind_args(n) or {}
    minuend, subtrahend = (b.get("other"), b.get("self")) if name == "aten.rsub" else (b.get("self"), b.get("other"))
    if sub and float(alpha) == 1.0 and (_is_max_of(it, subtrahend, minuend) or
                                         _is_entrywise_max_of(it, subtrahend, minuend)):
        out.sign = "-"
    return out


def _is_entrywise_max_of(it: VelocityInterpreter, m: Any, x: Any) -> bool:
    """``m`` is ``maximum(a, b)`` (or ``fmax``, ``max.other``) with ``x`` holding the values of ``a`` or of ``b`` (the
    same node, or the same deterministic computation: :func:`~.common.same_computation`): then ``x - m <= 0``
    entrywise (RWKV's ``exp(a - maximum(a, b))``), also when computed in floating point (``m`` is one of its operands
    exactly, and a difference that is ``<= 0`` rounds to a number ``<= 0``)."""
    m = strip_exact_casts(m, it.g.env)
    if target_name(m) not in ("aten.maximum", "aten.fmax", "aten.max") or len(m.args) != 2:
        return False
    return any(isinstance(v, torch.fx.Node) and same_computation(v, x, it.g.env) for v in m.args)


def _is_max_of(it: VelocityInterpreter, m: Any, x: Any) -> bool:
    """``m`` is the maximum of ``x`` over some dims, kept aligned with ``x`` (``keepdim``, or every dim reduced),
    up to casts that keep values exactly: then ``x - m <= 0`` entrywise, also when computed in floating point."""
    m, x = strip_exact_casts(m, it.g.env), strip_exact_casts(x, it.g.env)
    if not isinstance(m, torch.fx.Node) or m.op != "call_function" or not isinstance(x, torch.fx.Node):
        return False
    nm = op_name(m.target)
    if nm == "getitem":
        src = m.args[0]
        if not (isinstance(src, torch.fx.Node) and op_name(src.target) == "aten.max" and m.args[1] == 0):
            return False
        m = src
    elif nm not in ("aten.amax", "aten.max"):
        return False
    b = bind_args(m) or {}
    if "other" in b:
        return False  # max(a, b) entrywise
    xv, mv = it.g.env.get(x.name), it.g.env.get(m.name)
    mv = mv[0] if isinstance(mv, (tuple, list)) else mv
    aligned = bool(b.get("keepdim", False)) or (isinstance(mv, torch.Tensor) and mv.dim() == 0) or \
        (isinstance(mv, torch.Tensor) and isinstance(xv, torch.Tensor) and mv.dim() == xv.dim())
    return aligned and strip_exact_casts(m.args[0], it.g.env) is x


@register_rule("aten.where", overloads=("self", "ScalarOther", "ScalarSelf", "Scalar"),
               reads=("condition", "self", "other"))
def where(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Every entry of ``where(c, x, y)`` is the entry of ``x`` or of ``y``: the sum rule bounds it whatever ``c``.

    A condition that depends on the input switches between the branches (a piecewise map): the derivative autograd
    takes is, entry by entry, the derivative of the branch the condition picks, so a row of ``J v`` is made of
    entries of ``J_x v`` and of ``J_y v`` and its norm is at most ``N(J_x v) + N(J_y v)``: the sum rule bounds it for
    every pattern of the condition (docs/theory.md section 1.1).  The map jumps where the condition changes (the
    interpreter notes it).  Between two constants the derivative is 0 and the value is bounded by them, never read at
    the example."""
    cond, x, y = a["condition"], as_value(a["self"]), as_value(a["other"])
    out = linear_sum(x, y, 1.0, shape, "where (sum rule)")
    out.sign = x.sign if x.sign == y.sign else None
    if isinstance(cond, AValue) and not cond.const:
        out.rule = "where with an input-dependent condition (piecewise: sum rule of the branches)"
    else:
        out.rule = "where with a constant condition (sum rule)"
    return out


def product_shape(x: Any, y: Any) -> Shape:
    """The broadcast shape of two operands (numbers are 0-d)."""
    return tuple(torch.broadcast_shapes(*[v.shape if isinstance(v, AValue) else () for v in (x, y)]))


@register_rule("aten.addcmul", reads=("self", "tensor1", "tensor2", "value"))
def addcmul(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``self + value * tensor1 * tensor2``: the product rule for the product, the sum rule for the sum.

    With one constant factor (ResMLP's affine ``addcmul(beta, alpha, x)``) the product is affine: its bound is
    the other factor's times ``max |constant|`` (:func:`hadamard`), so the result keeps the input's exponents.
    """
    value = scalar_arg(a.get("value"), 1.0)
    if value is None or isinstance(a.get("value"), complex):
        return unknown(shape, f"addcmul with value={a.get('value')!r} (a tensor or a complex number)")
    t1, t2 = as_value(a["tensor1"]), as_value(a["tensor2"])
    prod = hadamard(t1, t2, product_shape(t1, t2), "addcmul")
    return linear_sum(as_value(a["self"]), prod, value, shape, f"addcmul ({prod.rule}, sum rule)")


@register_rule("aten.lerp", overloads=("Scalar", "Tensor"), reads=("self", "end", "weight"))
def lerp(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``self + weight * (end - self)``: the sum rule, and the product rule when the weight is a tensor."""
    x, end, w = as_value(a["self"]), as_value(a["end"]), a["weight"]
    diff = linear_sum(end, x, -1.0, product_shape(end, x), "lerp difference")
    if isinstance(w, AValue):
        step = hadamard(w, diff, product_shape(w, diff), "lerp")
    else:
        step = multiply(n, diff, w, diff.shape)
    return linear_sum(x, step, 1.0, shape, "lerp (sum rule)")

"""Pointwise rules: activations, clamps, ``exp``, powers, and the entrywise ops outside the class.

The activation constants (Lipschitz constants, saturation levels, growth slopes and offsets, signs) are
read from :mod:`certblocks.bounds.activations`; the rules add the ones that depend on an op's arguments
(``softplus``'s ``beta``, ``elu``'s ``alpha``, a clamp's range).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import torch

from ... import exponents as E
from ...bounds.activations import activation
from ...bounds.poly import Poly
from ...exponents import Exponents
from ..nodes import op_name
from ..values import AValue, max_abs
from .common import broadcast_factor, first_tensor, flip_sign, piecewise_constant, scaled, sqrt_last, unknown
from .registry import register_rule
from .selection import clamp_between

if TYPE_CHECKING:
    from ..interp import VelocityInterpreter

__all__ = ["lipschitz_value", "saturating_value", "STEP_OPS", "ROUNDING_OPS"]

Args = Dict[str, Any]
Shape = Tuple[int, ...]

#: Globally Lipschitz activations with ``|phi(z)| <= slope |z| + offset`` (their aten names; constants in bounds).
LIPSCHITZ_ACTIVATIONS = ("relu", "gelu", "silu", "mish", "hardswish", "abs", "neg", "positive")
#: Bounded activations (``|phi| <= saturation``; softsign has no aten op: it is traced as ``x / (1 + |x|)``).
SATURATING_ACTIVATIONS = ("sigmoid", "tanh", "hardsigmoid", "sin", "cos", "erf")

# torch's SELU constants (the definition of the op, not bounds)
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772, 1.0507009873554805


def lipschitz_value(x: AValue, shape: Sequence[int], lip: float, slope: float, offset: float, sign: Optional[str],
                    name: str) -> AValue:
    """``phi(x)`` for a ``lip``-Lipschitz ``phi`` with ``|phi(z)| <= slope |z| + offset`` entrywise (``x`` broadcast
    to ``shape``: a broadcast last dimension is bounded through the entries)."""
    entries = x.entry_bound()
    fb = broadcast_factor(x.shape, shape)
    rows = x.growth if fb == 1.0 else (None if entries is None else entries.scale(fb))
    return AValue(exps=E.compose(E.LIPSCHITZ, x.exps), shape=shape,
                  growth=None if rows is None else rows.scale(slope) + Poly.const(offset * sqrt_last(shape)),
                  max_abs=None if entries is None else entries.scale(slope) + Poly.const(offset),
                  jacobian=None if x.jacobian is None else x.jacobian.scale(lip * fb),
                  sign=sign, rule=f"Lipschitz activation {name}")


def saturating_value(x: AValue, shape: Sequence[int], level: float, lip: float, sign: Optional[str],
                     name: str) -> AValue:
    """``phi(x)`` for a ``lip``-Lipschitz ``phi`` with ``|phi| <= level`` (``x`` broadcast to ``shape``)."""
    fb = broadcast_factor(x.shape, shape)
    return AValue(exps=E.compose(E.SATURATING, x.exps), shape=shape, growth=Poly.const(level * sqrt_last(shape)),
                  max_abs=Poly.const(level), jacobian=None if x.jacobian is None else x.jacobian.scale(lip * fb),
                  sign=sign, rule=f"saturating activation {name}")


@register_rule(*(f"aten.{name}" for name in LIPSCHITZ_ACTIVATIONS), reads=("self", "approximate"))
def lipschitz_activation(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = first_tensor(a)
    name = op_name(n.target).split(".")[-1]
    table_name = name
    if name == "gelu":
        approximate = a.get("approximate", "none")
        if approximate not in ("none", "tanh"):
            return unknown(shape, f"gelu approximate={approximate!r}")
        table_name = "gelu_tanh" if approximate == "tanh" else "gelu"
    act = activation(table_name)
    sign = flip_sign(x.sign) if name == "neg" else act.sign
    return lipschitz_value(x, shape, act.lipschitz, act.slope, act.offset, sign, name)


@register_rule(*(f"aten.{name}" for name in SATURATING_ACTIVATIONS), reads=("self",))
def saturating_activation(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    name = op_name(n.target).split(".")[-1]
    act = activation(name)
    return saturating_value(first_tensor(a), shape, act.saturation, act.lipschitz, act.sign, name)


@register_rule("aten.softplus", reads=("self", "beta", "threshold"))
def softplus(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``softplus(beta x) / beta`` where ``beta x <= threshold``, ``x`` above: 1-Lipschitz (slopes ``sigmoid`` and 1),
    ``|phi(z)| <= |z| + log(2) / beta``; nonnegative only when ``threshold >= 0`` (a negative threshold returns ``x``
    for some ``x < 0``)."""
    x = a["self"]
    beta = 1.0 if a.get("beta") is None else float(a["beta"])
    threshold = 20.0 if a.get("threshold") is None else float(a["threshold"])
    if not beta > 0:
        return unknown(shape, f"softplus with beta={beta:g} (only beta > 0 is bounded)")
    # softplus_beta(x) = softplus(beta x) / beta: the same slopes, the offset divided by beta
    act = activation("softplus")
    return lipschitz_value(x, shape, act.lipschitz, act.slope, act.offset / beta,
                           act.sign if threshold >= 0 else None, "softplus")


@register_rule("aten.elu", "aten.celu", "aten.selu", reads=("self", "alpha", "scale", "input_scale"))
def elu(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``scale * x`` (``x > 0``), ``scale * alpha * (exp(input_scale * x) - 1)`` (``x <= 0``; celu: ``input_scale =
    1/alpha``, scale 1; selu: torch's constants): slopes ``|scale|`` and ``|scale alpha input_scale| e^(...) <=
    |scale alpha input_scale|``, and ``|phi(z)| <= Lip |z|``.  A negative ``input_scale`` (celu: ``alpha <= 0``)
    makes the negative branch grow exponentially: refused."""
    x = first_tensor(a)
    name = op_name(n.target)
    alpha = 1.0 if a.get("alpha") is None else float(a["alpha"])
    scale = 1.0 if a.get("scale") is None else float(a["scale"])
    input_scale = 1.0 if a.get("input_scale") is None else float(a["input_scale"])
    if name == "aten.selu":
        alpha, scale, input_scale = _SELU_ALPHA, _SELU_SCALE, 1.0
    elif name == "aten.celu":
        if not alpha > 0:
            return unknown(shape, f"celu with alpha={alpha:g}: exp(x / alpha) grows exponentially for x < 0")
        scale, input_scale = 1.0, 1.0 / alpha
    if input_scale < 0:
        return unknown(shape, f"elu with input_scale={input_scale:g}: exp(input_scale x) grows exponentially for x < 0")
    lip = abs(scale) * max(1.0, abs(alpha * input_scale))
    return lipschitz_value(x, shape, lip, lip, 0.0, None, name.split(".")[-1])


@register_rule("aten.leaky_relu", "aten.rrelu",
               reads=("self", "negative_slope", "lower", "upper", "training", "generator"))
def leaky_relu(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Slope 1 above 0 and ``s`` below (rrelu: ``s`` in ``[lower, upper]``, drawn at random in training, their mean
    in eval): ``|phi(z)| <= max(1, |s|) |z|`` whatever ``s`` in that range."""
    x = first_tensor(a)
    if op_name(n.target) == "aten.rrelu":
        lower = 0.125 if a.get("lower") is None else float(a["lower"])
        upper = 1.0 / 3.0 if a.get("upper") is None else float(a["upper"])
        s = max(abs(lower), abs(upper))
    else:
        s = abs(0.01 if a.get("negative_slope") is None else float(a["negative_slope"]))
    return lipschitz_value(x, shape, max(1.0, s), max(1.0, s), 0.0, None, "leaky_relu")


@register_rule("aten.prelu", reads=("self", "weight"))
def prelu(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x, w = a["self"], a["weight"]
    if not w.const:
        return unknown(shape, "prelu with an input-dependent slope")
    s = max(1.0, max_abs(w.value))
    return lipschitz_value(x, shape, s, s, 0.0, None, "prelu")


def _bound_range(b: Any) -> Optional[Tuple[float, float]]:
    """``(smallest, largest)`` entry of a constant clamp bound (a number or a constant tensor); ``None``: no bound."""
    if b is None:
        return None
    if isinstance(b, AValue):
        v = b.value.double()
        return float(v.min()), float(v.max())
    return float(b), float(b)


@register_rule("aten.hardtanh", "aten.relu6", "aten.clamp", "aten.clip", "aten.clamp_min", "aten.clamp_max",
               reads=("self", "min", "max", "min_val", "max_val"))
def clamp(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """A clamp between constant bounds (numbers or tensors): ``|clamp(x)| <= max |bound|`` with both, ``|x| + max
    |bound|`` with one; a bound that depends on the input goes to :func:`~.selection.clamp_between`."""
    x = a.get("self", a.get("input"))
    name = op_name(n.target)
    if name == "aten.relu6":
        lo, hi = 0.0, 6.0
    elif name == "aten.hardtanh":
        lo, hi = a.get("min_val", -1.0), a.get("max_val", 1.0)
    elif name == "aten.clamp_min":
        lo, hi = a.get("min"), None
    elif name == "aten.clamp_max":
        lo, hi = None, a.get("max")
    else:
        lo, hi = a.get("min"), a.get("max")
    if any(isinstance(b, AValue) and not b.const for b in (lo, hi)):
        return clamp_between(x, lo, hi, shape)
    lo_r, hi_r = _bound_range(lo), _bound_range(hi)
    # an infinite bound clamps nothing on its side: clamp(x, 0, inf) is clamp_min(x, 0)
    lo_r = None if lo_r is not None and lo_r == (-math.inf, -math.inf) else lo_r
    hi_r = None if hi_r is not None and hi_r == (math.inf, math.inf) else hi_r
    short = name.split(".")[-1]
    if lo_r is None and hi_r is None:
        return unknown(shape, f"{short} with neither min nor max")
    if lo_r is not None and hi_r is not None:
        # min(max(x, lo), hi) lies between min(lo, hi) and hi entrywise
        sign = "+" if min(lo_r[0], hi_r[0]) >= 0 else ("-" if hi_r[1] <= 0 else None)
        return saturating_value(x, shape, max(abs(v) for v in lo_r + hi_r), 1.0, sign, short)
    rng = lo_r if lo_r is not None else hi_r
    sign = "+" if (lo_r is not None and (lo_r[0] >= 0 or x.sign == "+")) else \
        ("-" if (hi_r is not None and (hi_r[1] <= 0 or x.sign == "-")) else None)
    return lipschitz_value(x, shape, 1.0, 1.0, max(abs(rng[0]), abs(rng[1])), sign, short)


@register_rule("aten.exp", "aten.exp2", reads=("self",))
def exp(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    x = a["self"]
    if x.sign in ("-", "0"):
        # on z <= 0: 0 < exp(z) <= 1 with slope <= 1; 2^z <= 1 with slope <= log 2
        lip = 1.0 if op_name(n.target) == "aten.exp" else math.log(2.0)
        return AValue(exps=E.exp_of_nonpositive(x.exps), shape=shape, growth=Poly.const(sqrt_last(shape)),
                      max_abs=Poly.const(1.0), jacobian=None if x.jacobian is None else x.jacobian.scale(lip),
                      sign="+", rule="exp of a provably nonpositive argument (bounded by 1)")
    src = n.args[0].name if n.args and isinstance(n.args[0], torch.fx.Node) else "?"
    out = unknown(shape, f"exp of an argument of unknown sign ({src}): unbounded growth")
    out.sign = "+"
    return out


@register_rule("aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.tan", "aten.atanh", "aten.logit",
               "aten.erfinv", "aten.digamma", "aten.lgamma",
               reads=("self", "eps"))  # refused whatever the arguments (sqrt, rsqrt, reciprocal: rules.division)
def outside(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    name = op_name(n.target)
    return unknown(shape, f"{name.split('.')[-1]} of an input-dependent tensor is outside the certified class "
                          "(not Lipschitz or unbounded near a point)")


@register_rule("aten.pow", overloads=("Tensor_Tensor", "Tensor_Scalar", "Scalar"), reads=("self", "exponent"))
@register_rule("aten.square", reads=("self",))
def power(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """``x^p`` for a number ``p >= 1``: ``|x^p| <= max|x|^(p-1) |x|``, slope ``p max|x|^(p-1)``.  A power below 1,
    a tensor exponent, and a fractional power of a tensor that may be negative (NaN there) are refused."""
    x = a.get("self")
    p = 2 if op_name(n.target) == "aten.square" else a.get("exponent")
    if isinstance(x, AValue) and isinstance(p, AValue):
        return unknown(shape, "pow with a tensor exponent")
    if not isinstance(x, AValue):
        return unknown(shape, "pow of a scalar base by a tensor exponent (exp-like)")
    if isinstance(p, complex):
        return unknown(shape, f"pow with a complex exponent {p!r}")
    p = float(p)
    if p == 1:
        return scaled(x, shape, 1.0, entry_factor=1.0, rule="pow 1")
    if p < 1:
        return unknown(shape, f"pow(x, {p:g}) with p < 1: not Lipschitz at 0")
    if not p.is_integer() and x.sign not in ("+", "0"):
        return unknown(shape, f"pow(x, {p:g}) of a tensor that may be negative (NaN there)")
    entries = x.entry_bound()
    fb = broadcast_factor(x.shape, shape)
    growth = jacobian = None
    if entries is not None and x.growth is not None:
        growth = entries.power(p - 1) * (x.growth if fb == 1.0 else entries.scale(fb))
    if entries is not None and x.jacobian is not None:
        jacobian = entries.power(p - 1).scale(p * fb) * x.jacobian
    sign = "+" if (p.is_integer() and int(p) % 2 == 0) or x.sign == "+" else (x.sign if p.is_integer() else None)
    return AValue(exps=E.compose(E.power(p), x.exps), shape=shape, growth=growth,
                  max_abs=None if entries is None else entries.power(p), jacobian=jacobian, sign=sign,
                  rule=f"entrywise power {p:g}")


#: Ops with a bounded output that jumps with the input: the bound of their entries (``None``: read from the op).
STEP_OPS = {"aten.eq": 1.0, "aten.ne": 1.0, "aten.lt": 1.0, "aten.le": 1.0, "aten.gt": 1.0, "aten.ge": 1.0,
            "aten.sign": 1.0, "aten.logical_and": 1.0, "aten.logical_or": 1.0, "aten.logical_not": 1.0,
            "aten.isnan": 1.0, "aten.argmax": None, "aten.argmin": None}
#: Rounding ops: ``|round(x)| <= |x| + 1`` entrywise (``+ 10^-decimals / 2`` with negative decimals), jumps.
ROUNDING_OPS = ("aten.round", "aten.floor", "aten.ceil", "aten.trunc")


# sign-only and boolean ops on constants never reach here (constants are evaluated); on activations:
@register_rule(*STEP_OPS, *ROUNDING_OPS, "aten.bitwise_and", "aten.__and__", "aten.__or__",
               reads=("self", "other", "dim", "decimals"), via_shape=("keepdim",))
def discontinuous(it: VelocityInterpreter, n: torch.fx.Node, a: Args, shape: Shape) -> AValue:
    """Comparisons, signs, argmax, rounding: piecewise constant, so autograd's derivative is 0 (docs/theory.md
    section 1.1: the certificate bounds the derivative autograd computes; round, floor, ceil, trunc and sign have a
    zero derivative in autograd, a boolean or an index none): Jacobian 0.  Their values are bounded (booleans and signs
    by 1, an argmax by the size of its dimension) or within 1 of their input (rounding: the input's growth exponent, a
    constant added).  The map jumps where they change (the interpreter notes it)."""
    name = op_name(n.target)
    short = name.split(".")[-1]
    x = first_tensor(a)
    conc = it.g.env.get(n.name)
    if name in ROUNDING_OPS:
        offset = max(1.0, 0.5 * 10.0 ** -int(a.get("decimals", 0) or 0))
        out = lipschitz_value(x, shape, 1.0, 1.0, offset, x.sign, short)
        out.exps, out.jacobian = Exponents(x.exps.q, 0.0), Poly.ZERO
        out.rule = f"{short} (within {offset:g} of its input; piecewise constant, derivative 0)"
        return out
    if name in STEP_OPS or (isinstance(conc, torch.Tensor) and conc.dtype == torch.bool):
        level = STEP_OPS.get(name)
        if level is None and name in STEP_OPS:  # an index along dim (all entries when dim is None)
            dim = a.get("dim")
            level = float(max((x.shape[dim] if dim is not None and x.ndim else math.prod(x.shape)) - 1, 0))
        return piecewise_constant(shape, 1.0 if level is None else level,
                                  f"{short} (bounded by {1.0 if level is None else level:g}; piecewise constant, "
                                  "derivative 0)", sign=None if name == "aten.sign" else "+")
    return unknown(shape, f"{name} of an input-dependent tensor is not bounded by a rule (an integer bitwise op)")

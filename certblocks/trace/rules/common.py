"""Helpers shared by the rule families: argument access, shape factors, bound algebra, signs."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import torch

from ...bounds.poly import Poly
from ...exponents import CONSTANT
from ..nodes import strip_exact_casts
from ..values import AValue, max_abs, row_norm

__all__ = [
    "KEEP",
    "first_tensor",
    "unknown",
    "scaled",
    "sqrt_last",
    "broadcast_factor",
    "view_factor",
    "pmax",
    "sign_mul",
    "flip_sign",
    "piecewise_constant",
    "const_row_norm",
    "unit_roundoff",
    "rounding_factor",
    "floor_in",
    "scalar_arg",
    "same_computation",
]

#: ``sign=KEEP`` in :func:`scaled`: the result has the input's sign.
KEEP = "keep"

_FLIP = {"+": "-", "-": "+", "0": "0"}


def first_tensor(args: Dict[str, Any]) -> Optional[AValue]:
    """The first tensor argument of an op (its abstract value)."""
    for v in args.values():
        if isinstance(v, AValue):
            return v
    return None


def unknown(shape: Sequence[int], why: str) -> AValue:
    """An underived value; the interpreter names the op as the rule."""
    return AValue.unknown(tuple(shape), "", why)


def sqrt_last(shape: Sequence[int]) -> float:
    """``sqrt`` of the last dimension (1 for a 0-d shape): row norm over max-abs of a row."""
    return math.sqrt(shape[-1] if shape else 1)


def scaled(x: AValue, shape: Sequence[int], factor: float, *, entry_factor: float, via_entries: bool = False,
           rule: str = "", sign: Optional[str] = KEEP, add: float = 0.0, add_entry: float = 0.0) -> AValue:
    """A value with ``x``'s exponents whose row norm and Jacobian bounds are ``x``'s times ``factor``.

    The three bounds move together (docs/theory.md section 2): the row norm and the Jacobian by ``factor``, every
    entry by ``entry_factor`` (``1`` for ops that move or copy entries, the op's own factor for ops that scale
    or sum them), so that no rule can scale a value's rows and forget its entries.

    Args:
        x: the input's abstract value.
        shape: the output's shape.
        factor: the row-norm (and Jacobian) factor.
        entry_factor: the factor on the bound of every entry (``|out_i| <= entry_factor * max|x| + add_entry``).
        via_entries: bound the rows through ``x``'s entries (``factor`` then includes the ``sqrt`` of a row).
        rule: the rule's name in reports.
        sign: the output's sign (:data:`KEEP`: ``x``'s).
        add: a constant added to the row norm bound.
        add_entry: a constant added to the entry bound.
    """
    base = x.entry_bound() if via_entries else x.growth
    entries = x.entry_bound()
    return AValue(exps=x.exps, shape=tuple(shape),
                  growth=None if base is None else base.scale(factor) + Poly.const(add),
                  max_abs=None if entries is None else entries.scale(entry_factor) + Poly.const(add_entry),
                  jacobian=None if x.jacobian is None else x.jacobian.scale(factor),
                  sign=x.sign if sign == KEEP else sign, row_sum=x.row_sum, rule=rule)


def broadcast_factor(shape: Sequence[int], out_shape: Sequence[int]) -> float:
    """Row-norm factor when an operand of ``shape`` is broadcast to ``out_shape``."""
    last = shape[-1] if len(shape) else 1
    out_last = out_shape[-1] if len(out_shape) else 1
    if last == 1 and out_last > 1:
        return math.sqrt(out_last)
    return 1.0


def view_factor(in_shape: Sequence[int], out_shape: Sequence[int]) -> Tuple[float, bool]:
    """Row-norm factor of a row-major reshape: ``(factor, via_entries)``."""
    a = in_shape[-1] if len(in_shape) else 1
    b = out_shape[-1] if len(out_shape) else 1
    if a == b:
        # same last dim: rows are regrouped, not split (row-major), when the sizes agree
        return 1.0, False
    if b < a and b > 0 and a % b == 0:
        return 1.0, False  # each new row is a chunk of an old row
    if b > a and a > 0 and b % a == 0:
        return math.sqrt(b // a), False  # each new row concatenates b/a old rows
    return math.sqrt(max(b, 1)), True  # entries: N <= sqrt(last) * max|.|


def const_row_norm(c: torch.Tensor, out_shape: Sequence[int]) -> float:
    """Row norm of a constant broadcast to ``out_shape``: its own row norm, or ``sqrt(last) max|c|`` when its last
    dimension (size 1, or none for a 0-d tensor) is broadcast along the output's rows."""
    last = c.shape[-1] if c.dim() else 1
    out_last = out_shape[-1] if len(out_shape) else 1
    if last == 1 and out_last > 1:
        return max_abs(c) * math.sqrt(out_last)
    return row_norm(c)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Relative rounding error of a float dtype (half its machine epsilon; 0 for a dtype that is not a float)."""
    if dtype.is_floating_point or dtype.is_complex:
        real = {torch.complex32: torch.float16, torch.complex64: torch.float32,
                torch.complex128: torch.float64}.get(dtype, dtype)
        return torch.finfo(real).eps / 2
    return 0.0


def rounding_factor(src: Optional[torch.dtype], dst: Optional[torch.dtype]) -> float:
    """Factor on the magnitude of a value cast from ``src`` to ``dst``: ``1 + u(dst)`` when the cast rounds
    (a coarser float, or an integer to a float), else 1 (round to nearest: ``|fl(v)| <= (1 + u) |v|``)."""
    if src is None or dst is None or not (dst.is_floating_point or dst.is_complex):
        return 1.0
    u_dst = unit_roundoff(dst)
    if (src.is_floating_point or src.is_complex) and unit_roundoff(src) >= u_dst:
        return 1.0
    return 1.0 + u_dst


def floor_in(m: float, dtype: Optional[torch.dtype]) -> float:
    """The largest value of ``dtype`` at most ``m`` (a lower bound of any value ``>= m`` rounded into it).

    Round to nearest is monotone, so a value ``v >= m`` computed or cast into ``dtype`` is ``>= fl(m) >=`` this
    (``m`` itself is first lowered by a float64 rounding margin).  Integers floor, booleans are 1 only above 0.
    """
    m = m - abs(m) * 2.0**-50
    if dtype is None or dtype == torch.float64:
        return m
    if dtype == torch.bool:
        return 1.0 if m > 0 else 0.0
    if not (dtype.is_floating_point or dtype.is_complex):
        return float(math.floor(m))
    real = {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)
    t = torch.tensor(m, dtype=torch.float64).to(real)
    if float(t) > m:
        t = torch.nextafter(t, torch.tensor(-math.inf, dtype=real))
    return float(t)


def scalar_arg(v: Any, default: float) -> Optional[float]:
    """A Python-number argument as a float (``default`` for ``None``; the modulus of a complex); ``None`` for a
    tensor."""
    if isinstance(v, AValue):
        return None
    if v is None:
        return default
    if isinstance(v, complex):
        return abs(v)
    return float(v)


def pmax(polys: Iterable[Optional[Poly]]) -> Optional[Poly]:
    """Upper bound of the pointwise max of several bounds: their coefficientwise max (``None`` if one is)."""
    ps = list(polys)
    if any(p is None for p in ps):
        return None
    if len(ps) == 1:
        return ps[0]
    t: Dict[float, float] = {}
    for p in ps:
        for e, c in p.terms.items():
            t[e] = max(t.get(e, 0.0), c)
    return Poly(t)


def sign_mul(s1: Optional[str], s2: Optional[str]) -> Optional[str]:
    """Sign of a product."""
    if "0" in (s1, s2):
        return "0"
    if s1 is None or s2 is None:
        return None
    return "+" if s1 == s2 else "-"


def flip_sign(s: Optional[str]) -> Optional[str]:
    """Sign of a negated value."""
    return _FLIP.get(s)


def piecewise_constant(shape: Sequence[int], level: float, rule: str, sign: Optional[str] = "+") -> AValue:
    """A value computed from the input that is piecewise constant in it and bounded by ``level`` entrywise whatever the
    input: an index (of a maximum, a sort, a top-k, a pooling window: bounded by its range), a boolean (a comparison:
    by 1), a sign (by 1).

    Its derivative is 0: the certificate bounds the derivative autograd computes (docs/theory.md section 1.1), and
    autograd passes no gradient through an integer, a boolean or a step.  So its exponents are ``(0, 0)`` and its
    Jacobian bound is 0; the map jumps where the value changes, which the interpreter notes (the values computed from it
    are piecewise: :attr:`certblocks.trace.interp.VelocityInterpreter.piecewise`).  Whatever the example says, the value
    is never read at it.
    """
    return AValue(exps=CONSTANT, shape=tuple(shape), growth=Poly.const(level * sqrt_last(shape)),
                  max_abs=Poly.const(level), jacobian=Poly.ZERO, sign=sign, rule=rule)


#: Tags of ops whose result is not a function of their arguments alone (a random draw, run-to-run differences).
_NONDETERMINISTIC = tuple(getattr(torch.Tag, t) for t in ("nondeterministic_seeded", "nondeterministic_bitwise")
                          if hasattr(torch.Tag, t))


def _deterministic(target: Any) -> bool:
    """An op whose result is a function of its arguments (no random draw, no run-to-run difference, no mutation)."""
    tags = getattr(target, "tags", ())
    return hasattr(target, "_schema") and not any(t in tags for t in _NONDETERMINISTIC) and \
        not target._schema.is_mutable


def same_computation(a: Any, b: Any, env: Dict[str, Any], depth: int = 4) -> bool:
    """Whether two node arguments hold the same values: the same node up to exact casts, or two calls of the same
    deterministic op on arguments that hold the same values (a graph computes ``key + time_first`` twice; both are
    the same rounded number, entry by entry).  Numbers and other literals must be equal and of the same type; the
    walk stops at ``depth``."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and \
            all(same_computation(x, y, env, depth) for x, y in zip(a, b))
    if not isinstance(a, torch.fx.Node) or not isinstance(b, torch.fx.Node):
        if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node) or type(a) is not type(b):
            return False
        try:
            return bool(a == b)
        except Exception:  # an object that does not compare: not known to be equal
            return False
    a, b = strip_exact_casts(a, env), strip_exact_casts(b, env)
    if a is b:
        return True
    if depth <= 0 or a.op != "call_function" or b.op != "call_function" or a.target is not b.target \
            or not _deterministic(a.target) or len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
        return False
    return all(same_computation(x, y, env, depth - 1) for x, y in zip(a.args, b.args)) and \
        all(same_computation(a.kwargs[k], b.kwargs[k], env, depth - 1) for k in a.kwargs)

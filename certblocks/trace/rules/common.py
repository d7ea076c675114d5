"""Helpers shared by the rule families: argument access, shape factors, bound algebra, signs."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

from ...bounds.poly import Poly
from ...exponents import Exponents
from ..values import AValue

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


def scaled(x: AValue, shape: Sequence[int], factor: float, *, via_entries: bool = False, rule: str = "",
           sign: Optional[str] = KEEP, add: float = 0.0) -> AValue:
    """A value with ``x``'s exponents whose row norm and Jacobian bounds are ``x``'s times ``factor``.

    Args:
        x: the input's abstract value.
        shape: the output's shape.
        factor: the row-norm (and Jacobian) factor.
        via_entries: bound the rows through ``x``'s entries (``factor`` then includes the ``sqrt`` of a row).
        rule: the rule's name in reports.
        sign: the output's sign (:data:`KEEP`: ``x``'s).
        add: a constant added to the row norm and max-abs bounds.
    """
    base = x.entry_bound() if via_entries else x.growth
    return AValue(exps=x.exps, shape=tuple(shape),
                  growth=None if base is None else base.scale(factor) + Poly.const(add),
                  max_abs=x.max_abs + Poly.const(add) if add and x.max_abs is not None else x.max_abs,
                  jacobian=None if x.jacobian is None else x.jacobian.scale(factor),
                  sign=x.sign if sign == KEEP else sign, rule=rule)


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


def switched(out: AValue, why: str) -> AValue:
    """``out`` with its growth bounds kept and its Jacobian dropped: an input-dependent switch (``where``,
    ``masked_fill`` with an input-dependent condition) is discontinuous, so sigma is not derived."""
    out.exps = Exponents(out.exps.q, None)
    out.jacobian = None
    out.rule = why
    out.bad = why
    return out

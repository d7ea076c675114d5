"""From the interpreter's polynomial bounds to a certificate's coefficients and peak.

The output's growth bound ``P(r)`` becomes ``c r^q + b`` and its Jacobian bound ``l1 max(R, 1)^sigma +
l0`` (:meth:`~certblocks.bounds.poly.Poly.collapse_growth`, ``collapse_jacobian``); every node's growth
bound, plus the query-key products inside fused attention, folds into the velocity's peak.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

from ..bounds.poly import Poly, fold_peak
from ..certificate import Peak
from .interp import VelocityInterpreter
from .nodes import op_name
from .report import NOT_DERIVED
from .values import AValue

__all__ = ["Coefficients", "coefficients", "peak"]


class Coefficients(NamedTuple):
    """``c, b, l1, l0`` (:data:`~certblocks.trace.report.NOT_DERIVED` where not derived) and whether all are."""

    c: float
    b: float
    l1: float
    l0: float
    derived: bool


def coefficients(av: AValue) -> Coefficients:
    """The certificate coefficients of a velocity's output value."""
    q, s = av.exps.q, av.exps.sigma
    c, b, l1, l0 = NOT_DERIVED, NOT_DERIVED, NOT_DERIVED, NOT_DERIVED
    ok = True
    try:
        if q is not None and av.growth is not None and av.growth.is_finite():
            c, b = av.growth.collapse_growth(q)
        else:
            ok = False
        if s is not None and av.jacobian is not None and av.jacobian.is_finite():
            l1, l0 = av.jacobian.collapse_jacobian(s)
        else:
            ok = False
    except ValueError:
        return Coefficients(NOT_DERIVED, NOT_DERIVED, NOT_DERIVED, NOT_DERIVED, False)
    c, b, l1, l0 = (min(v, NOT_DERIVED) if math.isfinite(v) else NOT_DERIVED for v in (c, b, l1, l0))
    return Coefficients(c, b, l1, l0, ok)


def peak(it: VelocityInterpreter) -> Optional[Peak]:
    """Bound on every value of the velocity's graph: its nodes' entry bounds, plus the query-key
    products inside fused attention (``||q_i|| ||k_j||``).  ``None`` when a node's growth is not derived."""
    polys: List[Tuple[str, Poly]] = []
    for n in it.order:
        av = it.value_of(n.name)
        if av is None or av.const:
            continue
        bound = av.entry_bound()  # max_abs when derived (a collapsed call's peak), else the row-norm bound
        if bound is None or not bound.is_finite():
            return None
        polys.append((n.name, bound))
        if n.op == "call_function" and "scaled_dot_product" in op_name(n.target):
            q, k = it.value_of(n.args[0].name), it.value_of(n.args[1].name)
            if q is None or k is None or q.growth is None or k.growth is None:
                return None
            scale = n.kwargs.get("scale")
            s = max(1.0, float(scale)) if isinstance(scale, (int, float)) else 1.0
            polys.append((f"query-key logits of {n.name}", (q.growth * k.growth).scale(s)))
    if not polys:
        return None
    top = max(polys, key=lambda t: (t[1].degree, t[1].total()))
    try:
        return fold_peak([dict(p.terms) for _, p in polys], f"{top[0]} (graph node)")
    except ValueError:
        return None

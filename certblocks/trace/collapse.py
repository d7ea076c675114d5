"""From the interpreter's polynomial bounds to a certificate's coefficients and peak.

The output's growth bound ``P(r)`` becomes ``c r^q + b`` and its Jacobian bound ``l1 max(R, 1)^sigma +
l0`` (:meth:`~certblocks.bounds.poly.Poly.collapse_growth`, ``collapse_jacobian``); every node's growth
bound, plus the query-key products inside fused attention, folds into the velocity's peak.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple, cast

import torch

from ..bounds.poly import Poly, fold_peak
from ..certificate import Peak
from .interp import VelocityInterpreter
from .nodes import bind_args, op_name
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


def peak(it: VelocityInterpreter) -> Peak:
    """Bound on every floating value of the velocity's graph: its nodes' entry bounds (every tensor of a node with
    several outputs), plus the query-key products inside fused attention (``||q_i|| ||k_j||``).

    Unknown is never zero: a floating value computed from the input without a finite bound makes the peak
    :meth:`~certblocks.certificate.Peak.unbounded`, naming the node and why.  Integer and boolean values (token ids,
    indices, masks) cannot overflow a floating dtype and are left out: every floating value computed from them is a
    node of its own.  Values hidden inside a module atom or a certified call are bounded by it (a certified call
    leaves its peak on one tensor it hides: :func:`~certblocks.trace.own.representative`).
    """
    hidden = {m.name for grp in it.atom_groups.values() for m in grp.members if m is not grp.output}
    for call, _ in it.certified_calls.values():
        hidden |= set(call.members) - {call.output.name}
    polys: List[Tuple[str, Poly]] = []
    for n in it.order:
        values = _values(it, n)
        if n.name in hidden:  # only the value a collapsed call leaves on one tensor it hides (its peak) counts
            av = it.value_of(n.name)
            values = [(0, av)] if av is not None else []
        for k, av in values:
            if av is not None and av.const:
                continue
            bound = None if av is None else av.entry_bound()  # max_abs when derived, else the row-norm bound
            if bound is None or not bound.is_finite():
                why = (av.bad or "its bound is not derived") if av is not None else "it has no abstract value"
                return Peak.unbounded(f"node {n.name}{f' (output {k})' if k else ''} ({_op(n)}) has no finite entry "
                                      f"bound: {why}")
            polys.append((n.name, bound))
        if n.name not in hidden and n.op == "call_function" and "scaled_dot_product" in op_name(n.target):
            q, kv = (it.value_of(cast(torch.fx.Node, a).name) for a in n.args[:2])
            if q is None or kv is None or q.growth is None or kv.growth is None:
                return Peak.unbounded(f"the query-key logits of {n.name}: the query or key bound is not derived")
            scale = (bind_args(n) or {}).get("scale")  # positional or keyword
            if scale is not None and not isinstance(scale, (int, float)):
                return Peak.unbounded(f"the query-key logits of {n.name}: scale {scale!r} is not a number")
            s = max(1.0, abs(float(scale))) if scale is not None else 1.0
            polys.append((f"query-key logits of {n.name}", (q.growth * kv.growth).scale(s)))
    if not polys:
        return Peak(0.0, 0.0, 0.0, "no floating value computed from the input")
    top = max(polys, key=lambda t: (t[1].degree, t[1].total()))
    try:
        return fold_peak([dict(p.terms) for _, p in polys], f"{top[0]} (graph node)")
    except ValueError as exc:
        return Peak.unbounded(f"the nodes' bounds do not fold into one peak: {exc}")


def _op(n: torch.fx.Node) -> str:
    return op_name(n.target) if n.op == "call_function" else n.op


def _values(it: VelocityInterpreter, n: torch.fx.Node) -> List[Tuple[int, Optional[AValue]]]:
    """``(output index, abstract value)`` of each non-empty floating tensor a node computes (several for a node with
    several outputs); none for an integer or boolean node or one that computes no tensor."""
    conc = it.g.env.get(n.name)
    av = it.values.get(n.name)
    if isinstance(conc, torch.Tensor):
        pairs = [(0, av if isinstance(av, AValue) else it.value_of(n.name), conc)]
    elif isinstance(conc, (tuple, list)):
        avs = list(av) if isinstance(av, (tuple, list)) else []
        avs += [None] * (len(conc) - len(avs))
        pairs = [(k, a if isinstance(a, AValue) else None, c) for k, (a, c) in enumerate(zip(avs, conc))
                 if isinstance(c, torch.Tensor)]
    else:
        return []
    return [(k, a) for k, a, c in pairs if (c.is_floating_point() or c.is_complex()) and c.numel()]

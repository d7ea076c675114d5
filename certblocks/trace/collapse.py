"""From the interpreter's polynomial bounds to a certificate's coefficients and peak.

The output's growth bound ``P(r)`` becomes ``c r^q + b`` and its Jacobian bound ``l1 max(R, 1)^sigma +
l0`` (:meth:`~certblocks.bounds.poly.Poly.collapse_growth`, ``collapse_jacobian``); every node's growth
bound, plus the query-key products inside fused attention, folds into the velocity's peak; under a precision
policy the bounds of the values held in each dtype fold into that dtype's peak (:func:`held_peaks`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional, Set, Tuple, Union, cast

import torch

from ..bounds.poly import Poly, fold_peak
from ..budget import DTYPE_MAX
from ..certificate import Peak
from .interp import VelocityInterpreter
from .nodes import IDENTITY_OPS, bind_args, op_name
from .report import NOT_DERIVED
from .values import AValue

__all__ = ["Coefficients", "coefficients", "held_peaks", "peak"]


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


class _Bound(NamedTuple):
    """One floating value of a velocity's graph and its entry bound (a polynomial in the input radius)."""

    label: str  # the node (``"linear_1"``) or ``"query-key logits of <node>"``
    node: torch.fx.Node
    poly: Poly
    dtype: Optional[str]  # the dtype the value is held in (:func:`~certblocks.trace.capture.held_dtype`)
    kind: str  # "node", "cast" (a cast into a narrower dtype) or "logits"


def _bounds(it: VelocityInterpreter) -> Union[Peak, List[_Bound]]:
    """The entry bound of every floating value of the velocity's graph (:func:`peak`), or the unbounded
    :class:`~certblocks.certificate.Peak` that names the first value without one."""
    hidden = {m.name for grp in it.atom_groups.values() for m in grp.members if m is not grp.output}
    groups = [{m.name for m in grp.members} | {grp.output.name} for grp in it.atom_groups.values()]
    for call, _ in it.certified_calls.values():
        hidden |= set(call.members) - {call.output.name}
        groups.append(set(call.members) | {call.output.name})
    # a value hidden in an atom or a certified call: its dtypes are not known one by one, the narrowest of the group's
    # values is taken (sound: every other is wider)
    group_dtype: Dict[str, Optional[str]] = {}
    for grp in groups:
        narrow = _narrowest(it, grp)
        for name in grp:
            group_dtype[name] = narrow if name not in group_dtype else _narrower(group_dtype[name], narrow)
    out: List[_Bound] = []
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
            dtype = group_dtype.get(n.name, it.g.dtype_of(n, k))
            out.append(_Bound(n.name, n, bound, dtype, "cast" if _narrowing_cast(it, n) else "node"))
        if n.name not in hidden and n.op == "call_function" and "scaled_dot_product" in op_name(n.target):
            q, kv = (it.value_of(cast(torch.fx.Node, a).name) for a in n.args[:2])
            if q is None or kv is None or q.growth is None or kv.growth is None:
                return Peak.unbounded(f"the query-key logits of {n.name}: the query or key bound is not derived")
            scale = (bind_args(n) or {}).get("scale")  # positional or keyword
            if scale is not None and not isinstance(scale, (int, float)):
                return Peak.unbounded(f"the query-key logits of {n.name}: scale {scale!r} is not a number")
            s = max(1.0, abs(float(scale))) if scale is not None else 1.0
            out.append(_Bound(f"query-key logits of {n.name}", n, (q.growth * kv.growth).scale(s),
                              it.g.dtype_of(n), "logits"))
    return out


def peak(it: VelocityInterpreter) -> Peak:
    """Bound on every floating value of the velocity's graph: its nodes' entry bounds (every tensor of a node with
    several outputs), plus the query-key products inside fused attention (``||q_i|| ||k_j||``).

    Unknown is never zero: a floating value computed from the input without a finite bound makes the peak
    :meth:`~certblocks.certificate.Peak.unbounded`, naming the node and why.  Integer and boolean values (token ids,
    indices, masks) cannot overflow a floating dtype and are left out: every floating value computed from them is a
    node of its own.  Values hidden inside a module atom or a certified call are bounded by it (a certified call
    leaves its peak on one tensor it hides: :func:`~certblocks.trace.own.representative`).
    """
    found = _bounds(it)
    if isinstance(found, Peak):
        return found
    if not found:
        return Peak(0.0, 0.0, 0.0, "no floating value computed from the input")
    top = max(found, key=lambda b: (b.poly.degree, b.poly.total()))
    try:
        return fold_peak([dict(b.poly.terms) for b in found], f"{top.label} (graph node)")
    except ValueError as exc:
        return Peak.unbounded(f"the nodes' bounds do not fold into one peak: {exc}")


def held_peaks(it: VelocityInterpreter) -> Dict[str, Peak]:
    """The peak of the values held in each dtype (docs/theory.md section 7): for each dtype, the fold of the entry
    bounds of the velocity's values held in it (:func:`~certblocks.trace.capture.held_dtype` under the policy the
    graph was captured under), naming the node that dominates, its module, its dtype and a lever.

    A velocity with a value not bounded gets that unbounded peak under the narrowest dtype its values are held in.
    A constant cast into a narrower dtype that overflowed in the captured run (a weight entry past 65504 cast to
    fp16) is an unbounded peak of that dtype naming the cast.
    """
    found = _bounds(it)
    dtypes = {b.dtype for b in found} if isinstance(found, list) else set()
    if isinstance(found, Peak):
        narrow = _narrowest(it, {n.name for n in it.order}) or "fp32"
        return {narrow: found}
    if None in dtypes:  # a value of a dtype certblocks has no range for: counted with the narrowest
        narrow = _narrowest(it, {n.name for n in it.order}) or "fp32"
        found = [b if b.dtype is not None else b._replace(dtype=narrow) for b in found]
        dtypes = {b.dtype for b in found}
    out: Dict[str, Peak] = {}
    for dtype in sorted((d for d in dtypes if d is not None), key=lambda d: DTYPE_MAX[d]):
        mine = [b for b in found if b.dtype == dtype]
        parts, seen = [], set()
        for b in mine:  # each distinct bound once, named by its first value in graph order (a view is its source)
            terms = tuple(sorted(b.poly.terms.items()))
            if terms not in seen:
                seen.add(terms)
                parts.append((terms, *_describe_value(it, b, dtype)))
        top = max(mine, key=lambda b: (b.poly.degree, b.poly.total()))
        what, lever = _describe_value(it, top, dtype)
        try:
            out[dtype] = replace(fold_peak([dict(b.poly.terms) for b in mine], what), lever=lever, parts=tuple(parts))
        except ValueError as exc:
            out[dtype] = Peak.unbounded(f"the bounds of the {dtype} values do not fold into one peak: {exc}")
    for n, dtype in _overflowed_constant_casts(it):
        out[dtype] = Peak.unbounded(f"node {n.name} (a cast of a constant into {dtype}, in "
                                    f"{it.g.module_path(n) or 'the model'}) overflows {dtype}: its value holds inf")
    return out


#: Ops whose output is a product of weights and inputs (the levers: keep it in fp32, cap its weights).
_MATMULS = ("aten.linear", "aten.addmm", "aten.mm", "aten.bmm", "aten.matmul", "aten.baddbmm", "aten.conv",
            "aten.convolution", "aten.conv1d", "aten.conv2d", "aten.einsum", "aten._scaled_mm")


def _describe_value(it: VelocityInterpreter, b: _Bound, dtype: str) -> Tuple[str, str]:
    """``(what, lever)`` of the value that dominates a dtype's peak: the node, its op, its module and dtype, and
    what lowers its bound."""
    n = b.node
    module = it.g.module_path(n)
    where = f"module {module}" if module else "the model's own code"
    keep = (f"keep {module} in fp32 (run it under torch.autocast(device_type, enabled=False) with its input cast to "
            "float32)" if module else "compute it in fp32")
    if b.kind == "logits":
        return (f"the query-key logits of {n.name} ({where}), held in {dtype}",
                f"normalize queries and keys (QK-norm bounds the logits), or {keep}")
    if b.kind == "cast":
        src = it.g.dtype_of(n.args[0]) if n.args and isinstance(n.args[0], torch.fx.Node) else None
        reader = f", read by {module}" if module else ""
        return (f"node {n.name} (a cast of a{'n' if (src or 'x')[0] in 'aefx' else ''} {src or 'wider'} value to "
                f"{dtype}{reader})",
                f"{keep}, so that its input is not cast to {dtype}; or lower the value cast (a cap on the weights "
                "upstream: certblocks.enforce, or a smaller branch gain), or a smaller input radius")
    op = _op(n)
    if any(op.startswith(m) for m in _MATMULS):
        return (f"node {n.name} ({op} of {where}), held in {dtype}",
                f"{keep}; or lower its output bound: cap its weights (certblocks.enforce) or a smaller branch gain "
                "(init_values)")
    return (f"node {n.name} ({op} in {where}), held in {dtype}",
            f"{keep}; or lower the bound of its inputs (a cap, a gain, a smaller input radius)")


def _narrowing_cast(it: VelocityInterpreter, n: torch.fx.Node) -> bool:
    """``n`` is a cast (:data:`~certblocks.trace.nodes.IDENTITY_OPS`) into a dtype narrower than its input's."""
    if n.op != "call_function" or op_name(n.target) not in IDENTITY_OPS or not n.args:
        return False
    src = n.args[0]
    a, b = (it.g.dtype_of(src) if isinstance(src, torch.fx.Node) else None), it.g.dtype_of(n)
    return a is not None and b is not None and DTYPE_MAX[b] < DTYPE_MAX[a]


def _overflowed_constant_casts(it: VelocityInterpreter) -> List[Tuple[torch.fx.Node, str]]:
    """The constants the velocity reads that a cast made non-finite in the captured run (their source was finite)."""
    seen: Dict[str, Tuple[torch.fx.Node, str]] = {}
    inside = {n.name for n in it.order}
    for n in it.order:
        for a in n.all_input_nodes:
            if a.name in inside or a.name in seen or a.op != "call_function" or op_name(a.target) not in IDENTITY_OPS:
                continue
            src = a.args[0] if a.args and isinstance(a.args[0], torch.fx.Node) else None
            v, w = it.g.env.get(a.name), it.g.env.get(src.name) if src is not None else None
            dtype = it.g.dtype_of(a)
            if dtype is None or not isinstance(w, torch.Tensor) or not isinstance(v, torch.Tensor) or not v.numel():
                continue
            if not bool(torch.isfinite(v).all()) and bool(torch.isfinite(w).all()):
                seen[a.name] = (a, dtype)
    return list(seen.values())


def _narrower(a: Optional[str], b: Optional[str]) -> Optional[str]:
    if a is None or b is None:
        return a or b
    return a if DTYPE_MAX[a] <= DTYPE_MAX[b] else b


def _narrowest(it: VelocityInterpreter, names: Set[str]) -> Optional[str]:
    """The narrowest dtype among the floating values of the named nodes (every output of each)."""
    out: Optional[str] = None
    for name in names:
        v = it.g.env.get(name)
        for k in range(len(v) if isinstance(v, (tuple, list)) else 1):
            out = _narrower(out, it.g.dtype_of(name, k))
    return out


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

"""A model as a chain of segments: stem, residual updates, maps between them, head (docs/theory.md section 6).

A certificate that chains only the residual updates is unsound: a map between two updates (patch
merging, a downsampling block, a x1e30 scaling), the stem before them and the head after them all
move the state.  :func:`model_chain` cuts a captured graph at its stream nodes -- the model input,
each residual update's input ``x_k`` and output ``x_k + f_k`` -- into segments that are each a
function of their input node alone:

* ``"stem"``: the model input to the first update's input (the patch or token embedding);
* ``"update"``: ``x_k -> x_k + f_k(x_k)``, certified through its velocity ``f_k``;
* ``"map"``: between two updates; ``"block"`` when it adds two branches of its input (a projection
  shortcut ``P x + f(x)``: a residual block certified as one map, counted as an update);
* ``"head"``: the last update's output to the model output.

A segment that reads a node of the stream other than its input (parallel branches
``x + f(x) + g(x)``, where the second add also reads ``x``) is merged with the segments before it
until it is a function of its input; merging never drops a dependency, so every segment's bound
holds for every input.  Inputs that are not on the stream (an attention mask given as a second
argument) are read at their example value, and the chain says so in its notes.

Unknown is never zero (docs/theory.md section 6).  Every output of the model is in the chain: the one the head
ends at, the stream's states and the values inside a segment are bounded by the segments; any other output
(a second head, a router's logits, ``1e30 * x``) is an ``"output"`` segment from the last stream node it is
a function of, whose bound the :class:`~certblocks.trace.report.ModelCertificate` folds into that segment's
peak.  What the chain cannot bound -- an integer value computed from the input and read by a later segment
at its example value, a head that reads more than the last state, an output not certified -- is a note of
type :class:`~certblocks.trace.report.Unbounded`: the stack certificate is not certified while it stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple, TypeGuard

import torch
from torch import nn

from .capture import CapturedGraph
from .nodes import op_name, strip_casts
from .report import TraceCertificate, Unbounded

__all__ = ["Segment", "Chain", "model_chain", "segment_name", "certify_outputs"]

Update = Tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]


@dataclass
class Segment:
    """One segment of a model's chain.

    Attributes:
        kind: ``"stem"``, ``"update"``, ``"map"``, ``"block"`` or ``"head"``; ``"output"`` for an output of the model
            other than the head's, from the stream node it is a function of (not a link of the chain).
        start: the segment's input node.
        end: its output node (for an update: the add node ``x + f``).
        velocity: an update's velocity output ``f`` (``None`` for the other kinds).
    """

    kind: str
    start: torch.fx.Node
    end: torch.fx.Node
    velocity: Optional[torch.fx.Node] = None


@dataclass
class Chain:
    """The segments of a model from its input to its output, and what the cut assumed.

    Attributes:
        segments: in order; the first is the stem and the last the head when the model has them.
        input: the model input node the chain starts from.
        output: the model output node it ends at.
        integer_input: the input holds integers (token ids): the stem's bound does not depend on it and
            no gradient flows into it.
        notes: the inputs read at their example value, and anything else the cut assumed; an
            :class:`~certblocks.trace.report.Unbounded` note names a value the chain does not bound.
        outputs: the model's other outputs that the segments do not bound, each an ``"output"`` segment from
            the start of the segment (or head) whose input it is a function of.
    """

    segments: List[Segment]
    input: torch.fx.Node
    output: torch.fx.Node
    integer_input: bool
    notes: List[str]
    outputs: List[Segment] = field(default_factory=list)


def _tensor(g: CapturedGraph, n: torch.fx.Node) -> Optional[torch.Tensor]:
    v = g.env.get(n.name)
    return v if isinstance(v, torch.Tensor) else None


def _external_inputs(g: CapturedGraph, start: torch.fx.Node, end: torch.fx.Node,
                     dep: Set[str]) -> List[torch.fx.Node]:
    """The input-dependent nodes outside ``start -> end`` that the segment reads (``start`` excluded)."""
    sub = g.between(start, end)
    out: List[torch.fx.Node] = []
    for name in sub - {start.name}:
        n = g.nodes[g.index[name]]
        for a in n.all_input_nodes:
            if a.name not in sub and a is not start and a.name in dep and a not in out:
                out.append(a)
    return out


def _adds_branches(g: CapturedGraph, seg: Segment) -> bool:
    """The segment adds two tensors of its output's shape that both depend on its input (a residual block with
    a non-identity shortcut, or parallel branches)."""
    sub = g.between(seg.start, seg.end)
    for name in sub - {seg.start.name}:
        n = g.nodes[g.index[name]]
        if n.op != "call_function" or op_name(n.target) != "aten.add":
            continue
        ops = [a for a in n.args[:2] if isinstance(a, torch.fx.Node)]
        shape = getattr(_tensor(g, n), "shape", None)
        if len(ops) == 2 and all(a.name in sub and getattr(_tensor(g, a), "shape", None) == shape for a in ops):
            return True
    return False


def model_chain(g: CapturedGraph, updates: Sequence[Update]) -> Optional[Chain]:
    """Cut the graph into the segments from the model input to its output.

    Args:
        g: the captured graph.
        updates: the residual updates ``(x, f, add)`` in depth order (:func:`find_residual_updates`).

    Returns:
        The chain, or ``None`` when the updates do not lie on one path from an input to an output
        (two stacks side by side, an encoder and a decoder): then only the updates are certified.
    """
    if not updates:
        return None
    first = updates[0][0]
    inputs = [n for n in g.user_inputs if _tensor(g, n) is not None and g.is_ancestor(n, first)]
    last = updates[-1][2]
    outputs = [o for o in g.outputs if _tensor(g, o) is not None and g.is_ancestor(last, o)]
    if not inputs or not outputs:
        return None
    x_in, out = inputs[0], outputs[0]
    segs: List[Segment] = []
    prev = x_in
    for x, f, add in updates:
        x = strip_casts(x)
        if not g.is_ancestor(prev, x):
            return None
        if x is not prev:
            segs.append(Segment("stem" if prev is x_in else "map", prev, x))
        segs.append(Segment("update", x, add, f))
        prev = add
    if strip_casts(out) is not prev:
        segs.append(Segment("head", prev, out))
    dep = g.depends_on_input()
    stream = {n.name for n in g.nodes if g.is_ancestor(x_in, n)}
    notes: List[str] = []
    try:
        segs = _merge_open(g, segs, dep, stream, notes)
    except ChainBroken as exc:
        if segs[-1].kind != "head":
            return Chain([], x_in, out, False, [f"{exc}: only the residual updates are certified"])
        try:  # a head that reads the input's statistics (instance normalization undone): certify without it
            notes = []
            segs = _merge_open(g, segs[:-1], dep, stream, notes)
        except ChainBroken as exc2:
            return Chain([], x_in, out, False, [f"{exc2}: only the residual updates are certified"])
        notes.append(Unbounded(f"{exc}: the head is not certified (it is not a function of the last state alone): "
                               "the output and Lip(G) are not bounded", out.name, None))
    extra = _other_outputs(g, segs, out, dep, stream, notes)
    others = [n for n in g.user_inputs if n is not x_in and any(g.is_ancestor(n, s.end) for s in segs + extra)]
    for n in others:
        notes.append(f"input {n.name!r} does not lie on the chain: its example value is used (the certificate "
                     "holds for inputs that share it)")
    for s in segs:  # a stem that adds two branches of the input is a residual block reading the input
        if s.kind in ("map", "stem") and _adds_branches(g, s):
            s.kind = "block"
    return Chain(segs, x_in, out, not _floating(_tensor(g, x_in)), notes, extra)


def _floating(t: Optional[torch.Tensor]) -> TypeGuard[torch.Tensor]:
    return t is not None and (t.is_floating_point() or t.is_complex())


def _other_outputs(g: CapturedGraph, segs: List[Segment], out: torch.fx.Node, dep: Set[str], stream: Set[str],
                   notes: List[str]) -> List[Segment]:
    """The model's outputs other than ``out`` that no segment bounds, each as an ``"output"`` segment from the last
    segment start it is a function of; an :class:`Unbounded` note for each (lifted once the output is certified).

    An output is bounded by the chain when it is a stream state (a segment boundary: its bound ``R_k``) or a value a
    segment computes (in the segment's graph: its peak).  Integer outputs cannot overflow a floating dtype; outputs
    that do not depend on the input are constants.  ``out`` is the head's (a head left out of the chain has its own
    note).
    """
    starts = [s.start for s in segs]
    bounded: Set[str] = {s.name for s in starts} | {segs[-1].end.name, out.name}
    for s in segs:
        bounded |= g.between(s.start, s.velocity if s.kind == "update" and s.velocity is not None else s.end)
    found: List[Segment] = []
    for k, o in enumerate(g.outputs):
        t = _tensor(g, o)
        if o.name not in dep or not _floating(t) or not t.numel() or strip_casts(o).name in bounded or any(
                o is f.end for f in found):
            continue
        start = next((s for s in reversed(starts) if g.is_ancestor(s, o) and not [
            e for e in _external_inputs(g, s, o, dep) if e.name in stream and _floating(_tensor(g, e))]), None)
        if start is None:  # not computed from the chain's input: another input's example value
            notes.append(f"output {k} ({o.name}) does not depend on the chain's input: its bound is its example value")
            continue
        for e in _external_inputs(g, start, o, dep):
            if e.name in stream and not _floating(_tensor(g, e)):
                notes.append(Unbounded(f"output {k} ({o.name}) reads {e.name!r}, computed from the input's values, at "
                                       "its example value", e.name, start.name))
        found.append(Segment("output", start, o))
        notes.append(Unbounded(f"output {k} ({o.name}) of the model is not bounded by the chain (it is not the head's "
                               "output, a state or a value of a segment) and was not certified", o.name, start.name))
    return found


def certify_outputs(g: CapturedGraph, chain: Chain) -> List[TraceCertificate]:
    """Each of ``chain.outputs`` certified as a map from its segment's input, for
    :attr:`~certblocks.trace.report.ModelCertificate.outputs` (which lifts its :class:`Unbounded` note)."""
    from .api import certify_velocity  # api imports this module

    out: List[TraceCertificate] = []
    for s in chain.outputs:
        tc = certify_velocity(g, s.start, s.end, f"output {s.end.name}")
        tc.certificate = replace(tc.certificate, kind="map")
        out.append(tc)
    return out


class ChainBroken(Exception):
    """A segment reads a value computed before the input of the segment in front of it: not one chain."""


def _merge_open(g: CapturedGraph, segs: List[Segment], dep: Set[str], stream: Set[str],
                notes: List[str]) -> List[Segment]:
    """Merge each segment that reads a floating-point stream node computed from the input of the segment in
    front of it (parallel branches ``x + f(x) + g(x)``) with that segment.  Integer and boolean nodes
    computed from the input (a padding mask from token ids) would be read at their example value: an
    :class:`Unbounded` note names each (the certificate is not certified).

    Raises:
        ChainBroken: a segment reads a value computed further back (a head that undoes an instance
            normalization of the input with its statistics); the head is then dropped by the caller.
    """
    out: List[Segment] = []
    for s in segs:
        cur = s
        while True:
            end_nodes = [cur.velocity] if cur.kind == "update" and cur.velocity is not None else [cur.end]
            ext = [e for n in end_nodes for e in _external_inputs(g, cur.start, n, dep) if e.name in stream]
            discrete = [e for e in ext if not _floating(_tensor(g, e))]
            ext = [e for e in ext if e not in discrete]
            if not ext:
                for e in discrete:  # the segment's interpreter reads it as a constant: not bounded over its range
                    notes.append(Unbounded(
                        f"{cur.kind} {segment_name(g, cur)!r} reads {e.name!r}, an integer or boolean value computed "
                        "from the input, at its example value (it is not bounded over its range)", e.name,
                        cur.start.name))
                break
            prev = out[-1] if out else None
            if prev is None or not all(g.is_ancestor(prev.start, e) for e in ext):
                raise ChainBroken(f"{cur.kind} {segment_name(g, cur)!r} reads {ext[0].name!r}, computed before the "
                                  "input of the segment in front of it")
            out.pop()
            kinds = {prev.kind, cur.kind}
            kind = ("stem" if "stem" in kinds else "head" if "head" in kinds else
                    "block" if kinds & {"update", "block"} else "map")
            cur = Segment(kind, prev.start, cur.end)
        out.append(cur)
    return out


def _deepest_common(stacks: List[List[str]]) -> List[str]:
    common = stacks[0]
    for st in stacks[1:]:
        k = 0
        while k < min(len(common), len(st)) and common[k] == st[k]:
            k += 1
        common = common[:k]
    return common


def segment_name(g: CapturedGraph, seg: Segment) -> str:
    """A name for a map segment: the deepest module holding all its operations (unless it is a list of layers),
    else the deepest module of each group of operations below the modules they share
    (``"layers.0.blocks.0+layers.1.downsample"``), else its output node."""
    sub = g.between(seg.start, seg.end) - {seg.start.name}
    calls = [g.nodes[g.index[n]] for n in sorted(sub, key=g.index.__getitem__)
             if g.nodes[g.index[n]].op == "call_function"]
    stacks = [[p for p, _ in g.module_stack(n)] for n in calls]
    inside = [st for st in stacks if st]
    if not inside:
        return seg.end.name
    shared = _deepest_common(inside)
    groups: Dict[str, List[List[str]]] = {}
    for st in inside:
        if len(st) > len(shared):  # operations sitting in the shared module itself name nothing more
            groups.setdefault(st[len(shared)], []).append(st)
    container = isinstance(g.get_module(shared[-1]), (nn.ModuleList, nn.ModuleDict, nn.Sequential)) if shared else True
    if shared and len(inside) == len(stacks) and (len(groups) <= 1 or not container):
        return shared[-1]  # one module (a list of layers is named by the layers the segment touches)
    if not groups:
        return shared[-1]
    names = [_deepest_common(members)[-1] for members in groups.values()]
    return "+".join(names[:3]) + ("+..." if len(names) > 3 else "")

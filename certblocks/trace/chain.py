"""A model as a chain of segments: stem, residual updates, maps between them, head (THEORY.md section 6).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .capture import CapturedGraph
from .nodes import op_name, strip_casts

__all__ = ["Segment", "Chain", "model_chain", "segment_name"]

Update = Tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]


@dataclass
class Segment:
    """One segment of a model's chain.

    Attributes:
        kind: ``"stem"``, ``"update"``, ``"map"``, ``"block"`` or ``"head"``.
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
        notes: the inputs read at their example value, and anything else the cut assumed.
    """

    segments: List[Segment]
    input: torch.fx.Node
    output: torch.fx.Node
    integer_input: bool
    notes: List[str]


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
            segs = _merge_open(g, segs[:-1], dep, stream, notes)
        except ChainBroken as exc2:
            return Chain([], x_in, out, False, [f"{exc2}: only the residual updates are certified"])
        notes.append(f"{exc}: the head is not certified (it is not a function of the last state alone); "
                     "stack() takes Lip(G) from its lip_g argument and bounds the last state, not the output")
    others = [n for n in g.user_inputs if n is not x_in and any(
        g.is_ancestor(n, s.end) for s in segs)]
    for n in others:
        notes.append(f"input {n.name!r} does not lie on the chain: its example value is used (the certificate "
                     "holds for inputs that share it)")
    for s in segs:  # a stem that adds two branches of the input is a residual block reading the input
        if s.kind in ("map", "stem") and _adds_branches(g, s):
            s.kind = "block"
    t = _tensor(g, x_in)
    integer = t is not None and not (t.is_floating_point() or t.is_complex())
    return Chain(segs, x_in, out, integer, notes)


class ChainBroken(Exception):
    """A segment reads a value computed before the input of the segment in front of it: not one chain."""


def _merge_open(g: CapturedGraph, segs: List[Segment], dep: Set[str], stream: Set[str],
                notes: List[str]) -> List[Segment]:
    """Merge each segment that reads a floating-point stream node computed from the input of the segment in
    front of it (parallel branches ``x + f(x) + g(x)``) with that segment.  Integer and boolean nodes
    computed from the input (a padding mask from token ids) are read at their example value: ``notes`` names
    them.

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
            discrete = [e for e in ext if (t := _tensor(g, e)) is None or not (t.is_floating_point() or t.is_complex())]
            for e in discrete:
                note = (f"node {e.name!r} is computed from the input's integer values and read at its example value "
                        "(the certificate holds for inputs that share it)")
                if note not in notes:
                    notes.append(note)
            ext = [e for e in ext if e not in discrete]
            if not ext:
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
    calls = [g.nodes[g.index[n]] for n in sorted(sub, key=g.index.get) if g.nodes[g.index[n]].op == "call_function"]
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

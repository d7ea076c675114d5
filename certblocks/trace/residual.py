"""Finding the velocities of a captured graph: residual updates ``X + f(X)``, or modules chosen by path."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from .capture import CapturedGraph
from .nodes import PASS_THROUGH_OPS, op_name, strip_casts

if TYPE_CHECKING:
    from .report import TraceCertificate

__all__ = ["find_residual_updates", "velocity_name", "module_velocities", "dedupe_names"]


def find_residual_updates(g: CapturedGraph) -> List[Tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """Residual updates ``add(X, F)`` where ``X`` is an ancestor of ``F`` (the outermost ones), in depth order.

    Returns:
        ``(x, f, add)`` triples: the residual stream node (casts followed back), the velocity's output
        node and the add node.
    """
    dep = g.depends_on_input()
    cands = []
    for n in g.nodes:
        if n.op != "call_function" or op_name(n.target) != "aten.add" or len(n.args) < 2:
            continue
        a, b = n.args[0], n.args[1]
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or a is b:
            continue
        if a.name not in dep or b.name not in dep:
            continue
        if n.kwargs.get("alpha", 1) != 1:
            continue
        va, vb, vn = g.env.get(a.name), g.env.get(b.name), g.env.get(n.name)
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and isinstance(vn, torch.Tensor)):
            continue
        if not (va.shape == vb.shape == vn.shape) or not vn.is_floating_point():
            continue
        sa, sb = strip_casts(a), strip_casts(b)
        if g.is_ancestor(sa, b):
            cands.append((sa, b, n))
        elif g.is_ancestor(sb, a):
            cands.append((sb, a, n))
    # keep the outermost: drop an update that lies inside another update's velocity
    return [c for c in cands if not any(o is not c and c[2] is not o[0] and g.is_ancestor(o[0], c[2])
                                        and g.is_ancestor(c[2], o[1]) for o in cands)]


def _producer(n: torch.fx.Node) -> torch.fx.Node:
    """The node that computed ``n``'s values, through :data:`~certblocks.trace.nodes.PASS_THROUGH_OPS`."""
    while n.op == "call_function" and op_name(n.target) in PASS_THROUGH_OPS and n.all_input_nodes:
        n = n.args[0] if isinstance(n.args[0], torch.fx.Node) else n.all_input_nodes[0]
    return n


def velocity_name(g: CapturedGraph, f: torch.fx.Node, add: Optional[torch.fx.Node] = None) -> str:
    """The branch module: the child of the add node's module on the way to the velocity's producer.

    A branch gain (a ``LayerScale``: ``gamma * v``, certblocks' or timm's) is not the branch: the update is named
    after the module whose output it scales (``blocks.0.attn``, not ``blocks.0.ls1``), as the blocks name it.
    """
    node = _producer(f)
    name = _branch_path(g, node, add)
    while _is_gain(g, node, name):
        inner = [a for a in node.all_input_nodes if a.op != "get_attr" and isinstance(g.env.get(a.name), torch.Tensor)
                 and g.env[a.name].ndim > 1]
        if len(inner) != 1:
            break
        node = _producer(inner[0])
        name = _branch_path(g, node, add)
    return name


def _branch_path(g: CapturedGraph, node: torch.fx.Node, add: Optional[torch.fx.Node]) -> str:
    st = [p for p, _ in g.module_stack(node)]
    if add is not None:
        base = [p for p, _ in g.module_stack(add)]
        if st[: len(base)] == base and len(st) > len(base):
            return st[len(base)]
        if base:
            return base[-1]
    return st[0] if st else ""


def _is_gain(g: CapturedGraph, node: torch.fx.Node, path: str) -> bool:
    """``node`` is computed inside a ``LayerScale`` module at ``path``."""
    return any(p == path and t.rsplit(".", 1)[-1] == "LayerScale" for p, t in g.module_stack(node))


def module_velocities(g: CapturedGraph, patterns: Sequence[str]) -> List[Tuple[str, torch.fx.Node, torch.fx.Node]]:
    """The modules whose path matches one of ``patterns`` (globs), each as a velocity ``(path, x, out)``.

    Raises:
        ValueError: no module matches, or a matching module has no input-dependent input or tensor output.
    """
    paths: List[str] = []
    for n in g.nodes:
        for p, _ in g.module_stack(n):
            if p not in paths:
                paths.append(p)
    chosen = [p for p in paths if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]
    if not chosen:
        raise ValueError(f"residual={list(patterns)!r} matches no module path of the graph; paths include "
                         f"{paths[:12]}{' ...' if len(paths) > 12 else ''}")
    # drop paths nested inside another chosen path
    chosen = [p for p in chosen if not any(p != o and p.startswith(o + ".") for o in chosen)]
    dep = g.depends_on_input()
    out = []
    for p in chosen:
        members = [n for n in g.nodes if any(mp == p for mp, _ in g.module_stack(n))]
        names = {m.name for m in members}
        ins: List[torch.fx.Node] = []
        for m in members:
            for a in m.all_input_nodes:
                if a.name not in names and a.name in dep and a not in ins and isinstance(g.env.get(a.name),
                                                                                        torch.Tensor):
                    ins.append(a)
        outs = [m for m in members if any(u.name not in names for u in m.users)
                and isinstance(g.env.get(m.name), torch.Tensor)]
        if not ins or not outs:
            raise ValueError(f"module {p!r} has no input-dependent input or no tensor output in the graph")
        fl = [a for a in ins if a.meta.get("val") is not None and g.env[a.name].is_floating_point()] or ins
        x = fl[0]
        if len(fl) > 1:
            same = [a for a in fl if tuple(g.env[a.name].shape) == tuple(g.env[outs[-1].name].shape)]
            x = same[0] if same else fl[0]
        o = [m for m in outs if tuple(g.env[m.name].shape) == tuple(g.env[x.name].shape)]
        out.append((p, x, (o or outs)[-1]))
    return out


def dedupe_names(certs: List[TraceCertificate]) -> None:
    """Number repeated velocity names in place (``attn#0``, ``attn#1``)."""
    seen: Dict[str, int] = {}
    for c in certs:
        seen[c.name] = seen.get(c.name, 0) + 1
    count: Dict[str, int] = {}
    for c in certs:
        if seen[c.name] > 1:
            k = count.get(c.name, 0)
            count[c.name] = k + 1
            new = f"{c.name}#{k}"
            c.name = new
            object.__setattr__(c.certificate, "name", new)

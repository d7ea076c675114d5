"""``certify(module, example_input)``: certificates of a module's residual updates from its graph."""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import exponents as E
from ..bounds import fold_peak
from ..certificate import BlockCertificate, Peak
from .capture import CapturedGraph, capture
from .interp import VelocityInterpreter
from .nodes import CASTS as _CASTS
from .nodes import op_name
from ..bounds.poly import Poly
from .report import NOT_DERIVED, ModelCertificate, TraceCertificate, node_row
from .values import AValue

__all__ = ["certify", "certify_velocity", "find_residual_updates", "ResidualUpdate"]

_STRUCTURAL_PASS = _CASTS | {"aten.dropout", "aten.view", "aten.reshape", "aten._unsafe_view", "getitem",
                             "aten.transpose", "aten.permute", "aten.flatten", "aten.unflatten", "aten.squeeze",
                             "aten.unsqueeze", "aten.contiguous", "aten.clone", "aten.to", "aten.slice",
                             "aten.select", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind",
                             "aten.narrow", "aten.expand"}


class ResidualUpdate(Tuple[Any, Any, Any]):
    """``(x, f, add)``: the residual stream node, the velocity output node and the add node."""


def _as_args(example_input: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    if isinstance(example_input, torch.Tensor):
        return (example_input,), {}
    if isinstance(example_input, dict):
        return (), dict(example_input)
    if isinstance(example_input, (list, tuple)):
        return tuple(example_input), {}
    raise TypeError(f"example_input must be a tensor, a tuple of arguments or a dict of keyword arguments, "
                    f"got {type(example_input).__name__}")


def find_residual_updates(g: CapturedGraph) -> List[Tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """Residual updates ``add(X, F)`` where ``X`` is an ancestor of ``F`` (the outermost ones), in depth order."""
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
        alpha = n.kwargs.get("alpha", 1)
        if alpha != 1:
            continue
        va, vb, vn = g.env.get(a.name), g.env.get(b.name), g.env.get(n.name)
        if not all(isinstance(v, torch.Tensor) for v in (va, vb, vn)):
            continue
        if not (va.shape == vb.shape == vn.shape) or not vn.is_floating_point():
            continue
        sa, sb = _strip_casts(a), _strip_casts(b)
        if g.is_ancestor(sa, b):
            cands.append((sa, b, n))
        elif g.is_ancestor(sb, a):
            cands.append((sb, a, n))
    keep = []
    for c in cands:
        nested = False
        for o in cands:
            if o is c:
                continue
            x2, f2, add2 = o
            if c[2] is not x2 and g.is_ancestor(x2, c[2]) and g.is_ancestor(c[2], f2):
                nested = True
                break
        if not nested:
            keep.append(c)
    return keep


def _strip_casts(n: torch.fx.Node) -> torch.fx.Node:
    """Follow dtype casts and copies back to the tensor they copy (the residual stream)."""
    while n.op == "call_function" and op_name(n.target) in _CASTS and n.args and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n


# ------------------------------------------------------------------------------------------------
def _producer(g: CapturedGraph, n: torch.fx.Node) -> torch.fx.Node:
    while n.op == "call_function" and op_name(n.target) in _STRUCTURAL_PASS and n.all_input_nodes:
        n = n.args[0] if isinstance(n.args[0], torch.fx.Node) else n.all_input_nodes[0]
    return n


def _velocity_name(g: CapturedGraph, x: torch.fx.Node, f: torch.fx.Node, add: Optional[torch.fx.Node] = None) -> str:
    """The branch module: the child of the add node's module on the way to the velocity's producer."""
    prod = _producer(g, f)
    st = [p for p, _ in g.module_stack(prod)]
    if add is not None:
        base = [p for p, _ in g.module_stack(add)]
        if st[: len(base)] == base and len(st) > len(base):
            return st[len(base)]
        if base:
            return base[-1]
    return st[0] if st else ""


def _av(it: VelocityInterpreter, name: str) -> Optional[AValue]:
    v = it.values.get(name)
    if isinstance(v, (list, tuple)):
        v = next((e for e in v if isinstance(e, AValue)), None)
    return v if isinstance(v, AValue) else None


def _desc(g: CapturedGraph, it: VelocityInterpreter, n: Any, depth: int = 0) -> str:
    """A short symbolic description of a node: ``SiLU(W_up x)``."""
    if not isinstance(n, torch.fx.Node):
        return repr(n)
    if n is it.x:
        return "x"
    if depth > 3:
        return "..."
    av = _av(it, n.name)
    if av is not None and av.const:
        pn = g.param_name(n)
        return pn.rsplit(".", 1)[0] if pn else "const"
    t = op_name(n.target) if n.op == "call_function" else n.op
    if t in _STRUCTURAL_PASS and n.all_input_nodes:
        return _desc(g, it, n.args[0] if isinstance(n.args[0], torch.fx.Node) else n.all_input_nodes[0], depth)
    short = t.split(".")[-1]
    mod = g.module_path(n)
    if n.name in it.atom_groups:
        atom, inp = it.atom_groups[n.name].atom, it.atom_groups[n.name].input
        return f"{atom.name}({_desc(g, it, inp, depth + 1)})"
    if short in ("linear", "addmm", "mm", "matmul", "conv1d", "conv2d", "einsum", "bmm"):
        acts = [a for a in n.all_input_nodes if not (_av(it, a.name) and _av(it, a.name).const)]
        if len(acts) == 1:
            wname = mod.rsplit(".", 1)[-1] if mod else short
            wname = wname[2:] if wname[:2] in ("w_", "W_") else wname
            return f"W_{wname} {_desc(g, it, acts[0], depth + 1)}"
        return f"{short}(" + ", ".join(_desc(g, it, a, depth + 1) for a in acts) + ")"
    names = {"silu": "SiLU", "gelu": "GELU", "relu": "ReLU", "sigmoid": "sigmoid", "tanh": "tanh",
             "softplus": "softplus", "exp": "exp", "softmax": "softmax", "layer_norm": "LN", "rms_norm": "RMSNorm",
             "scaled_dot_product_attention": "attention"}
    acts = [a for a in n.all_input_nodes if not (_av(it, a.name) and _av(it, a.name).const)]
    label = names.get(short, short)
    if len(acts) == 1:
        return f"{label}({_desc(g, it, acts[0], depth + 1)})"
    if short in ("mul", "div", "add", "sub") and len(acts) == 2:
        sym = {"mul": "*", "div": "/", "add": "+", "sub": "-"}[short]
        return f"({_desc(g, it, acts[0], depth + 1)} {sym} {_desc(g, it, acts[1], depth + 1)})"
    return f"{label}(" + ", ".join(_desc(g, it, a, depth + 1) for a in acts) + ")"


def _reachable(it: VelocityInterpreter, out: torch.fx.Node) -> List[torch.fx.Node]:
    seen = set()
    stack = [out.name]
    while stack:
        nm = stack.pop()
        if nm in seen:
            continue
        seen.add(nm)
        av = _av(it, nm)
        if av is not None:
            stack.extend(d for d in av.deps if d)
    return [n for n in it.order if n.name in seen]


def _culprit(g: CapturedGraph, it: VelocityInterpreter, out: torch.fx.Node) -> Tuple[str, str, str]:
    """(culprit text, node name, suggestion)."""
    res = _av(it, out.name)
    nodes = _reachable(it, out)
    where = lambda n: f"{n.name} ({op_name(n.target)}" + (f" in {g.module_path(n)})" if g.module_path(n) else ")")
    if not res.exps.known:
        comp = "q" if res.exps.q is None else "sigma"
        for n in nodes:
            av = _av(it, n.name)
            if av is None or getattr(av.exps, comp) is not None:
                continue
            deps = [_av(it, d) for d in av.deps if _av(it, d) is not None]
            if all(getattr(d.exps, comp) is not None for d in deps):
                why = av.bad or av.rule or "outside the certified class"
                return (f"{where(n)}: {why}", n.name,
                        f"{where(n)} is outside the certified class ({why}): replace it by a primitive the rules "
                        "cover (a normalization, a saturating or Lipschitz map, an exp of a provably nonpositive "
                        "argument) or register an atom for it with certblocks.trace.register_atom")
        return ("not derived", "", "register an atom for the op outside the class")
    q, s = res.exps.q, res.exps.sigma
    comp = "q" if q > 1 else ("sigma" if s > 0 else None)
    if comp is None:
        # exponents are fine: name the node that multiplies the Jacobian bound the most
        best, best_ratio = None, 1.0
        for n in nodes:
            av = _av(it, n.name)
            if av is None or av.const or av.jacobian is None or n is it.x:
                continue
            deps = [_av(it, d) for d in av.deps if _av(it, d) is not None and not _av(it, d).const]
            base = max([d.jacobian.total() for d in deps if d.jacobian is not None], default=1.0)
            ratio = av.jacobian.total() / base if base > 0 else 1.0
            if ratio > best_ratio:
                best, best_ratio = n, ratio
        if best is None:
            return ("", "", "")
        return (f"largest Jacobian factor: {where(best)} x{best_ratio:.3g} ({_av(it, best.name).rule})", best.name,
                "")
    best, best_jump = None, -1.0
    for n in nodes:
        av = _av(it, n.name)
        if av is None or av.const or n is it.x:
            continue
        mine = getattr(av.exps, comp)
        deps = [_av(it, d) for d in av.deps if _av(it, d) is not None and not _av(it, d).const]
        base = max([getattr(d.exps, comp) or 0.0 for d in deps], default=0.0)
        jump = (mine or 0.0) - base
        if jump > 0 and jump >= best_jump:
            best, best_jump = n, jump
    if best is None:
        return ("", "", "")
    av = _av(it, best.name)
    t = op_name(best.target)
    deps = [d for d in av.deps if _av(it, d) is not None and not _av(it, d).const]
    dnodes = [next((m for m in it.order if m.name == d), None) for d in deps]
    parts = [f"{_desc(g, it, m)} (q={_av(it, m.name).exps.q:g})" for m in dnodes if m is not None
             and _av(it, m.name).exps.q is not None]
    if comp == "q":
        if t in ("aten.pow", "aten.square") or (len(dnodes) == 1 and t == "aten.mul"):
            text = f"{where(best)} raises {_desc(g, it, dnodes[0]) if dnodes else 'its input'} to a power: q={q:g}"
            fix = ("normalize the input of the power (q -> 0) or replace the power by a Lipschitz or bounded map "
                   "(q -> 1)")
        elif len(parts) >= 2:
            text = f"{where(best)} multiplies " + " by ".join(parts) + f": q={q:g}"
            fix = (f"the {t.split('.')[-1]} multiplies " + " by ".join(parts) +
                   ": gate with sigmoid or normalize the gate input (bound one factor: q -> "
                   f"{max(q - 1, 0):g} or less)")
        else:
            text = f"{where(best)} raises q to {q:g} ({av.rule})"
            fix = "normalize the input of this primitive (q -> 0) or swap it for a Lipschitz or bounded substitute"
        return text, best.name, fix
    # sigma
    if "attention" in av.rule or "row-stochastic" in av.rule or "softmax" in av.rule:
        qk_sigma = _logit_sigma(it, best)
        if qk_sigma is not None and qk_sigma >= 1:
            text = (f"{where(best)}: attention, the query-key logits grow like ||x||^2 (sigma_logits = "
                    f"{qk_sigma:g}) and the Jacobian grows like R^{s:g}")
            fix = ("normalize queries and keys (QK-norm: sigma -> 1) or normalize the branch input "
                   "(pre-normalization: (q, sigma) -> (0, 0))")
        else:
            text = (f"{where(best)}: attention weights that depend on x multiply the values (q_V = 1): the "
                    f"Jacobian grows like R^{s:g}")
            fix = "normalize the branch input (pre-normalization: (q, sigma) -> (0, 0))"
    elif len(parts) >= 2:
        text = f"{where(best)} multiplies " + " by ".join(parts) + f": the Jacobian grows like R^{s:g}"
        fix = "normalize the branch input (sigma -> 0) or bound one factor of the product"
    else:
        text = f"{where(best)} ({av.rule}): the Jacobian grows like R^{s:g}"
        fix = "normalize the branch input (sigma -> 0)"
    return text, best.name, fix


def _logit_sigma(it: VelocityInterpreter, n: torch.fx.Node) -> Optional[float]:
    """sigma of the query-key logits feeding an attention node (SDPA: from Q and K; P @ V: from P)."""
    t = op_name(n.target)
    if "scaled_dot_product" in t:
        q, k = _av(it, n.args[0].name), _av(it, n.args[1].name)
        if q is None or k is None:
            return None
        acts = [v.exps for v in (q, k) if not v.const]
        return E.product(*acts).sigma if acts else 0.0
    for d in (_av(it, d) for d in (_av(it, n.name).deps if _av(it, n.name) else ())):
        if d is not None and d.stochastic_dim is not None:
            return d.exps.sigma
    return None


def _collapse(av: AValue) -> Tuple[float, float, float, float, bool]:
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
        return NOT_DERIVED, NOT_DERIVED, NOT_DERIVED, NOT_DERIVED, False
    vals = [min(v, NOT_DERIVED) if math.isfinite(v) else NOT_DERIVED for v in (c, b, l1, l0)]
    return vals[0], vals[1], vals[2], vals[3], ok


def _peak(g: CapturedGraph, it: VelocityInterpreter) -> Optional[Peak]:
    """Bound on every value of the velocity's graph: its nodes' growth polynomials, plus the query-key
    products inside fused attention (``||q_i|| ||k_j||``).  ``None`` when a node's growth is not derived."""
    polys: List[Tuple[str, Poly]] = []
    for n in it.order:
        av = _av(it, n.name)
        if av is None or av.const:
            continue
        if av.growth is None or not av.growth.is_finite():
            return None
        polys.append((n.name, av.growth))
        if n.op == "call_function" and "scaled_dot_product" in op_name(n.target):
            q, k = _av(it, n.args[0].name), _av(it, n.args[1].name)
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


def certify_velocity(g: CapturedGraph, x: torch.fx.Node, out: torch.fx.Node, name: str = "") -> TraceCertificate:
    """Certify the velocity ``x -> out`` of a captured graph."""
    it = VelocityInterpreter(g, x, out)
    res = it.run()
    c, b, l1, l0, ok = _collapse(res)
    culprit, cnode, fix = _culprit(g, it, out)
    cert = BlockCertificate(res.exps.q, res.exps.sigma, c=c, b=b, l1=l1, l0=l0, name=name, culprit=culprit, fix=fix,
                            peak=_peak(g, it))
    rows = []
    for n in it.order:
        av = _av(it, n.name)
        if av is None:
            continue
        rows.append(node_row(n, av, g.module_path(n), op_name(n.target) if n.op == "call_function" else n.op))
    shape = tuple(g.env[x.name].shape) if isinstance(g.env.get(x.name), torch.Tensor) else ()
    return TraceCertificate(name, cert, culprit, cnode, fix, rows, ok, x.name, out.name, shape)


def _module_velocities(g: CapturedGraph, patterns: Sequence[str]) -> List[Tuple[str, torch.fx.Node, torch.fx.Node]]:
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
        ins = []
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


def certify(module: nn.Module, example_input: Any, *, residual: Union[str, Sequence[str], None, bool] = "auto",
            kwargs: Optional[Dict[str, Any]] = None) -> Union[TraceCertificate, ModelCertificate]:
    """Certify a module from its graph (captured with ``torch.export``).

    Args:
        module: any ``nn.Module`` (it is traced in its current train/eval mode; call ``.eval()`` first
            to remove dropout).
        example_input: a tensor, a tuple of positional arguments, or a dict of keyword arguments.  The
            graph is specialized to these shapes: coefficients hold for inputs of the same shape.
        residual: ``"auto"`` finds the residual updates ``X + f(X)`` (add nodes where one operand is
            an ancestor of the other) and certifies each velocity ``f``; when there is none, the whole
            module is certified as one velocity.  ``None``/``False``: the whole module is one velocity
            (its first floating-point input to its first output).  A module path or glob pattern
            (``"blocks.*.attn"``), or a list of them: each matching module is a velocity of its own input.
        kwargs: extra keyword arguments for the forward.

    Returns:
        A :class:`TraceCertificate` for a single velocity, or a :class:`ModelCertificate` listing the
        residual updates (or the selected modules) in depth order; ``.stack(dtype, r0=...)`` on it
        gives a :class:`~certblocks.certificate.StackCertificate`.
    """
    args, kw = _as_args(example_input)
    kw.update(kwargs or {})
    g = capture(module, args, kw)
    model_name = type(module).__name__
    if residual is None or residual is False:
        return _whole(g, model_name)
    if isinstance(residual, str) and residual == "auto":
        ups = find_residual_updates(g)
        if not ups:
            return _whole(g, model_name)
        certs = []
        for k, (x, f, add) in enumerate(ups):
            name = _velocity_name(g, x, f, add) or f"update {k}"
            certs.append(certify_velocity(g, x, f, name))
        _dedupe_names(certs)
        return ModelCertificate(certs, model_name, g.strict)
    if isinstance(residual, str):
        residual = [residual]
    if not isinstance(residual, (list, tuple)) or not all(isinstance(p, str) for p in residual):
        raise TypeError(f"residual must be 'auto', None, a module path/pattern or a list of them, got {residual!r}")
    certs = [certify_velocity(g, x, o, p) for p, x, o in _module_velocities(g, residual)]
    return ModelCertificate(certs, model_name, g.strict)


def _dedupe_names(certs: List[TraceCertificate]) -> None:
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


def _whole(g: CapturedGraph, model_name: str) -> TraceCertificate:
    xs = [n for n in g.user_inputs if isinstance(g.env.get(n.name), torch.Tensor)
          and (g.env[n.name].is_floating_point() or g.env[n.name].is_complex())]
    if not xs:
        raise ValueError(f"{model_name} has no floating-point tensor input to certify as a velocity "
                         "(integer inputs such as token ids: use residual='auto' or module paths)")
    outs = [o for o in g.outputs if isinstance(g.env.get(o.name), torch.Tensor)]
    if not outs:
        raise ValueError(f"{model_name} has no tensor output")
    return certify_velocity(g, xs[0], outs[0], model_name)


_ = Poly

"""Diagnosis of a traced velocity: the culprit node behind its exponents, and a fix in words.

The culprit is the first node whose exponent exceeds its inputs' (or, when the exponents are
certified, the node that multiplies the Jacobian bound the most); :func:`describe` writes a node as a
short formula (``SiLU(W_up x)``) for the message.  The culprit is an op that grows: ops that only move values
(views, copies, casts, dropout -- certificates hold in eval mode, where dropout is the identity) are never named;
the output of a module that carries its own certificate is named as that module (``blocks.3.attn
(QKNormAttention)``), not as its last op.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, cast

import torch

from .. import exponents as E
from .capture import CapturedGraph
from .interp import VelocityInterpreter
from .nodes import PASS_THROUGH_OPS, op_name
from .values import AValue

__all__ = ["culprit", "describe"]

_LABELS = {"silu": "SiLU", "gelu": "GELU", "relu": "ReLU", "sigmoid": "sigmoid", "tanh": "tanh",
           "softplus": "softplus", "exp": "exp", "softmax": "softmax", "layer_norm": "LN", "rms_norm": "RMSNorm",
           "scaled_dot_product_attention": "attention"}
_LINEAR = ("linear", "addmm", "mm", "matmul", "conv1d", "conv2d", "einsum", "bmm")
_SYMBOLS = {"mul": "*", "div": "/", "add": "+", "sub": "-"}
_DROPOUTS = frozenset({"aten.dropout", "aten.feature_dropout", "aten.alpha_dropout", "aten.native_dropout"})


def _is_const(it: VelocityInterpreter, name: str) -> bool:
    av = it.value_of(name)
    return av is not None and av.const


def describe(g: CapturedGraph, it: VelocityInterpreter, n: Any, depth: int = 0) -> str:
    """A short symbolic description of a node: ``SiLU(W_up x)``."""
    if not isinstance(n, torch.fx.Node):
        return repr(n)
    if n is it.x:
        return "x"
    if depth > 3:
        return "..."
    if _is_const(it, n.name):
        pn = g.param_name(n)
        return pn.rsplit(".", 1)[0] if pn else "const"
    t = op_name(n.target) if n.op == "call_function" else n.op
    if t in PASS_THROUGH_OPS and n.all_input_nodes:
        return describe(g, it, n.args[0] if isinstance(n.args[0], torch.fx.Node) else n.all_input_nodes[0], depth)
    short = t.split(".")[-1]
    if n.name in it.atom_groups:
        group = it.atom_groups[n.name]
        return f"{group.atom.name}({describe(g, it, group.input, depth + 1)})"
    acts = [a for a in n.all_input_nodes if not _is_const(it, a.name)]
    if short in _LINEAR:
        if len(acts) == 1:
            mod = g.module_path(n)
            wname = mod.rsplit(".", 1)[-1] if mod else short
            wname = wname[2:] if wname[:2] in ("w_", "W_") else wname
            return f"W_{wname} {describe(g, it, acts[0], depth + 1)}"
        return f"{short}(" + ", ".join(describe(g, it, a, depth + 1) for a in acts) + ")"
    label = _LABELS.get(short, short)
    if len(acts) == 1:
        return f"{label}({describe(g, it, acts[0], depth + 1)})"
    if short in _SYMBOLS and len(acts) == 2:
        return f"({describe(g, it, acts[0], depth + 1)} {_SYMBOLS[short]} {describe(g, it, acts[1], depth + 1)})"
    return f"{label}(" + ", ".join(describe(g, it, a, depth + 1) for a in acts) + ")"


def _reachable(it: VelocityInterpreter, out: torch.fx.Node) -> List[torch.fx.Node]:
    """The interpreted nodes ``out`` was computed from, in topological order."""
    seen = set()
    stack = [out.name]
    while stack:
        nm = stack.pop()
        if nm in seen:
            continue
        seen.add(nm)
        av = it.value_of(nm)
        if av is not None:
            stack.extend(d for d in av.deps if d)
    return [n for n in it.order if n.name in seen]


def _logit_sigma(it: VelocityInterpreter, n: torch.fx.Node) -> Optional[float]:
    """sigma of the query-key logits feeding an attention node (SDPA: from Q and K; P @ V: from P)."""
    if "scaled_dot_product" in op_name(n.target):
        q, k = it.value_of(cast(torch.fx.Node, n.args[0]).name), it.value_of(cast(torch.fx.Node, n.args[1]).name)
        if q is None or k is None:
            return None
        acts = [v.exps for v in (q, k) if not v.const]
        return E.product(*acts).sigma if acts else 0.0
    av = it.value_of(n.name)
    for d in (it.value_of(d) for d in (av.deps if av else ())):
        if d is not None and d.stochastic_dim is not None:
            return d.exps.sigma
    return None


def _act_deps(it: VelocityInterpreter, names: Tuple[str, ...]) -> List[str]:
    """The input-dependent ones among a node's dependencies."""
    return [d for d in names if (v := it.value_of(d)) is not None and not v.const]


def _value(it: VelocityInterpreter, name: str) -> AValue:
    """The abstract value of a node the interpreter reached (the culprit search visits only those)."""
    v = it.value_of(name)
    assert v is not None, name
    return v


def _moves_only(it: VelocityInterpreter, n: torch.fx.Node) -> bool:
    """A node that only moves its input's values (a view, copy, cast or dropout) and is not the output of a
    module with its own certificate: never the culprit."""
    return (n.name not in it.certified_calls and n.op == "call_function"
            and (op_name(n.target) in PASS_THROUGH_OPS or op_name(n.target) in _DROPOUTS))


def _largest_jacobian_factor(g: CapturedGraph, it: VelocityInterpreter, nodes: List[torch.fx.Node],
                             where: Any) -> Tuple[str, str, str]:
    """With certified exponents: the node that multiplies the Jacobian bound the most."""
    best, best_ratio = None, 1.0
    for n in nodes:
        av = it.value_of(n.name)
        if av is None or av.const or av.jacobian is None or n is it.x or _moves_only(it, n):
            continue
        deps = [_value(it, d) for d in _act_deps(it, av.deps)]
        base = max([d.jacobian.total() for d in deps if d.jacobian is not None], default=1.0)
        ratio = av.jacobian.total() / base if base > 0 else 1.0
        if ratio > best_ratio:
            best, best_ratio = n, ratio
    if best is None:
        return ("", "", "")
    return (f"largest Jacobian factor: {where(best)} x{best_ratio:.3g} ({_value(it, best.name).rule})", best.name, "")


def culprit(g: CapturedGraph, it: VelocityInterpreter, out: torch.fx.Node) -> Tuple[str, str, str]:
    """``(culprit text, node name, suggested fix)`` for the velocity ending at ``out``."""
    res = _value(it, out.name)
    nodes = _reachable(it, out)

    def where(n: torch.fx.Node) -> str:
        if n.name in it.certified_calls:  # a module with its own certificate: the module, not its last op
            call = it.certified_calls[n.name][0]
            return f"{call.path} ({type(call.module).__name__})"
        return f"{n.name} ({op_name(n.target)}" + (f" in {g.module_path(n)})" if g.module_path(n) else ")")

    comp: Optional[str]
    if not res.exps.known:
        comp = "q" if res.exps.q is None else "sigma"
        for n in nodes:
            av = it.value_of(n.name)
            if av is None or getattr(av.exps, comp) is not None:
                continue
            deps = [v for d in av.deps if (v := it.value_of(d)) is not None]
            if all(getattr(d.exps, comp) is not None for d in deps):
                why = av.bad or av.rule or "outside the certified class"
                return (f"{where(n)}: {why}", n.name,
                        f"{where(n)} is outside the certified class ({why}): replace it by a primitive the rules "
                        "cover (a normalization, a saturating or Lipschitz map, an exp of a provably nonpositive "
                        "argument) or register an atom for it with certblocks.trace.register_atom")
        return ("not derived", "", "register an atom for the op outside the class")
    q, s = res.exps.q, res.exps.sigma
    assert q is not None and s is not None  # known exponents
    comp = "q" if q > 1 else ("sigma" if s > 0 else None)
    if comp is None:
        return _largest_jacobian_factor(g, it, nodes, where)
    # the node whose exponent jumps the most above its inputs'
    best, best_jump = None, -1.0
    for n in nodes:
        av = it.value_of(n.name)
        if av is None or av.const or n is it.x or _moves_only(it, n):
            continue
        mine = getattr(av.exps, comp)
        base = max([getattr(_value(it, d).exps, comp) or 0.0 for d in _act_deps(it, av.deps)], default=0.0)
        jump = (mine or 0.0) - base
        if jump > 0 and jump >= best_jump:
            best, best_jump = n, jump
    if best is None:
        return ("", "", "")
    av = _value(it, best.name)
    t = op_name(best.target)
    dnodes = [next((m for m in it.order if m.name == d), None) for d in _act_deps(it, av.deps)]
    parts = [f"{describe(g, it, m)} (q={_value(it, m.name).exps.q:g})" for m in dnodes if m is not None
             and _value(it, m.name).exps.q is not None]
    if comp == "q":
        if t in ("aten.pow", "aten.square") or (len(dnodes) == 1 and t == "aten.mul"):
            text = (f"{where(best)} raises {describe(g, it, dnodes[0]) if dnodes else 'its input'} to a power: "
                    f"q={q:g}")
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

"""Modules that carry their own certificate: the tracer uses it instead of re-deriving it from their graph.

A *certified module* follows the block protocol (:class:`~certblocks.protocol.CertifiedBlock`: a callable
``certificate(*, seq_len=None, r0=None)`` and ``exponents``): every shipped block, and any user module that
states its own bound.  Its certificate, computed from its weights, is never looser than what the per-op
rules derive from its graph (they lose factors at every reshape, split and product), so:

* :func:`own_certificate` -- when a velocity ``x -> out`` is exactly one call of a certified module, possibly
  behind casts of ``x`` and followed by casts and multiplications by constant scalars (the stack's
  ``x + dt * block(x)``), the velocity's certificate is the module's own, scaled by ``|dt|``;
* :func:`certified_calls` -- the calls of certified modules inside a larger velocity, which the interpreter
  collapses into one value each (:meth:`~certblocks.trace.interp.VelocityInterpreter._collapse_certified_calls`).

A call qualifies when, in the captured graph, it reads one tensor that depends on the velocity's input (every
other tensor it reads is a parameter or a constant), returns one tensor of the same leading shape, and draws
nothing at random (no active dropout): the certificate bounds the module as a function of that one tensor.

The certificate bounds the certified class's own forward, so it stands for a call only when the graph is that
forward (:func:`own_refusal`): no forward hook or pre-hook on the module or inside it (registered on a module,
or globally with ``torch.nn.modules.module.register_module_forward_hook``/``_pre_hook``), and the module's
``forward`` is the one the class that defines ``certificate`` runs (``type(m).forward is C.forward`` for that
class ``C``: a subclass that overrides ``forward`` opts in by defining ``certificate`` too; a ``forward``
assigned on the instance never does).  Otherwise the call is traced generically, and the notes say which
module and why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import nn

from ..bounds.norms import one_thread, rounded_up
from ..bounds.poly import Poly
from ..certificate import BlockCertificate
from ..protocol import CertifiedBlock
from .capture import CapturedGraph
from .nodes import IDENTITY_OPS, bind_args, op_name

__all__ = ["CallBounds", "CertifiedCall", "certified_calls", "call_bounds", "call_certificate", "is_certified",
           "own_certificate", "own_refusal", "representative", "rules_only", "scaled_certificate"]

#: Ops of a velocity's tail that scale the module's output by a constant (the stack's ``dt * block(x)``).
_SCALE_OPS = ("aten.mul", "aten.div", "aten.neg")
#: Ops that draw random numbers: a call that contains one is not the function its certificate bounds.
_RANDOM = ("rand", "normal", "bernoulli", "multinomial", "poisson")
#: The call key of the captured module itself (``nn_module_stack`` keys never hold a space).
_ROOT = "<captured module>"
_USE_OWN: contextvars.ContextVar[bool] = contextvars.ContextVar("certblocks_trace_use_own", default=True)


@contextlib.contextmanager
def rules_only() -> Iterator[None]:
    """Inside the block the tracer ignores own certificates and derives every module from its graph.

    For the tests that check a block's class-level ``exponents`` against what the rules derive from its forward
    (with own certificates the tracer would read the exponents back from the block).
    """
    token = _USE_OWN.set(False)
    try:
        yield
    finally:
        _USE_OWN.reset(token)


class CertifiedCall(NamedTuple):
    """One call of a certified module inside a velocity.

    Attributes:
        path: the module's path in the captured model.
        module: the module.
        input: the one tensor the call reads that depends on the velocity's input.
        output: the call's one output.
        members: names of the call's nodes inside the velocity (they depend on its input and feed its output).
    """

    path: str
    module: nn.Module
    input: torch.fx.Node
    output: torch.fx.Node
    members: FrozenSet[str]


def is_certified(module: Any) -> bool:
    """Whether ``module`` follows the block protocol: a callable ``certificate`` and ``exponents``."""
    if isinstance(module, CertifiedBlock):
        return callable(getattr(module, "certificate", None))
    return callable(getattr(module, "certificate", None)) and hasattr(module, "exponents")


def _owner(cls: type, attr: str) -> Optional[type]:
    """The class of ``cls``'s MRO that defines ``attr``."""
    return next((k for k in cls.__mro__ if attr in vars(k)), None)


def own_refusal(module: nn.Module) -> Optional[str]:
    """Why ``module``'s own certificate may not stand for its call (``None``: it may; module docstring).

    The certificate bounds the forward of the class that defines ``certificate``, built of the module's own
    submodules: a forward hook or pre-hook (on the module, on a submodule, or global) changes what the call
    computes, and so does a ``forward`` that is not that class's (overridden by a subclass, or set on the instance).
    """
    g_hooks = nn.modules.module
    if getattr(g_hooks, "_global_forward_hooks", None) or getattr(g_hooks, "_global_forward_pre_hooks", None):
        return "a global forward hook is registered (register_module_forward_hook / _pre_hook)"
    for name, sub in module.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            kind = "forward hook" if sub._forward_hooks else "forward pre-hook"
            where = f"its submodule {name}" if name else "it"
            return f"{where} has a {kind}, which the certificate does not bound"
        if "forward" in vars(sub):
            where = f"its submodule {name}" if name else "it"
            return f"{where} has a forward set on the instance"
    cls = type(module)
    owner = _owner(cls, "certificate")
    if owner is None:
        return None if "certificate" in vars(module) else "its certificate is not a method of its class"
    if cls.forward is not getattr(owner, "forward", None):
        fwd = _owner(cls, "forward")
        return (f"{cls.__name__}.forward is {fwd.__name__ if fwd else '?'}'s, not the forward of {owner.__name__}, "
                f"whose certificate it has (define certificate in the class that overrides forward)")
    return None


def _draws_random(n: torch.fx.Node) -> bool:
    """Whether a node is random at run time: an active dropout (train and ``p > 0``) or a random op."""
    if n.op != "call_function":
        return False
    name = op_name(n.target)
    if any(r in name for r in _RANDOM):
        return True
    if "dropout" not in name and "scaled_dot_product" not in name:
        return False
    a = bind_args(n)
    if a is None:
        return True
    p = a.get("dropout_p", a.get("p", 0.0))
    return a.get("train", True) is not False and not (isinstance(p, (int, float)) and p == 0)


def _shape(g: CapturedGraph, n: torch.fx.Node) -> Optional[Tuple[int, ...]]:
    v = g.env.get(n.name)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def certified_calls(g: CapturedGraph, x: torch.fx.Node, sub: Set[str],
                    notes: Optional[List[str]] = None) -> List[CertifiedCall]:
    """The outermost qualifying calls of certified modules among the nodes ``sub`` of the velocity ``x -> out``.

    Args:
        g: the captured graph.
        x: the velocity's input node.
        sub: the names of the velocity's nodes (:meth:`~certblocks.trace.capture.CapturedGraph.between`).
        notes: where to say which certified modules are traced generically and why (:func:`own_refusal`).

    Returns:
        The calls (module docstring: one input that depends on ``x``, one output, nothing random), none inside
        another, in graph order of their outputs; none inside :func:`rules_only`.  The captured module itself
        counts (its call is the whole graph).
    """
    if not _USE_OWN.get():
        return []
    members: Dict[str, List[torch.fx.Node]] = {}
    paths: Dict[str, str] = {}
    candidates: List[str] = []
    for n in g.nodes:
        # the captured module itself is a call too: every op of the graph
        root = [(_ROOT, "")] if n.op == "call_function" else []
        for key, path in root + [(k, p) for k, p, _ in g.module_calls(n)]:
            members.setdefault(key, []).append(n)
            paths[key] = path
            if n.name in sub and key not in candidates:
                candidates.append(key)
    user_dep = g.depends_on_input()
    outputs = {o.name for o in g.outputs}
    found: List[Tuple[FrozenSet[str], CertifiedCall]] = []
    for key in candidates:
        module = g.get_module(paths[key])
        if module is None or not is_certified(module):
            continue
        why = own_refusal(module)
        if why is not None:
            if notes is not None:
                note = (f"{type(module).__name__} ({paths[key] or 'the captured module'}): its own certificate is not "
                        f"used ({why}); traced op by op")
                if note not in notes:
                    notes.append(note)
            continue
        call = _qualify(g, x, sub, key, paths[key], module, members[key], user_dep, outputs)
        if call is not None:
            found.append((frozenset(m.name for m in members[key]), call))
    found.sort(key=lambda t: -len(t[0]))
    kept: List[Tuple[FrozenSet[str], CertifiedCall]] = []
    for names, call in found:
        if not any(names <= outer for outer, _ in kept):
            kept.append((names, call))
    return sorted((c for _, c in kept), key=lambda c: g.index[c.output.name])


def _qualify(g: CapturedGraph, x: torch.fx.Node, sub: Set[str], key: str, path: str, module: nn.Module,
             nodes: List[torch.fx.Node], user_dep: Set[str], outputs: Set[str]) -> Optional[CertifiedCall]:
    """The call as a :class:`CertifiedCall`, or ``None`` when it does not qualify (module docstring)."""
    names = {m.name for m in nodes}
    if any(_draws_random(m) for m in nodes):
        return None
    outs = [m for m in nodes if m.name in outputs or any(u.name not in names for u in m.users)]
    if len(outs) != 1 or outs[0].name not in sub:
        return None
    ins: Dict[str, torch.fx.Node] = {}
    for m in nodes:
        for a in m.all_input_nodes:
            if a.name in names:
                continue
            if a is x or a.name in sub:
                ins[a.name] = a
            elif a.name in user_dep:
                return None  # reads another input of the model: not a function of one tensor
    if len(ins) != 1:
        return None
    inp = next(iter(ins.values()))
    s_in, s_out = _shape(g, inp), _shape(g, outs[0])
    if s_in is None or s_out is None or len(s_in) < 2 or s_in[:-1] != s_out[:-1]:
        return None
    return CertifiedCall(path, module, inp, outs[0], frozenset(m.name for m in nodes if m.name in sub))


def call_certificate(g: CapturedGraph, call: CertifiedCall) -> Optional[BlockCertificate]:
    """``module.certificate(seq_len=...)`` at the traced sequence length (dimension ``-2`` of the call's input).

    ``None`` when the module's ``certificate`` refuses (``TypeError``/``ValueError``/``NotImplementedError``),
    returns something else than a :class:`BlockCertificate`, or leaves an exponent underived.
    """
    shape = _shape(g, call.input)
    seq_len = shape[-2] if shape is not None and len(shape) >= 2 else None
    try:
        with one_thread():
            cert = call.module.certificate(seq_len=seq_len)  # type: ignore[operator]  # a certified block
    except (TypeError, ValueError, NotImplementedError):
        return None
    if not isinstance(cert, BlockCertificate) or cert.q is None or cert.sigma is None:
        return None
    return cert


class CallBounds(NamedTuple):
    """A certified call's bounds in the radius ``r`` of the velocity's input (``None``: not derived).

    Attributes:
        growth: the output's row norm.
        max_abs: the output's entries, at most ``max(inner, growth)``.
        jacobian: the output's Jacobian.
        inner: every entry of every tensor the call computes (its peak at its input's bound).
    """

    growth: Optional[Poly]
    max_abs: Optional[Poly]
    jacobian: Optional[Poly]
    inner: Optional[Poly]


def call_bounds(cert: BlockCertificate, growth: Optional[Poly], jacobian: Optional[Poly]) -> CallBounds:
    """The bounds of a certified call whose input has row norm ``<= growth(r)`` and Jacobian ``<= jacobian(R)``.

    With the module's ``c, b, q`` and ``l1, l0, sigma``: the output's row norm is at most ``c growth^q + b``,
    its Jacobian at most ``(l1 max(growth, 1)^sigma + l0) jacobian`` with ``max(G, 1)^sigma <= G^sigma + 1``
    (chain rule: the module's Jacobian at an input of norm at most ``growth(R)``), and its intermediates at
    most the peak ``pc growth^pq + pb`` (``inner``: ``None`` when the module states no peak).
    """
    if cert.q is None or cert.sigma is None:
        return CallBounds(None, None, None, None)
    out = inner = jac = None
    if growth is not None:
        out = growth.power(cert.q).scale(cert.c) + Poly.const(cert.b)
        if cert.peak is not None:
            inner = growth.power(cert.peak.q).scale(cert.peak.c) + Poly.const(cert.peak.b)
        if jacobian is not None:
            if cert.sigma == 0:
                lip = Poly.const(cert.l1 + cert.l0)
            else:
                lip = (growth.power(cert.sigma) + Poly.const(1.0)).scale(cert.l1) + Poly.const(cert.l0)
            jac = lip * jacobian
    max_abs = out
    if inner is not None and out is not None:
        max_abs = Poly({e: max(out.terms.get(e, 0.0), inner.terms.get(e, 0.0)) for e in {*out.terms, *inner.terms}})
    return CallBounds(out, max_abs, jac, inner)


def representative(g: CapturedGraph, call: CertifiedCall) -> Optional[Tuple[torch.fx.Node, float]]:
    """A tensor the call computes besides its output, with the least last dimension, and ``sqrt`` of that dimension.

    Every entry of it is at most the call's peak, so its row norm is at most the peak times that factor: the
    value a collapsed call leaves on it carries the call's peak into the velocity's.  ``None`` when the call
    computes no other tensor.
    """
    best: Optional[Tuple[torch.fx.Node, float]] = None
    for m in g.nodes:
        if m.name not in call.members or m is call.output:
            continue
        s = _shape(g, m)
        if s is None:
            continue
        d = s[-1] if s else 1
        if best is None or d < best[1]:
            best = (m, d)
    return None if best is None else (best[0], math.sqrt(max(best[1], 1)))


def _scalar(g: CapturedGraph, a: Any, user_dep: Set[str]) -> Optional[float]:
    """A constant scalar argument (a number, or a one-element tensor that depends on no input); else ``None``."""
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return float(a)
    if isinstance(a, torch.fx.Node) and a.name not in user_dep:
        v = g.env.get(a.name)
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
            return float(v.detach().double().reshape(()))
    return None


def _tail(g: CapturedGraph, out: torch.fx.Node, user_dep: Set[str],
          stop: Set[str]) -> Optional[Tuple[torch.fx.Node, float, Set[str]]]:
    """Walk back from ``out`` over casts, inactive dropouts and constant scalings, up to a node named in ``stop``.

    Returns:
        ``(node, factor, names)``: the node the chain starts from, an upper bound of ``|product of the
        scalars|`` (exact when it is 1) and the names of the chain's nodes; ``None`` for a random op.
    """
    n, factor, names = out, 1.0, set()
    while n.op == "call_function" and n.name not in stop:
        name = op_name(n.target)
        tensors = [a for a in n.args if isinstance(a, torch.fx.Node) and a.name in user_dep]
        if len(tensors) != 1 or not (name in IDENTITY_OPS or name in _SCALE_OPS or "dropout" in name):
            break
        if _draws_random(n):
            return None
        if name in ("aten.mul", "aten.div"):
            other = [a for a in n.args if a is not tensors[0]]
            s = _scalar(g, other[0], user_dep) if len(other) == 1 else None
            if s is None or (name == "aten.div" and (n.args[0] is not tensors[0] or s == 0)):
                break
            s = abs(s) if name == "aten.mul" else 1.0 / abs(s)
            if s != 1.0:
                factor = rounded_up(factor * s, 2)
        names.add(n.name)
        n = tensors[0]
    return n, factor, names


def _head(g: CapturedGraph, inp: torch.fx.Node, x: torch.fx.Node) -> Optional[Set[str]]:
    """The casts from ``x`` to ``inp`` (same shape): their names, or ``None`` when ``inp`` is not such a copy."""
    names: Set[str] = set()
    n = inp
    while n is not x:
        if n.op != "call_function" or op_name(n.target) not in IDENTITY_OPS or not n.args \
                or not isinstance(n.args[0], torch.fx.Node) or _shape(g, n) != _shape(g, n.args[0]):
            return None
        names.add(n.name)
        n = n.args[0]
    return names


def scaled_certificate(cert: BlockCertificate, factor: float, name: str = "") -> BlockCertificate:
    """The certificate of ``s * v`` for ``|s| <= factor``: every coefficient times ``factor`` (rounded up).

    The peak bounds the module's own intermediates, which do not scale; the scaled output ``s v(x)`` adds
    entries at most ``factor (c ||x||^q + b)``, which the peak already covers when ``factor <= 1`` (it bounds
    the module's output).  ``factor == 1`` returns the certificate unchanged (renamed).
    """
    if factor == 1.0:
        return dataclasses.replace(cert, name=name or cert.name)

    def up(v: float) -> float:
        return rounded_up(v * factor, 1) if v else 0.0

    return cert.with_output_scaled(factor, up, name)


def own_certificate(g: CapturedGraph, x: torch.fx.Node, out: torch.fx.Node, name: str = "",
                    notes: Optional[List[str]] = None) -> Optional[BlockCertificate]:
    """The certificate of the velocity ``x -> out`` when it is exactly one call of a certified module.

    The velocity may cast ``x`` before the call and cast, multiply or divide the call's output by constant
    scalars after it (``dt * block(x)``): the certificate is then :func:`scaled_certificate` of the module's
    own, at the sequence length of the traced input (its dimension ``-2``).

    Args:
        g: the captured graph.
        x: the velocity's input node.
        out: the velocity's output node.
        name: the certificate's name (default: the module's).
        notes: where to say which certified modules are traced generically and why (:func:`own_refusal`).

    Returns:
        The certificate, or ``None`` when the velocity is not exactly one qualifying call (module docstring)
        or the module's ``certificate`` refuses (:func:`call_certificate`).
    """
    if x is out:
        return None
    sub = g.between(x, out)
    calls = {c.output.name: c for c in certified_calls(g, x, sub, notes)}
    tail = _tail(g, out, g.depends_on_input(), set(calls))
    if tail is None or tail[0].name not in calls:
        return None
    core, factor, tail_names = tail
    call = calls[core.name]
    head = _head(g, call.input, x)
    if head is None or sub != {x.name} | head | set(call.members) | tail_names:
        return None
    cert = call_certificate(g, call)
    if cert is None:
        return None
    return scaled_certificate(cert, factor, name)

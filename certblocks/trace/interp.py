"""The abstract interpreter: walks a velocity's graph and dispatches each node to its rule.

:class:`VelocityInterpreter` walks the nodes of a velocity ``x -> v(x)`` in topological order
and gives each an :class:`~certblocks.trace.values.AValue`: exponents by the rules of docs/theory.md section 2,
and sound bounds on its row norm, max-abs and Jacobian (see :mod:`certblocks.trace.values`).
Nodes that do not depend on ``x`` are constants: their concrete values (from one run of the
graph on the example input) give exact norms and signs.  Sub-graphs of a registered module atom,
and ops registered as atoms, are collapsed (:mod:`certblocks.trace.atoms`); every other op goes to
the rule registered for it (:mod:`certblocks.trace.rules`).

Every op outside the class gets unknown exponents (``None``) and the node records why
(``AValue.bad``); the certificate then names it.  Nothing is guessed.  Before a rule runs, the registry checks
the call against the rule's declaration (:func:`~certblocks.trace.rules.registry.check_call`: an overload or an
argument value the rule does not read is refused, the argument named).  A rule that raises gives an unknown
value with the exception as the reason; with the environment variable ``CERTBLOCKS_STRICT_RULES=1`` (the test
suite sets it) the exception propagates instead: a rule that crashes is a bug.

:attr:`VelocityInterpreter.notes` lists every value read at its example although it depends on a model input
(a mask or another input of the model, read as a constant of the velocity) and every certified module traced
generically instead of by its own certificate; the certificate carries them.

**Piecewise maps.**  The Jacobian bound a rule computes is a bound of the derivative autograd computes at every input
of the ball (docs/theory.md section 1.1): where the map is differentiable that is its derivative, and where an
input-dependent index, mask, boolean or rounding switches between branches (a router's top-k, ``where``,
``masked_fill``, a gather by a computed index) it is the derivative of the branch autograd takes.  Such a map jumps
between branches, so its Jacobian bound is not a Lipschitz constant between two inputs.
:attr:`VelocityInterpreter.piecewise` names every such value (an integer or boolean value computed from a floating
input, a rounding or a sign of one, and every value computed from them) and where its jumps come from; when the
velocity's output is one, the notes say so (:data:`PIECEWISE_NOTE`).  A rule for an op that jumps on floating values
(a user's op) marks its node itself: ``it.piecewise[node.name] = ("<node> (<why>)",)``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple, cast

import torch

from .. import exponents as E
from ..bounds.poly import Poly
from . import atoms as _atoms
from . import own as _own
from .nodes import bind_args, op_name
from .report import PIECEWISE_NOTE
from .rules import check_call, rule_for
from .values import AValue

__all__ = ["VelocityInterpreter", "AtomGroup", "STRICT_ENV", "strict_rules", "PIECEWISE_NOTE", "JUMP_OPS"]

#: The environment variable that makes a rule's exception propagate (``"1"``) instead of giving "unknown".
STRICT_ENV = "CERTBLOCKS_STRICT_RULES"


def strict_rules() -> bool:
    """Whether rules run in strict mode (:data:`STRICT_ENV` is ``"1"``): a rule that raises is a bug, not unknown."""
    return os.environ.get(STRICT_ENV, "") == "1"

# ops whose result is random even when their inputs are constants: never folded into a constant
_RANDOM = ("rand", "normal", "bernoulli", "dropout", "empty", "multinomial")

#: Floating-valued ops that jump with their input (integer and boolean values are recognized by their dtype).
JUMP_OPS = frozenset({"aten.round", "aten.floor", "aten.ceil", "aten.trunc", "aten.sign"})


class AtomGroup(NamedTuple):
    """The nodes of one module atom's call, collapsed into its output node."""

    path: str
    atom: _atoms.Atom
    input: torch.fx.Node
    output: torch.fx.Node
    members: List[torch.fx.Node]


class VelocityInterpreter:
    """Interpret the sub-graph of a velocity ``x -> out``.

    Args:
        graph: the captured graph (:class:`certblocks.trace.capture.CapturedGraph`).
        x: the velocity's input node.
        out: the velocity's output node.
    """

    def __init__(self, graph: Any, x: torch.fx.Node, out: torch.fx.Node) -> None:
        self.g = graph
        self.x = x
        self.out = out
        self.values: Dict[str, Any] = {}
        self.order: List[torch.fx.Node] = []
        self.atom_groups: Dict[str, AtomGroup] = {}
        self.certified_calls: Dict[str, Tuple[_own.CertifiedCall, Any]] = {}
        #: Values read at their example although they depend on a model input, and certified modules traced
        #: generically (module docstring); in order, without repeats.
        self.notes: List[str] = []
        #: Piecewise values (module docstring): node name -> the switches it depends on (``"node (rule)"``).
        self.piecewise: Dict[str, Tuple[str, ...]] = {}
        self._user_dep: Optional[Set[str]] = None

    # ------------------------------------------------------------------------------------------
    def run(self) -> AValue:
        """Interpret every node between ``x`` and ``out``; the abstract value of ``out``."""
        g = self.g
        sub = g.between(self.x, self.out)
        self.order = [n for n in g.nodes if n.name in sub]
        skip = self._collapse_certified_calls(sub, self._find_module_atoms(sub))
        self.values[self.x.name] = AValue(exps=E.IDENTITY, shape=tuple(g.env[self.x.name].shape),
                                          growth=Poly.mono(1.0, 1.0), max_abs=Poly.mono(1.0, 1.0),
                                          jacobian=Poly.const(1.0), rule="input")
        for n in self.order:
            if n is self.x or n.name in skip:
                continue
            if n.name in self.atom_groups:
                av = self._module_atom(n)
            else:
                try:
                    av = self._eval(n)
                except Exception as exc:  # a rule crashed: never guess, mark unknown (strict mode: a bug, raise)
                    if strict_rules():
                        raise
                    av = self.unknown_like(n, f"{op_name(n.target)}: rule failed",
                                           f"the rule for {op_name(n.target)} raised {type(exc).__name__}: {exc}")
            self.values[n.name] = av
            self._mark_piecewise(n, av)
        if self.out.name in self.piecewise:
            self.note(f"{PIECEWISE_NOTE} (switches: {', '.join(self.piecewise[self.out.name])})")
        return self.value(self.out)

    def _mark_piecewise(self, n: torch.fx.Node, av: Any) -> None:
        """Record ``n`` in :attr:`piecewise` when its value jumps with a floating velocity input (module docstring): an
        integer or boolean value computed from it, a rounding or a sign of it, or a value computed from such a value."""
        x = self.g.env.get(self.x.name)
        if not (isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())):
            return  # token ids: no continuity to speak of (no gradient flows into them)
        if n.name in self.certified_calls:
            ins: List[Any] = [self.certified_calls[n.name][0].input]
        elif n.name in self.atom_groups:
            ins = [self.atom_groups[n.name].input]
        else:
            ins = list(n.all_input_nodes)
        inherited = tuple(dict.fromkeys(s for a in ins for s in self.piecewise.get(a.name, ())))
        first = av[0] if isinstance(av, (list, tuple)) and av else av
        if not isinstance(first, AValue) or first.const:
            return
        conc = self.g.env.get(n.name)
        jumps = (isinstance(conc, torch.Tensor) and not (conc.is_floating_point() or conc.is_complex())) or \
            (n.op == "call_function" and op_name(n.target) in JUMP_OPS)
        if jumps and not inherited:
            self.piecewise[n.name] = (f"{n.name} ({first.rule})",)
        elif inherited:
            self.piecewise[n.name] = inherited

    # helpers ----------------------------------------------------------------------------------
    def shape_of(self, n: torch.fx.Node) -> Tuple[int, ...]:
        """The shape of a node's concrete value (``()`` when it is not a tensor)."""
        v = self.g.env.get(n.name)
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
        return ()

    def note(self, text: str) -> None:
        """Add a note (once)."""
        if text not in self.notes:
            self.notes.append(text)

    def depends_on_model_input(self, n: Any) -> bool:
        """Whether a node depends on an input of the captured model (the velocity's input or another one)."""
        if self._user_dep is None:
            self._user_dep = self.g.depends_on_input()
        return isinstance(n, torch.fx.Node) and n.name in self._user_dep

    def example(self, n: Any) -> Any:
        """The concrete value of a node on the example input, for a rule that reads it as a constant.

        A node interpreted as input-dependent, or one that depends on a model input, is read at its example value:
        the read is noted (:attr:`notes`).
        """
        if not isinstance(n, torch.fx.Node):
            return n
        av = self.values.get(n.name)
        if (isinstance(av, AValue) and not av.const) or (av is None and self.depends_on_model_input(n)):
            what = f"the model input {n.name}" if n.op == "placeholder" else \
                f"{n.name} ({op_name(n.target) if n.op == 'call_function' else n.op}), which depends on a model input,"
            self.note(f"{what} is read at its example value")
        return self.g.env.get(n.name)

    def unknown_like(self, n: torch.fx.Node, rule: str, bad: str) -> Any:
        """An unknown value for every output of ``n`` (a list for an op with several), ``bad`` on the first."""
        conc = self.g.env.get(n.name)
        if isinstance(conc, (tuple, list)):
            return [AValue.unknown(tuple(c.shape) if isinstance(c, torch.Tensor) else (), rule, bad if k == 0 else "",
                                   self.deps_of(n)) for k, c in enumerate(conc)]
        return AValue.unknown(self.shape_of(n), rule, bad, self.deps_of(n))

    def deps_of(self, n: torch.fx.Node) -> Tuple[str, ...]:
        """The names of a node's input-dependent inputs."""
        return tuple(a.name for a in n.all_input_nodes if a.name in self.values and not self.values[a.name].const)

    def value(self, n: Any) -> Any:
        """The abstract value of a node argument (constants are created on demand)."""
        if isinstance(n, torch.fx.Node):
            v = self.values.get(n.name)
            if v is not None:
                return v
            conc = self.g.env.get(n.name)
            if self.depends_on_model_input(n):
                self.example(n)  # a value of another model input (a mask, a second tensor): noted
            if isinstance(conc, torch.Tensor):
                av = AValue.constant(conc)
                self.values[n.name] = av
                return av
            if isinstance(conc, (tuple, list)):
                return [AValue.constant(c) if isinstance(c, torch.Tensor) else c for c in conc]
            return conc
        if isinstance(n, (list, tuple)):
            return type(n)(self.value(a) for a in n)
        return n

    def value_of(self, name: str) -> Optional[AValue]:
        """The abstract value of an interpreted node by name (the first one of a node with several outputs)."""
        v = self.values.get(name)
        if isinstance(v, (list, tuple)):
            v = next((e for e in v if isinstance(e, AValue)), None)
        return v if isinstance(v, AValue) else None

    # module atoms -----------------------------------------------------------------------------
    def _find_module_atoms(self, sub: Set[str]) -> Set[str]:
        """Group the nodes of each call of a registered module atom; the names of the nodes they hide.

        A call's members are the velocity's nodes whose module stack names the module (the outermost one with
        an atom: it takes precedence over every op and atom inside it), one group per call (``nn_module_stack``
        tells two calls of a shared module apart).  Multi-output ops and their ``getitem`` nodes are members like
        the others; what counts is the call's one node that the velocity uses outside it (its output) and its one
        input that depends on the velocity input.  A call with several of either is not collapsed: a warning says
        why and :attr:`atom_failures` keeps it (module path -> reason).
        """
        self.atom_failures: Dict[str, str] = {}
        groups: Dict[Tuple[str, str], Tuple[Any, List[torch.fx.Node]]] = {}
        for n in self.order:
            for call, path, type_name in self.g.module_calls(n):
                atom = _atoms.lookup_module_atom(type_name)
                if atom is not None:
                    groups.setdefault((path, call), (atom, []))[1].append(n)
                    break
        skip: Set[str] = set()
        for (path, _), (atom, members) in groups.items():
            names = {m.name for m in members}
            # users outside the velocity (an unused index output, say) do not make a node an output
            outs = [m for m in members if m is self.out or any(u.name in sub and u.name not in names for u in m.users)]
            ins = {a.name: a for m in members for a in m.all_input_nodes
                   if a.name not in names and (a.name in sub or a is self.x)}
            if len(outs) != 1 or len(ins) != 1:
                why = (f"the velocity uses {len(outs)} of its call's values ({', '.join(m.name for m in outs)}), "
                       "an atom has one output" if len(outs) != 1 else
                       f"its call depends on the velocity input through {len(ins)} tensors ({', '.join(ins)}), "
                       "an atom maps one input")
                self.atom_failures[path] = f"atom {atom.name} registered for {path} not applied: {why}"
                warnings.warn(self.atom_failures[path] + "; its ops are interpreted one by one", stacklevel=2)
                continue
            out = outs[0]
            self.atom_groups[out.name] = AtomGroup(path, atom, next(iter(ins.values())), out, members)
            skip |= names - {out.name}
        return skip

    def _module_atom(self, n: torch.fx.Node) -> AValue:
        group = self.atom_groups[n.name]
        return self._apply_atom(group.atom, self.value(group.input), self.g.get_module(group.path), self.shape_of(n),
                                f"atom {group.atom.name} ({group.path})", (group.input.name,))

    def _apply_atom(self, atom: _atoms.Atom, y: AValue, obj: Any, out_shape: Tuple[int, ...], rule: str,
                    deps: Tuple[str, ...]) -> AValue:
        growth = jacobian = None
        if atom.coefficients is not None:
            co = atom.coefficients(obj, y.shape, out_shape)
            q, s = atom.exponents.q, atom.exponents.sigma
            if y.growth is not None and q is not None:
                growth = y.growth.power(q).scale(co["c"]) + Poly.const(co["b"])
            if y.growth is not None and y.jacobian is not None and s is not None:
                jacobian = ((y.growth.power(s) + Poly.const(1.0)).scale(co["l1"]) + Poly.const(co["l0"])) * y.jacobian
        return AValue(exps=E.compose(atom.exponents, y.exps), shape=out_shape, growth=growth, max_abs=growth,
                      jacobian=jacobian, rule=rule, deps=deps)

    # modules with their own certificate ------------------------------------------------------
    def _collapse_certified_calls(self, sub: Set[str], skip: Set[str]) -> Set[str]:
        """Group each call of a module with its own certificate (:mod:`certblocks.trace.own`); ``skip`` and the
        names of the nodes they hide.  A call inside a registered module atom, or of a module registered as
        one, is left to the atom."""
        hidden: Set[str] = set()
        for call in _own.certified_calls(self.g, self.x, sub, self.notes):
            o = call.output.name
            if o in skip or o in self.atom_groups:
                continue
            cert = _own.call_certificate(self.g, call)
            if cert is not None:
                self.certified_calls[o] = (call, cert)
                hidden |= call.members - {o}
        return skip | hidden

    def _certified_call_value(self, n: torch.fx.Node) -> AValue:
        """The value of a certified call's output from the module's own certificate (:func:`~certblocks.trace.own.
        call_bounds`); the call's peak goes on one tensor it hides (:func:`~certblocks.trace.own.representative`),
        so that the velocity's peak covers the call's intermediates (none stated: the velocity states none)."""
        call, cert = self.certified_calls[n.name]
        y = self.value(call.input)
        bounds = _own.call_bounds(cert, y.growth, y.jacobian)
        exps = E.compose(cert.exponents, y.exps)
        label = f"own certificate of {type(call.module).__name__} ({call.path})"
        rep = _own.representative(self.g, call)
        if rep is not None:
            node, factor = rep
            inner = bounds.inner
            self.values[node.name] = AValue(
                exps=exps, shape=self.shape_of(node), growth=None if inner is None else inner.scale(factor),
                max_abs=inner, rule=f"inside {call.path}: every entry within its peak ({label})",
                deps=(call.input.name,))
        return AValue(exps=exps, shape=self.shape_of(n), growth=bounds.growth, max_abs=bounds.max_abs,
                      jacobian=bounds.jacobian, rule=label, deps=(call.input.name,))

    # evaluation -------------------------------------------------------------------------------
    def _eval(self, n: torch.fx.Node) -> Any:
        name = op_name(n.target)
        shape = self.shape_of(n)
        if n.name in self.certified_calls:
            return self._certified_call_value(n)
        if n.op != "call_function":
            return AValue.unknown(shape, n.op, f"{n.op} node {n.name} is not interpreted", self.deps_of(n))
        atom = _atoms.lookup_op_atom(name)
        if atom is not None:
            acts = [self.value(a) for a in n.all_input_nodes if not self.value(a).const]
            if len(acts) == 1:
                return self._apply_atom(atom, acts[0], n, shape, f"atom {atom.name}", self.deps_of(n))
        if name == "getitem":
            src = self.value(n.args[0])
            if isinstance(src, (list, tuple)):
                v = src[cast(int, n.args[1])]
                if isinstance(v, AValue):
                    return v
            return AValue.unknown(shape, "getitem", f"getitem on {type(src).__name__}", self.deps_of(n))
        bound = bind_args(n)
        if bound is None:
            return AValue.unknown(shape, name, f"{name} is outside the certified class (no rule)", self.deps_of(n))
        args = {k: self.value(v) for k, v in bound.items()}
        conc = self.g.env.get(n.name)
        tensors = [v for v in args.values() if isinstance(v, AValue)] + \
            [e for v in args.values() if isinstance(v, (list, tuple)) for e in v if isinstance(e, AValue)]
        if isinstance(conc, torch.Tensor) and all(v.const for v in tensors) and not any(r in name for r in _RANDOM):
            return AValue.constant(conc, "constant (inputs do not depend on x)")
        if isinstance(conc, torch.Tensor) and conc.numel() == 0:  # shapes are static: empty for every input
            return AValue.constant(conc, "empty tensor (no entry to bound)")
        rule = rule_for(name)
        if rule is None:
            return AValue.unknown(shape, name, f"{name} is outside the certified class (no rule for this op)",
                                  self.deps_of(n))
        refused = check_call(n)
        if refused is not None:
            return self.unknown_like(n, name, refused)
        return self._finish(rule(self, n, args, shape), n, name)

    def _finish(self, res: Any, n: torch.fx.Node, name: str) -> Any:
        """Fill in what a rule left out: its inputs, its name, and why a node with known inputs is unknown."""
        if isinstance(res, AValue):
            if not res.deps:
                res.deps = self.deps_of(n)
            if not res.rule:
                res.rule = name
            if res.exps.q is None or res.exps.sigma is None:
                ins = [self.values.get(d) for d in res.deps]
                if all(v is not None and v.exps.known for v in ins) and not res.bad:
                    res.bad = f"{name}: outside the certified class"
        elif isinstance(res, (list, tuple)):
            for r in res:
                if isinstance(r, AValue) and not r.deps:
                    r.deps = self.deps_of(n)
        return res

"""The abstract interpreter: one rule per aten op (THEORY.md section 2) plus atom recognizers.

:class:`VelocityInterpreter` walks the nodes of a velocity ``x -> v(x)`` in topological order
and gives each an :class:`~certblocks.trace.values.AValue`: exponents by the rules of THEORY.md,
and sound bounds on its row norm, max-abs and Jacobian (see :mod:`certblocks.trace.values`).
Nodes that do not depend on ``x`` are constants: their concrete values (from one run of the
graph on the example input) give exact norms and signs.

Every op outside the class gets unknown exponents (``None``) and the node records why
(``AValue.bad``); the certificate then names it.  Nothing is guessed.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import exponents as E
from ..exponents import Exponents
from . import atoms as _atoms
from ..bounds.norms import inf_norm, op_norm
from ..bounds.poly import Poly
from .values import AValue, max_abs, row_norm

__all__ = ["VelocityInterpreter", "op_name"]

LN2 = math.log(2.0)
SQRT = math.sqrt

# Lipschitz activations: name -> (Lip, growth slope L (|phi(x)| <= L|x| + a), a per entry, sign of output)
_LIPSCHITZ: Dict[str, Tuple[float, float, float, Optional[str]]] = {
    "aten.relu": (1.0, 1.0, 0.0, "+"),
    "aten.gelu": (1.13, 1.0, 0.0, None),
    "aten.silu": (1.1, 1.0, 0.0, None),
    "aten.mish": (1.1, 1.0, 0.0, None),
    "aten.hardswish": (1.5, 1.0, 0.0, None),
    "aten.abs": (1.0, 1.0, 0.0, "+"),
    "aten.neg": (1.0, 1.0, 0.0, None),
    "aten.positive": (1.0, 1.0, 0.0, None),
}
# Saturating activations: name -> (saturation level s (|phi| <= s), Lip, sign)
_SATURATING: Dict[str, Tuple[float, float, Optional[str]]] = {
    "aten.sigmoid": (1.0, 0.25, "+"),
    "aten.tanh": (1.0, 1.0, None),
    "aten.hardsigmoid": (1.0, 1.0 / 6.0, "+"),
    "aten.sin": (1.0, 1.0, None),
    "aten.cos": (1.0, 1.0, None),
    "aten.erf": (1.0, 2.0 / math.sqrt(math.pi), None),
    "aten.softsign": (1.0, 1.0, None),
}
# Structural ops that keep values (exponents and bounds follow from the shapes).
_VIEWS = {
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.flatten", "aten.unflatten", "aten.squeeze",
    "aten.unsqueeze", "aten.view_as", "aten.reshape_as",
}
_IDENTITY = {
    "aten.clone", "aten.contiguous", "aten.alias", "aten.detach", "aten.to", "aten._to_copy", "aten.type_as",
    "aten.lift_fresh_copy", "aten.fill_", "aten._assert_tensor_metadata", "aten.lift_fresh",
    "aten.copy", "aten.resolve_conj", "aten.resolve_neg", "aten.conj", "aten.conj_physical",
}
_CASTS = _IDENTITY | {"aten.expand", "aten.expand_as"}


def op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``aten.linear``; ``operator.getitem`` -> ``getitem``."""
    if target is operator.getitem:
        return "getitem"
    s = str(target)
    if hasattr(target, "_schema") or hasattr(target, "overloadpacket"):
        parts = s.split(".")
        if len(parts) >= 3:
            return ".".join(parts[:-1])
    return s


def _bind(node: torch.fx.Node) -> Optional[Dict[str, Any]]:
    """Map a node's arguments to the op schema's argument names (defaults filled in)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    out: Dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def _bcast_factor(shape: Sequence[int], out_shape: Sequence[int]) -> float:
    """Row-norm factor when an operand of ``shape`` is broadcast to ``out_shape``."""
    last = shape[-1] if len(shape) else 1
    out_last = out_shape[-1] if len(out_shape) else 1
    if last == 1 and out_last > 1:
        return SQRT(out_last)
    return 1.0


def _view_factor(in_shape: Sequence[int], out_shape: Sequence[int]) -> Tuple[float, bool]:
    """Row-norm factor of a row-major reshape: (factor, via_entries)."""
    a = in_shape[-1] if len(in_shape) else 1
    b = out_shape[-1] if len(out_shape) else 1
    if a == b:
        # same last dim: rows are regrouped, not split (row-major), when the sizes agree
        return 1.0, False
    if b < a and b > 0 and a % b == 0:
        return 1.0, False  # each new row is a chunk of an old row
    if b > a and a > 0 and b % a == 0:
        return SQRT(b // a), False  # each new row concatenates b/a old rows
    return SQRT(max(b, 1)), True  # entries: N <= sqrt(last) * max|.|


def _neg_dim(d: int, ndim: int) -> int:
    return d - ndim if d >= 0 else d


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
        self.values: Dict[str, AValue] = {}
        self.order: List[torch.fx.Node] = []
        self.atom_groups: Dict[str, Tuple[str, Any, torch.fx.Node, torch.fx.Node, List[torch.fx.Node]]] = {}

    # ------------------------------------------------------------------------------------------
    def run(self) -> AValue:
        g = self.g
        sub = g.between(self.x, self.out)
        self.order = [n for n in g.nodes if n.name in sub]
        skip = self._find_module_atoms(sub)
        xv = g.env[self.x.name]
        shape = tuple(xv.shape)
        self.values[self.x.name] = AValue(E.IDENTITY, Poly.mono(1.0, 1.0), Poly.mono(1.0, 1.0), Poly.const(1.0),
                                          shape, None, False, None, None, "input")
        for n in self.order:
            if n is self.x or n.name in skip:
                continue
            if n.name in self.atom_groups:
                av = self._module_atom(n)
            else:
                try:
                    av = self._eval(n)
                except Exception as exc:  # a rule crashed: never guess, mark unknown
                    av = AValue.unknown(self._shape(n), f"{op_name(n.target)}: rule failed",
                                        f"the rule for {op_name(n.target)} raised {type(exc).__name__}: {exc}",
                                        self._deps(n))
            self.values[n.name] = av
        return self.value(self.out)

    # helpers ----------------------------------------------------------------------------------
    def _shape(self, n: torch.fx.Node) -> Tuple[int, ...]:
        v = self.g.env.get(n.name)
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
        return ()

    def _deps(self, n: torch.fx.Node) -> Tuple[str, ...]:
        return tuple(a.name for a in n.all_input_nodes if a.name in self.values and not self.values[a.name].const)

    def value(self, n: Any) -> Any:
        """The abstract value of a node argument (constants are created on demand)."""
        if isinstance(n, torch.fx.Node):
            v = self.values.get(n.name)
            if v is not None:
                return v
            conc = self.g.env.get(n.name)
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

    # module atoms -----------------------------------------------------------------------------
    def _find_module_atoms(self, sub: set) -> set:
        groups: Dict[str, Tuple[Any, List[torch.fx.Node]]] = {}
        for n in self.order:
            for path, type_name in self.g.module_stack(n):
                atom = _atoms.lookup_module_atom(type_name)
                if atom is not None:
                    groups.setdefault(path, (atom, []))[1].append(n)
                    break
        skip: set = set()
        for path, (atom, members) in groups.items():
            names = {m.name for m in members}
            outs = [m for m in members if m is self.out or any(u.name not in names for u in m.users)]
            ins = {a.name: a for m in members for a in m.all_input_nodes
                   if a.name not in names and (a.name in sub or a is self.x)}
            if len(outs) != 1 or len(ins) != 1:
                continue
            out = outs[0]
            self.atom_groups[out.name] = (path, atom, next(iter(ins.values())), out, members)
            skip |= names - {out.name}
        return skip

    def _module_atom(self, n: torch.fx.Node) -> AValue:
        path, atom, inp, out, members = self.atom_groups[n.name]
        y = self.value(inp)
        module = self.g.get_module(path)
        return self._apply_atom(atom, y, module, self._shape(n), f"atom {atom.name} ({path})", (inp.name,))

    def _apply_atom(self, atom: Any, y: AValue, obj: Any, out_shape: Tuple[int, ...], rule: str,
                    deps: Tuple[str, ...]) -> AValue:
        ex = E.compose(atom.exponents, y.exps)
        G = J = None
        if atom.coefficients is not None:
            co = atom.coefficients(obj, y.shape, out_shape)
            q, s = atom.exponents.q, atom.exponents.sigma
            if y.G is not None and q is not None:
                G = y.G.power(q).scale(co["c"]) + Poly.const(co["b"])
            if y.G is not None and y.J is not None and s is not None:
                J = ((y.G.power(s) + Poly.const(1.0)).scale(co["l1"]) + Poly.const(co["l0"])) * y.J
        return AValue(ex, G, G, J, out_shape, None, False, None, None, rule, deps)

    # evaluation -------------------------------------------------------------------------------
    def _eval(self, n: torch.fx.Node) -> AValue:
        name = op_name(n.target)
        shape = self._shape(n)
        if n.op != "call_function":
            return AValue.unknown(shape, n.op, f"{n.op} node {n.name} is not interpreted", self._deps(n))
        atom = _atoms.lookup_op_atom(name)
        if atom is not None:
            acts = [self.value(a) for a in n.all_input_nodes if not self.value(a).const]
            if len(acts) == 1:
                return self._apply_atom(atom, acts[0], n, shape, f"atom {atom.name}", self._deps(n))
        if name == "getitem":
            src = self.value(n.args[0])
            idx = n.args[1]
            if isinstance(src, (list, tuple)):
                v = src[idx]
                if isinstance(v, AValue):
                    return v
            return AValue.unknown(shape, "getitem", f"getitem on {type(src).__name__}", self._deps(n))
        if "certblocks.selective_scan" in name or "certblocks::selective_scan" in name:
            return self._selective_scan(n)
        a = _bind(n)
        if a is None:
            return AValue.unknown(shape, name, f"{name} is outside the certified class (no rule)", self._deps(n))
        args = {k: self.value(v) for k, v in a.items()}
        conc = self.g.env.get(n.name)
        tensors = [v for v in args.values() if isinstance(v, AValue)] + \
            [e for v in args.values() if isinstance(v, (list, tuple)) for e in v if isinstance(e, AValue)]
        if isinstance(conc, torch.Tensor) and all(v.const for v in tensors) and not any(
                r in name for r in ("rand", "normal", "bernoulli", "dropout", "empty", "multinomial")):
            return AValue.constant(conc, "constant (inputs do not depend on x)")
        fn = _RULES.get(name)
        if fn is None:
            for prefix, f in _PREFIX_RULES:
                if name.startswith(prefix):
                    fn = f
                    break
        if fn is None:
            return AValue.unknown(shape, name, f"{name} is outside the certified class (no rule for this op)",
                                  self._deps(n))
        res = fn(self, n, args, shape)
        if isinstance(res, AValue):
            if not res.deps:
                res.deps = self._deps(n)
            if not res.rule:
                res.rule = name
            if res.exps.q is None or res.exps.sigma is None:
                ins = [self.values.get(d) for d in res.deps]
                if all(v is not None and v.exps.known for v in ins) and not res.bad:
                    res.bad = f"{name}: outside the certified class"
        elif isinstance(res, (list, tuple)):
            for r in res:
                if isinstance(r, AValue) and not r.deps:
                    r.deps = self._deps(n)
        return res

    # the selective scan ---------------------------------------------------------------------
    def _selective_scan(self, n: torch.fx.Node) -> Any:
        a = _bind(n) or {}
        v = {k: self.value(x) for k, x in a.items()}
        u, delta, A, B, C = v["u"], v["delta"], v["A"], v["B"], v["C"]
        D, z, bias = v.get("D"), v.get("z"), v.get("delta_bias")
        softplus, gate = bool(v.get("delta_softplus")), v.get("gate")
        shapes = [tuple(t.shape) for t in self.g.env[n.name]] if isinstance(self.g.env.get(n.name), (tuple, list)) \
            else [self._shape(n)]
        out_shape = shapes[0]
        deps = self._deps(n)

        def unknown(why: str) -> List[Any]:
            return [AValue.unknown(out_shape, "selective_scan", why, deps)] + \
                [AValue.unknown(s, "selective_scan state", why, deps) for s in shapes[1:]]

        if not A.const or A.sign not in ("-", "0"):
            return unknown("selective_scan: A is not a constant <= 0, so exp(delta*A) is not bounded")
        # delta after bias and softplus
        dexps = delta.exps
        dG, dJ = delta.M_or_G(), delta.J
        dsign = delta.sign
        if bias is not None and isinstance(bias, AValue):
            if not bias.const:
                return unknown("selective_scan: delta_bias depends on the input")
            dG = None if dG is None else dG + Poly.const(max_abs(bias.value))
            dsign = dsign if bias.sign in (dsign, "0") else None
        if softplus:
            dG = None if dG is None else dG + Poly.const(LN2)
            dsign = "+"
        if dsign not in ("+", "0"):
            return unknown("selective_scan: delta is not provably >= 0 (use delta_softplus or a nonnegative delta)")
        L = u.shape[-1]
        Nst = A.shape[-1]
        Amax = max_abs(A.value)
        # exponents from the recurrence h_t = exp(delta A) h + (delta B) u, y = C h (+ D u), gate
        abar = E.exp_of_nonpositive(dexps)
        bu = E.product(dexps, B.exps, u.exps) if not B.const else E.product(dexps, u.exps)
        h = E.add(bu, E.product(abar, bu))
        y = E.product(C.exps, h) if not C.const else h
        if D is not None and isinstance(D, AValue):
            y = E.add(y, u.exps)
        gG = gJ = None
        if z is not None and isinstance(z, AValue):
            if gate == "sigmoid":
                gex = E.compose(E.SATURATING, z.exps)
                gG = Poly.const(1.0)
                gJ = None if z.J is None else z.J.scale(0.25)
            elif gate in ("silu", None):
                gex = E.compose(E.LIPSCHITZ, z.exps)
                gG = z.M_or_G()
                gJ = None if z.J is None else z.J.scale(1.1)
            else:
                return unknown(f"selective_scan: gate {gate!r} has no rule")
            y = E.product(y, gex) if not z.const else y
        # coefficients (max-abs form): |h| <= L |delta| |B| |u|,  |y| <= N |C| |h| + |D||u|
        uM, bM, cM = u.M_or_G(), B.M_or_G(), C.M_or_G()
        G = J = None
        if None not in (uM, bM, cM, dG, dJ, u.J, B.J, C.J):
            hM = (dG * bM * uM).scale(L)
            hJ = (dJ * bM * uM + dG * B.J * uM + dG * bM * u.J).scale(L) + (dJ * dG * bM * uM).scale(L * L * Amax)
            yM = (cM * hM).scale(Nst)
            yJ = (C.J * hM + cM * hJ).scale(Nst)
            if D is not None and isinstance(D, AValue):
                dm = max_abs(D.value) if D.const else None
                if dm is None:
                    yM = yJ = None
                else:
                    yM = yM + uM.scale(dm)
                    yJ = yJ + u.J.scale(dm)
            if yM is not None and z is not None and isinstance(z, AValue):
                if gG is None or gJ is None:
                    yM = yJ = None
                else:
                    yJ = yJ * gG + yM * gJ
                    yM = yM * gG
            if yM is not None:
                f = SQRT(out_shape[-1])
                G, J = yM.scale(f), yJ.scale(f)
        out = AValue(y, G, None if G is None else G, J, out_shape, None, False, None, None,
                     "selective scan (recurrence rule)", deps)
        if G is not None:
            out.M = G.scale(1.0 / SQRT(out_shape[-1]))
        state = [AValue(h, None, None, None, s, None, False, None, None, "selective scan state", deps)
                 for s in shapes[1:]]
        return [out] + state


# ----------------------------------------------------------------------------------------------
# rules.  Each takes (interp, node, args, shape) and returns an AValue (or a list for tuples).

Rule = Callable[[VelocityInterpreter, torch.fx.Node, Dict[str, Any], Tuple[int, ...]], Any]
_RULES: Dict[str, Rule] = {}
_PREFIX_RULES: List[Tuple[str, Rule]] = []


def rule(*names: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for nm in names:
            _RULES[nm] = fn
        return fn
    return deco


def _first_tensor(args: Dict[str, Any]) -> Optional[AValue]:
    for v in args.values():
        if isinstance(v, AValue):
            return v
    return None


def _unknown(shape, why: str) -> AValue:
    return AValue.unknown(shape, "", why)


def _scaled(x: AValue, shape, fac_G: float, fac_J: Optional[float] = None, via_entries: bool = False,
            rule_name: str = "", sign: Any = "keep", exps: Optional[Exponents] = None, add_G: float = 0.0) -> AValue:
    """A value with x's exponents and row-norm bounds multiplied by a factor."""
    fac_J = fac_G if fac_J is None else fac_J
    base = x.M_or_G() if via_entries else x.G
    G = None if base is None else base.scale(fac_G) + Poly.const(add_G)
    J = None if x.J is None else x.J.scale(fac_J)
    M = x.M if not via_entries else x.M
    if add_G and M is not None:
        M = M + Poly.const(add_G)
    return AValue(exps or x.exps, G, M, J, tuple(shape), x.sign if sign == "keep" else sign, False, None, None,
                  rule_name)


@rule(*_IDENTITY)
def _r_identity(it, n, a, shape):
    x = _first_tensor(a)
    if x is None:
        return _unknown(shape, "no tensor argument")
    fac, via = (1.0, False) if tuple(x.shape) == tuple(shape) else _view_factor(x.shape, shape)
    out = _scaled(x, shape, fac, via_entries=via, rule_name="structural (preserves)")
    out.stoch = x.stoch if tuple(x.shape) == tuple(shape) else None
    return out


@rule("aten.dropout", "aten.feature_dropout", "aten.alpha_dropout", "aten.native_dropout")
def _r_dropout(it, n, a, shape):
    x = a.get("input", a.get("self"))
    p, train = a.get("p", 0.0), a.get("train", False)
    f = 1.0 / (1.0 - p) if (train and p < 1) else 1.0
    out = _scaled(x, shape, f, rule_name="dropout" + (" (train: scale 1/(1-p))" if train else " (eval: identity)"))
    out.stoch = None if train and p > 0 else x.stoch
    if op_name(n.target) == "aten.native_dropout":
        return [out, AValue.constant(torch.ones(shape, dtype=torch.bool))]
    return out


@rule(*_VIEWS, "aten.view_as_real", "aten.view_as_complex", "aten.real", "aten.imag")
def _r_view(it, n, a, shape):
    x = _first_tensor(a)
    fac, via = _view_factor(x.shape, shape)
    out = _scaled(x, shape, fac, via_entries=via, rule_name="structural (reshape)")
    if tuple(x.shape[-1:]) == tuple(shape[-1:]) and x.stoch is not None and x.stoch in (-1, len(x.shape) - 1):
        out.stoch = -1
    return out


@rule("aten.expand", "aten.expand_as", "aten.broadcast_to")
def _r_expand(it, n, a, shape):
    x = _first_tensor(a)
    fac = _bcast_factor(x.shape, shape)
    return _scaled(x, shape, fac, via_entries=fac != 1.0, rule_name="structural (expand)")


def _perm_keeps_last(perm: Sequence[int], ndim: int) -> bool:
    return not perm or (perm[-1] % ndim) == ndim - 1


@rule("aten.permute")
def _r_permute(it, n, a, shape):
    x = a["self"]
    keep = _perm_keeps_last(list(a["dims"]), max(x.ndim, 1))
    f = 1.0 if keep else SQRT(shape[-1] if shape else 1)
    return _scaled(x, shape, f, via_entries=not keep, rule_name="structural (permute)")


@rule("aten.transpose", "aten.t", "aten.swapaxes", "aten.swapdims", "aten.movedim", "aten.numpy_T", "aten.mT")
def _r_transpose(it, n, a, shape):
    x = _first_tensor(a)
    nd = max(x.ndim, 1)
    if op_name(n.target) in ("aten.transpose", "aten.swapaxes", "aten.swapdims"):
        d0, d1 = [a.get(k) for k in ("dim0", "dim1")] if "dim0" in a else (a.get("axis0"), a.get("axis1"))
        touches = nd - 1 in ((d0 or 0) % nd, (d1 or 0) % nd)
    else:
        touches = nd >= 2
    if tuple(x.shape) == tuple(shape) and x.ndim <= 1:
        touches = False
    f = SQRT(shape[-1] if shape else 1) if touches else 1.0
    out = _scaled(x, shape, f, via_entries=touches, rule_name="structural (transpose)")
    if not touches:
        out.stoch = x.stoch
    return out


@rule("aten.slice", "aten.narrow", "aten.index_select", "aten.select", "aten.split", "aten.chunk",
      "aten.unbind", "aten.split_with_sizes", "aten.tensor_split", "aten.unsafe_split", "aten.diagonal",
      "aten.roll", "aten.flip", "aten.repeat", "aten.tile", "aten.repeat_interleave")
def _r_select(it, n, a, shape):
    x = _first_tensor(a)
    name = op_name(n.target)
    conc = it.g.env.get(n.name)
    shapes = [tuple(c.shape) for c in conc] if isinstance(conc, (list, tuple)) else [tuple(shape)]
    nd = max(x.ndim, 1)
    dim = a.get("dim", 0)
    if dim is None:
        dim = 0
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if dim else 0
    last_touched = (dim % nd) == nd - 1 if isinstance(dim, int) else True
    outs = []
    for s in shapes:
        if name in ("aten.repeat", "aten.tile"):
            reps = list(a.get("repeats", a.get("dims", [])))
            k = reps[-1] if reps else 1
            f, via = SQRT(k), False
        elif name == "aten.repeat_interleave":
            f, via = SQRT(s[-1] if s else 1), True
        elif name in ("aten.select", "aten.unbind", "aten.diagonal") and last_touched:
            f, via = SQRT(s[-1] if s else 1), True
        elif name in ("aten.diagonal", "aten.index_select") and (name == "aten.diagonal" or last_touched):
            f, via = SQRT(s[-1] if s else 1), True  # indices may repeat entries of a row
        else:
            f, via = 1.0, False  # a subset (or permutation) of rows, or of each row
        o = _scaled(x, s, f, via_entries=via, rule_name=f"structural ({name.split('.')[-1]})")
        if not last_touched and name not in ("aten.repeat", "aten.tile"):
            o.stoch = x.stoch
        outs.append(o)
    if isinstance(conc, (list, tuple)):
        return outs
    return outs[0]


@rule("aten.cat", "aten.concat", "aten.concatenate", "aten.stack", "aten.hstack", "aten.vstack")
def _r_cat(it, n, a, shape):
    parts = [p for p in a["tensors"]]
    name = op_name(n.target)
    dim = a.get("dim", 0) or 0
    nd_out = max(len(shape), 1)
    acts = [p for p in parts if isinstance(p, AValue)]
    ex = E.add(*[p.exps for p in acts])
    along_last = (dim % nd_out) == nd_out - 1
    if name == "aten.stack" and along_last:
        f = SQRT(shape[-1])
        G = _psum_max([None if p.M_or_G() is None else p.M_or_G() for p in acts], f)
        J = _psum_max([p.J for p in acts], f)
    elif along_last:
        G = _psum([p.G for p in acts])
        J = _psum([p.J for p in acts])
    else:
        G = _pmax([p.G for p in acts])
        J = _pmax([p.J for p in acts])
    M = _pmax([p.M_or_G() for p in acts])
    signs = {p.sign for p in acts}
    sign = signs.pop() if len(signs) == 1 else None
    return AValue(ex, G, M, J, shape, sign, False, None, None, f"structural ({name.split('.')[-1]})")


def _psum(ps):
    out = Poly()
    for p in ps:
        if p is None:
            return None
        out = out + p
    return out


def _pmax(ps):
    """Upper bound of the max of several bounds: their sum (sound; the max itself is not a Poly)."""
    ps = list(ps)
    if any(p is None for p in ps):
        return None
    if len(ps) == 1:
        return ps[0]
    # coefficientwise maximum is an upper bound of the pointwise max for nonneg coefficients
    t: Dict[float, float] = {}
    for p in ps:
        for e, c in p.terms.items():
            t[e] = max(t.get(e, 0.0), c)
    return Poly(t)


def _psum_max(ps, f):
    m = _pmax(ps)
    return None if m is None else m.scale(f)


@rule("aten.constant_pad_nd", "aten.pad")
def _r_pad(it, n, a, shape):
    x = a.get("self", a.get("input"))
    value = a.get("value") or 0.0
    pad = list(a.get("pad", []))
    if a.get("mode", "constant") not in (None, "constant"):
        # reflect/replicate/circular copy entries: bound the rows through their entries
        return _scaled(x, shape, SQRT(shape[-1] if shape else 1), via_entries=True, rule_name="structural (pad)")
    last_padded = len(pad) >= 2 and (pad[0] != 0 or pad[1] != 0)
    addg = abs(value) * SQRT(shape[-1]) if value else 0.0
    if last_padded:
        return _scaled(x, shape, 1.0, rule_name="structural (pad)", add_G=addg,
                       sign=x.sign if value == 0 else None)
    return _scaled(x, shape, 1.0, rule_name="structural (pad)", add_G=addg, sign=x.sign if value == 0 else None)


@rule("aten.masked_fill")
def _r_masked_fill(it, n, a, shape):
    x, mask, value = a["self"], a["mask"], a["value"]
    if isinstance(mask, AValue) and not mask.const:
        return _unknown(shape, "masked_fill with a mask that depends on the input (a discontinuous switch)")
    if isinstance(value, AValue):
        if not value.const:
            return _unknown(shape, "masked_fill with a value that depends on the input")
        value = max_abs(value.value)
    v = abs(float(value))
    out = _scaled(x, shape, _bcast_factor(x.shape, shape), rule_name="masked_fill (constant)",
                  add_G=v * SQRT(shape[-1] if shape else 1) if v else 0.0, sign=None)
    if math.isinf(v):
        out.G = Poly.const(math.inf)
        out.M = Poly.const(math.inf)
    return out


# elementwise ---------------------------------------------------------------------------------
def _lipschitz(x: AValue, shape, lip: float, slope: float, a0: float, sign, name: str) -> AValue:
    d = shape[-1] if shape else 1
    G = None if x.G is None else x.G.scale(slope) + Poly.const(a0 * SQRT(d))
    M = None if x.M_or_G() is None else x.M_or_G().scale(slope) + Poly.const(a0)
    J = None if x.J is None else x.J.scale(lip)
    return AValue(E.compose(E.LIPSCHITZ, x.exps), G, M, J, shape, sign, False, None, None,
                  f"Lipschitz activation {name}")


def _saturating(x: AValue, shape, level: float, lip: float, sign, name: str) -> AValue:
    d = shape[-1] if shape else 1
    J = None if x.J is None else x.J.scale(lip)
    return AValue(E.compose(E.SATURATING, x.exps), Poly.const(level * SQRT(d)), Poly.const(level), J, shape, sign,
                  False, None, None, f"saturating activation {name}")


def _make_lip(name):
    lip, slope, a0, sign = _LIPSCHITZ[name]

    def fn(it, n, a, shape):
        x = _first_tensor(a)
        s = sign
        if name == "aten.neg":
            s = {"+": "-", "-": "+", "0": "0"}.get(x.sign)
        if name in ("aten.gelu",) and a.get("approximate", "none") not in ("none", "tanh"):
            return _unknown(shape, f"gelu approximate={a.get('approximate')!r}")
        return _lipschitz(x, shape, lip, slope, a0, s, name.split(".")[-1])
    return fn


for _nm in _LIPSCHITZ:
    _RULES[_nm] = _make_lip(_nm)


def _make_sat(name):
    level, lip, sign = _SATURATING[name]

    def fn(it, n, a, shape):
        return _saturating(_first_tensor(a), shape, level, lip, sign, name.split(".")[-1])
    return fn


for _nm in _SATURATING:
    _RULES[_nm] = _make_sat(_nm)


@rule("aten.softplus")
def _r_softplus(it, n, a, shape):
    x = a["self"]
    beta = float(a.get("beta", 1.0) or 1.0)
    if beta <= 0:
        return _unknown(shape, f"softplus with beta={beta}")
    # softplus(x) <= max(x, 0) + log(2)/beta, slope <= 1
    return _lipschitz(x, shape, 1.0, 1.0, LN2 / beta, "+", "softplus")


@rule("aten.elu", "aten.celu", "aten.selu")
def _r_elu(it, n, a, shape):
    x = _first_tensor(a)
    alpha = float(a.get("alpha", 1.0) or 1.0)
    scale = float(a.get("scale", 1.0) or 1.0)
    if op_name(n.target) == "aten.selu":
        alpha, scale = 1.6732632423543772, 1.0507009873554805
    lip = scale * max(1.0, alpha)
    return _lipschitz(x, shape, lip, lip, 0.0, None, "elu")


@rule("aten.leaky_relu", "aten.rrelu")
def _r_leaky(it, n, a, shape):
    x = _first_tensor(a)
    s = abs(float(a.get("negative_slope", a.get("upper", 0.01)) or 0.01))
    return _lipschitz(x, shape, max(1.0, s), max(1.0, s), 0.0, None, "leaky_relu")


@rule("aten.prelu")
def _r_prelu(it, n, a, shape):
    x, w = a["self"], a["weight"]
    if not w.const:
        return _unknown(shape, "prelu with an input-dependent slope")
    s = max(1.0, max_abs(w.value))
    return _lipschitz(x, shape, s, s, 0.0, None, "prelu")


@rule("aten.hardtanh", "aten.relu6", "aten.clamp", "aten.clip", "aten.clamp_min", "aten.clamp_max")
def _r_clamp(it, n, a, shape):
    x = a.get("self", a.get("input"))
    name = op_name(n.target)
    if name == "aten.relu6":
        lo, hi = 0.0, 6.0
    elif name == "aten.hardtanh":
        lo, hi = a.get("min_val", -1.0), a.get("max_val", 1.0)
    elif name == "aten.clamp_min":
        lo, hi = a.get("min"), None
    elif name == "aten.clamp_max":
        lo, hi = None, a.get("max")
    else:
        lo, hi = a.get("min"), a.get("max")
    for b in (lo, hi):
        if isinstance(b, AValue) and not b.const:
            return _unknown(shape, f"{name} with an input-dependent bound")
    lo = max_abs(lo.value) * (-1 if lo.sign == "-" else 1) if isinstance(lo, AValue) else lo
    hi = max_abs(hi.value) * (-1 if hi.sign == "-" else 1) if isinstance(hi, AValue) else hi
    if lo is not None and hi is not None:
        sign = "+" if lo >= 0 else ("-" if hi <= 0 else None)
        return _saturating(x, shape, max(abs(lo), abs(hi)), 1.0, sign, name.split(".")[-1])
    bound = abs(lo if lo is not None else hi)
    sign = "+" if (lo is not None and lo >= 0) else ("-" if (hi is not None and hi <= 0) else None)
    if x.sign == "+" and lo is not None:
        sign = "+"
    return _lipschitz(x, shape, 1.0, 1.0, bound, sign, name.split(".")[-1])


# exp and sign analysis -------------------------------------------------------------------------
@rule("aten.exp", "aten.exp2")
def _r_exp(it, n, a, shape):
    x = a["self"]
    if x.sign in ("-", "0"):
        d = shape[-1] if shape else 1
        lip = 1.0 if op_name(n.target) == "aten.exp" else LN2
        J = None if x.J is None else x.J.scale(lip)
        return AValue(E.exp_of_nonpositive(x.exps), Poly.const(SQRT(d)), Poly.const(1.0), J, shape, "+", False,
                      None, None, "exp of a provably nonpositive argument (bounded by 1)")
    src = n.args[0].name if n.args and isinstance(n.args[0], torch.fx.Node) else "?"
    out = _unknown(shape, f"exp of an argument of unknown sign ({src}): unbounded growth")
    out.sign = "+"
    return out


@rule("aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.sqrt", "aten.rsqrt", "aten.reciprocal",
      "aten.tan", "aten.atanh", "aten.logit", "aten.erfinv", "aten.digamma", "aten.lgamma")
def _r_outside(it, n, a, shape):
    x = _first_tensor(a)
    name = op_name(n.target)
    out = _unknown(shape, f"{name.split('.')[-1]} of an input-dependent tensor is outside the certified class "
                          "(not Lipschitz or unbounded near a point)")
    if name in ("aten.sqrt", "aten.rsqrt", "aten.reciprocal") and x is not None and x.sign == "+":
        out.sign = "+"
    return out


@rule("aten.pow", "aten.square")
def _r_pow(it, n, a, shape):
    x = a.get("self")
    p = a.get("exponent", 2)
    if op_name(n.target) == "aten.square":
        p = 2
    if isinstance(x, AValue) and isinstance(p, AValue):
        return _unknown(shape, "pow with a tensor exponent")
    if not isinstance(x, AValue):
        return _unknown(shape, "pow of a scalar base by a tensor exponent (exp-like)")
    p = float(p)
    if p == 1:
        return _scaled(x, shape, 1.0, rule_name="pow 1")
    if p < 1:
        return _unknown(shape, f"pow(x, {p:g}) with p < 1: not Lipschitz at 0")
    ex = E.compose(E.power(p), x.exps)
    M = x.M_or_G()
    G = J = None
    if M is not None and x.G is not None:
        G = M.power(p - 1) * x.G
    if M is not None and x.J is not None:
        J = M.power(p - 1).scale(p) * x.J
    sign = "+" if (p.is_integer() and int(p) % 2 == 0) or x.sign == "+" else (x.sign if p.is_integer() else None)
    Mo = None if M is None else M.power(p)
    return AValue(ex, G, Mo, J, shape, sign, False, None, None, f"entrywise power {p:g}")


# linear algebra ----------------------------------------------------------------------------------
def _sign_mul(s1, s2):
    if "0" in (s1, s2):
        return "0"
    if s1 is None or s2 is None:
        return None
    return "+" if s1 == s2 else "-"


def _hadamard(x: AValue, y: AValue, shape, name: str) -> AValue:
    """Entrywise product (with broadcasting)."""
    sign = _sign_mul(x.sign, y.sign)
    if y.const or x.const:
        act, c = (x, y) if y.const else (y, x)
        m = max_abs(c.value)
        fa = _bcast_factor(act.shape, shape)
        if fa != 1.0:
            # act broadcast along rows: N(out) <= max|act| * N(c)
            G = None if act.M_or_G() is None else act.M_or_G().scale(row_norm(c.value))
            J = None if act.J is None else act.J.scale(row_norm(c.value))
        else:
            G = None if act.G is None else act.G.scale(m)
            J = None if act.J is None else act.J.scale(m)
        M = None if act.M_or_G() is None else act.M_or_G().scale(m)
        return AValue(act.exps, G, M, J, shape, sign, False, None, None, f"{name} by a constant (affine)")
    ex = E.product(x.exps, y.exps)
    fx, fy = _bcast_factor(x.shape, shape), _bcast_factor(y.shape, shape)
    xM, yM = x.M_or_G(), y.M_or_G()
    G = J = None
    if None not in (x.G, y.G, xM, yM):
        # N(x*y) <= N(x) max|y| (x's rows), with broadcast factors
        c1 = x.G.scale(fx) * yM
        c2 = xM * y.G.scale(fy)
        G = c1 if c1.total() <= c2.total() else c2
    if None not in (x.J, y.J, xM, yM):
        J = x.J.scale(fx) * yM + xM * y.J.scale(fy)
    M = None if None in (xM, yM) else xM * yM
    if x is y:
        sign = "+"
    return AValue(ex, G, M, J, shape, sign, False, None, None, f"{name} of two input-dependent tensors (product)")


def _is_same(n1: Any, n2: Any) -> bool:
    return isinstance(n1, torch.fx.Node) and isinstance(n2, torch.fx.Node) and _strip(n1) is _strip(n2)


def _strip(n: Any) -> Any:
    """Follow casts and no-op copies."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and op_name(n.target) in _CASTS and n.args:
        n = n.args[0]
    return n


@rule("aten.mul", "aten.multiply")
def _r_mul(it, n, a, shape):
    x, y = a["self"], a["other"]
    rec = _recognize_norm(it, n, shape)
    if rec is not None:
        return rec
    if not isinstance(y, AValue):
        s = abs(float(y))
        sg = x.sign if float(y) > 0 else ({"+": "-", "-": "+", "0": "0"}.get(x.sign) if float(y) < 0 else "0")
        out = _scaled(x, shape, s, rule_name="mul by a scalar (affine)", sign=sg)
        out.M = None if x.M_or_G() is None else x.M_or_G().scale(s)
        return out
    if not isinstance(x, AValue):
        return _r_mul(it, n, {"self": y, "other": x}, shape)
    out = _hadamard(x, y, shape, "mul")
    if _is_same(n.args[0], n.args[1]):
        out.sign = "+"
    return out


@rule("aten.div", "aten.divide", "aten.true_divide")
def _r_div(it, n, a, shape):
    x, y = a["self"], a["other"]
    if a.get("rounding_mode") is not None:
        return _unknown(shape, "div with rounding (discontinuous)")
    rec = _recognize_norm(it, n, shape) or _recognize_softmax(it, n, shape)
    if rec is not None:
        return rec
    if not isinstance(y, AValue):
        y = float(y)
        if y == 0:
            return _unknown(shape, "division by zero")
        return _r_mul(it, n, {"self": x, "other": 1.0 / y}, shape)
    if y.const:
        if not isinstance(x, AValue):
            return _unknown(shape, "scalar / tensor")
        v = y.value
        if bool((v == 0).any()):
            return _unknown(shape, "division by a constant with zeros")
        return _r_mul(it, n, {"self": x, "other": AValue.constant(1.0 / v)}, shape)
    return _unknown(shape, "division by an input-dependent tensor is outside the certified class "
                           "(not recognized as a normalization or a softmax)")


@rule("aten.add", "aten.sub", "aten.subtract", "aten.rsub")
def _r_add(it, n, a, shape):
    x, y = a["self"], a["other"]
    alpha = a.get("alpha", 1) or 1
    name = op_name(n.target)
    if name == "aten.rsub":
        x, y = y, x
    sub = name in ("aten.sub", "aten.subtract", "aten.rsub")
    if isinstance(alpha, AValue):
        return _unknown(shape, "add with a tensor alpha")
    alpha = float(alpha)
    if not isinstance(x, AValue):
        x = AValue.constant(torch.as_tensor(float(x)))
    if not isinstance(y, AValue):
        y = AValue.constant(torch.as_tensor(float(y)))
    ysign = y.sign if alpha > 0 else {"+": "-", "-": "+", "0": "0"}.get(y.sign)
    if sub:
        ysign = {"+": "-", "-": "+", "0": "0"}.get(ysign)
    if x.const and y.const:
        return AValue.constant(it.g.env[n.name])
    ex = E.add(*[v.exps for v in (x, y) if not v.const])
    fx, fy = _bcast_factor(x.shape, shape), _bcast_factor(y.shape, shape)
    aa = abs(alpha)

    def bx(v, f, s=1.0):
        if v.const:
            return Poly.const(row_norm(v.value) * s) if f == 1.0 else Poly.const(max_abs(v.value) * f * s)
        if v.G is None:
            return None
        return v.G.scale(s) if f == 1.0 else (None if v.M_or_G() is None else v.M_or_G().scale(f * s))
    G = _psum([bx(x, fx), bx(y, fy, aa)])
    J = _psum([None if x.J is None else x.J.scale(fx), None if y.J is None else y.J.scale(fy * aa)])
    M = _psum([x.M_or_G(), None if y.M_or_G() is None else y.M_or_G().scale(aa)])
    if x.sign in ("+", "0") and ysign in ("+", "0"):
        sign = "+" if "+" in (x.sign, ysign) else "0"
    elif x.sign in ("-", "0") and ysign in ("-", "0"):
        sign = "-" if "-" in (x.sign, ysign) else "0"
    else:
        sign = None
    # x - max(x) along a dim is <= 0
    if sub and _is_max_of(n.args[1] if name != "aten.rsub" else n.args[0], n.args[0] if name != "aten.rsub"
                          else n.args[1]):
        sign = "-"
    return AValue(ex, G, M, J, shape, sign, False, None, None, "sub (sum rule)" if sub else "add (sum rule)")


def _is_max_of(m: Any, x: Any) -> bool:
    """``m`` is amax/max(x, dim, keepdim) (possibly cast/expanded) of the same ``x``."""
    m = _strip(m)
    if not isinstance(m, torch.fx.Node) or m.op != "call_function":
        return False
    nm = op_name(m.target)
    if nm == "getitem":
        src = m.args[0]
        if isinstance(src, torch.fx.Node) and op_name(src.target) == "aten.max" and m.args[1] == 0:
            return _strip(src.args[0]) is _strip(x)
        return False
    if nm in ("aten.amax", "aten.max"):
        return _strip(m.args[0]) is _strip(x)
    return False


@rule("aten.addcmul", "aten.addcdiv", "aten.lerp")
def _r_addc(it, n, a, shape):
    return _unknown(shape, f"{op_name(n.target)} has no rule (rewrite it as mul/add)")


def _linear_core(x: AValue, Wnorm: float, bias: Optional[AValue], shape, rule_name: str) -> AValue:
    bnorm = 0.0 if bias is None else row_norm(bias.value) if bias.value.dim() else abs(float(bias.value))
    if bias is not None and bias.value.dim() == 0:
        bnorm = abs(float(bias.value)) * SQRT(shape[-1] if shape else 1)
    G = None if x.G is None else x.G.scale(Wnorm) + Poly.const(bnorm)
    J = None if x.J is None else x.J.scale(Wnorm)
    return AValue(x.exps, G, G, J, shape, None, False, None, None, rule_name)


@rule("aten.linear")
def _r_linear(it, n, a, shape):
    x, W, b = a["input"], a["weight"], a.get("bias")
    if isinstance(b, AValue) and not b.const:
        return _unknown(shape, "linear with an input-dependent bias")
    if W.const:
        return _linear_core(x, op_norm(W.value), b, shape, "affine (linear with a parameter)")
    if x.const:
        return _matmul_const_left(x, W, shape, transpose=True, bias=b)
    out = _matmul_acts(x, W, shape, k=W.shape[-1], rows_b=W.shape[-2] if W.ndim >= 2 else 1, name="linear")
    return out


def _matmul_const_left(c: AValue, y: AValue, shape, transpose: bool = False, bias=None) -> AValue:
    """c @ y with a constant c: rows of the output combine rows of y."""
    A = c.value
    f = inf_norm(A) if A.dim() >= 2 else max_abs(A)
    G = None if y.G is None else y.G.scale(f)
    if bias is not None:
        G = None if G is None else G + Poly.const(row_norm(bias.value))
    J = None if y.J is None else y.J.scale(f)
    return AValue(y.exps, G, G, J, shape, None, False, None, None, "affine (constant matrix on the left)")


def _matmul_acts(x: AValue, y: AValue, shape, k: int, rows_b: int, name: str) -> AValue:
    """Product of two input-dependent matrices: N(x @ y) <= N(x) ||y||_F <= sqrt(rows of y) N(x) N(y)."""
    ex = E.product(x.exps, y.exps)
    f = SQRT(max(rows_b, 1))
    G = J = None
    if x.G is not None and y.G is not None:
        G = (x.G * y.G).scale(f)
    if None not in (x.G, y.G, x.J, y.J):
        J = (x.J * y.G + x.G * y.J).scale(f)
    return AValue(ex, G, G, J, shape, _sign_mul(x.sign, y.sign), False, None, None,
                  f"{name} of two input-dependent tensors (product)")


def _matmul(it, x: AValue, y: AValue, shape, name: str) -> AValue:
    if x.const and y.const:
        return AValue.unknown(shape, name, "constant matmul")
    if y.const:
        if y.ndim == 1:
            f = row_norm(y.value)  # each output entry is <x_row, y>
            G = None if x.G is None else x.G.scale(f)
            J = None if x.J is None else x.J.scale(f)
            sqrt_last = SQRT(shape[-1]) if shape else 1.0
            return AValue(x.exps, None if G is None else G.scale(sqrt_last), G,
                          None if J is None else J.scale(sqrt_last), shape, None, False, None, None,
                          f"affine ({name} with a constant vector)")
        return _linear_core(x, op_norm(y.value), None, shape, f"affine ({name} with a parameter/constant)")
    if x.const:
        if x.ndim == 1:
            return AValue.unknown(shape, name, "vector @ activation: no rule")
        return _matmul_const_left(x, y, shape)
    if y.ndim == 1:
        return AValue.unknown(shape, name, f"{name} with a 1-D input-dependent operand has no rule")
    k = y.shape[-2]
    if x.stoch is not None and (x.stoch % max(x.ndim, 1)) == x.ndim - 1:
        # rows of x are probability vectors: N(x @ y) <= N(y); d(xy) = dx y + x dy
        ex = E.product(x.exps, y.exps)
        G = y.G
        J = None if None in (x.J, y.G, y.J) else y.J + (x.J * y.G).scale(SQRT(k))
        return AValue(ex, G, G, J, shape, None, False, None, None,
                      f"{name} of a row-stochastic matrix with an input-dependent tensor (product)")
    return _matmul_acts(x, y, shape, k=k, rows_b=k, name=name)


@rule("aten.matmul", "aten.mm", "aten.bmm")
def _r_matmul(it, n, a, shape):
    return _matmul(it, a["self"], a.get("other", a.get("mat2")), shape, op_name(n.target).split(".")[-1])


@rule("aten.addmm", "aten.baddbmm", "aten.addbmm")
def _r_addmm(it, n, a, shape):
    bias, m1, m2 = a["self"], a.get("mat1", a.get("batch1")), a.get("mat2", a.get("batch2"))
    beta, alpha = float(a.get("beta", 1) or 0), float(a.get("alpha", 1) or 0)
    if isinstance(bias, AValue) and not bias.const:
        return _unknown(shape, "addmm with an input-dependent bias")
    core = _matmul(it, m1, m2, shape, "addmm")
    if core.G is not None:
        core.G = core.G.scale(abs(alpha)) + Poly.const(abs(beta) * (row_norm(bias.value) if bias.value.dim()
                                                                      else abs(float(bias.value))))
        core.M = core.G
    if core.J is not None:
        core.J = core.J.scale(abs(alpha))
    return core


@rule("aten.einsum")
def _r_einsum(it, n, a, shape):
    eq = a["equation"]
    ops = list(a["tensors"])
    acts = [o for o in ops if not o.const]
    if not acts:
        return AValue.constant(it.g.env[n.name])
    # |out| <= einsum(|A|, ..., ones) * prod max|act|  (entries), N(out) <= sqrt(last) * max|out|
    absops = [o.value.abs().double() if o.const else torch.ones(o.shape, dtype=torch.float64) for o in ops]
    F = float(torch.einsum(eq, *absops).max()) * (1 + 1e-9)
    d = SQRT(shape[-1] if shape else 1)
    Ms = [o.M_or_G() for o in acts]
    ex = E.product(*[o.exps for o in acts])
    G = J = None
    if None not in Ms:
        prodM = Poly.const(1.0)
        for m in Ms:
            prodM = prodM * m
        G = prodM.scale(F * d)
        if all(o.J is not None for o in acts):
            J = Poly()
            for i, o in enumerate(acts):
                term = o.J
                for j, m in enumerate(Ms):
                    if j != i:
                        term = term * m
                J = J + term
            J = J.scale(F * d)
    rn = "affine (einsum with constants)" if len(acts) == 1 else "einsum of input-dependent tensors (product)"
    return AValue(ex, G, None if G is None else G.scale(1.0 / d), J, shape, None, False, None, None, rn)


@rule("aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution", "aten._convolution",
      "aten.conv_transpose1d", "aten.conv_transpose2d", "aten.conv_transpose3d")
def _r_conv(it, n, a, shape):
    x, W, b = a["input"], a["weight"], a.get("bias")
    if not W.const or (isinstance(b, AValue) and not b.const):
        return _unknown(shape, "convolution with input-dependent weights")
    transposed = bool(a.get("transposed", False)) or "transpose" in op_name(n.target)
    Wa = W.value.abs().double()
    if transposed:
        dims = [0] + list(range(2, Wa.dim()))
        per_out = Wa.sum(dim=dims)
    else:
        per_out = Wa.reshape(Wa.shape[0], -1).sum(-1)
    F = float(per_out.max()) * (1 + 1e-9)
    bmax = 0.0 if not isinstance(b, AValue) else max_abs(b.value)
    d = SQRT(shape[-1] if shape else 1)
    xm = x.M_or_G()
    M = None if xm is None else xm.scale(F) + Poly.const(bmax)
    G = None if M is None else M.scale(d)
    J = None if x.J is None else x.J.scale(F * d)
    return AValue(x.exps, G, M, J, shape, None, False, None, None, "affine (convolution)")


_FFT_NORM = {None: (1.0, None), "backward": (1.0, None), "ortho": (None, None), "forward": (None, None)}


def _fft_scale(norm: Any, inverse: bool, n: int) -> float:
    if isinstance(norm, int):  # aten _fft_* : 0 none, 1 1/sqrt(n), 2 1/n
        return {0: 1.0, 1: 1.0 / SQRT(n), 2: 1.0 / n}[norm]
    if norm in (None, "backward"):
        return 1.0 / n if inverse else 1.0
    if norm == "ortho":
        return 1.0 / SQRT(n)
    if norm == "forward":
        return 1.0 if inverse else 1.0 / n
    raise ValueError(f"unknown fft norm {norm!r}")


@rule("aten.fft_fft", "aten.fft_ifft", "aten.fft_rfft", "aten.fft_irfft", "aten.fft_fftn", "aten.fft_ifftn",
      "aten.fft_rfftn", "aten.fft_irfftn", "aten.fft_fft2", "aten.fft_ifft2", "aten.fft_rfft2", "aten.fft_irfft2",
      "aten.fft_hfft", "aten.fft_ihfft", "aten._fft_r2c", "aten._fft_c2r", "aten._fft_c2c")
def _r_fft(it, n, a, shape):
    """FFTs are linear: every output entry is a combination of at most n entries with moduli <= scale."""
    x = a["self"]
    name = op_name(n.target)
    inverse = "ifft" in name or "irfft" in name or name == "aten._fft_c2r" or \
        (name == "aten._fft_c2c" and not a.get("forward", True))
    dims = a.get("dim")
    if dims is None:
        dims = list(range(-2, 0)) if name.endswith("2") else (list(range(x.ndim)) if name.endswith("n")
                                                               else [-1])
    if isinstance(dims, int):
        dims = [dims]
    nd_in, nd_out = max(x.ndim, 1), max(len(shape), 1)
    terms = 1
    for d in dims:
        terms *= max(x.shape[d], shape[d] if len(shape) == x.ndim else 1)
    norm = a.get("norm", a.get("normalization"))
    scale = _fft_scale(norm, inverse, terms)
    F = scale * terms
    if name in ("aten.fft_hfft", "aten.fft_irfft", "aten._fft_c2r", "aten.fft_irfftn", "aten.fft_irfft2"):
        F *= 2  # hermitian extension: each stored coefficient appears at most twice
    touches_last = any((d % nd_in) == nd_in - 1 for d in dims)
    if touches_last:
        dd = SQRT(shape[-1] if shape else 1)
        xm = x.M_or_G()
        M = None if xm is None else xm.scale(F)
        G = None if M is None else M.scale(dd)
        J = None if x.J is None else x.J.scale(F * dd)
    else:
        G = None if x.G is None else x.G.scale(F)
        M = None if x.M_or_G() is None else x.M_or_G().scale(F)
        J = None if x.J is None else x.J.scale(F)
    _ = nd_out
    return AValue(x.exps, G, M, J, shape, None, False, None, None, "linear (FFT)")


# reductions ---------------------------------------------------------------------------------------
def _reduce_dims(a: Dict[str, Any], ndim: int) -> List[int]:
    d = a.get("dim")
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return list(range(ndim))
    if isinstance(d, int):
        d = [d]
    return sorted({int(v) % max(ndim, 1) for v in d})


@rule("aten.mean", "aten.sum", "aten.nansum", "aten.nanmean")
def _r_sum(it, n, a, shape):
    x = a.get("self", a.get("input"))
    nd = max(x.ndim, 1)
    dims = _reduce_dims(a, x.ndim)
    count = 1
    for d in dims:
        count *= x.shape[d] if x.ndim else 1
    mean = "mean" in op_name(n.target)
    last = nd - 1 in dims
    if not last:
        f = 1.0 if mean else float(count)
        out = _scaled(x, shape, f, rule_name="reduction (linear)")
        out.M = None if x.M_or_G() is None else x.M_or_G().scale(f)
        return out
    d_last = x.shape[-1] if x.ndim else 1
    other = count // max(d_last, 1)
    # an entry of the result is a (mean of) sum over `other` rows' sums: |row sum| <= sqrt(d) N
    per_entry = (1.0 / SQRT(d_last)) if mean else (other * SQRT(d_last))
    dd = SQRT(shape[-1] if shape else 1)
    M = None if x.G is None else x.G.scale(per_entry)
    G = None if M is None else M.scale(dd)
    J = None if x.J is None else x.J.scale(per_entry * dd)
    return AValue(x.exps, G, M, J, shape, x.sign, False, None, None, "reduction (linear)")


@rule("aten.amax", "aten.amin", "aten.max", "aten.min", "aten.logsumexp")
def _r_max(it, n, a, shape):
    x = a.get("self")
    name = op_name(n.target)
    if isinstance(a.get("other"), AValue):  # elementwise max/min of two tensors: 1-Lipschitz in each
        y = a["other"]
        return _r_add(it, n, {"self": x, "other": y, "alpha": 1}, shape)
    conc = it.g.env.get(n.name)
    dims = _reduce_dims(a, x.ndim)
    nd = max(x.ndim, 1)
    count = 1
    for d in dims:
        count *= x.shape[d] if x.ndim else 1
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else shape
    dd = SQRT(out_shape[-1] if out_shape else 1)
    extra = math.log(max(count, 1)) if name == "aten.logsumexp" else 0.0
    if nd - 1 in dims:
        xm = x.M_or_G()
        M = None if xm is None else xm + Poly.const(extra)
        G = None if M is None else M.scale(dd)
        J = None if x.J is None else x.J.scale(dd)
    else:
        G = None if x.G is None else x.G.scale(SQRT(count)) + Poly.const(extra * dd)
        M = None if x.M_or_G() is None else x.M_or_G() + Poly.const(extra)
        J = None if x.J is None else x.J.scale(SQRT(count))
    out = AValue(E.compose(E.LIPSCHITZ, x.exps), G, M, J, out_shape, x.sign if not extra else None, False, None,
                 None, f"{name.split('.')[-1]} (1-Lipschitz)")
    if isinstance(conc, (tuple, list)):
        return [out, AValue.constant(conc[1])]
    return out


@rule("aten.linalg_vector_norm", "aten.norm", "aten.frobenius_norm")
def _r_norm(it, n, a, shape):
    x = a.get("self", a.get("input"))
    p = a.get("ord", a.get("p", 2))
    if p is None:
        p = 2
    if float(p) != 2.0:
        return _unknown(shape, f"vector norm of order {p} has no rule")
    dims = _reduce_dims(a, x.ndim)
    nd = max(x.ndim, 1)
    dd = SQRT(shape[-1] if shape else 1)
    if dims == [nd - 1]:
        M = x.G
        G = None if M is None else M.scale(dd)
        J = None if x.J is None else x.J.scale(dd)
    else:
        count = 1
        for d in dims:
            count *= x.shape[d]
        M = None if x.G is None else x.G.scale(SQRT(count))
        G = None if M is None else M.scale(dd)
        J = None if x.J is None else x.J.scale(SQRT(count) * dd)
    return AValue(E.compose(E.LIPSCHITZ, x.exps), G, M, J, shape, "+", False, None, None,
                  "Euclidean norm (1-Lipschitz)")


@rule("aten.var", "aten.std")
def _r_var(it, n, a, shape):
    return _unknown(shape, f"{op_name(n.target)} outside a recognized normalization has no rule")


@rule("aten.cumsum")
def _r_cumsum(it, n, a, shape):
    x = a["self"]
    dim = int(a["dim"]) % max(x.ndim, 1)
    k = x.shape[dim]
    if dim == x.ndim - 1:
        dd = SQRT(shape[-1])
        M = None if x.G is None else x.G.scale(SQRT(k))
        return AValue(x.exps, None if M is None else M.scale(dd), M, None if x.J is None else x.J.scale(SQRT(k) * dd),
                      shape, x.sign, False, None, None, "linear (cumsum)")
    return _scaled(x, shape, float(k), rule_name="linear (cumsum)")


@rule("aten.where")
def _r_where(it, n, a, shape):
    cond, x, y = a["condition"], a["self"], a["other"]
    if isinstance(cond, AValue) and not cond.const:
        return _unknown(shape, "where() with a condition that depends on the input (a discontinuous switch)")
    xs = [v if isinstance(v, AValue) else AValue.constant(torch.as_tensor(float(v))) for v in (x, y)]
    out = _r_add(it, n, {"self": xs[0], "other": xs[1], "alpha": 1}, shape)
    out.rule = "where with a constant condition (sum rule)"
    out.sign = xs[0].sign if xs[0].sign == xs[1].sign else None
    return out


@rule("aten.embedding")
def _r_embedding(it, n, a, shape):
    return _unknown(shape, "embedding lookup of an input-dependent index (not differentiable)")


# normalizations ----------------------------------------------------------------------------------
def _norm_value(x: AValue, shape, bound: float, jac: float, name: str, deps=()) -> AValue:
    J = None if x.J is None else x.J.scale(jac)
    return AValue(E.normalize(x.exps), Poly.const(bound), Poly.const(bound), J, shape, None, False, None, None,
                  f"normalization {name}", tuple(deps))


@rule("aten.layer_norm", "aten.native_layer_norm")
def _r_layer_norm(it, n, a, shape):
    x, w, b, eps = a["input"], a.get("weight"), a.get("bias"), float(a.get("eps", 1e-5))
    ns = list(a["normalized_shape"])
    for p in (w, b):
        if isinstance(p, AValue) and not p.const:
            return _unknown(shape, "layer_norm with input-dependent affine parameters")
    if eps <= 0:
        return _unknown(shape, "layer_norm with eps <= 0 (Jacobian unbounded)")
    numel = 1
    for s in ns:
        numel *= s
    gmax = max_abs(w.value) if isinstance(w, AValue) else 1.0
    bnorm = 0.0
    if isinstance(b, AValue):
        bnorm = row_norm(b.value)
    d = shape[-1]
    bound = gmax * SQRT(numel) + bnorm
    jac = gmax / SQRT(eps) * SQRT(numel / d)
    out = _norm_value(x, shape, bound, jac, "(LayerNorm)")
    if op_name(n.target) == "aten.native_layer_norm":
        conc = it.g.env[n.name]
        return [out, AValue.unknown(tuple(conc[1].shape), "layer_norm mean"),
                AValue.unknown(tuple(conc[2].shape), "layer_norm rstd")]
    return out


@rule("aten.rms_norm")
def _r_rms_norm(it, n, a, shape):
    x, w, eps = a["input"], a.get("weight"), a.get("eps")
    if isinstance(w, AValue) and not w.const:
        return _unknown(shape, "rms_norm with an input-dependent weight")
    if eps is None:
        eps = torch.finfo(it.g.env[n.name].dtype).eps
    eps = float(eps)
    if eps <= 0:
        return _unknown(shape, "rms_norm with eps <= 0")
    numel = 1
    for s in a["normalized_shape"]:
        numel *= s
    gmax = max_abs(w.value) if isinstance(w, AValue) else 1.0
    return _norm_value(x, shape, gmax * SQRT(numel), gmax / SQRT(eps) * SQRT(numel / shape[-1]), "(RMSNorm)")


@rule("aten.group_norm")
def _r_group_norm(it, n, a, shape):
    x, w, b, G_, eps = a["input"], a.get("weight"), a.get("bias"), int(a["num_groups"]), float(a.get("eps", 1e-5))
    if eps <= 0:
        return _unknown(shape, "group_norm with eps <= 0")
    C = x.shape[1]
    group_numel = (C // G_) * int(torch.tensor(x.shape[2:]).prod()) if x.ndim > 2 else C // G_
    gmax = max_abs(w.value) if isinstance(w, AValue) else 1.0
    bmax = max_abs(b.value) if isinstance(b, AValue) else 0.0
    d = shape[-1]
    bound = gmax * SQRT(G_ * group_numel) + bmax * SQRT(d)
    jac = gmax / SQRT(eps) * SQRT(G_ * group_numel)
    return _norm_value(x, shape, bound, jac, "(GroupNorm)")


@rule("aten.batch_norm", "aten._native_batch_norm_legit_no_training", "aten.native_batch_norm",
      "aten._native_batch_norm_legit", "aten.instance_norm")
def _r_batch_norm(it, n, a, shape):
    x = a["input"]
    training = a.get("training", a.get("use_input_stats", False))
    name = op_name(n.target)
    if name == "aten._native_batch_norm_legit_no_training":
        training = False
    if training:
        return _unknown(shape, f"{name} with batch statistics: normalizes over the batch, not per sample")
    w, b, rm, rv = a.get("weight"), a.get("bias"), a.get("running_mean"), a.get("running_var")
    eps = float(a.get("eps", 1e-5))
    for p in (w, b, rm, rv):
        if isinstance(p, AValue) and not p.const:
            return _unknown(shape, "batch_norm with input-dependent statistics")
    C = x.shape[1]
    var = rv.value.double() if isinstance(rv, AValue) else torch.ones(C, dtype=torch.float64)
    mean = rm.value.double() if isinstance(rm, AValue) else torch.zeros(C, dtype=torch.float64)
    g = w.value.double() if isinstance(w, AValue) else torch.ones(C, dtype=torch.float64)
    beta = b.value.double() if isinstance(b, AValue) else torch.zeros(C, dtype=torch.float64)
    scale = g / torch.sqrt(var + eps)
    shift = beta - mean * scale
    s = float(scale.abs().max()) * (1 + 1e-9)
    sh = float(shift.abs().max())
    conc = it.g.env.get(n.name)
    if isinstance(conc, (tuple, list)):
        shape = tuple(conc[0].shape)
    d = shape[-1]
    # in eval mode batch_norm is an affine map per channel (not a normalization)
    G = None if x.G is None else x.G.scale(s) + Poly.const(sh * SQRT(d))
    J = None if x.J is None else x.J.scale(s)
    out = AValue(x.exps, G, G, J, shape, None, False, None, None,
                 "affine (batch_norm in eval mode uses running statistics: an affine map, not a normalization)")
    if name != "aten.batch_norm":
        conc = it.g.env[n.name]
        return [out] + [AValue.constant(c) for c in conc[1:]]
    return out


@rule("aten.softmax", "aten._softmax", "aten.special_softmax")
def _r_softmax(it, n, a, shape):
    x = a["self"]
    dim = int(a["dim"]) % max(len(shape), 1)
    return _softmax_value(x, shape, dim, "softmax")


def _softmax_value(z: AValue, shape, dim: int, name: str, deps=()) -> AValue:
    nd = max(len(shape), 1)
    if dim == nd - 1:
        G, M, jf = Poly.const(1.0), Poly.const(1.0), 0.5
    else:
        d = shape[-1]
        G, M, jf = Poly.const(SQRT(d)), Poly.const(1.0), 0.5 * SQRT(d * shape[dim])
    J = None if z.J is None else z.J.scale(jf)
    return AValue(E.compose(E.SOFTMAX, z.exps), G, M, J, shape, "+", False, None, dim - nd,
                  f"{name} (row-stochastic)", tuple(deps))


@rule("aten.log_softmax", "aten._log_softmax")
def _r_log_softmax(it, n, a, shape):
    x = a["self"]
    dim = int(a["dim"]) % max(len(shape), 1)
    k = shape[dim]
    d = shape[-1]
    xm = x.M_or_G()
    M = None if xm is None else xm.scale(2.0) + Poly.const(math.log(k))
    G = None if M is None else M.scale(SQRT(d))
    jf = (1 + SQRT(k)) * (SQRT(d * k) if dim != len(shape) - 1 else 1.0)
    J = None if x.J is None else x.J.scale(jf)
    return AValue(E.compose(E.LIPSCHITZ, x.exps), G, M, J, shape, "-", False, None, None, "log_softmax (Lipschitz)")


# attention ---------------------------------------------------------------------------------------
@rule("aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
      "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
      "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_attention_math",
      "aten._scaled_dot_product_fused_attention_overrideable")
def _r_sdpa(it, n, a, shape):
    q, k, v = a["query"], a["key"], a["value"]
    mask = a.get("attn_mask", a.get("attn_bias"))
    conc = it.g.env.get(n.name)
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else shape
    extra = [] if not isinstance(conc, (tuple, list)) else \
        [AValue.unknown(tuple(c.shape) if isinstance(c, torch.Tensor) else (), "attention auxiliary output")
         for c in conc[1:]]
    if isinstance(mask, AValue) and not mask.const:
        out = AValue.unknown(out_shape, "sdpa", "attention mask depends on the input")
        return [out] + extra if extra else out
    p = float(a.get("dropout_p", 0.0) or 0.0)
    E_ = q.shape[-1]
    s = a.get("scale")
    s = 1.0 / SQRT(E_) if s is None else float(s)
    logits = E.product(*[t.exps for t in (q, k) if not t.const]) if not (q.const and k.const) else E.CONSTANT
    if v.const:
        ex = Exponents(0.0, logits.sigma)
    else:
        ex = Exponents(v.exps.q, None if (logits.sigma is None or v.exps.q is None or v.exps.sigma is None)
                       else max(logits.sigma + v.exps.q, v.exps.sigma))
    drop = 1.0 / (1.0 - p) if p > 0 else 1.0
    G = None if v.G is None else v.G.scale(drop)
    J = None
    if None not in (q.G, k.G, v.G, q.J, k.J, v.J):
        J = (v.J + (q.J * k.G + q.G * k.J) * v.G * Poly.const(2.0 * abs(s))).scale(drop)
    out = AValue(ex, G, G, J, out_shape, None, False, None, None,
                 "attention atom: q = q_V, sigma = max(sigma_logits + q_V, sigma_V)")
    return [out] + extra if extra else out


# recognizers ------------------------------------------------------------------------------------
def _node(x: Any) -> Optional[torch.fx.Node]:
    return x if isinstance(x, torch.fx.Node) else None


def _target(n: Any) -> str:
    return op_name(n.target) if isinstance(n, torch.fx.Node) and n.op == "call_function" else ""


def _const_scalar(it, x: Any) -> Optional[float]:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.fx.Node):
        v = it.values.get(x.name)
        if v is not None and not v.const:
            return None
        c = it.g.env.get(x.name)
        if isinstance(c, torch.Tensor) and c.numel() >= 1:
            if bool((c == c.reshape(-1)[0]).all()):
                return float(c.reshape(-1)[0])
    return None


def _sum_of_squares(it, n: Any, a: Any, any_dim: bool = False) -> Optional[float]:
    """If ``n`` is mean/sum over the last dim (keepdim) of a^2, return 1/d or 1 (the k in k |a|^2).

    With ``any_dim`` the reduction may run over any single dimension; :func:`_norm_dim` tells which.
    """
    n = _strip(n)
    t = _target(n)
    if t not in ("aten.mean", "aten.sum"):
        return None
    sq = _strip(n.args[0])
    st = _target(sq)
    ok = (st in ("aten.pow",) and len(sq.args) > 1 and sq.args[1] == 2 and _is_same(sq.args[0], a)) or \
         (st == "aten.square" and _is_same(sq.args[0], a)) or \
         (st == "aten.mul" and _is_same(sq.args[0], a) and _is_same(sq.args[1], a))
    if not ok:
        return None
    aval = it.g.env[_strip(a).name] if isinstance(_strip(a), torch.fx.Node) else None
    if aval is None:
        return None
    nd = aval.dim()
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    if dims is None or len(dims) != 1 or not keep or (not any_dim and int(dims[0]) % nd != nd - 1):
        return None
    return 1.0 / aval.shape[int(dims[0]) % nd] if t == "aten.mean" else 1.0


def _norm_dim(it, den: Any, a: Any) -> Optional[int]:
    """The dimension a recognized ``rsqrt(k |a|^2 + eps)`` denominator reduces over (None if not that form)."""
    den = _strip(den)
    if _target(den) != "aten.rsqrt":
        return None
    inner = _strip(den.args[0])
    if _target(inner) != "aten.add":
        return None
    for s in inner.args[:2]:
        s = _strip(s)
        if isinstance(s, torch.fx.Node) and _sum_of_squares(it, s, a, any_dim=True) is not None:
            dims = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
            return int(dims[0]) % it.g.env[_strip(a).name].dim()
    return None


def _var_of(it, n: Any, a: Any) -> Optional[float]:
    """var(y, last, keepdim, correction 0) where a = y - mean(y): returns 1/d (k |a|^2)."""
    n = _strip(n)
    if _target(n) != "aten.var":
        return None
    a = _strip(a)
    if _target(a) != "aten.sub":
        return None
    y, m = a.args[0], _strip(a.args[1])
    if _target(m) != "aten.mean" or not _is_same(m.args[0], y) or not _is_same(n.args[0], y):
        return None
    mb = _bind(m) or {}
    ynd = it.g.env[_strip(y).name].dim()
    if mb.get("dim") is None or [int(d) % ynd for d in mb["dim"]] != [ynd - 1] or not mb.get("keepdim", False):
        return None  # the centring must be over the normalized (last) dimension
    b = _bind(n) or {}
    corr = b.get("correction")
    unbiased = b.get("unbiased")
    yv = it.g.env[_strip(y).name]
    nd = yv.dim()
    dims = b.get("dim")
    if dims is None or [int(d) % nd for d in dims] != [nd - 1] or not b.get("keepdim", False):
        return None
    d = yv.shape[-1]
    if corr is not None:
        c = float(corr)
    elif unbiased is None or unbiased:
        c = 1.0
    else:
        c = 0.0
    if d - c <= 0:
        return None
    return 1.0 / (d - c)


def _denominator_k_eps(it, den: Any, a: Any, inverse: bool) -> Optional[Tuple[float, float, bool]]:
    """Recognize a denominator sqrt(k |a|^2 + eps) (or ||a|| + eps, max(||a||, eps)).

    Returns (k, eps, sqrt_form) or None.  ``inverse`` asks for rsqrt(...) (a multiplier).
    """
    den = _strip(den)
    t = _target(den)
    if inverse:
        if t != "aten.rsqrt":
            if t in ("aten.reciprocal",):
                inner = _denominator_k_eps(it, den.args[0], a, False)
                return inner
            return None
        inner = _strip(den.args[0])
    else:
        if t in ("aten.linalg_vector_norm", "aten.norm") and _is_same(den.args[0], a):
            b = _bind(den) or {}
            ordv = b.get("ord", b.get("p", 2))
            nd = it.g.env[_strip(a).name].dim()
            dims = b.get("dim")
            if (ordv in (None, 2, 2.0)) and dims is not None and [int(d) % nd for d in dims] == [nd - 1] \
                    and b.get("keepdim", False):
                return (1.0, 0.0, False)  # x / ||x|| without eps
            return None
        if t == "aten.sqrt":
            inner = _strip(den.args[0])
        elif t in ("aten.clamp_min", "aten.clamp", "aten.add", "aten.maximum"):
            base = _strip(den.args[0])
            if t == "aten.clamp":
                eps = _const_scalar(it, den.args[1] if len(den.args) > 1 else den.kwargs.get("min"))
            else:
                eps = _const_scalar(it, den.args[1])
            if eps is None or eps <= 0:
                return None
            if _target(base) in ("aten.linalg_vector_norm", "aten.norm") and _is_same(base.args[0], a):
                b = _bind(base) or {}
                ordv = b.get("ord", b.get("p", 2))
                aval = it.g.env[_strip(a).name]
                nd = aval.dim()
                dims = b.get("dim")
                if (ordv in (None, 2, 2.0)) and dims is not None and [int(d) % nd for d in dims] == [nd - 1] \
                        and b.get("keepdim", False):
                    return (1.0, eps, False)
            if t == "aten.add" and _target(base) == "aten.sqrt":
                k = _sum_of_squares(it, base.args[0], a)
                if k is not None:
                    return (k, eps, False)
            return None
        else:
            return None
    if _target(inner) != "aten.add":
        return None
    eps = _const_scalar(it, inner.args[1])
    s = inner.args[0]
    if eps is None:
        eps, s = _const_scalar(it, inner.args[0]), inner.args[1]
    if eps is None or eps <= 0:
        return None
    k = _sum_of_squares(it, s, a, any_dim=inverse)
    if k is None:
        k = _var_of(it, s, a)
    if k is None:
        return None
    return (k, eps, True)


def _recognize_norm(it, n: torch.fx.Node, shape) -> Optional[AValue]:
    """x * rsqrt(mean(x^2) + eps), x / sqrt(...), x / max(||x||, eps), centred variants -> (0, sigma_x)."""
    t = _target(n)
    cands = []
    if t == "aten.mul":
        cands = [(n.args[0], n.args[1]), (n.args[1], n.args[0])]
        inverse = True
    elif t == "aten.div":
        cands = [(n.args[0], n.args[1])]
        inverse = False
    else:
        return None
    expanded = []
    for a, den in cands:
        expanded.append((a, den, 1.0))
        # (c * a) / N(a) with a constant c: the normalization of a, scaled by max|c|
        a0 = _strip(a)
        if _target(a0) == "aten.mul":
            for i in (0, 1):
                c, other = a0.args[i], a0.args[1 - i]
                cv = _const_scalar(it, c) if not isinstance(c, torch.fx.Node) else None
                if isinstance(c, torch.fx.Node):
                    v = it.values.get(c.name)
                    if (v is None or v.const) and isinstance(it.g.env.get(c.name), torch.Tensor):
                        cv = max_abs(it.g.env[c.name])
                if cv is not None:
                    expanded.append((other, den, abs(cv)))
    for a, den, cscale in expanded:
        if not isinstance(a, torch.fx.Node) or not isinstance(den, torch.fx.Node):
            continue
        r = _denominator_k_eps(it, den, a, inverse)
        if r is None:
            continue
        if cscale != 1.0:
            c_shape = tuple(it.g.env[_strip(a).name].shape)
            if c_shape[-1:] != tuple(shape[-1:]):
                continue
        k, eps, sqrt_form = r
        av = it.values.get(_strip(a).name) or it.value(a)
        if av.const:
            continue
        # |a / sqrt(k|a|^2 + eps)| <= 1/sqrt(k), Jacobian <= 1/sqrt(eps); |a/max(|a|,eps)| <= 1, Jac <= 1/eps
        bound = cscale / SQRT(k)
        if eps == 0:
            # x / ||x||: bounded (q = 0) but its Jacobian 1/||x|| is unbounded at 0 -- l0 is not derived
            out = _norm_value(av, tuple(shape), bound, 1.0, "written out (x / ||x|| without eps, recognized; "
                              "Jacobian unbounded at 0: l0 not derived)", deps=(_strip(a).name,))
            out.J = None
            return out
        jac = (1.0 / SQRT(eps) if sqrt_form else 1.0 / eps) * cscale
        nd = len(shape)
        dim = _norm_dim(it, den, a) if inverse else None
        if dim is not None and nd and dim != nd - 1:
            # Normalized along dim (not the last): every entry is <= bound, a row (last dim) is
            # <= sqrt(n_last) * bound; a perturbation's column along dim is <= sqrt(n_dim) times
            # its row norm, and the column map is 1/sqrt(eps)-Lipschitz.
            n_last, n_dim = shape[-1], shape[dim]
            out = _norm_value(av, tuple(shape), bound * SQRT(n_last), jac * SQRT(n_dim * n_last),
                              f"written out (x / ||x|| along dim {dim}, recognized)", deps=(_strip(a).name,))
            out.M = Poly.const(bound)
            return out
        out = _norm_value(av, tuple(shape), bound, jac, "written out (x / ||x|| form, recognized)",
                          deps=(_strip(a).name,))
        return out
    return None


def _recognize_softmax(it, n: torch.fx.Node, shape) -> Optional[AValue]:
    """exp(z) / sum(exp(z), dim, keepdim) -> softmax of z along dim."""
    e, s = n.args[0], _strip(n.args[1])
    if _target(s) != "aten.sum" or not _is_same(s.args[0], e):
        return None
    e0 = _strip(e)
    if _target(e0) != "aten.exp":
        return None
    ev = it.g.env[e0.name]
    nd = ev.dim()
    b = _bind(s) or {}
    dims = b.get("dim")
    if dims is None or len(dims) != 1 or not b.get("keepdim", False):
        return None
    dim = int(dims[0]) % nd
    z = e0.args[0]
    zv = it.value(z)
    if not isinstance(zv, AValue):
        return None
    if zv.const:
        return None
    return _softmax_value(zv, tuple(shape), dim, "softmax written as exp/sum (recognized)",
                          deps=(_strip(z).name if isinstance(_strip(z), torch.fx.Node) else "",))


# sign-only and boolean ops on constants never reach here (constants are evaluated); on activations:
@rule("aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt", "aten.ge", "aten.sign", "aten.round", "aten.floor",
      "aten.ceil", "aten.trunc", "aten.argmax", "aten.argmin", "aten.topk", "aten.sort", "aten.bitwise_and",
      "aten.logical_and", "aten.logical_or", "aten.logical_not", "aten.__and__", "aten.__or__", "aten.isnan")
def _r_discontinuous(it, n, a, shape):
    return _unknown(shape, f"{op_name(n.target)} of an input-dependent tensor is discontinuous "
                           "(outside the certified class)")


@rule("aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.new_zeros", "aten.new_ones",
      "aten.new_full", "aten.new_empty", "aten.rand_like", "aten.randn_like", "aten.scalar_tensor",
      "aten.sym_size", "aten.sym_numel", "aten.size")
def _r_shape_only(it, n, a, shape):
    conc = it.g.env.get(n.name)
    if isinstance(conc, torch.Tensor):
        if op_name(n.target) in ("aten.rand_like", "aten.randn_like"):
            return _unknown(shape, "random tensor")
        return AValue.constant(conc, "constant (depends only on the shape)")
    return _unknown(shape, "shape query")


@rule("aten.max_pool1d", "aten.max_pool2d", "aten.max_pool3d", "aten.max_pool1d_with_indices",
      "aten.max_pool2d_with_indices", "aten.max_pool3d_with_indices", "aten.avg_pool1d", "aten.avg_pool2d",
      "aten.avg_pool3d", "aten.adaptive_avg_pool1d", "aten.adaptive_avg_pool2d", "aten.adaptive_avg_pool3d",
      "aten.adaptive_max_pool1d", "aten.adaptive_max_pool2d", "aten._adaptive_avg_pool2d")
def _r_pool(it, n, a, shape):
    """Pooling: every output entry is a max or a mean of input entries (1-Lipschitz in max-abs)."""
    x = a.get("self", a.get("input"))
    name = op_name(n.target)
    conc = it.g.env.get(n.name)
    out_shape = tuple(conc[0].shape) if isinstance(conc, (tuple, list)) else shape
    pad_ok = not (a.get("count_include_pad") is False and any(p for p in (a.get("padding") or [])))
    if not pad_ok:
        pass  # mean over fewer entries: still a mean, |out| <= max|x|
    d = SQRT(out_shape[-1] if out_shape else 1)
    xm = x.M_or_G()
    M = xm
    G = None if xm is None else xm.scale(d)
    J = None if x.J is None else x.J.scale(d)
    lin = "avg" in name
    out = AValue(x.exps if lin else E.compose(E.LIPSCHITZ, x.exps), G, M, J, out_shape,
                 x.sign, False, None, None, "linear (average pooling)" if lin else "max pooling (1-Lipschitz)")
    if isinstance(conc, (tuple, list)):
        return [out] + [AValue.constant(c) for c in conc[1:]]
    return out

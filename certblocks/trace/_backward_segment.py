"""The backward bound of one segment (docs/theory.md section 7): :func:`segment_gradients` propagates a bound of the
costate at a segment's output back through its ops, with local derivative bounds read from the forward rules
evaluated with a unit Jacobian, groups (a recognized pattern, a module atom, a module with its own certificate)
capping the sum over their ops, and the entry bounds of the gradients reaching parameters.  The module docstring of
:mod:`certblocks.trace.backward` states the mathematics and the table of local bounds."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Union

import torch

from ..bounds.norms import rounded_up
from ..bounds.poly import Poly
from ._backward_ops import (
    _ATTENTION,
    _CATS,
    _CONVS,
    _INF,
    _MATMULS,
    _NO_GRADIENT,
    _POINTWISE,
    _SELECTS,
    _broadcast_sum,
    _dtype,
    _node_names,
    _op,
    _positions,
    _rows,
    _shape,
    needs_grad,
)
from ._backward_results import ZERO, GradBound, SegmentGradients, _sum
from .capture import CapturedGraph
from .interp import VelocityInterpreter, strict_rules
from .nodes import IDENTITY_OPS, VIEW_OPS, bind_args, op_name
from .own import call_bounds, rules_only
from .rules import rule_for
from .rules.arithmetic import linear_sum, multiply
from .values import AValue, max_abs


def _eval(p: Optional[Poly], r: float) -> Optional[float]:
    """``p(r)`` rounded up; ``None`` when not derived or not finite."""
    if p is None or not math.isfinite(r):
        return None
    try:
        v = p(r)
    except (OverflowError, ValueError):
        return None
    v = rounded_up(v, max(len(p.terms), 1) + 2)
    return v if math.isfinite(v) else None


class _Generic(VelocityInterpreter):
    """The interpreter with every module atom traced op by op (run inside :func:`rules_only`: no own certificates):
    the values of the nodes a collapsed call hides."""

    def _find_module_atoms(self, sub: Set[str]) -> Set[str]:
        self.atom_failures = {}
        return set()


@dataclass
class _Group:
    """A sub-graph whose input's gradient is also bounded by the group's Jacobian times its output's gradient."""

    input: str
    output: str
    members: Set[str]
    jacobian: Optional[float]
    row_local: bool
    label: str

    @property
    def scope(self) -> Set[str]:
        return self.members | {self.output}


# ---------------------------------------------------------------------------------------------------- one segment
class _SegmentPass:
    """The backward bound of one segment ``start -> end`` (see :func:`segment_gradients`)."""

    def __init__(self, g: CapturedGraph, start: torch.fx.Node, end: torch.fx.Node, radius: float,
                 grad: Set[str], it: Optional[VelocityInterpreter] = None,
                 dtypes: Optional[Mapping[str, torch.dtype]] = None) -> None:
        self.g, self.start, self.end, self.radius, self.grad, self.dtypes = g, start, end, radius, grad, dtypes
        if it is None:
            it = VelocityInterpreter(g, start, end)
            it.run()
        self.it = it
        self.generic: Optional[VelocityInterpreter] = None
        if it.certified_calls or it.atom_groups:
            gen = _Generic(g, start, end)
            with rules_only():
                gen.run()
            self.generic = gen
        sub = g.between(start, end)
        self.order = [n for n in g.nodes if n.name in sub]
        self.inside = sub
        self.values = self._merged()
        self.groups = self._groups()
        self._bounds_so_far: Dict[str, Any] = {}

    # forward bounds at the radius ---------------------------------------------------------------------------
    def _merged(self) -> Dict[str, Any]:
        """Node name -> the abstract value with its bounds evaluated at the radius (the smaller of the collapsed and
        the op-by-op interpretations, both sound), Jacobian zero: what the rules read to give local derivatives."""
        out: Dict[str, Any] = {k: v for k, v in self.it.values.items() if k not in self.inside}  # constants
        srcs = [self.it.values] + ([self.generic.values] if self.generic is not None else [])
        for n in self.order:
            cands = [s.get(n.name) for s in srcs if s.get(n.name) is not None]
            if not cands:
                continue
            if isinstance(cands[0], (list, tuple)):
                k = len(cands[0])
                out[n.name] = [self._merge([c[i] for c in cands if isinstance(c, (list, tuple)) and len(c) == k])
                               for i in range(k)]
            else:
                out[n.name] = self._merge([c for c in cands if isinstance(c, AValue)])
        for o, (call, cert) in self.it.certified_calls.items():  # every entry inside a call is within its peak
            y = out.get(call.input.name)
            inner = call_bounds(cert, y.growth, Poly.const(1.0)).inner if isinstance(y, AValue) else None
            top = _eval(inner, self.radius)
            if top is None:
                continue
            for m in call.members - {o}:
                v = out.get(m)
                if isinstance(v, AValue) and not v.const:
                    e = _eval(v.entry_bound(), self.radius)
                    if e is None or top < e:
                        out[m] = dataclasses.replace(v, max_abs=Poly.const(top))
        return out

    def _merge(self, avs: List[Any]) -> Any:
        avs = [a for a in avs if isinstance(a, AValue)]
        if not avs:
            return None
        for a in avs:
            if a.const:
                return a
        r = self.radius
        gs = [v for v in (_eval(a.growth, r) for a in avs) if v is not None]
        es = [v for v in (_eval(a.entry_bound(), r) for a in avs) if v is not None]
        grow = min(gs) if gs else None
        ent = min(es + ([grow] if grow is not None else [])) if (es or grow is not None) else None
        base = avs[0]
        stoch = next((a for a in avs if a.stochastic_dim is not None), None)
        sign = next((a.sign for a in avs if a.sign is not None), None)
        return dataclasses.replace(
            base, growth=None if grow is None else Poly.const(grow), max_abs=None if ent is None else Poly.const(ent),
            jacobian=Poly.ZERO, sign=sign, stochastic_dim=None if stoch is None else stoch.stochastic_dim,
            row_sum=1.0 if stoch is None else stoch.row_sum)

    def entry_of(self, a: Any) -> Optional[float]:
        """A bound of every entry of an argument at the radius (a number: its modulus)."""
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return abs(float(a))
        if not isinstance(a, torch.fx.Node):
            return None
        v = self.values.get(a.name)
        if isinstance(v, AValue):
            if v.const and v.value is not None:
                return max_abs(v.value)
            return _eval(v.entry_bound(), self.radius)
        conc = self.g.env.get(a.name)
        if a.name not in self.inside and isinstance(conc, torch.Tensor):
            return max_abs(conc)  # a constant of the segment (a parameter, a mask)
        return None

    # groups ------------------------------------------------------------------------------------------------
    def _groups(self) -> List[_Group]:
        out: List[_Group] = []
        it = self.it
        for o, (call, cert) in it.certified_calls.items():
            y = self.values.get(call.input.name)
            jac = None
            if isinstance(y, AValue) and y.growth is not None:
                b = call_bounds(cert, y.growth, Poly.const(1.0))
                jac = _eval(b.jacobian, self.radius)
            out.append(_Group(call.input.name, o, set(call.members) - {o}, jac, False,
                              f"own certificate of {type(call.module).__name__} ({call.path})"))
        for o, atom_grp in it.atom_groups.items():
            y = self.values.get(atom_grp.input.name)
            jac = None
            if isinstance(y, AValue):
                unit = dataclasses.replace(y, jacobian=Poly.const(1.0))
                av = it._apply_atom(atom_grp.atom, unit, self.g.get_module(atom_grp.path),
                                    _shape(self.g, atom_grp.output), "", ())
                jac = _eval(av.jacobian, self.radius)
            out.append(_Group(atom_grp.input.name, o, {m.name for m in atom_grp.members} - {o}, jac, False,
                              f"atom {atom_grp.atom.name} ({atom_grp.path})"))
        for n in self.order:
            grp = self._recognized(n)
            if grp is not None:
                out.append(grp)
        return out

    def _recognized(self, n: torch.fx.Node) -> Optional[_Group]:
        """A normalization or softmax written out that a rule recognized at ``n``: a group from its input."""
        av = self.values.get(n.name)
        if not isinstance(av, AValue) or "recognized" not in av.rule or not av.deps or n.op != "call_function":
            return None
        base = self.g.nodes[self.g.index[av.deps[0]]] if av.deps[0] in self.g.index else None
        if base is None or base.name not in self.inside or base is n:
            return None
        members = self.g.between(base, n) - {base.name, n.name}
        if any(u.name not in members and u is not n for m in members for u in self.g.nodes[self.g.index[m]].users):
            return None  # an op inside is used outside the pattern: no shortcut
        res = self._rule_with_unit(n, base.name, recognize=True)
        jac = None if res is None or not isinstance(res, AValue) else _eval(res.jacobian, self.radius)
        name = op_name(n.target)
        row_local = "along dim" not in av.rule and (av.stochastic_dim is None or av.stochastic_dim == -1)
        return _Group(base.name, n.name, members, jac, row_local, f"{av.rule} at {n.name} ({name})")

    # local derivatives -------------------------------------------------------------------------------------
    def _rule_with_unit(self, n: torch.fx.Node, target: str, *, recognize: bool = False) -> Any:
        """The rule of ``n`` evaluated with a unit Jacobian on ``target`` and zero on every other input-dependent
        node: its Jacobian is the local derivative bound of ``n`` in ``target`` (module docstring)."""
        it = self.it
        vals = dict(self.values)
        tv = vals.get(target)
        if not isinstance(tv, AValue) or tv.const:
            return None
        vals[target] = dataclasses.replace(tv, jacobian=Poly.const(1.0))
        proxy = copy.copy(it)
        proxy.values = vals
        proxy.notes = list(it.notes)
        name = op_name(n.target)
        shape = _shape(self.g, n) if not isinstance(self.g.env.get(n.name), (tuple, list)) else ()
        bound = bind_args(n)
        if bound is None:
            return None
        args = {k: proxy.value(v) for k, v in bound.items()}
        if name in ("aten.mul", "aten.multiply") and not recognize:
            return multiply(n, args["self"], args["other"], shape)
        if name in ("aten.div", "aten.divide", "aten.true_divide") and not recognize:
            return _divide(proxy, n, args, shape)
        if name == "aten.where":
            cond = args["condition"]
            if isinstance(cond, AValue) and not cond.const:  # autograd masks the gradient: each branch at most 1
                return linear_sum(_as_value(args["self"]), _as_value(args["other"]), 1.0, shape, "where (masked)")
        if name == "aten.masked_fill":
            mask = args.get("mask")
            if isinstance(mask, AValue) and not mask.const and target in _node_names(bound.get("self")):
                x = args["self"]
                f = 1.0 if tuple(x.shape) == tuple(shape) else math.sqrt(max(shape[-1] if shape else 1, 1))
                return dataclasses.replace(x, jacobian=x.jacobian.scale(f))
        from .atoms import lookup_op_atom

        atom = lookup_op_atom(name)
        if atom is not None:
            acts = [v for v in args.values() if isinstance(v, AValue) and not v.const]
            if len(acts) == 1:
                return proxy._apply_atom(atom, acts[0], n, shape, "", ())
        rule = rule_for(name)
        if rule is None:
            return None
        return rule(proxy, n, args, shape)

    def local(self, n: torch.fx.Node, a: torch.fx.Node) -> Tuple[List[Optional[float]], str]:
        """``||dn/da||`` per output of ``n`` at the radius (``None``: not bounded) and why not."""
        name = _op(n)
        conc = self.g.env.get(n.name)
        k = len(conc) if isinstance(conc, (tuple, list)) else 1
        if name in _NO_GRADIENT:
            return [0.0] * k, ""
        try:
            res = self._rule_with_unit(n, a.name)
        except Exception as exc:  # a rule that raises on a unit Jacobian: not bounded (strict mode: a bug)
            if strict_rules():
                raise
            return [None] * k, f"{name}: its rule raised {type(exc).__name__} ({exc}) on the local derivative"
        if res is None:
            return [None] * k, f"{name}: no rule gives its local derivative in {a.name}"
        res_list = list(res) if isinstance(res, (list, tuple)) else [res]
        out: List[Optional[float]] = []
        for r in res_list:
            out.append(_eval(r.jacobian, self.radius) if isinstance(r, AValue) and r.jacobian is not None else None)
        if any(v is None for v in out):
            why = next((r.bad for r in res_list if isinstance(r, AValue) and r.bad), "")
            return out, f"{name} ({n.name}): no local derivative bound in {a.name}" + (f": {why}" if why else "")
        return out, ""

    def row_factor(self, n: torch.fx.Node, a: torch.fx.Node) -> Union[None, str, float, Tuple[str, float]]:
        """How the largest row of ``a``'s gradient follows from ``n``'s (module docstring): ``"local"`` when the
        backward of ``n`` maps each row of its output gradient to one row of ``a``'s by a map bounded by the local
        derivative; a number when a row of ``a``'s gradient is part of one output row (1) or joins ``k`` of them
        (``sqrt(k)``); ``("sum", k)`` when a row collects at most ``k`` output rows each through the local derivative
        (an attention's keys and values: ``k`` queries); ``None`` when a row may collect any number of rows (it is then
        bounded by ``N*``)."""
        name = _op(n)
        pos = _positions(n, a)
        sa, so = _shape(self.g, a), _shape(self.g, n)
        b = bind_args(n) or {}
        nd = len(so)
        if name in _POINTWISE:
            return "local" if sa == so else None
        if not sa or not so:
            return None
        if name == "aten.linear":
            return "local" if pos == ["input"] and sa[:-1] == so[:-1] else None
        if name in _MATMULS:
            return "local" if pos == ["self"] and len(sa) >= 2 and sa[:-1] == so[:-1] else None
        if name in ("aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm"):
            ok = pos == ["input"] and len(b.get("normalized_shape") or ()) == 1 and sa == so
            return "local" if ok else None
        if name in ("aten.softmax", "aten._softmax", "aten.special_softmax", "aten.log_softmax", "aten._log_softmax"):
            return "local" if sa == so and int(b.get("dim", -1)) % max(nd, 1) == nd - 1 else None
        if name in _ATTENTION:
            if pos == ["query"] and sa[:-1] == so[:-1]:
                return "local"
            # a key's or value's gradient sums the contributions of the queries: sum_i P_ij ... <= (queries) x local
            return ("sum", float(so[-2])) if len(so) >= 2 and set(pos) <= {"key", "value"} else None
        if name in VIEW_OPS:
            if math.prod(sa) != math.prod(so) or not sa[-1] or not so[-1]:
                return None
            if so[-1] % sa[-1] == 0:
                return 1.0  # a row of the input lies in one row of the output
            if sa[-1] % so[-1] == 0:
                return math.sqrt(sa[-1] // so[-1])  # a row of the input joins sa/so rows of the output
            return None
        if name == "aten.permute":
            dims = [int(d) % len(sa) for d in b.get("dims", ())]
            return "local" if dims and dims[-1] == len(sa) - 1 else None
        if name in ("aten.transpose", "aten.swapaxes", "aten.swapdims"):
            d0 = b.get("dim0", b.get("axis0"))
            d1 = b.get("dim1", b.get("axis1"))
            ok = d0 is not None and d1 is not None and len(sa) - 1 not in (int(d0) % len(sa), int(d1) % len(sa))
            return "local" if ok else None
        if name in _SELECTS or name in _CATS:
            d = int(b.get("dim", 0) or 0)
            return "local" if (d % max(len(sa), 1)) != len(sa) - 1 and sa[-1] == so[-1] else None
        return None

    # parameters ---------------------------------------------------------------------------------------------
    def parameter_entry(self, n: torch.fx.Node, a: torch.fx.Node, gu: GradBound) -> Tuple[float, str]:
        """A bound of every entry of the gradient reaching the parameter-side argument ``a`` of ``n``."""
        name = _op(n)
        b = bind_args(n) or {}
        pos = _positions(n, a)
        so, sa = _shape(self.g, n), _shape(self.g, a)
        t, rows = gu.total, gu.rows
        nrows = _rows(so)
        col = min(t, nrows * rows)  # sum over the rows of one column of g
        bcast = _broadcast_sum(sa, so, t, rows)  # sum over the copies of one entry of a broadcast argument
        why = f"{name} ({n.name}): no bound of the gradient of its parameter argument {a.name}"
        if not gu.known:
            return _INF, gu.why or why
        if len(pos) != 1:
            return _INF, why
        p = pos[0]
        other = None
        if name == "aten.linear":
            if p == "weight":
                other = self.entry_of(b.get("input"))
                return (_INF, why) if other is None else (other * col, "")
            if p == "bias":
                return col, ""
        if name in _MATMULS:
            left, right = b.get("self"), b.get("other", b.get("mat2"))
            if p in ("other", "mat2"):
                e = self.entry_of(left)
                return (_INF, why) if e is None else (e * col, "")
            if p == "self" and len(so) >= 1:
                e = self.entry_of(right)
                return (_INF, why) if e is None else (e * math.sqrt(max(so[-1], 1)) * t, "")
        if name == "aten.addmm":  # beta self + alpha mat1 @ mat2 (HF's Conv1D: the bias, the input, the weight)
            beta, alpha = b.get("beta", 1), b.get("alpha", 1)
            if not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
                return _INF, why
            if p == "self":
                return abs(float(beta)) * bcast, ""
            if p == "mat2":
                e = self.entry_of(b.get("mat1"))
                return (_INF, why) if e is None else (abs(float(alpha)) * e * col, "")
            if p == "mat1" and len(so) >= 1:
                e = self.entry_of(b.get("mat2"))
                return (_INF, why) if e is None else (abs(float(alpha)) * e * math.sqrt(max(so[-1], 1)) * t, "")
        if name in ("aten.mul", "aten.multiply"):
            other = b.get("other") if p == "self" else b.get("self")
            e = self.entry_of(other)
            return (_INF, why) if e is None else (e * bcast, "")
        if name in ("aten.add", "aten.sub", "aten.subtract", "aten.rsub"):
            alpha = b.get("alpha", 1)
            scaled_pos = "other" if name != "aten.rsub" else "self"
            f = abs(float(alpha)) if p == scaled_pos and isinstance(alpha, (int, float)) else 1.0
            return f * bcast, ""
        if name in ("aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm"):
            numel = math.prod(b.get("normalized_shape") or (1,))
            if p == "weight":  # the normalized entries are at most sqrt(numel) (their squares sum to numel)
                return math.sqrt(numel) * bcast, ""
            if p == "bias":
                return bcast, ""
        if name == "aten.embedding" and p == "weight":
            return t, ""  # dW[v] sums the gradient's rows at the positions of token v
        if name in _CONVS and p in ("weight", "bias") and so:
            across = math.sqrt(max(so[-1], 1)) * t  # sum over every output position of one channel of g
            if p == "bias":
                return across, ""
            e = self.entry_of(b.get("input"))
            return (_INF, why) if e is None else (e * across, "")
        if name in _CATS:
            return rows, ""
        if name == "aten.where" and p in ("self", "other"):
            return bcast, ""
        return _INF, why

    # the pass ----------------------------------------------------------------------------------------------
    def run(self, g_out: GradBound, cap_in: Optional[GradBound] = None) -> SegmentGradients:
        """Propagate ``g_out`` (the gradient bound at ``end``) back to ``start`` (capped by ``cap_in``)."""
        res = SegmentGradients(radius=self.radius)
        contrib: Dict[str, List[Tuple[str, float, float, str]]] = {}
        slots: Dict[str, Dict[int, List[Tuple[str, float, float, str]]]] = {}
        bounds: Dict[str, Any] = {}
        self._bounds_so_far = bounds
        params: Dict[str, Tuple[float, str]] = {}
        for n in reversed(self.order):
            if n is self.end:
                gb: Any = g_out
            elif isinstance(self.g.env.get(n.name), (tuple, list)):
                gb = {k: self._finish(n.name, items) for k, items in slots.get(n.name, {}).items()}
            else:
                gb = self._finish(n.name, contrib.get(n.name, []))
            if n is self.start and cap_in is not None:
                gb = GradBound.of(min(gb.total, cap_in.total), min(gb.rows, cap_in.rows),
                                  gb.why if not math.isfinite(cap_in.total) else "")
            bounds[n.name] = gb
            if n is self.start or n.name not in self.grad or n.op != "call_function":
                continue
            self._propagate(n, gb, contrib, slots, params, res)
        for name, gb in bounds.items():
            if isinstance(gb, dict):
                for k, v in gb.items():
                    res.bounds[f"{name}#{k}"] = v
            elif name in self.grad:
                res.bounds[name] = gb
        res.parameters = params
        return res

    def _propagate(self, n: torch.fx.Node, gb: Any, contrib: Dict[str, List[Tuple[str, float, float, str]]],
                   slots: Dict[str, Dict[int, List[Tuple[str, float, float, str]]]],
                   params: Dict[str, Tuple[float, str]], res: SegmentGradients) -> None:
        name = _op(n)
        if name == "getitem":
            src, k = n.args[0], n.args[1]
            if isinstance(src, torch.fx.Node) and isinstance(k, int) and src.name in self.grad:
                slots.setdefault(src.name, {}).setdefault(k, []).append((n.name, gb.total, gb.rows, gb.why))
            return
        outs: Dict[int, GradBound] = gb if isinstance(gb, dict) else {0: gb}
        if not outs:
            return
        lead = outs.get(0, ZERO)
        n_dtype = _dtype(self.g, n, self.dtypes)
        for a in dict.fromkeys(n.all_input_nodes):
            if a.name not in self.grad:
                continue
            if a.name in self.inside:
                local, why = self.local(n, a)
                total, rows_, whys = 0.0, 0.0, []
                rf = self.row_factor(n, a)
                for k, gk in outs.items():
                    lk = local[k] if k < len(local) else None
                    if gk.total == 0.0 and gk.rows == 0.0:
                        continue
                    if lk is None:
                        total, rows_ = _INF, _INF
                        whys.append(why)
                        continue
                    total += lk * gk.total
                    if rf == "local":
                        rows_ += lk * gk.rows
                    elif isinstance(rf, tuple):
                        rows_ += min(rf[1] * lk * gk.rows, lk * gk.total)
                    elif isinstance(rf, (int, float)):
                        rows_ += rf * gk.rows
                    else:
                        rows_ += lk * gk.total
                    if gk.why:
                        whys.append(gk.why)
                c_why = next((w for w in whys if w), "")
                contrib.setdefault(a.name, []).append((n.name, total, min(rows_, total), c_why))
                hidden_entry, hidden_why = min(rows_, total), c_why
            else:
                e, why = self.parameter_entry(n, a, lead)
                old = params.get(a.name, (0.0, ""))
                params[a.name] = (old[0] + e, old[1] or why)
                hidden_entry, hidden_why = e, why
            a_dtype = _dtype(self.g, a, self.dtypes)
            if (name not in IDENTITY_OPS and n_dtype is not None and a_dtype is not None and n_dtype != a_dtype
                    and n_dtype.is_floating_point and a_dtype.is_floating_point):
                res.hidden.append((n.name, a.name, n_dtype, hidden_entry, hidden_why))

    def _finish(self, name: str, items: List[Tuple[str, float, float, str]]) -> GradBound:
        """The gradient bound of a node from its users' contributions, through the groups it is the input of."""
        groups = sorted((gr for gr in self.groups if gr.input == name), key=lambda gr: len(gr.members))
        if not groups:
            return _sum(items)
        assigned: Dict[int, List[Tuple[str, float, float, str]]] = {i: [] for i in range(len(groups))}
        free: List[Tuple[str, float, float, str]] = []

        def place(item: Tuple[str, float, float, str], start: int = 0) -> None:
            for i in range(start, len(groups)):
                if item[0] in groups[i].scope:
                    assigned[i].append(item)
                    return
            free.append(item)

        for item in items:
            place(item)
        for i, gr in enumerate(groups):
            s = _sum(assigned[i])
            out = self._out_bound(gr.output)
            total, rows, why = s.total, s.rows, s.why
            if gr.jacobian is not None and out is not None and out.known:
                cap = gr.jacobian * out.total
                if cap < total:
                    total, why = cap, ""
                    rows = min(rows, gr.jacobian * out.rows if gr.row_local else cap)
            place((gr.output, total, min(rows, total), why), i + 1)
        return _sum(free)

    def _out_bound(self, name: str) -> Optional[GradBound]:
        b = self._bounds_so_far.get(name)
        return b if isinstance(b, GradBound) else None


def _as_value(v: Any) -> AValue:
    return v if isinstance(v, AValue) else AValue.constant(torch.as_tensor(v))


def _divide(it: Any, n: torch.fx.Node, args: Dict[str, Any], shape: Tuple[int, ...]) -> Optional[AValue]:
    """``self / other`` as a product with the reciprocal (the div rule without its recognizers)."""
    from .rules.division import _inverse  # the div rule's reciprocal of a denominator with a proven minimum

    x, y = args["self"], args["other"]
    inv = _inverse(it, n.args[1], y)
    if isinstance(inv, str):
        return AValue.unknown(tuple(shape), "div", inv)
    if not isinstance(y, AValue):
        return multiply(n, x, 1.0 / y, shape)
    return multiply(n, x, inv, shape)


# ---------------------------------------------------------------------------------------------------- public API
def segment_gradients(g: CapturedGraph, start: torch.fx.Node, end: torch.fx.Node, radius: float,
                      g_out: Union[float, GradBound], *, it: Optional[VelocityInterpreter] = None,
                      cap_in: Union[None, float, GradBound] = None,
                      dtypes: Optional[Mapping[str, torch.dtype]] = None,
                      grad: Optional[Set[str]] = None) -> SegmentGradients:
    """Bound the gradient of every node of one segment ``start -> end`` of a captured graph.

    Args:
        g: the captured graph.
        start: the segment's input node (a velocity's ``x``).
        end: its output node.
        radius: the bound ``R`` on the input's row norm at which the forward bounds are read.
        g_out: the bound on the costate at ``end``: a number bounds ``N*`` (the sum over its rows of their Euclidean
            norms), a :class:`GradBound` also its largest row.
        it: the segment's interpreter, already run (default: one is run here).
        cap_in: a bound already known for the gradient at ``start`` (the chain's costate there).
        dtypes: node name -> the dtype its tensor is held in (default: the captured run's).
        grad: the nodes that carry a gradient (default: computed from parameters, :func:`needs_grad`, plus the
            segment's input when it is a floating input of the model).

    Returns:
        The :class:`SegmentGradients`.

    Raises:
        ValueError: ``radius`` or ``g_out`` negative or NaN.
    """
    if not isinstance(radius, (int, float)) or not radius >= 0:
        raise ValueError(f"radius must be a number >= 0, got {radius!r}")
    gb = GradBound.of(float(g_out)) if isinstance(g_out, (int, float)) else g_out
    if not isinstance(gb, GradBound) or not gb.total >= 0:
        raise ValueError(f"g_out must be a number >= 0 or a GradBound, got {g_out!r}")
    cap = GradBound.of(float(cap_in)) if isinstance(cap_in, (int, float)) else cap_in
    if grad is None:
        grad = needs_grad(g, inputs=True)
    return _SegmentPass(g, start, end, float(radius), grad, it, dtypes).run(gb, cap)

"""The search of one captured sample variant (see :mod:`certblocks.testing.conformance`): the graph as a function of
its input (:class:`_Program`), the nodes that state bounds (:class:`_Node`) and :class:`_Check`, which scores every
node's values, largest entries and Jacobian estimates against its bounds at the sample, at structured random draws
and along gradient ascents on spheres of the searched radii."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from ..bounds.poly import Poly
from ..trace.capture import CapturedGraph
from ..trace.values import AValue
from ._conformance_types import Effort, Finding

_TINY = 1e-300


# ---------------------------------------------------------------------------------------------- norms
def _real(t: Tensor) -> Tensor:
    """A value as a real float64 tensor with the same row norms (complex: real and imaginary parts side by side)."""
    if t.is_complex():
        t = torch.cat([t.real, t.imag], dim=-1) if t.dim() else t.abs()
    return t.to(torch.float64)


def _rows(t: Tensor) -> Tensor:
    """``t`` as ``(rows, last)``; a 0-d tensor is one row of one entry."""
    return t.reshape(1, 1) if t.dim() == 0 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _row_norm(t: Tensor) -> Tensor:
    """The row norm (differentiable, float64; 0 for an empty tensor)."""
    r = _rows(_real(t))
    return r.norm(dim=-1).max() if r.numel() else r.new_zeros(())


def _max_abs(t: Tensor) -> Tensor:
    a = t.abs() if t.is_complex() else t.to(torch.float64).abs()
    return a.max().to(torch.float64) if a.numel() else a.new_zeros((), dtype=torch.float64)


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal shapes and entries (NaN equal to NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return bool(torch.equal(a, b))


def _on_sphere(z: Tensor, radius: float) -> Tensor:
    return z * (radius / _row_norm(z).clamp_min(_TINY))


def _unit_rows(w: Tensor) -> Tensor:
    """Every row scaled to norm 1 (zero rows stay 0): a tangent of row norm 1 (or 0)."""
    r = _rows(w)
    n = r.norm(dim=-1, keepdim=True)
    return torch.where(n > 0, r / n.clamp_min(_TINY), r).reshape(w.shape)


# ---------------------------------------------------------------------------------------------- the program
class _Program:
    """The captured graph as a function of ``x`` returning the values of chosen nodes (constants fixed)."""

    def __init__(self, g: CapturedGraph, names: Sequence[str]) -> None:
        gm = g.ep.graph_module
        graph = torch.fx.Graph()
        env: Dict[torch.fx.Node, torch.fx.Node] = {}
        graph.graph_copy(gm.graph, env)
        by_name = {n.name: env[n] for n in gm.graph.nodes if n in env}
        snaps = []
        for name in names:  # each value as computed: an op further on may write into it (a view of x or a constant)
            with graph.inserting_after(by_name[name]):
                snaps.append(graph.call_function(torch.ops.aten.clone.default, (by_name[name],)))
        graph.output(tuple(snaps))
        self.gm = torch.fx.GraphModule(gm, graph)
        state, consts = g.ep.state_dict, getattr(g.ep, "constants", {}) or {}
        self.args: List[Any] = []
        self.slot = -1
        for spec in g.ep.graph_signature.input_specs:
            if spec.kind.name == "USER_INPUT":
                self.slot = len(self.args)
                self.args.append(None)
            else:
                self.args.append(state[spec.target] if spec.target in state else consts.get(spec.target))

    def __call__(self, x: Tensor) -> Tuple[Tensor, ...]:
        # copies: an op may write into an argument (batch_norm's running statistics, which a derived argument makes
        # a view of x), and the constants and x must stay as they are
        args = [a.clone() if isinstance(a, Tensor) else a for a in self.args]
        args[self.slot] = x.clone()
        return tuple(self.gm(*args))


# ---------------------------------------------------------------------------------------------- one node
@dataclass
class _Node:
    """A checked node: its name, op, abstract value, example value and what it states."""

    name: str
    op: str
    av: AValue
    example: Tensor
    floating: bool
    piecewise: bool = False
    findings: Dict[str, Finding] = field(default_factory=dict)

    @property
    def eps(self) -> float:
        """The rounding unit of the node's values."""
        t = self.example
        if t.is_complex():
            return torch.finfo(t.real.dtype).eps
        return torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0

    @property
    def bounds(self) -> Dict[str, Optional[Poly]]:
        av = self.av
        return {"growth": av.growth, "entries": av.entry_bound(), "jacobian": av.jacobian}

    def states_something(self) -> bool:
        av = self.av
        return av.const or any(b is not None for b in self.bounds.values()) or av.sign is not None or \
            av.stochastic_dim is not None


class _Check:
    """The checks of one captured sample variant (see the module docstring)."""

    def __init__(self, nodes: List[_Node], prog: _Program, effort: Effort, gen: torch.Generator, sample: str,
                 variant: str, dtype: torch.dtype) -> None:
        self.nodes, self.prog, self.e, self.gen = nodes, prog, effort, gen
        self.sample, self.variant, self.dtype = sample, variant, dtype
        eps = torch.finfo(dtype).eps
        self.rtol = max(effort.rtol, 1e3 * eps)  # a float32 op rounds at 1e-7: its bound gets that much room
        self.eps, self.h = eps, max(1e-6, 10 * math.sqrt(eps))  # the rounding unit, a difference step
        # an integer or boolean value has derivative 0 (autograd passes no gradient through it): any bound holds
        self.jac_nodes = [k for k, n in enumerate(nodes) if n.floating and n.av.jacobian is not None and not n.av.const]
        self.random: Set[int] = set()  # nodes whose values are random (dropout in training, rrelu, rand_like)
        self.grad_ok = True  # every op of the graph has a derivative (else: no ascent, difference quotients only)

    # bookkeeping ---------------------------------------------------------------------------------
    def fail(self, k: int, check: str, value: float, bound: float, radius: float, detail: str) -> None:
        node = self.nodes[k]
        ratio = math.inf if not bound > 0 or math.isnan(value) else value / bound
        old = node.findings.get(check)
        if old is None or ratio > old.ratio:
            node.findings[check] = Finding(node.op, check, ratio, value, bound, radius, node.name, node.av.rule,
                                           self.sample, self.variant, detail)

    def beaten(self, value: float, bound: float, slack: float = 0.0) -> bool:
        return math.isnan(value) or value > bound * (1 + self.rtol) + slack

    # static ----------------------------------------------------------------------------------------
    def exponents(self) -> None:
        for k, node in enumerate(self.nodes):
            q, s = node.av.exps.q, node.av.exps.sigma
            for what, poly, e in (("growth", node.av.growth, q), ("max_abs", node.av.max_abs, q),
                                  ("jacobian", node.av.jacobian, s)):
                if poly is not None and e is not None and poly.degree > e + 1e-9:
                    self.fail(k, "exponents", poly.degree, e, math.nan,
                              f"the {what} bound has degree {poly.degree:g} above the stated exponent {e:g}")

    # values at one point -------------------------------------------------------------------------
    def values(self, x: Tensor, outs: Sequence[Tensor]) -> None:
        r = float(_row_norm(x))
        slack = 1e-12 * max(1.0, r)
        for k, (node, t) in enumerate(zip(self.nodes, outs)):
            t = t.detach()
            av = node.av
            if av.const:
                if not _same(t, node.example):
                    diff = float(_max_abs((t.to(torch.float64) - node.example.to(torch.float64))
                                          if t.shape == node.example.shape else t))
                    self.fail(k, "constant", diff, 0.0, r, "a constant (read at its example value) that changes with x"
                              f" (largest change {diff:.4g})")
                continue
            n_val, m_val = float(_row_norm(t)), float(_max_abs(t))
            nan = bool(torch.isnan(t).any()) if (t.is_floating_point() or t.is_complex()) else False
            for check, poly, val in (("growth", av.growth, n_val), ("entries", av.entry_bound(), m_val)):
                if poly is None:
                    continue
                bound = float(poly(r))
                if not math.isfinite(bound):  # no bound (inf), or one computed from a NaN constant: says nothing
                    continue
                if nan:
                    self.fail(k, "finite", math.nan, bound, r, f"the op's value is NaN where the {check} bound is "
                              f"{bound:.4g}")
                elif self.beaten(val, bound, slack):
                    what = "row norm" if check == "growth" else ("largest entry" if av.max_abs is not None else
                                                                  "largest entry (against the growth bound)")
                    self.fail(k, check, val, bound, r, f"{what} of the value")
            if nan:
                continue
            self.sign(k, av.sign, t, r)
            if av.stochastic_dim is not None and t.numel():
                tt = t.to(torch.float64).reshape(t.shape or (1,))  # a 0-d value is one distribution of one entry
                err = float((tt.sum(dim=av.stochastic_dim) - 1).abs().max())
                if float(tt.min()) < 0 or err > 10 * self.eps * tt.shape[av.stochastic_dim]:
                    self.fail(k, "stochastic", err, 0.0, r, f"row-stochastic along {av.stochastic_dim} stated; "
                              f"smallest entry {float(tt.min()):.3g}, largest |sum - 1| {err:.3g}")

    def sign(self, k: int, sign: Optional[str], t: Tensor, r: float) -> None:
        if sign is None or not t.numel() or t.is_complex():
            return
        tt = t.to(torch.float64)
        lo, hi = float(tt.min()), float(tt.max())
        bad = {"+": lo < 0, "-": hi > 0, "0": lo != 0 or hi != 0}.get(sign, False)
        if bad:
            self.fail(k, "sign", max(abs(lo), abs(hi)), 0.0, r,
                      f"sign '{sign}' stated; entries in [{lo:.4g}, {hi:.4g}]")

    def evaluate(self, x: Tensor) -> Tuple[Tensor, ...]:
        with torch.no_grad():
            outs = self.prog(x)
        self.values(x, outs)
        return outs

    # the Jacobian ----------------------------------------------------------------------------------
    def jacobian(self, x: Tensor) -> None:
        """Lower estimates of each node's Jacobian operator norm at ``x`` against its bound.

        For an output row ``i`` and a unit vector ``u`` the vector-Jacobian product ``g = J^T (u at row i)`` scores
        ``sum_j ||g_j||`` (the rows ``j`` of ``x``): the tangent ``v = g_j / ||g_j||`` row by row (row norm 1)
        attains it, ``<u, (J v)_i> = sum_j ||g_j||``, so it never exceeds the operator norm.  The next ``u`` is the
        largest row of ``J v``: for a continuous value a difference quotient, itself scored against the bound at the
        largest radius it touches; for a piecewise value autograd's Jacobian-vector product (:meth:`exact_jvp`), scored
        at ``x`` (a quotient across a jump would measure the jump).  Without derivatives (an op with none, a random op)
        only the quotients along random tangents are scored (and none for random values, whose two evaluations draw
        anew, nor for piecewise ones).
        """
        if not self.jac_nodes:
            return
        r = float(_row_norm(x))
        xg = x.detach().clone().requires_grad_(self.grad_ok)
        with torch.enable_grad():
            outs = self.prog(xg)
        for k in self.jac_nodes:
            node, out = self.nodes[k], outs[k]
            if out.numel() == 0:
                continue
            bound = float(node.av.jacobian(r))
            rows = _rows(_real(out.detach()))
            i = int(rows.norm(dim=-1).nan_to_num(0.0).argmax())
            u = rows[i].clone() if bool(rows[i].any()) else torch.ones(rows.shape[1], dtype=torch.float64)
            if node.piecewise and k not in self.random:  # a branch's derivative may be largest at any row: start from
                # autograd's J v along a random tangent (scored), at its largest row
                v0 = _unit_rows(torch.randn(x.shape, generator=self.gen, dtype=torch.float64).to(x.dtype))
                jv0 = self.exact_jvp(x, v0, k)
                if jv0 is not None:
                    self.score_jvp(k, jv0, v0, r, "a random tangent")
                    rows0 = _rows(_real(jv0))
                    i0 = int(rows0.norm(dim=-1).nan_to_num(0.0).argmax())
                    if bool(torch.isfinite(rows0[i0]).all()) and bool(rows0[i0].any()):
                        i, u = i0, rows0[i0].clone()
            for _ in range(max(self.e.power_iters, 1)):
                g = self.vjp(out, xg, rows.shape, i, u) if out.requires_grad else None
                if g is not None:
                    score = float(_rows(g.to(torch.float64)).norm(dim=-1).sum())
                    if self.beaten(score, bound, 1e-12):
                        self.fail(k, "jacobian", score, bound, r, "a vector-Jacobian product (exact)")
                    v = _unit_rows(g.detach().to(x.dtype))
                else:
                    v = _unit_rows(torch.randn(x.shape, generator=self.gen, dtype=torch.float64).to(x.dtype))
                if node.piecewise:  # autograd's J v at x, never a quotient across a jump
                    jv = None if k in self.random else self.exact_jvp(x, v, k)
                    if jv is None:
                        break
                    self.score_jvp(k, jv, v, r, "a vector-Jacobian product's tangent")
                    jv = _real(jv)
                    jr = _rows(jv)
                    i = int(jr.norm(dim=-1).nan_to_num(0.0).argmax())
                    u = jr[i].clone()
                    if not bool(torch.isfinite(u).all()) or not bool(u.any()):
                        break
                    continue
                jv, rad, slack = self.difference(x, v, k)
                if jv is None:
                    break
                if k not in self.random:
                    quot, b2 = float(_row_norm(jv)), float(node.av.jacobian(rad))
                    if self.beaten(quot, b2, slack):
                        self.fail(k, "jacobian", quot, b2, rad, "a difference quotient (mean value inequality)")
                jr = _rows(_real(jv))
                i = int(jr.norm(dim=-1).nan_to_num(0.0).argmax())
                u = jr[i].clone()
                if not bool(torch.isfinite(u).all()) or not bool(u.any()):
                    break

    def vjp(self, out: Tensor, xg: Tensor, shape: Tuple[int, ...], i: int, u: Tensor) -> Optional[Tensor]:
        """``J^T`` of the cotangent ``u`` at row ``i`` (``None`` when the graph has no derivative)."""
        cot = torch.zeros(shape, dtype=torch.float64)
        cot[i] = u / u.norm().clamp_min(_TINY)
        real = _real(out)
        try:
            with torch.enable_grad():
                g = torch.autograd.grad(real, xg, cot.reshape(real.shape).to(real.dtype), retain_graph=True,
                                        allow_unused=True)[0]
        except RuntimeError:  # an op without a derivative (aten.copy): difference quotients only
            self.grad_ok = False
            return None
        return g

    def exact_jvp(self, x: Tensor, v: Tensor, k: int) -> Optional[Tensor]:
        """Autograd's ``J v`` of node ``k`` at ``x``: the transpose of a double backward (``J v = d/du <J^T u, v>``, the
        vector-Jacobian products the backward computes), else forward mode checked against them (a custom op without
        a forward-mode derivative gives zeros silently); ``None`` when neither holds (an op without a derivative)."""
        if not self.grad_ok:
            return None
        try:
            with torch.enable_grad():
                xg = x.detach().clone().requires_grad_(True)
                out = _real(self.prog(xg)[k])
                u = torch.zeros_like(out, requires_grad=True)
                g = torch.autograd.grad(out, xg, u, create_graph=True, allow_unused=True)[0]
                if g is None or not g.requires_grad:  # no path from x: the derivative is 0
                    return torch.zeros_like(out).detach()
                jv = torch.autograd.grad(g, u, v.to(g.dtype), allow_unused=True)[0]
            return torch.zeros_like(out).detach() if jv is None else jv.detach()
        except Exception:  # a backward that is not differentiable: forward mode, if it agrees with the backward
            pass
        try:
            jv = _real(torch.func.jvp(lambda z: self.prog(z)[k], (x.detach(),), (v.detach(),))[1].detach())
            u = torch.randn(jv.shape, generator=self.gen, dtype=torch.float64).to(jv.dtype)
            xg = x.detach().clone().requires_grad_(True)
            with torch.enable_grad():
                gu = torch.autograd.grad(_real(self.prog(xg)[k]), xg, u, allow_unused=True)[0]
            lhs = float((u * jv).sum())
            rhs = 0.0 if gu is None else float((gu.to(torch.float64) * v.to(torch.float64)).sum())
            scale = float(u.norm() * jv.norm()) + (0.0 if gu is None else float(gu.norm() * v.norm()))
            return jv if abs(lhs - rhs) <= 1e-6 * scale + 1e-300 else None
        except Exception:  # no derivative at all
            return None

    def difference(self, x: Tensor, v: Tensor, k: int) -> Tuple[Optional[Tensor], float, float]:
        """``(f(x + h v) - f(x - h v)) / 2h`` of node ``k`` (per unit of ``N(v)``), the largest row norm of
        ``x +- h v`` and a rounding allowance (``None`` when ``v`` is 0)."""
        nv = float(_row_norm(v))
        if not nv > 0:
            return None, 0.0, 0.0
        eps = max(self.eps, self.nodes[k].eps)  # a value rounded to float32 needs a longer step
        h = max(1e-6, 10 * math.sqrt(eps)) * max(float(_row_norm(x)), 1e-3) / nv
        with torch.no_grad():
            hi, lo = self.prog(x + h * v)[k], self.prog(x - h * v)[k]
        rad = max(float(_row_norm(x + h * v)), float(_row_norm(x - h * v)))
        slack = 1e3 * eps * (float(_row_norm(hi)) + float(_row_norm(lo))) / (2 * h * nv)
        return (_real(hi) - _real(lo)) / (2 * h * nv), rad, slack

    # the search --------------------------------------------------------------------------------------
    def run(self, x0: Tensor) -> None:
        self.exponents()
        with torch.no_grad():
            runs = [self.prog(x0) for _ in range(3)]
        self.random = {k for k, node in enumerate(self.nodes)
                       if any(r in node.op for r in _RANDOM_OPS) or not all(_same(runs[0][k], o[k]) for o in runs[1:])}
        try:
            xg = x0.detach().clone().requires_grad_(True)
            with torch.enable_grad():
                outs = [_real(t) for t in self.prog(xg) if t.is_floating_point() or t.is_complex()]
                if outs:
                    torch.autograd.grad(sum(t.sum() for t in outs), xg, allow_unused=True)
        except RuntimeError:  # an op without a derivative
            self.grad_ok = False
        r0 = float(_row_norm(x0)) or 1.0
        base = x0 if bool(x0.any()) else torch.ones_like(x0)
        for i, f in enumerate(self.e.radii):
            radius = r0 * f
            start = _on_sphere(base, radius)
            best, top = start, self.score(self.evaluate(start), radius)
            self.jacobian(start)
            for j in range(self.e.draws):
                p = _on_sphere(_family(x0.shape, j, self.gen).to(x0.dtype), radius)
                s = self.score(self.evaluate(p), radius)
                if s > top:
                    best, top = p, s
            if i < self.e.ascents and self.e.steps and self.grad_ok:
                self.ascend(([start] + ([best] if best is not start else []))[:max(self.e.starts, 1)], radius)

    def score(self, outs: Sequence[Tensor], radius: float) -> float:
        """How close a point's values come to their bounds (the sum of the ratios; ranks the random draws)."""
        total = 0.0
        for node, t in zip(self.nodes, outs):
            for poly, val in ((node.av.growth, _row_norm), (node.av.entry_bound(), _max_abs)):
                if poly is not None and not node.av.const:
                    v = float(val(t))
                    total += v / max(float(poly(radius)), _TINY) if math.isfinite(v) else 0.0
        return total

    def ascend(self, starts: List[Tensor], radius: float) -> None:
        """Adam from each start on the sum over nodes of value / bound (row norm, largest entry, and along a learned
        tangent a difference quotient, or for a piecewise value autograd's Jacobian-vector product), the state on the
        sphere of ``radius``; every visited point is checked, the end points' Jacobians scored."""
        pol = [(k, n) for k, n in enumerate(self.nodes) if n.floating and not n.av.const]
        if not pol:
            return
        bounds = {k: {c: p(radius) if p is not None else None for c, p in n.bounds.items()} for k, n in pol}
        wants = [k for k, n in pol if bounds[k]["jacobian"] is not None and k not in self.random]
        need_j = any(not self.nodes[k].piecewise for k in wants)
        need_exact = any(self.nodes[k].piecewise for k in wants)
        h = 1e2 * self.h * max(radius, 1e-3)
        for x0 in starts:
            z = _on_sphere(x0, math.sqrt(max(x0.shape[-1] if x0.dim() else 1, 1))).detach().requires_grad_(True)
            w = torch.randn(x0.shape, generator=self.gen, dtype=torch.float64).to(x0.dtype).requires_grad_(True)
            opt = torch.optim.Adam([z, w], lr=self.e.lr)
            for step in range(self.e.steps + 1):
                with torch.enable_grad():
                    x = _on_sphere(z, radius)
                    outs = self.prog(x)
                    self.values(x.detach(), outs)
                    if step == self.e.steps:
                        break
                    v = _unit_rows(w)
                    hi = self.prog(x + h * v) if need_j else None
                    lo = self.prog(x - h * v) if need_j else None
                    tangents = self.tangents(x, v) if need_exact else None
                    for k in [k for k in wants if self.nodes[k].piecewise] if tangents is not None else []:
                        self.score_jvp(k, tangents[k], v, radius, "the ascent's tangent")
                    obj = x.new_zeros((), dtype=torch.float64)
                    for k, _ in pol:
                        t, b = outs[k], bounds[k]
                        if not t.requires_grad:
                            continue
                        if b["growth"] is not None:
                            obj = obj + _row_norm(t) / max(b["growth"], _TINY)
                        if b["entries"] is not None:
                            obj = obj + _max_abs(t) / max(b["entries"], _TINY)
                        if b["jacobian"] is None or k in self.random:
                            continue
                        if self.nodes[k].piecewise:
                            if tangents is not None:
                                obj = obj + _row_norm(tangents[k]) / max(b["jacobian"], _TINY)
                        elif hi is not None:
                            obj = obj + _row_norm((_real(hi[k]) - _real(lo[k])) / (2 * h)) / max(b["jacobian"], _TINY)
                    if not obj.requires_grad or not torch.isfinite(obj):
                        break
                    gz, gw = torch.autograd.grad(-obj, [z, w], allow_unused=True)
                z.grad = None if gz is None else torch.nan_to_num(gz, nan=0.0, posinf=0.0, neginf=0.0)
                w.grad = None if gw is None else torch.nan_to_num(gw, nan=0.0, posinf=0.0, neginf=0.0)
                opt.step()
            self.jacobian(_on_sphere(z.detach(), radius))

    def score_jvp(self, k: int, jv: Tensor, v: Tensor, radius: float, along: str) -> None:
        """Score autograd's ``J v`` of node ``k`` at a point of row norm ``radius``: exact, ``N(J v) <= jacobian(R)
        N(v)``."""
        nv = float(_row_norm(v))
        if not nv > 0:
            return
        bound = float(self.nodes[k].av.jacobian(radius))
        val = float(_row_norm(jv)) / nv
        if self.beaten(val, bound, 1e-12):
            self.fail(k, "jacobian", val, bound, radius, f"a Jacobian-vector product (exact, autograd's) along {along}")

    def tangents(self, x: Tensor, v: Tensor) -> Optional[Tuple[Tensor, ...]]:
        """Autograd's ``J v`` of every node at ``x`` by forward mode, differentiable in ``x`` and ``v`` (the ascent's
        objective for piecewise values); ``None`` when an op has no forward-mode derivative (the ascent then steers
        by the other terms, and :meth:`jacobian` scores the end points exactly)."""
        try:
            return tuple(_real(t) for t in torch.func.jvp(self.prog, (x,), (v,))[1])
        except Exception:
            return None


#: Ops whose values are random (two runs at the same input differ): no difference quotient across two runs.
_RANDOM_OPS = ("dropout", "rrelu", "rand", "bernoulli", "normal", "multinomial")
_FAMILIES = ("gaussian", "axis", "dominant_row", "equal_rows", "constant_features", "nonnegative", "nonpositive")


def _family(shape: Sequence[int], j: int, gen: torch.Generator) -> Tensor:
    """Draw ``j`` of the structured direction families (cycled): Gaussian; one-hot rows; one row dominant (the others
    1e-3 smaller); every row equal; near-constant features ``1 + 1e-3 g``; entries of one sign."""
    fam = _FAMILIES[j % len(_FAMILIES)]
    shape = tuple(shape)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    if not g.numel():
        return g
    rows = _rows(g).clone()
    if fam == "dominant_row":
        keep = (j // len(_FAMILIES)) % rows.shape[0]
        rows[torch.arange(rows.shape[0]) != keep] *= 1e-3
    elif fam == "equal_rows":
        rows[:] = rows[:1]
    elif fam == "constant_features":
        rows = 1.0 + 1e-3 * rows
    elif fam == "nonnegative":
        rows = rows.abs()
    elif fam == "nonpositive":
        rows = -rows.abs()
    elif fam == "axis":
        col = (j // len(_FAMILIES)) % rows.shape[1]
        mag = rows[:, 0].abs() + 1e-3
        rows = torch.zeros_like(rows)
        rows[:, col] = mag
    return rows.reshape(shape)

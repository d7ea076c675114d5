"""Conformance of the tracer's rules with the ops they model: every rule checked against the op itself.

For one call ``op(*args, **kwargs)`` (a :class:`Sample`) the first floating tensor argument becomes the input
``x`` of a velocity and the other tensors stay constants (and, in further *variants*, become the velocity input
itself or a fixed linear image of it).  The call is wrapped in a tiny module, captured with
:func:`certblocks.trace.capture` and interpreted by the tracer from ``x`` to every output, so each rule sees
exactly the graph ``torch.export`` records.  Every node of that graph then makes promises about the tensor
``t(x)`` it computes, for every ``x`` with ``N(x) <= R`` (``N`` the row norm of docs/theory.md section 1: the
largest Euclidean norm along the last dimension; the checks compare at ``R = N(x)``, the strictest radius since
every bound is nondecreasing):

==============  ==============================================================================================
check           the promise
==============  ==============================================================================================
``growth``      ``N(t(x)) <= growth(R)``
``entries``     ``max |t(x)| <= max_abs(R)`` (``growth(R)`` when no entry bound is derived): the node's
                contribution to the velocity's peak
``jacobian``    ``N(J(x) v) <= jacobian(R) N(v)`` for every tangent ``v`` (operator norm induced by the row
                norms), ``J(x)`` the derivative autograd computes at ``x`` (docs/theory.md section 1.1: at a switch,
                the derivative of the branch it takes; an integer or boolean value has derivative 0)
``sign``        every entry ``>= 0`` (``"+"``), ``<= 0`` (``"-"``), ``= 0`` (``"0"``)
``stochastic``  entries ``>= 0`` summing to 1 along ``stochastic_dim``
``constant``    a constant value is the same for every ``x`` (a rule that reads a value computed from ``x``, such
                as the indices of a maximum, at its example value breaks this)
``finite``      an op value that is NaN where the rule states a finite bound
``exponents``   a stated ``q`` (``sigma``) is at least the degree of the growth (Jacobian) polynomial, so that
                the bound is ``c R^q + b`` (``l1 max(R, 1)^sigma + l0``) as the certificate writes it
==============  ==============================================================================================

The values are searched, in float64, at the sample, at the sample rescaled to a few radii, at random draws of
structured direction families on the same spheres, and at the end points of gradient ascents (Adam, the state
projected on the sphere) that maximize every node's row norm, largest entry and a Jacobian-vector product norm
relative to their bounds; the Jacobian's operator norm is estimated from below at those points by an alternating
maximization whose scores are exact vector-Jacobian products (a tangent that attains each score exists).  For a
continuous value, difference quotients are scored too, against the bound at the largest radius they touch (the mean
value inequality).  A *piecewise* value (the interpreter's
:attr:`~certblocks.trace.interp.VelocityInterpreter.piecewise`: computed through an index, a mask, a boolean or a
rounding of the input, which jump) gets no difference quotient at all, since one across a jump measures the jump and
not a derivative: its Jacobian-vector products are autograd's (forward mode, else the transpose of a double
backward) and are scored exactly, like the vector-Jacobian products.  Constants keep their values (every evaluation
runs on copies: an op may write into its arguments), and each node's value is taken as the node computes it.  A check
fails when ANY tested value exceeds its bound by more than a relative ``rtol`` (and a rounding allowance); a node with
no bound at all is *refused* (sound by definition) and counted apart from the checked ones, unless an input's bound is
itself not derived (then the sample is skipped for it, with the reason); a node whose input's bound is beaten is not
judged (the finding is its input's).  Random values (dropout in training) are checked at every draw, and get no
difference quotient across two draws; a graph with an op that has no derivative gets difference quotients only (none
for its piecewise values).  Rules that raise are listed (the tracer marks their nodes unknown).  NaN and inf in a
sample's ``x`` are set to 0 and +-1 (they are outside every certificate's domain).

Each node is counted under the op whose rule produced it (``torch.export`` may record another op than the one
called: the sample is attributed to the rules that actually ran); a multi-output op's values (its ``getitem``
nodes) count under it.  :func:`check_rule` runs a user's samples::

    from certblocks.testing.conformance import Sample, check_rule

    report = check_rule("mylib.op", [Sample((torch.randn(4, 8), torch.randn(8)), {"scale": 2.0})])
    assert report.ok, report.table()

:func:`run_conformance` sweeps every registered rule with PyTorch's own OpInfo samples
(``torch.testing._internal.common_methods_invocations.op_db``) and the hand-written ones of
:mod:`certblocks.testing.conformance_samples`; ``python -m certblocks.testing.conformance`` prints the coverage
table (``--ops aten.add,aten.mul``, ``--json PATH``, ``--effort fast``, ``--per-opinfo N``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import math
import random
import sys
import time
import types
import unittest
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from ..bounds.poly import Poly
from ..trace.capture import CapturedGraph, CaptureError, capture
from ..trace.interp import VelocityInterpreter
from ..trace.nodes import op_name
from ..trace.rules import registered_rules
from ..trace.values import AValue

__all__ = ["CHECKS", "FAST", "FULL", "ConformanceReport", "Effort", "Finding", "OpRow", "Sample", "check_rule",
           "check_samples", "hand_samples", "main", "opinfo_samples", "run_conformance", "run_fast", "without_opinfo"]

#: The promises checked at every node (the module docstring says what each means).
CHECKS: Tuple[str, ...] = ("growth", "entries", "jacobian", "sign", "stochastic", "constant", "finite", "exponents")
#: Ops whose values are unspecified (uninitialized memory): only their shapes mean something.
_UNSPECIFIED = frozenset({"aten.empty_like", "aten.new_empty", "aten.empty", "aten.empty_strided"})
_TINY = 1e-300
#: Re-raise errors of the search itself instead of counting them as skips (set by debugging sessions).
_RAISE = False


@dataclass(frozen=True)
class Sample:
    """One call of an op: ``fn(*args, **kwargs)``.

    Attributes:
        args: positional arguments (tensors, numbers, lists of them).
        kwargs: keyword arguments.
        fn: the callable (default: the op by name, ``torch.ops.<namespace>.<name>``).
        label: a short description for reports (default: the call with the arguments' shapes).
        dtype: the floating dtype the call runs in (float64 unless the op needs another; the checks compute in
            float64 and allow the rounding of this dtype).
    """

    args: Tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    fn: Optional[Callable[..., Any]] = None
    label: str = ""
    dtype: torch.dtype = torch.float64


@dataclass(frozen=True)
class Effort:
    """How hard each sample is searched.

    Attributes:
        radii: the radii searched, as multiples of the sample's row norm (1 is the sample's own).
        draws: random draws per radius, cycling through structured direction families.
        ascents: gradient ascents run at the first ``ascents`` radii.
        starts: starting points of each ascent: the sample rescaled, then the best random draw.
        steps: Adam steps per ascent.
        power_iters: iterations of the Jacobian's alternating maximization at each scored point.
        variants: how many calls per sample: the first with only ``x`` as input, the next ones with another floating
            tensor argument made an input too (the velocity input itself when the shapes agree, then a fixed linear
            image of it; two such arguments at most).
        lr: Adam's learning rate (the ascent moves a direction whose entries are of order 1).
        rtol: a value above ``bound * (1 + rtol)`` (plus a rounding allowance) is a failure.
    """

    radii: Tuple[float, ...] = (1.0, 100.0, 0.01)
    draws: int = 6
    ascents: int = 2
    starts: int = 2
    steps: int = 8
    power_iters: int = 3
    variants: int = 5
    lr: float = 0.1
    rtol: float = 1e-6

    def __post_init__(self) -> None:
        if not self.radii or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf
                                 for r in self.radii):
            raise ValueError(f"radii must be finite numbers > 0 (multiples of the sample's norm), got {self.radii!r}")
        for name in ("draws", "ascents", "starts", "steps", "power_iters", "variants"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("lr", "rtol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


#: The whole sweep's search.
FULL = Effort()
#: The fast subset's search (the default test run).
FAST = Effort(draws=3, ascents=1, starts=1, steps=4, power_iters=2, variants=2)


@dataclass
class Finding:
    """A promise of a node that an input beats.

    Attributes:
        op: the op whose rule produced the node's value.
        check: which promise (:data:`CHECKS`).
        ratio: value over bound (``inf`` for a bound of 0 or a NaN).
        value: the op's value (a row norm, an entry, a Jacobian norm estimate, ...).
        bound: the rule's bound at ``radius``.
        radius: the row norm of the input.
        node: the graph node.
        rule: the rule's description of the value.
        sample: the call.
        variant: which arguments were inputs (``const``: only ``x``; ``tied(k)``: argument ``k`` is ``x``;
            ``linear(k)``: argument ``k`` is a linear image of ``x``).
        detail: what was compared, in words.
    """

    op: str
    check: str
    ratio: float
    value: float
    bound: float
    radius: float
    node: str
    rule: str
    sample: str
    variant: str
    detail: str = ""

    def __str__(self) -> str:
        return (f"{self.op} [{self.check}] x{self.ratio:.4g} at R={self.radius:.4g}: {self.value:.6g} > "
                f"{self.bound:.6g} ({self.detail}); node {self.node}, rule '{self.rule}'; "
                f"{self.sample} [{self.variant}]")


@dataclass
class OpRow:
    """The coverage of one rule: node-samples checked, refused, failed, and skipped samples by reason."""

    op: str
    checked: int = 0
    refused: int = 0
    failed: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)
    sources: Set[str] = field(default_factory=set)

    @property
    def reached(self) -> int:
        """Node-samples in which the rule ran (checked, refused or failed)."""
        return self.checked + self.refused + self.failed

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


@dataclass
class ConformanceReport:
    """The outcome of a conformance run.

    Attributes:
        rows: op name -> :class:`OpRow` (every op whose rule ran, and every op asked for).
        findings: every beaten promise.
        crashes: rules that raised: ``"op: message"`` -> the first sample it raised on (the tracer marks those nodes
            unknown, which counts as refused).
        unruled: ops met in the graphs with no registered rule -> count.
        samples: sample variants run.
        seconds: wall time.
    """

    rows: Dict[str, OpRow] = field(default_factory=dict)
    findings: List[Finding] = field(default_factory=list)
    crashes: Dict[str, str] = field(default_factory=dict)
    unruled: Dict[str, int] = field(default_factory=dict)
    samples: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No promise was beaten."""
        return not self.findings

    def row(self, op: str) -> OpRow:
        if op not in self.rows:
            self.rows[op] = OpRow(op)
        return self.rows[op]

    def merge(self, other: ConformanceReport) -> ConformanceReport:
        """Add ``other``'s counts and findings to this report (returned)."""
        for op, r in other.rows.items():
            mine = self.row(op)
            mine.checked += r.checked
            mine.refused += r.refused
            mine.failed += r.failed
            mine.sources |= r.sources
            for why, k in r.skipped.items():
                mine.skipped[why] = mine.skipped.get(why, 0) + k
        self.findings += other.findings
        for msg, where in other.crashes.items():
            self.crashes.setdefault(msg, where)
        for op, k in other.unruled.items():
            self.unruled[op] = self.unruled.get(op, 0) + k
        self.samples += other.samples
        self.seconds += other.seconds
        return self

    def failures_by_op(self) -> Dict[str, List[Finding]]:
        out: Dict[str, List[Finding]] = {}
        for f in self.findings:
            out.setdefault(f.op, []).append(f)
        return out

    def table(self, ops: Optional[Iterable[str]] = None) -> str:
        """The coverage table: one line per op (``ops``: these, in this order; default: every row, sorted)."""
        names = list(ops) if ops is not None else sorted(self.rows)
        lines = [f"{'op':46s} {'src':11s} {'checked':>8s} {'refused':>8s} {'failed':>7s}  skipped (reason: count)"]
        tot = [0, 0, 0]
        for op in names:
            r = self.rows.get(op, OpRow(op))
            tot = [tot[0] + r.checked, tot[1] + r.refused, tot[2] + r.failed]
            src = "+".join(sorted(r.sources)) or "-"
            skip = "; ".join(f"{k}: {v}" for k, v in sorted(r.skipped.items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"{op:46s} {src:11s} {r.checked:8d} {r.refused:8d} {r.failed:7d}  {skip}")
        lines.append(f"{'total (' + str(len(names)) + ' ops, ' + str(self.samples) + ' sample variants)':58s} "
                     f"{tot[0]:8d} {tot[1]:8d} {tot[2]:7d}  {self.seconds:.1f} s")
        if self.findings:
            lines.append(f"\n{len(self.findings)} findings:")
            lines += [f"  {f}" for f in self.findings]
        if self.crashes:
            lines.append(f"\n{len(self.crashes)} rules raised:")
            lines += [f"  {c} (first on {w})" for c, w in self.crashes.items()]
        return "\n".join(lines)

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "rows": {op: {"checked": r.checked, "refused": r.refused, "failed": r.failed, "skipped": r.skipped,
                          "sources": sorted(r.sources)} for op, r in sorted(self.rows.items())},
            "findings": [dict(vars(f)) for f in self.findings],
            "crashes": self.crashes, "unruled": self.unruled, "samples": self.samples, "seconds": self.seconds,
        }


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


# ---------------------------------------------------------------------------------------------- the call
def _leaf_float(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def _cast(t: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``dtype``, complex ones in its complex dtype, detached copies; anything else as it is."""
    if not isinstance(t, Tensor):
        return t
    t = t.detach()
    if t.is_floating_point():
        t = t.to(dtype)
    elif t.is_complex():
        t = t.to(torch.complex128 if dtype == torch.float64 else torch.complex64)
    return t.clone()


def _linear_image(x: Tensor, shape: Sequence[int]) -> Tensor:
    """A fixed linear image of ``x`` with ``shape``: ``x`` flipped along its last dimension when the shapes agree
    (the same row norms), else ``x``'s entries in order, repeated as needed, reshaped."""
    if tuple(shape) == tuple(x.shape):
        return x.flip(-1) if x.dim() else -x
    n = math.prod(shape)
    flat = x.reshape(-1)
    if n > flat.numel():
        flat = flat.repeat(-(-n // flat.numel()))
    return flat[:n].reshape(tuple(shape))


class _Call(nn.Module):
    """``x -> fn(*args, **kwargs)`` with ``x`` at leaf ``xi`` of the flattened arguments, derived tensors at the
    leaves of ``derived`` (``"tied"``: ``x`` itself; ``"linear"``: :func:`_linear_image`) and the other tensors as
    buffers (constants of the graph)."""

    def __init__(self, fn: Callable[..., Any], leaves: List[Any], spec: Any, xi: int, derived: Dict[int, str]) -> None:
        super().__init__()
        self.fn, self.spec, self.xi, self.derived = fn, spec, xi, dict(derived)
        self.plain: Dict[int, Any] = {}
        self.shapes = {i: tuple(leaves[i].shape) for i in derived}
        self.count = len(leaves)
        for i, leaf in enumerate(leaves):
            if i == xi or i in derived:
                continue
            if isinstance(leaf, Tensor):
                self.register_buffer(f"c{i}", leaf)
            else:
                self.plain[i] = leaf

    def leaf(self, i: int, x: Tensor) -> Any:
        if i == self.xi:
            return x
        if i in self.derived:
            return x if self.derived[i] == "tied" else _linear_image(x, self.shapes[i])
        return self.plain[i] if i in self.plain else getattr(self, f"c{i}")

    def forward(self, x: Tensor) -> Any:
        args, kwargs = torch.utils._pytree.tree_unflatten([self.leaf(i, x) for i in range(self.count)], self.spec)
        return self.fn(*args, **kwargs)


def _tensor_tag(t: Tensor) -> str:
    dt = {torch.float64: "", torch.float32: "", torch.bool: ":bool", torch.complex128: ":c"}.get(t.dtype, f":{t.dtype}")
    return f"[{','.join(str(s) for s in t.shape)}]{dt.replace('torch.', '')}"


def _describe(name: str, leaves: List[Any], spec: Any, xi: int, derived: Dict[int, str]) -> str:
    """``name(x[5,5], c[5], alpha=2)``: the call with tensors by role and shape."""
    tags: List[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            role = "x" if i == xi else {"tied": "x", "linear": "L(x)"}.get(derived.get(i, ""), "c")
            tags.append(_Tag(role + _tensor_tag(leaf)))
        else:
            tags.append(leaf)
    args, kwargs = torch.utils._pytree.tree_unflatten(tags, spec)
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


class _Tag(str):
    def __repr__(self) -> str:
        return str(self)


def _variants(leaves: List[Any], xi: int, count: int) -> List[Tuple[str, Dict[int, str]]]:
    """The first ``count`` of: ``const``, then for each other real floating tensor leaf (two at most) ``tied(k)``
    when its shape is ``x``'s, and ``linear(k)``."""
    out: List[Tuple[str, Dict[int, str]]] = [("const", {})]
    if leaves[xi].numel() == 0:
        return out
    others = [i for i, leaf in enumerate(leaves) if i != xi and _leaf_float(leaf) and leaf.numel()][:2]
    for i in others:
        if tuple(leaves[i].shape) == tuple(leaves[xi].shape):
            out.append((f"tied({i})", {i: "tied"}))
        out.append((f"linear({i})", {i: "linear"}))
    return out[:max(count, 1)]


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


# ---------------------------------------------------------------------------------------------- one sample
def _node_op(n: torch.fx.Node) -> str:
    """The op whose rule gives a node its value: a ``getitem``'s source op."""
    if n.op == "call_function" and op_name(n.target) == "getitem" and isinstance(n.args[0], torch.fx.Node):
        return _node_op(n.args[0])
    return op_name(n.target) if n.op == "call_function" else n.op


def _interpret(g: CapturedGraph, x: torch.fx.Node) -> Tuple[Dict[str, Any], List[torch.fx.Node], Set[str]]:
    """Every output's velocity from ``x``: the abstract values by node name, the nodes in graph order and the names of
    the piecewise values (:attr:`~certblocks.trace.interp.VelocityInterpreter.piecewise`)."""
    values: Dict[str, Any] = {}
    piecewise: Set[str] = set()
    dep = g.depends_on_input()
    for out in g.outputs:
        if out.name not in dep or out is x:
            continue
        it = VelocityInterpreter(g, x, out)
        it.run()
        for name, v in it.values.items():
            values.setdefault(name, v)
        piecewise |= set(it.piecewise)
    return values, [n for n in g.nodes if n.name in values and n is not x], piecewise


def _derived(v: Any) -> bool:
    """A value whose bound is derived: a constant, or a value with a row-norm bound."""
    if isinstance(v, AValue):
        return v.const or v.growth is not None
    if isinstance(v, (list, tuple)):
        return all(_derived(e) for e in v if isinstance(e, AValue))
    return True  # a number, or a constant node not yet read


def _op_inputs(n: torch.fx.Node) -> List[torch.fx.Node]:
    """The inputs of the op that gives ``n`` its value (a ``getitem``'s: its source op's)."""
    if n.op == "call_function" and op_name(n.target) == "getitem" and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return list(n.all_input_nodes)


def _inputs_known(n: torch.fx.Node, values: Mapping[str, Any]) -> bool:
    """Whether every input of the node's op has a derived bound: a node without a bound is then the rule's
    refusal, not an unknown inherited from upstream."""
    return all(_derived(values.get(a.name)) for a in _op_inputs(n))


def _seed_all(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators (OpInfo sample functions draw from all three)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a torch dependency in practice
        pass


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run with the global generators seeded, and give the caller back their states."""
    state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover
        np, np_state = None, None
    with torch.random.fork_rng(devices=[]):
        _seed_all(seed)
        try:
            yield
        finally:
            random.setstate(state)
            if np is not None:
                np.random.set_state(np_state)


def _fn_for(op: str) -> Callable[..., Any]:
    ns, _, name = op.partition(".")
    try:
        return getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError) as exc:
        raise ValueError(f"op {op!r} names no torch.ops operator ({exc}); give the Sample a fn") from exc


def check_samples(samples: Iterable[Tuple[Sample, Sequence[str], str]], *, effort: Effort = FULL, seed: int = 0,
                  report: Optional[ConformanceReport] = None) -> ConformanceReport:
    """Check samples against the rules that run on them.

    Args:
        samples: ``(sample, intended ops, source)`` triples: the ops the sample means to reach (a sample that
            reaches none of them is counted as skipped under the first, with the ops it reached) and the name of
            its source (``"opinfo"``, ``"hand"``, ...) for the coverage table.
        effort: the search (:data:`FULL`, :data:`FAST` or an :class:`Effort`).
        seed: the seed of every random draw (each sample's generator also depends on its label).
        report: a report to add to (default: a new one).

    Returns:
        The :class:`ConformanceReport`.
    """
    if not isinstance(effort, Effort):
        raise TypeError(f"effort must be an Effort (FULL, FAST or your own), got {type(effort).__name__}")
    rep = report if report is not None else ConformanceReport()
    rules = registered_rules()
    t0 = time.perf_counter()
    with warnings.catch_warnings(), _seeded(seed):  # random ops draw from a seeded stream; the caller's is restored
        warnings.simplefilter("ignore")
        for sample, intended, source in samples:
            _check_one(sample, list(intended), source, effort, seed, rep, rules)
    rep.seconds += time.perf_counter() - t0
    return rep


def _check_one(sample: Sample, intended: List[str], source: str, effort: Effort, seed: int,
               rep: ConformanceReport, rules: Mapping[str, Any]) -> None:
    if not isinstance(sample, Sample):
        raise TypeError(f"samples must be Sample objects, got {type(sample).__name__}")
    first = intended[0] if intended else "?"
    fn = sample.fn if sample.fn is not None else _fn_for(first)
    leaves, spec = torch.utils._pytree.tree_flatten((tuple(sample.args), dict(sample.kwargs)))
    if any(isinstance(leaf, Tensor) and leaf.layout != torch.strided for leaf in leaves):
        rep.row(first).skip("a sparse tensor argument")
        return
    if not isinstance(sample.dtype, torch.dtype) or not sample.dtype.is_floating_point:
        raise TypeError(f"Sample.dtype must be a floating torch.dtype, got {sample.dtype!r}")
    leaves = [_cast(leaf, sample.dtype) for leaf in leaves]
    xi = next((i for i, leaf in enumerate(leaves) if _leaf_float(leaf)), None)
    if xi is None:
        rep.row(first).skip("no floating tensor argument")
        return
    name = sample.label or first
    for variant, derived in _variants(leaves, xi, effort.variants):
        label = _describe(name, leaves, spec, xi, derived) if not sample.label or variant == "const" else \
            f"{sample.label} {_describe('', leaves, spec, xi, derived)}"
        rep.samples += 1
        _seed_all(seed + zlib.crc32(f"{label}|{variant}".encode()))  # random ops: the same draws whatever ran before
        module = _Call(fn, leaves, spec, xi, derived)
        x0 = leaves[xi].clone()
        if not bool(torch.isfinite(x0).all()):  # NaN and inf are outside every certificate's domain
            x0 = torch.nan_to_num(x0, nan=0.0, posinf=1.0, neginf=-1.0)
            label += " (x's non-finite entries set to 0, +-1)"
        try:
            with torch.no_grad():
                copy.deepcopy(module)(x0.clone())
        except Exception as exc:  # the op refuses these arguments (e.g. a derived argument of the wrong kind)
            rep.row(first).skip(f"the call raises {type(exc).__name__}" + (f" [{variant}]" if derived else ""))
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                pristine = {k: v.clone() for k, v in module.named_buffers()}
                g = capture(module, (x0.clone(),))
        except CaptureError:
            rep.row(first).skip("capture failure")
            continue
        with torch.no_grad():  # the capture's run may have written into the constants: they are restored
            for k, v in module.named_buffers():
                v.copy_(pristine[k])
        try:
            values, order, piecewise = _interpret(g, g.user_inputs[0])
        except Exception as exc:  # the tracer itself raised (a strict mode that raises on a rule's error)
            rep.crashes.setdefault(f"the tracer raised {type(exc).__name__}: {exc}", f"{label} [{variant}]")
            rep.row(first).skip("the tracer raised")
            continue
        reached = {_node_op(n) for n in order if n.op == "call_function"}
        if intended and not reached & set(intended):
            shown = ", ".join(sorted(reached)) or "nothing (the output is the input)"
            rep.row(first).skip(f"exported as {shown}")
        nodes = _checked_nodes(g, order, values, rules, rep, f"{label} [{variant}]", source, piecewise)
        if not nodes:
            continue
        gen = torch.Generator().manual_seed(seed + zlib.crc32(f"{label}|{variant}".encode()))
        try:
            check = _Check(nodes, _Program(g, [n.name for n in nodes]), effort, gen, label, variant, sample.dtype)
            check.run(x0)
        except Exception as exc:  # the search itself failed on this graph: say so, count nothing as checked
            if _RAISE:
                raise
            for node in nodes:
                rep.row(node.op).skip(f"search raised {type(exc).__name__}")
            continue
        _tally(nodes, order, rep, source)


def _checked_nodes(g: CapturedGraph, order: List[torch.fx.Node], values: Mapping[str, Any], rules: Mapping[str, Any],
                   rep: ConformanceReport, where: str, source: str,
                   piecewise: Optional[Set[str]] = None) -> List[_Node]:
    """The nodes that state something to check; counts the others (refused, skipped, unruled) and the crashes."""
    nodes: List[_Node] = []
    for n in order:
        op = _node_op(n)
        av, conc = values.get(n.name), g.env.get(n.name)
        if op not in rules:
            if n.op == "call_function" and op != "getitem":
                rep.unruled[op] = rep.unruled.get(op, 0) + 1
            continue
        if isinstance(av, AValue) and (av.rule.endswith("rule failed") or av.bad.startswith("the rule for")):
            rep.crashes.setdefault(f"{op}: {av.bad}", where)
        if isinstance(conc, (list, tuple)):  # a multi-output node counts through its getitems
            continue
        if not isinstance(av, AValue) or not isinstance(conc, Tensor):
            rep.row(op).skip("value is not a tensor")
        elif op in _UNSPECIFIED:
            rep.row(op).skip("values unspecified (uninitialized memory)")
        else:
            node = _Node(n.name, op, av, conc.detach().clone(), conc.is_floating_point() or conc.is_complex(),
                         n.name in (piecewise or ()))
            if node.states_something():
                nodes.append(node)
            elif _inputs_known(n, values):
                rep.row(op).refused += 1
                rep.row(op).sources.add(source)
            else:
                rep.row(op).skip("an input's bound is not derived")
    return nodes


def _tally(nodes: List[_Node], order: List[torch.fx.Node], rep: ConformanceReport, source: str) -> None:
    """Count each searched node as checked or failed, or skip it when an input's bound is itself beaten (the
    finding is the input's: the node was judged on a bound that does not hold)."""
    beaten: Set[str] = set()
    fx = {n.name: n for n in order}
    for node in nodes:
        row = rep.row(node.op)
        row.sources.add(source)
        if any(a.name in beaten for a in _op_inputs(fx[node.name])):
            beaten.add(node.name)
            row.skip("an input's bound is beaten")
        elif node.findings:
            beaten.add(node.name)
            row.failed += 1
            rep.findings += sorted(node.findings.values(), key=lambda f: f.check)
        else:
            row.checked += 1


def check_rule(op: str, samples: Sequence[Sample], *, effort: Effort = FULL, seed: int = 0) -> ConformanceReport:
    """Check the rule of ``op`` (and every other rule its samples reach) on ``samples``.

    Args:
        op: the op's registry key (``"aten.add"``, ``"mylib.op"``): a sample without ``fn`` calls
            ``torch.ops.<namespace>.<name>`` with its arguments.
        samples: the calls; the first floating tensor among the arguments is the velocity input.
        effort: the search (:data:`FULL` or :data:`FAST`).
        seed: the seed of the random draws.

    Returns:
        The :class:`ConformanceReport`; ``report.rows[op]`` counts the node-samples the rule ran on.

    Raises:
        ValueError: ``op`` has no registered rule.
    """
    if not isinstance(op, str) or op.replace("::", ".") not in registered_rules():
        raise ValueError(f"op must name a registered rule (certblocks.trace.rules.registered_rules()), got {op!r}")
    op = op.replace("::", ".")
    rep = ConformanceReport()
    rep.row(op)
    return check_samples(((s, [op], "hand") for s in samples), effort=effort, seed=seed, report=rep)


# ---------------------------------------------------------------------------------------------- OpInfo
@contextlib.contextmanager
def _opinfo_import() -> Iterator[None]:
    """Import PyTorch's OpInfo database.  It imports the test helper ``expecttest`` for a base class only: when that
    package is missing a stand-in module with ``TestCase`` and ``ACCEPT`` is registered.  The database freezes
    torch's global backend flags on import; they are unfrozen again when they were not frozen before."""
    frozen = torch.backends.flags_frozen()
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ModuleNotFoundError:
            stand_in = types.ModuleType("expecttest")
            stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            stand_in.ACCEPT = False  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stand_in
    try:
        yield
    finally:
        if not frozen and torch.backends.flags_frozen():
            torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


@functools.lru_cache(maxsize=1)
def _op_db() -> Tuple[Any, ...]:
    with _opinfo_import(), warnings.catch_warnings(), _seeded(0):  # the import draws from the global generators
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return tuple(op_db)


def _opinfo_targets(info: Any, keys: Set[str]) -> List[str]:
    """The registered ops an OpInfo names: its aten name, its name's last part, its aliases, its function's name."""
    names = [info.aten_name, info.name.split(".")[-1], info.name.replace(".", "_"),
             getattr(info.op, "__name__", "")] + [a.name.split(".")[-1] for a in getattr(info, "aliases", ())]
    out: List[str] = []
    for nm in names:
        key = f"aten.{nm}"
        if nm and key in keys and key not in out:
            out.append(key)
    return out


def _signature(s: Any) -> str:
    leaves, spec = torch.utils._pytree.tree_flatten(((s.input,) + tuple(s.args), dict(s.kwargs)))
    return str(spec) + "|" + "|".join(str(tuple(v.shape)) if isinstance(v, Tensor) else repr(v) for v in leaves)


def opinfo_samples(ops: Optional[Iterable[str]] = None, *, per_opinfo: Optional[int] = None, spread: bool = True,
                   float32: bool = True, seed: int = 0) -> List[Tuple[Sample, List[str], str]]:
    """The float CPU samples of every OpInfo that names a registered rule (PyTorch's ``op_db``).

    Each OpInfo's float64 samples, then (``float32``) its float32 samples whose shapes and arguments differ from
    every float64 one (all are checked in float64), drawn by its ``sample_inputs_func`` after ``torch.manual_seed``
    set from the OpInfo's name and dtype: the same samples on every run.

    Args:
        ops: keep the OpInfos naming one of these registry keys (default: every registered rule).
        per_opinfo: at most this many samples per OpInfo (default: all).
        spread: take them evenly spread over the OpInfo's list (else its first ones: only those are generated).
        float32: add the float32 samples that differ from the float64 ones.
        seed: added to each OpInfo's seed.

    Returns:
        ``(sample, intended ops, "opinfo")`` triples for :func:`check_samples`.
    """
    keys = set(registered_rules())
    wanted = keys if ops is None else {o.replace("::", ".") for o in ops}
    out: List[Tuple[Sample, List[str], str]] = []
    limit = None if spread else per_opinfo
    with warnings.catch_warnings(), _seeded(seed):
        warnings.simplefilter("ignore")
        for info in _op_db():
            targets = [t for t in _opinfo_targets(info, keys) if t in wanted]
            if not targets:
                continue
            dtypes = info.supported_dtypes("cpu")
            name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
            found: List[Tuple[Any, str]] = []
            seen: Set[str] = set()
            for dt in (torch.float64, torch.float32) if float32 else (torch.float64,):
                if dt not in dtypes or (limit is not None and len(found) >= limit):
                    continue
                try:
                    _seed_all(seed + zlib.crc32(f"{name}|{dt}".encode()))
                    # the OpInfo's own sample function (its sample_inputs wraps it in a test-tracking iterator that
                    # inspects the call stack at every call: seconds over the database)
                    for s in info.sample_inputs_func(info, "cpu", dt, False):
                        sig = _signature(s)
                        if sig not in seen:
                            seen.add(sig)
                            found.append((s, "" if dt == torch.float64 else " f32"))
                        if limit is not None and len(found) >= limit:
                            break
                except Exception:  # a sample generator that needs what this machine lacks
                    continue
            for i in _spread(len(found), per_opinfo):
                s, tag = found[i]
                out.append((Sample((s.input,) + tuple(s.args), dict(s.kwargs), fn=info.op,
                                   label=f"{name}#{i}{tag}"), targets, "opinfo"))
    return out


def _spread(n: int, k: Optional[int]) -> List[int]:
    """``k`` indices evenly spread over ``range(n)`` (all of them when ``k`` is ``None`` or ``>= n``)."""
    if k is None or k >= n:
        return list(range(n))
    if k <= 0:
        return []
    if k == 1:
        return [0]
    return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


def hand_samples(ops: Optional[Iterable[str]] = None,
                 per_op: Optional[int] = None) -> List[Tuple[Sample, List[str], str]]:
    """The hand-written samples of :mod:`certblocks.testing.conformance_samples` (``per_op``: at most this many
    per op, evenly spread)."""
    from .conformance_samples import conformance_samples

    wanted = None if ops is None else {o.replace("::", ".") for o in ops}
    out: List[Tuple[Sample, List[str], str]] = []
    for op, samples in conformance_samples.items():
        if wanted is None or op in wanted:
            out += [(samples[i], [op], "hand") for i in _spread(len(samples), per_op)]
    return out


def run_conformance(ops: Optional[Iterable[str]] = None, *, effort: Effort = FULL, per_opinfo: Optional[int] = None,
                    spread: bool = True, float32: bool = True, per_op: Optional[int] = None,
                    hand_per_op: Optional[int] = None, seed: int = 0, opinfo: bool = True, hand: bool = True,
                    progress: Optional[Callable[[str], None]] = None) -> ConformanceReport:
    """Check every registered rule (or ``ops``) on the OpInfo samples and the hand-written ones.

    Args:
        ops: registry keys to sweep (default: every registered rule).
        effort: the search.
        per_opinfo: at most this many samples per OpInfo (default: all).
        spread: spread them over each OpInfo's list (else its first ones).
        float32: add the float32 samples that differ from the float64 ones.
        per_op: at most this many OpInfo samples per op named (its OpInfos' samples together, evenly spread).
        hand_per_op: at most this many hand-written samples per op (default: all).
        seed: the seed of the samples and of the search.
        opinfo: use PyTorch's OpInfo samples.
        hand: use the hand-written samples.
        progress: called with each sample's label before it runs.

    Returns:
        The :class:`ConformanceReport`, with a row for every op swept.
    """
    keys = sorted(registered_rules()) if ops is None else [o.replace("::", ".") for o in ops]
    unknown = [k for k in keys if k not in registered_rules()]
    if unknown:
        raise ValueError(f"ops must name registered rules; these have none: {unknown}")
    rep = ConformanceReport()
    for k in keys:
        rep.row(k)
    todo: List[Tuple[Sample, List[str], str]] = []
    if opinfo:
        found = opinfo_samples(keys, per_opinfo=per_opinfo, spread=spread, float32=float32, seed=seed)
        if per_op is not None:
            by_op: Dict[str, List[int]] = {}
            for j, (_, targets, _) in enumerate(found):
                by_op.setdefault(targets[0], []).append(j)
            keep = sorted(idx[i] for idx in by_op.values() for i in _spread(len(idx), per_op))
            found = [found[j] for j in keep]
        todo += found
    if hand:
        todo += hand_samples(keys, hand_per_op)
    for item in todo:
        if progress is not None:
            progress(item[0].label)
        check_samples([item], effort=effort, seed=seed, report=rep)
    return rep


def run_fast(ops: Optional[Iterable[str]] = None, seed: int = 0) -> ConformanceReport:
    """The fast subset: the first float64 sample of each OpInfo, one per op, and every hand-written sample, searched
    with :data:`FAST` (deterministic: the same samples and draws on every run)."""
    return run_conformance(ops, effort=FAST, per_opinfo=1, spread=False, float32=False, per_op=1, seed=seed)


def without_opinfo(report: ConformanceReport, ops: Optional[Iterable[str]] = None) -> List[str]:
    """The ops (default: every registered rule) that no OpInfo sample reached in ``report``."""
    keys = sorted(registered_rules()) if ops is None else list(ops)
    return [k for k in keys if "opinfo" not in report.rows.get(k, OpRow(k)).sources]


# ---------------------------------------------------------------------------------------------- CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m certblocks.testing.conformance``: print the coverage table; exit status 1 on a finding."""
    p = argparse.ArgumentParser(prog="python -m certblocks.testing.conformance", description=main.__doc__)
    p.add_argument("--ops", default="", help="comma-separated registry keys (default: every registered rule)")
    p.add_argument("--json", default="", help="write the report as JSON to this path")
    p.add_argument("--effort", choices=("fast", "full"), default="full",
                   help="full: every sample, the full search; fast: the default test run's subset and search")
    p.add_argument("--per-opinfo", type=int, default=None, help="at most this many samples per OpInfo")
    p.add_argument("--per-op", type=int, default=None, help="at most this many samples per op")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-opinfo", action="store_true", help="only the hand-written samples")
    a = p.parse_args(argv)
    ops = [o.strip() for o in a.ops.split(",") if o.strip()] or None
    if a.effort == "fast" and a.per_opinfo is None and a.per_op is None and not a.no_opinfo:
        rep = run_fast(ops, seed=a.seed)
    else:
        rep = run_conformance(ops, effort=FAST if a.effort == "fast" else FULL, per_opinfo=a.per_opinfo,
                              per_op=a.per_op, seed=a.seed, opinfo=not a.no_opinfo)
    print(rep.table(sorted(rep.rows)))
    missing = without_opinfo(rep, ops)
    print(f"\nops with a rule that no OpInfo sample reached ({len(missing)}): {', '.join(missing)}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(rep.as_dict(), without_opinfo=missing), fh, indent=1, default=str)
    return 0 if rep.ok else 1


if __name__ == "__main__":  # pragma: no cover
    from certblocks.testing.conformance import main as _main  # the package's module, whose Sample the samples use

    sys.exit(_main())

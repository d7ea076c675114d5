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

**Where it lives.**  This module holds the call of a sample (its variants, the wrapped module), the checks of one sample
(:func:`check_samples`, :func:`check_rule`), the sweep (:func:`run_conformance`, :func:`run_fast`) and the command
line; :mod:`certblocks.testing._conformance_search` the search of one captured sample,
:mod:`certblocks.testing._conformance_opinfo` the samples' sources (OpInfo, hand-written) and
:mod:`certblocks.testing._conformance_types` the inputs and results (:class:`Sample`, :class:`Effort`,
:class:`ConformanceReport`).  Every name is importable from here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import sys
import time
import warnings
import zlib
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from ..trace.capture import CapturedGraph, CaptureError, capture
from ..trace.interp import VelocityInterpreter
from ..trace.nodes import op_name
from ..trace.rules import registered_rules
from ..trace.values import AValue
from ._conformance_opinfo import _seed_all, _seeded, _spread, hand_samples, opinfo_samples
from ._conformance_search import _Check, _Node, _Program
from ._conformance_types import CHECKS, FAST, FULL, ConformanceReport, Effort, Finding, OpRow, Sample

__all__ = ["CHECKS", "FAST", "FULL", "ConformanceReport", "Effort", "Finding", "OpRow", "Sample", "check_rule",
           "check_samples", "hand_samples", "main", "opinfo_samples", "run_conformance", "run_fast", "without_opinfo"]

#: Ops whose values are unspecified (uninitialized memory): only their shapes mean something.
_UNSPECIFIED = frozenset({"aten.empty_like", "aten.new_empty", "aten.empty", "aten.empty_strided"})
#: Re-raise errors of the search itself instead of counting them as skips (set by debugging sessions).
_RAISE = False


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

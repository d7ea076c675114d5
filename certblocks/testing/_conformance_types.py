"""What a conformance run takes and gives: a call of an op (:class:`Sample`), how hard it is searched
(:class:`Effort`, :data:`FULL`, :data:`FAST`), a beaten promise (:class:`Finding`) and the coverage of each rule
(:class:`OpRow`, :class:`ConformanceReport`).  The checks: :mod:`certblocks.testing.conformance`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

#: The promises checked at every node (the module docstring says what each means).
CHECKS: Tuple[str, ...] = ("growth", "entries", "jacobian", "sign", "stochastic", "constant", "finite", "exponents")


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

"""What a search found: :class:`CheckResult` (one check's worst case), :class:`SoundnessReport` (a velocity's
checks) and :class:`ModelSoundnessReport` (a whole model's checks)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._constants import DEFAULT_RTOL


@dataclass(frozen=True)
class CheckResult:
    """The worst case one check found.

    Attributes:
        check: ``"growth"``, ``"jacobian"`` or ``"peak"`` for a velocity; ``"output"``, ``"intermediate"``,
            ``"gradient"``, ``"state"`` or ``"costate"`` for a whole model (:func:`search_model`).
        ratio: the largest value / bound found (``inf`` for a non-finite value).
        value: the value there (``||v(x)||``, the Jacobian's lower estimate, the largest intermediate).
        bound: the certificate's bound at that radius.
        radius: ``||x||`` there.
        input: that ``x``, ``(1, *shape)`` float64 on the CPU (a whole model: the model input, token ids
            as integers).
        direction: for the Jacobian, the tangent (per-token norm 1) attaining ``value``.
        evaluations: the number of inputs scored (random draws and ascent iterates).
        rtol: the rounding allowance: the check passes when ``ratio <= 1 + rtol``.
        where: the segment boundary or graph node attaining the ratio, when the check has several.
    """

    check: str
    ratio: float
    value: float
    bound: float
    radius: float
    input: Optional[Tensor]
    direction: Optional[Tensor] = None
    evaluations: int = 0
    rtol: float = DEFAULT_RTOL
    where: str = ""

    @property
    def ok(self) -> bool:
        """No counterexample: the worst ratio is at most ``1 + rtol``."""
        return self.ratio <= 1.0 + self.rtol

    def describe(self) -> str:
        """One line: the check, the worst ratio, its radius, value against bound, the effort, the verdict."""
        what = _WHAT.get(self.check, "value")
        at = f" at {self.where}" if self.where else ""
        radius = f"radius {self.radius:.4g}" if math.isfinite(self.radius) else "token ids"
        return (f"{self.check}: worst ratio {self.ratio:.6g} at {radius}{at} ({what} {self.value:.6g}, "
                f"bound {self.bound:.6g}; {self.evaluations} inputs) {'ok' if self.ok else 'COUNTEREXAMPLE'}")


_WHAT = {"growth": "||v(x)||", "jacobian": "||dv(x)|| >=", "peak": "largest intermediate",
         "output": "||y||", "intermediate": "largest intermediate", "gradient": "dual norm of the input gradient",
         "state": "||X_k||", "costate": "dual norm of the costate"}


class _Verdict:
    """``failures``, ``ok`` and the text of a report whose ``results`` are its checks' worst cases."""

    name: str
    _title = "soundness search for"

    @property
    def results(self) -> List[CheckResult]:
        raise NotImplementedError

    @property
    def failures(self) -> List[CheckResult]:
        """The checks that found a counterexample."""
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        """No check found a counterexample."""
        return not self.failures

    def __str__(self) -> str:
        head = f"{self._title} {self.name}: {'no counterexample' if self.ok else 'COUNTEREXAMPLE'}"
        return "\n".join([head] + ["  " + r.describe() for r in self.results])


@dataclass(frozen=True)
class SoundnessReport(_Verdict):
    """What :func:`search` found, check by check (``None``: not run).

    Attributes:
        name: the certificate's name.
        growth: the growth check's worst case.
        jacobian: the Jacobian check's worst case.
        peak: the peak check's worst case.
    """

    name: str
    growth: Optional[CheckResult] = None
    jacobian: Optional[CheckResult] = None
    peak: Optional[CheckResult] = None

    @property
    def results(self) -> List[CheckResult]:
        """The checks that ran, in :data:`CHECKS` order."""
        return [r for r in (self.growth, self.jacobian, self.peak) if r is not None]


@dataclass(frozen=True)
class ModelSoundnessReport(_Verdict):
    """What :func:`search_model` found on a whole model, check by check.

    Attributes:
        name: the model's class name.
        checks: one worst case per check that ran, in :data:`MODEL_CHECKS` order.
    """

    name: str
    checks: Tuple[CheckResult, ...] = ()
    _title = "soundness search for the model"

    @property
    def results(self) -> List[CheckResult]:
        """The checks that ran."""
        return list(self.checks)

    def __getitem__(self, check: str) -> CheckResult:
        for r in self.checks:
            if r.check == check:
                return r
        raise KeyError(f"the search ran no {check!r} check; it ran {[r.check for r in self.checks]}")


@dataclass
class _Best:
    """The running worst case of one check."""

    check: str
    rtol: float
    ratio: float = -math.inf
    value: float = 0.0
    bound: float = math.nan
    radius: float = 0.0
    input: Optional[Tensor] = None
    direction: Optional[Tensor] = None
    evaluations: int = 0

    def update(self, ratios: Tensor, values: Tensor, bound: float, radius: float, xs: Tensor,
               dirs: Optional[Tensor] = None, counted: bool = True) -> None:
        """Keep the worst of ``ratios`` (one per sample of ``xs``)."""
        self.evaluations += int(ratios.numel()) if counted else 0
        if not ratios.numel():
            return
        k = int(ratios.argmax())
        if float(ratios[k]) > self.ratio:
            self.ratio, self.value = float(ratios[k]), float(values.detach().reshape(-1)[k])
            self.bound, self.radius = bound, radius
            self.input = xs[k:k + 1].detach().to("cpu", torch.float64).clone()
            self.direction = None if dirs is None else dirs[k:k + 1].detach().to("cpu", torch.float64).clone()

    def result(self) -> CheckResult:
        return CheckResult(self.check, max(self.ratio, 0.0), self.value, self.bound, self.radius, self.input,
                           self.direction, self.evaluations, self.rtol)

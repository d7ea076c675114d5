"""The tracer tests' soundness check: :mod:`certblocks.testing`'s searches with their settings.

``soundness(module, cert, shape, name)`` searches inputs of ``shape`` (batch first) for a counterexample to
the growth bound, the Jacobian bound and the peak (when the certificate states one), in float64 on a copy of
the module, and fails naming the check, the ratio and the radius.  Each budget covers the search these
tests ran before: random entries of scale 0.01, 1 and 100 (token norms near 0.03, 3 and 300) with 16
gradient ascents of 8 steps for the growth and 4 of 6 steps for the peak; one ascent of 5 steps in each
Jacobian ball of radius 0.5, 5 and 30.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch

import certblocks.testing as cbt
from certblocks.certificate import BlockCertificate

RADII = (0.01, 0.03, 0.5, 3.0, 30.0, 300.0)
RTOL = 1e-6
GROWTH = dict(radii=RADII, count=16, restarts=14, from_best=2, steps=8, rtol=RTOL)
JACOBIAN = dict(radii=(0.5, 5.0, 30.0), count=8, restarts=1, from_best=1, steps=5, power_iters=10, rtol=RTOL)
PEAK = dict(radii=RADII, count=8, restarts=4, from_best=1, steps=6, rtol=RTOL)


def _check(m: torch.nn.Module, cert: BlockCertificate, shape: Sequence[int], name: str = "") -> cbt.SoundnessReport:
    sample = tuple(shape[1:])
    report = cbt.SoundnessReport(
        name or cert.name,
        growth=cbt.search_growth(m, cert, sample, **GROWTH),
        jacobian=cbt.search_jacobian(m, cert, sample, **JACOBIAN),
        peak=cbt.search_peak(m, cert, sample, **PEAK) if cert.peak is not None else None,
    )
    assert report.ok, f"{cert}\n{report}"
    return report


@pytest.fixture
def soundness() -> Callable[..., cbt.SoundnessReport]:
    return _check

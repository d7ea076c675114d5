"""``var``/``std`` outside a recognized normalization and the lower bound of a square root: a standard deviation is a
centered Euclidean norm over ``sqrt(k - c)`` (1-Lipschitz up to that factor), a variance its square, and
``sqrt(y) >= sqrt(m)`` for ``y >= m >= 0``; so RevIN's ``(x - mean) / sqrt(var + eps)`` with the scale detached (the
instance normalization of the forecasters, over the time axis) is read from its primitives, and the counterexample
search does not beat the certificates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.trace import certify

T, D = 6, 4
SHAPE = (1, T, D)


class Spread(nn.Module):
    """``fc(x) + w * std(x)`` (or the variance) over ``dim`` with a correction."""

    def __init__(self, kind: str, dim: int, correction: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(D, D)
        self.kind, self.dim, self.correction = kind, dim, correction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.std if self.kind == "std" else torch.var
        return self.fc(x) + 0.5 * f(x, dim=self.dim, keepdim=True, correction=self.correction)


class RevIN(nn.Module):
    """Instance normalization over time with a detached scale, then a Linear."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.eps = nn.Linear(D, D), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=1, keepdim=True).detach()
        scale = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        return self.fc((x - mean) / scale)


@pytest.mark.parametrize("kind,dim,correction", [("std", -1, 1), ("std", 1, 0), ("var", -1, 0), ("var", 1, 1)])
def test_spread_is_certified_and_holds(kind: str, dim: int, correction: int, soundness) -> None:
    m = Spread(kind, dim, correction).eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.coefficients_derived and c.q == (1.0 if kind == "std" else 2.0), c.explain()
    assert any(r.op == f"aten.{kind}" and "centered Euclidean norm" in r.rule for r in c.nodes)
    soundness(m, c.certificate, SHAPE, f"{kind} over dim {dim}, correction {correction}")


def test_a_spread_bound_too_small_is_beaten() -> None:
    m = Spread("std", 1, 1).eval()
    cert = certify(m, torch.randn(*SHAPE), residual=None).certificate
    bad = dataclasses.replace(cert, c=cert.c / 100, b=cert.b / 100)
    report = cbt.search(m, bad, SHAPE[1:], checks=["growth"], count=8, restarts=2, from_best=1, steps=6, rtol=1e-6)
    assert report.growth.ratio > 10, report


def test_no_degree_of_freedom_is_refused() -> None:
    m = Spread("var", -1, D).eval()  # k - c = 0: inf or NaN
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is None and "k - c <= 0" in c.culprit, c.explain()


def test_revin_divides_by_a_proven_minimum(soundness) -> None:
    m = RevIN().eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.coefficients_derived, c.explain()
    (div,) = [r for r in c.nodes if r.op == "aten.div"]
    assert "no proven positive lower bound" not in div.rule, div
    soundness(m, c.certificate, SHAPE, "RevIN")

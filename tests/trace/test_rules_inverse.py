"""The rules the harder third-party set revealed besides its three named constructs: ``rsqrt``, ``reciprocal`` and
``sqrt`` of a tensor with a proven positive minimum (an RMSNorm written out: its ``rsqrt(mean(x^2) + eps)`` node had no
bound, so no peak, in Llama, Mistral, Qwen3, Phi-3, Gemma-2, T5, Falcon-Mamba, Granite, Cohere and Mixtral), a
LayerNorm written out with its centring computed twice (Cohere's), a clamp with an infinite bound (Mamba2's
``time_step_limit = (0, inf)``).  Each certificate: derived, not beaten by the search, and beaten when made 100x too
small; without a positive minimum the root or the inverse is refused, and there is an input where it is unbounded.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.trace import certify

D, T = 6, 4
SHAPE = (1, T, D)


class Case(nn.Module):
    """``op(fc(x))``."""

    def __init__(self, op: Callable) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(D, D)
        self.op = op

    def forward(self, x):
        return self.op(self.fc(x))


def _rms_written_out(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * 1.5


def _layer_norm_centred_twice(h):  # Cohere's: (h - mean) once for the variance, once for the output
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    return (h - mean) * torch.rsqrt(var + 1e-5)


#: Modules whose certificate is derived now (the node named was unbounded or outside the class before).
CERTIFIED: Dict[str, Callable] = {
    "rsqrt of mean(x^2) + eps (RMSNorm written out)": _rms_written_out,
    "rsqrt of x^2 + 1": lambda h: h * torch.rsqrt(h * h + 1.0),
    "reciprocal of x^2 + 1": lambda h: torch.tanh(h) * torch.reciprocal(h * h + 1.0),
    "sqrt of x^2 + 0.5": lambda h: torch.sqrt(h * h + 0.5),
    "LayerNorm written out, centred twice": _layer_norm_centred_twice,
    "clamp between 0 and inf": lambda h: torch.clamp(h, 0.0, float("inf")),
}


@pytest.mark.parametrize("name", list(CERTIFIED))
def test_certified_and_sound(name, soundness):
    m = Case(CERTIFIED[name]).eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is not None and c.sigma is not None and c.coefficients_derived, c.explain()
    assert c.certificate.peak is not None and c.certificate.peak.derived, c.explain()
    if "centred" in name or "RMSNorm" in name:
        assert c.q == 0, c.explain()  # recognized as a normalization
    soundness(m, c.certificate, SHAPE, name)


@pytest.mark.parametrize("name", ["rsqrt of x^2 + 1", "sqrt of x^2 + 0.5"])
def test_a_certificate_100x_too_small_is_beaten(name):
    m = Case(CERTIFIED[name]).eval()
    cert = certify(m, torch.randn(*SHAPE), residual=None).certificate
    bad = dataclasses.replace(cert, c=cert.c / 100, b=cert.b / 100)
    report = cbt.search(m, bad, SHAPE[1:], checks=["growth"], count=8, restarts=2, from_best=1, steps=6, rtol=1e-6)
    assert report.growth.ratio > 10, report


#: Without a positive minimum: refused, and an input (the second entry) where the op is unbounded or not Lipschitz.
REFUSED: Dict[str, Callable] = {
    "rsqrt of a tensor without a sign": lambda h: torch.rsqrt(h),
    "reciprocal of x^2": lambda h: torch.reciprocal(h * h),
    "sqrt of |x| (slope unbounded at 0)": lambda h: torch.sqrt(h.abs()),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_without_a_positive_minimum(name):
    m = Case(REFUSED[name]).eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is None or c.sigma is None, c.explain()
    assert "no proven positive lower bound" in c.culprit, c.culprit
    m = m.double()
    with torch.no_grad():  # an input where fc(x) = 0 in its first token: 1/0, or sqrt's infinite slope
        x = torch.zeros(1, T, D, dtype=torch.float64)
        x[0, 0] = -torch.linalg.lstsq(m.fc.weight, m.fc.bias).solution
        assert float(m.fc(x)[0, 0].abs().max()) < 1e-12
    if "sqrt" in name:
        _, g = torch.autograd.functional.jvp(m, x, torch.ones_like(x))
        assert not bool(torch.isfinite(g).all()) or float(g.abs().max()) > 1e5
    else:
        with torch.no_grad():
            y = m(x)
        assert not bool(torch.isfinite(y).all()) or float(y.abs().max()) > 1e10

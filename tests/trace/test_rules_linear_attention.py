"""EfficientViT's ReLU linear attention: ``M = Q (K^T [V | 1])``, ``out = M[..., :-1] / (M[..., -1:] + eps)``.

With ``Q, K >= 0`` the last column of ``M`` is ``Q K^T 1 >= 0`` (the columns of a product of nonnegative factors, read
through the padding: :func:`certblocks.trace.rules.lower_bounds.columns_lower_bound`), so the denominator is
``>= eps``; recognized (:mod:`certblocks.trace.rules.linear_attention`) the quotient is a weighted mean of the values
with weights summing to at most 1: ``q = q_V`` instead of the cubic ``|num| / eps``, and attention's ``sigma``.  The
module alone (timm's own ``LiteMLA`` and the same computation written as a function, also with ``(Q K^T) V``): the
counterexample search does not beat it, and beats one 100x too small.  Without the ReLU on the keys there is no sign:
the division is refused, and an input makes the denominator vanish.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import certblocks.testing as cbt
from certblocks.trace import certify

D, DK, T = 8, 4, 6
SHAPE = (1, T, D)
EPS = 1e-5


class LinearAttention(nn.Module):
    """The quotient of LiteMLA's ``_attn``: ``kernel`` on the keys (ReLU, or none), the product ``Q (K^T V)`` or
    ``(Q K^T) V``, the values padded with the constant ``pad``."""

    def __init__(self, keys_relu: bool = True, order: str = "kv", pad: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(D, 3 * DK)
        self.keys_relu, self.order, self.pad = keys_relu, order, pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = F.relu(q)
        k = F.relu(k) if self.keys_relu else k
        v = F.pad(v, (0, 1), mode="constant", value=self.pad)
        out = q @ (k.transpose(-1, -2) @ v) if self.order == "kv" else (q @ k.transpose(-1, -2)) @ v
        return out[..., :-1] / (out[..., -1:] + EPS)


@pytest.fixture(scope="module", params=["kv", "qk", "pad 2"])
def linear_attention(request):
    m = LinearAttention(order="qk" if request.param == "qk" else "kv", pad=2.0 if request.param == "pad 2" else 1.0)
    m = m.eval()
    return m, certify(m, torch.randn(*SHAPE), residual=None)


def test_the_quotient_is_recognized(linear_attention):
    m, c = linear_attention
    assert (c.q, c.sigma) == (1, 2) and c.coefficients_derived, c.explain()
    (div,) = [r for r in c.nodes if r.op == "aten.div"]
    assert "normalized linear attention" in div.rule and (div.q, div.sigma) == (1, 2), div
    assert c.certificate.peak.q == 3  # Q (K^T V): the numerator itself grows like ||x||^3


def test_the_certificate_holds(linear_attention, soundness):
    m, c = linear_attention
    soundness(m, c.certificate, SHAPE, "linear attention")


def test_a_certificate_100x_too_small_is_beaten(linear_attention):
    m, c = linear_attention
    cert = c.certificate
    bad = dataclasses.replace(cert, c=cert.c / 100, b=cert.b / 100)
    report = cbt.search(m, bad, SHAPE[1:], checks=["growth"], count=8, restarts=2, from_best=1, steps=6, rtol=1e-6)
    assert report.growth.ratio > 10, report


def test_the_output_is_a_weighted_mean_of_the_values():
    """Each output row is within the values' largest row norm divided by the padding constant."""
    for pad in (1.0, 2.0):
        m = LinearAttention(pad=pad).eval()
        torch.manual_seed(2)
        x = 20.0 * torch.randn(64, T, D)
        with torch.no_grad():
            v = m.qkv(x).chunk(3, dim=-1)[2]
            out = m(x)
        assert float(out.norm(dim=-1).max()) <= float(v.norm(dim=-1).max()) / pad * (1 + 1e-5)


def test_keys_without_a_sign_are_refused_and_the_denominator_can_vanish():
    m = LinearAttention(keys_relu=False).eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is None and "no proven positive lower bound" in c.culprit, c.explain()
    torch.manual_seed(4)
    x = torch.randn(4096, T, D)
    with torch.no_grad():
        q, k, _ = m.qkv(x).chunk(3, dim=-1)
        den = F.relu(q) @ k.sum(dim=-2, keepdim=True).transpose(-1, -2)
    assert float((den + EPS).min()) < 0  # a sign change: the denominator crosses 0 between such inputs


def test_timm_lite_mla_is_recognized(soundness):
    pytest.importorskip("timm")
    from timm.models.efficientvit_mit import LiteMLA

    torch.manual_seed(0)
    m = LiteMLA(8, 8, dim=4).eval()
    x = torch.randn(1, 8, 3, 3)
    c = certify(m, x, residual=None)
    assert (c.q, c.sigma) == (1, 2) and c.coefficients_derived, c.explain()
    divs = [r for r in c.nodes if r.op == "aten.div"]
    assert divs and all("normalized linear attention" in r.rule for r in divs)
    soundness(m, c.certificate, tuple(x.shape), "LiteMLA")


def test_inside_efficientvit_every_context_module_is_recognized():
    pytest.importorskip("timm")
    from .third_party.registry import build, unknown_in

    m, x = build("efficientvit_b0")
    rep = certify(m, x)
    assert unknown_in(rep) == ""
    context = [tc for tc in rep.segments if "context_module" in tc.name]
    assert context
    for tc in context:
        divs = [r for r in tc.nodes if r.op == "aten.div"]
        assert len(divs) == 1 and "normalized linear attention" in divs[0].rule, [r.rule for r in divs]
        assert (tc.q, tc.sigma) == (1, 2), tc.explain()

"""A mixture-of-experts router (Mixtral's): the top-k of a softmax divided by their sum.

The sum of the ``k`` largest of ``E`` probabilities is at least ``k/E`` (their mean is at least the mean of all), so the
division has a proven positive minimum (:func:`certblocks.trace.rules.lower_bounds.lower_bound`, carried through the
rounding of the dtype it is computed in), and the normalized routing weights are bounded and Lipschitz.  The
counterexample search does not beat the certificate of the router alone, and beats one made 100x too small.  In the
whole Mixtral the routing weights are derived the same way.  The choice of experts is not continuous (the top-k
indices jump where two router probabilities swap), but the certificate bounds the derivative autograd computes
(docs/theory.md section 1.1: the selected experts' branch), so the MoE block and the MoE updates have ``sigma``
derived and say that they are piecewise; the searches, from random inputs, gradient ascents and inputs on and near
the ties of the router probabilities, do not beat the MoE block's certificate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.trace import capture, certify
from certblocks.trace.interp import VelocityInterpreter
from certblocks.trace.rules.lower_bounds import lower_bound

from .test_switches import derivative_holds, on_sphere, router_ties

D, E, K, T = 8, 4, 2, 5
SHAPE = (1, T, D)


class Router(nn.Module):
    """``topk(softmax(W x), k) / sum``: Mixtral's routing weights (``dtype``: the dtype the softmax runs in)."""

    def __init__(self, k: int = K, dtype: torch.dtype = torch.float32, largest: bool = True,
                 softmax: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(D, E, bias=False)
        self.k, self.dtype, self.largest, self.softmax = k, dtype, largest, softmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).to(self.dtype)
        probs = torch.softmax(logits, dim=-1) if self.softmax else torch.sigmoid(logits)
        top = torch.topk(probs, self.k, dim=-1, largest=self.largest).values
        return (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)


def _sum_bound(m: nn.Module) -> float:
    """The lower bound the tracer proves for the denominator ``top.sum(...)``."""
    g = capture(m.eval(), (torch.randn(*SHAPE),))
    it = VelocityInterpreter(g, g.user_inputs[0], g.outputs[0])
    it.run()
    (den,) = [n for n in g.nodes if n.op == "call_function" and str(n.target) == "aten.sum.dim_IntList"]
    return lower_bound(it, den)


def _smallest_sum(m: Router, draws: int = 4000) -> float:
    """The smallest top-k mass over random inputs and the input 0 (all probabilities equal: the mass is k/E)."""
    torch.manual_seed(1)
    x = torch.cat([torch.zeros(1, T, D), 3.0 * torch.randn(draws // T, T, D)])
    with torch.no_grad():
        probs = torch.softmax(m.gate(x).to(m.dtype), dim=-1)
        return float(torch.topk(probs, m.k, dim=-1).values.sum(-1).min())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_top_k_mass_has_the_lower_bound_k_over_e(k):
    m = Router(k)
    bound = _sum_bound(m)
    assert k / E * (1 - 1e-5) < bound <= k / E, bound  # k/E, less a few roundings of float32
    assert _smallest_sum(m) >= bound  # attained at x = 0 (up to rounding)
    assert _smallest_sum(m) <= k / E * (1 + 1e-6)


def test_the_lower_bound_survives_bfloat16():
    """In bfloat16 the softmax, the top-k and the sum round at 2^-9: the proven minimum is lowered accordingly, and no
    input computes a smaller sum."""
    m = Router(K, torch.bfloat16)
    bound = _sum_bound(m)
    assert 0.45 < bound < K / E * (1 - 2.0 ** -9), bound
    assert _smallest_sum(m) >= bound


@pytest.mark.parametrize("kind", ["smallest", "sigmoid"])
def test_no_lower_bound_without_the_largest_probabilities(kind):
    """The k smallest probabilities, or sigmoid scores (no sum to 1), have no positive minimum: the division is
    refused, naming the denominator -- and an input brings the denominator close to 0."""
    m = Router(K, largest=kind != "smallest", softmax=kind != "sigmoid").eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is None and "no proven positive lower bound" in c.culprit, c.explain()
    with torch.no_grad():
        x = 50.0 * torch.randn(256, T, D)
        probs = torch.softmax(m.gate(x), -1) if kind == "smallest" else torch.sigmoid(m.gate(x))
        assert float(torch.topk(probs, K, dim=-1, largest=kind != "smallest").values.sum(-1).min()) < 1e-3


@pytest.fixture(scope="module")
def router_certificate():
    m = Router().eval()
    c = certify(m, torch.randn(*SHAPE), residual=None)
    return m, c


def test_the_router_is_certified(router_certificate):
    _, c = router_certificate
    assert (c.q, c.sigma) == (0, 0) and c.coefficients_derived, c.explain()
    div = [r for r in c.nodes if r.op == "aten.div"]
    assert div and "reciprocal of sum" in div[0].rule and ">= 0.5 " in div[0].rule, div


def test_the_router_certificate_holds(router_certificate, soundness):
    m, c = router_certificate
    soundness(m, c.certificate, SHAPE, "router")


def test_a_router_certificate_100x_too_small_is_beaten(router_certificate):
    m, c = router_certificate
    cert = c.certificate
    bad = dataclasses.replace(cert, c=cert.c / 100, b=cert.b / 100, l1=cert.l1 / 100, l0=cert.l0 / 100,
                              peak=dataclasses.replace(cert.peak, c=cert.peak.c / 100, b=cert.peak.b / 100))
    report = cbt.search(m, bad, SHAPE[1:], count=8, restarts=1, from_best=1, steps=4, power_iters=5, rtol=1e-6)
    assert {r.check for r in report.failures} >= {"growth", "peak"}, report
    assert report.growth.ratio > 10, report


def test_inside_mixtral_the_weights_are_derived_and_the_moe_updates_are_piecewise():
    pytest.importorskip("transformers")
    from .third_party.registry import build, unknown_in

    m, ids = build("mixtral")
    rep = certify(m, ids)
    moe = [tc for tc in rep.segments if tc.name.endswith(".mlp")]
    assert len(moe) == 2
    for tc in moe:
        div = [r for r in tc.nodes if r.op == "aten.div"]
        assert len(div) == 1 and ">= 0.5 " in div[0].rule, [r.rule for r in div]
        assert (div[0].q, div[0].sigma) == (0, 0)  # the routing weights: bounded, Lipschitz
        cert = tc.certificate
        assert (cert.q, cert.sigma) == (0, 0) and tc.coefficients_derived, tc.explain()  # pre-normalized
        assert tc.piecewise and "topk indices" in next(n for n in tc.notes if "piecewise" in n)
    assert not any(tc.piecewise for tc in rep.segments if not tc.name.endswith(".mlp"))  # attention: continuous
    assert unknown_in(rep) == ""
    assert any("piecewise" in n and ".mlp" in n for n in rep.notes)  # the model's notes name the MoE updates


DM = 32  # the width of the registry's Mixtral


@pytest.fixture(scope="module")
def mixtral_moe():
    """The sparse MoE block of the registry's Mixtral (router, top-2 of 4, experts by batched_mm), certified alone."""
    pytest.importorskip("transformers")
    from .third_party.registry import build

    m, _ = build("mixtral")
    moe = m.model.layers[0].mlp.eval()
    torch.manual_seed(0)
    return moe, certify(moe, torch.randn(1, T, DM), residual=None)


def test_the_mixtral_moe_block_derives_sigma_and_holds(mixtral_moe, soundness):
    moe, c = mixtral_moe
    cert = c.certificate
    assert cert.q is not None and cert.sigma is not None and c.coefficients_derived, c.explain()
    assert c.piecewise
    soundness(moe, cert, (1, T, DM), "Mixtral sparse MoE block")


def test_the_mixtral_moe_bound_holds_at_the_ties_of_the_router(mixtral_moe):
    """autograd's derivative at the ties of the 2nd and 3rd router probabilities (the top-k there takes one of them)
    and 1e-9 to 1e-3 off them, at radii 0.5 to 30, is within the bound, and searches started there find nothing."""
    moe, c = mixtral_moe
    g = torch.Generator().manual_seed(3)
    for r in (0.5, 5.0, 30.0):
        x = on_sphere(torch.randn(4, T, DM, generator=g, dtype=torch.float64), r)
        xs = torch.cat([router_ties(moe.gate.weight, x, e) for e in (0.0, 1e-9, -1e-9, 1e-3, -1e-3)])
        derivative_holds(moe, c.certificate, xs, iters=15)

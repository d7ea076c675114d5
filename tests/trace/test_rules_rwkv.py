"""RWKV's WKV recurrence: exponentials of max-shifted arguments and a ratio of running sums.

Each step computes ``M = maximum(a, b)``, ``e1 = exp(a - M)`` and ``e2 = exp(b - M)`` (``a - maximum(a, b) <= 0``, so
both are in ``(0, 1]``: the sign rule of ``sub``), and the ratio ``(e1 num + e2 v) / (e1 den + e2)``.  ``M`` is one of
its operands exactly, so one of the two exponentials is ``exp(0) = 1``: by induction the running denominator is
``>= 1`` (:func:`certblocks.trace.rules.lower_bounds.lower_bound`, the case ``M = a`` ruled out at the first step by
the ``-1e38`` the state starts from).  The WKV loop of transformers' own CPU implementation, on a short sequence,
after the LayerNorm the model puts in front of it: certified, the counterexample search does not beat it, and a
certificate 100x too small is beaten.  Without the LayerNorm the key is unbounded: ``key + time_first < -1e38``
cannot be ruled out, where the first step's denominator underflows to 0 -- the tracer refuses, and such an input does
make the module return NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.trace import certify

D, T = 6, 4
SHAPE = (1, T, D)

rwkv = pytest.importorskip("transformers.models.rwkv.modeling_rwkv")


class WKV(nn.Module):
    """``rwkv_linear_attention_cpu`` on keys and values read from the (normalized) input."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(D) if norm else nn.Identity()
        self.key, self.value = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.time_decay, self.time_first = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out, _ = rwkv.rwkv_linear_attention_cpu(self.time_decay, self.time_first, self.key(h), self.value(h))
        return out


@pytest.fixture(scope="module")
def wkv():
    m = WKV().eval()
    return m, certify(m, torch.randn(*SHAPE), residual=None)


def test_the_wkv_loop_is_certified(wkv):
    _, c = wkv
    assert (c.q, c.sigma) == (0, 0) and c.coefficients_derived, c.explain()
    exps = [r for r in c.nodes if r.op == "aten.exp"]  # 4 a step; the last state update is not used
    assert len(exps) == 4 * T - 2 and all("provably nonpositive" in r.rule for r in exps), [r.rule for r in exps]
    divs = [r for r in c.nodes if r.op == "aten.div"]
    assert len(divs) == T and all(">= 1 " in r.rule for r in divs), [r.rule for r in divs]


def test_the_wkv_certificate_holds(wkv, soundness):
    m, c = wkv
    soundness(m, c.certificate, SHAPE, "wkv")


def test_a_wkv_certificate_100x_too_small_is_beaten(wkv):
    m, c = wkv
    cert = c.certificate
    bad = dataclasses.replace(cert, b=cert.b / 100, l0=cert.l0 / 100,
                              peak=dataclasses.replace(cert.peak, c=cert.peak.c / 100, b=cert.peak.b / 100))
    report = cbt.search(m, bad, SHAPE[1:], count=8, restarts=1, from_best=1, steps=4, power_iters=5, rtol=1e-6)
    assert report.growth.ratio > 1 and report.peak.ratio > 1, report


def test_the_ratio_is_a_weighted_mean_of_the_values(wkv):
    """What the bound does not use (it is loose by at most the sequence length): every output is within the range
    of the values seen so far, whatever the input."""
    m, _ = wkv
    torch.manual_seed(3)
    x = 30.0 * torch.randn(64, T, D)
    with torch.no_grad():
        out, v = m(x), m.value(m.norm(x))
    run_max = torch.cummax(v, dim=1).values
    run_min = -torch.cummax(-v, dim=1).values
    assert bool((out <= run_max + 1e-5).all() and (out >= run_min - 1e-5).all())


def test_an_unbounded_key_is_refused_and_can_give_nan():
    m = WKV(norm=False).eval()
    with torch.no_grad():  # key = x, value = x / 10: the first token's key at -2e38 (a float32 number)
        m.key.weight.copy_(torch.eye(D))
        m.value.weight.copy_(0.1 * torch.eye(D))
    c = certify(m, torch.randn(*SHAPE), residual=None)
    assert c.q is None and "no proven positive lower bound" in c.culprit, c.explain()
    x = torch.randn(1, T, D)
    x[0, 0] = -2e38  # maximum(-1e38, key + u) = -1e38: exp(0) * 0 + exp(-1e38) = 0 = the denominator
    with torch.no_grad():
        assert bool(torch.isnan(m(x)[0, 0]).all())


@pytest.mark.parametrize("other", ["same node", "same computation"])
def test_exp_of_a_minus_its_maximum_with_another_tensor(other):
    """``exp(a - maximum(a, b)) <= 1`` whether ``a`` is the same node or the same computation done again; with a
    different ``a`` the argument has no sign and the exponential is refused."""

    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            a = self.a(x)
            m = torch.maximum(a, self.b(x))
            again = self.a(x) if other == "same computation" else a
            return torch.exp(again - m) + torch.exp(self.b(x) - m)

    c = certify(Shift().eval(), torch.randn(*SHAPE), residual=None)
    assert c.q == 0 and c.sigma == 0, c.explain()

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            return torch.exp(self.a(x) - torch.maximum(self.a(2 * x), self.b(x)))

    c = certify(Other().eval(), torch.randn(*SHAPE), residual=None)
    assert c.q is None and "exp of an argument of unknown sign" in c.culprit, c.explain()


def test_inside_rwkv_every_step_has_the_bound():
    pytest.importorskip("transformers")
    from .third_party.registry import build, unknown_in

    m, ids = build("rwkv")
    rep = certify(m, ids)
    assert unknown_in(rep) == ""
    attn = [tc for tc in rep.segments if tc.name.endswith(".attention")]
    assert len(attn) == 2
    for tc in attn:
        divs = [r for r in tc.nodes if r.op == "aten.div"]
        assert len(divs) == ids.shape[1] and all(">= 1 " in r.rule for r in divs), [r.rule for r in divs]
        assert (tc.q, tc.sigma) == (0, 0), tc.explain()

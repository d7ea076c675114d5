"""Soundness under precision policies (docs/theory.md section 7): searches run under ``torch.autocast`` on the CPU
(fp16 and bf16) against each dtype's bound, and three models whose verdict depends on where each tensor is held.

* a model whose fp32 stream passes 65504 while every fp16 value stays small: certified in ``amp-fp16``, refused in
  pure fp16 -- and the run under fp16 autocast stays finite;
* a branch Linear whose fp16 output passes 65504: refused in ``amp-fp16`` naming that Linear -- and an input makes
  it overflow under fp16 autocast, while the fp32 run stays finite;
* a cast of an fp32 value to fp16 that passes 65504: refused naming the cast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from certblocks import certify
from certblocks.certificate import BlockCertificate, Peak
from certblocks.testing.counterexamples import search_held
from certblocks.testing.record import held_intermediates

POLICIES = ("amp-fp16", "amp-bf16", "fsdp-bf16")


class Branch(nn.Module):
    """``fc2(gelu(fc1(tanh(alpha x))))``: the matmuls read a bounded value (no eps)."""

    def __init__(self, d: int = 8, h: int = 32, alpha: float = 0.5) -> None:
        super().__init__()
        self.alpha, self.fc1, self.fc2 = alpha, nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(torch.tanh(self.alpha * x))))


class PreNorm(nn.Module):
    """``fc2(relu(fc1(LayerNorm(x))))``: on the CPU the LayerNorm keeps an fp32 input in fp32 under autocast."""

    def __init__(self, d: int = 8, h: int = 32) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.ln(x))))


class Bare(nn.Module):
    """``fc2(relu(fc1(x)))``: the input itself is cast to the low dtype."""

    def __init__(self, d: int = 8, h: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """Two updates ``x + Branch(x)`` and a bounded head; ``bias`` (the norm of each fc2 bias, its weights / 10) makes
    the stream grow by about that much per update, ``w2`` sets every fc2 weight to +-w2."""

    def __init__(self, d: int = 8, bias: float = 0.0, w2: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Branch(d) for _ in range(2))
        self.head = nn.Linear(d, 4)
        with torch.no_grad():
            for b in self.blocks:
                if bias:
                    b.fc2.bias.fill_(bias / d**0.5)
                    b.fc2.weight.mul_(0.1)
                if w2:
                    b.fc2.weight.copy_(w2 * torch.sign(b.fc2.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(torch.tanh(0.5 * x))


class CastNet(nn.Module):
    """A map ``1e5 x`` (elementwise: fp32 under autocast), then ``x + fc(x)``: fc's input is the fp32 stream cast to
    fp16; fc's weights are tiny, so the cast is the largest fp16 value."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(d, d), nn.Linear(d, 4)
        with torch.no_grad():
            self.fc.weight.mul_(1e-6)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = 1e5 * x
        x = x + self.fc(x)
        return self.head(torch.tanh(x * 1e-5))


def _example(d: int = 8) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 5, d)


def _fp16_run(model: nn.Module, x: torch.Tensor) -> dict:
    """``{dtype: largest |entry|}`` of every value of ``model(x)`` under fp16 autocast on the CPU."""
    with torch.autocast("cpu", dtype=torch.float16):
        rec = held_intermediates(model, x)
    return {dt: float(total.detach()) for dt, (total, _) in rec.items()}


# ------------------------------------------------------------------------------------------------ the searches

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("velocity", [Branch, PreNorm, Bare], ids=lambda c: c.__name__)
def test_no_value_beats_its_dtypes_bound_under_autocast(velocity, policy):
    torch.manual_seed(1)
    v = velocity().eval()
    cert = certify(v, _example(), residual=None, precision=policy).certificate
    assert cert.precision == policy and cert.peaks
    result = search_held(v, cert, _example(), policy, radii=(0.1, 1.0, 30.0, 1e3), count=16, restarts=2, steps=10)
    assert result.ok, result.describe()
    assert result.evaluations > 100 and result.where  # the search ran, and read values in a named dtype


def test_the_search_finds_a_planted_wrong_bound():
    torch.manual_seed(1)
    v = Bare().eval()
    cert = certify(v, _example(), residual=None, precision="amp-fp16").certificate
    low = {d: Peak(p.q, p.c / 4, p.b / 4, p.what) for d, p in cert.peaks.items()}
    wrong = BlockCertificate(cert.q, cert.sigma, c=cert.c, b=cert.b, l1=cert.l1, l0=cert.l0, peak=cert.peak,
                             peaks=low, precision="amp-fp16")
    result = search_held(v, wrong, _example(), "amp-fp16", radii=(1.0, 10.0), count=8, restarts=1, steps=5)
    assert not result.ok and result.where in ("fp16", "fp32")


def test_the_search_reads_the_casts_autocast_makes():
    """The cast of the input to fp16 is a value held in fp16: at radius 1e5 it overflows, and the search says so."""
    v = Bare().eval()
    cert = certify(v, _example(), residual=None, precision="amp-fp16").certificate
    result = search_held(v, cert, _example(), "amp-fp16", radii=(1e5,), count=4, restarts=0, from_best=0, steps=0)
    assert result.ratio == float("inf") and result.where == "fp16"
    assert cert.peaks["fp16"].bound(1e5) >= 65504  # the certificate refuses this radius in fp16


# ------------------------------------------------------------------------------------------------ the models

def test_fp32_stream_past_65504_is_certified_in_amp_fp16_and_refused_in_fp16():
    model = Net(bias=8000.0).eval()
    rep = certify(model, _example(), precision="amp-fp16")
    amp = rep.stack("amp-fp16", r0=6e4)
    assert amp.ok, amp.explain()
    assert amp.radii[-1] > 65504 and amp.notes == ()  # the stream passes 65504, every segment read per dtype
    pure = rep.stack("fp16", r0=6e4)
    assert not pure.ok and pure.first_failure.kind == "forward" and rep.stack("bf16", r0=6e4).ok
    # the run: a state entry of 6e4 (per-token norm 6e4) under fp16 autocast: the fp32 stream passes 65504, every
    # fp16 value stays small, the output is finite
    x = torch.zeros(2, 5, 8)
    x[..., 0] = 6e4
    seen = _fp16_run(model, x)
    assert seen[torch.float32] > 65504 and seen[torch.float16] < 65504


def test_a_branch_linear_past_65504_in_fp16_is_refused_naming_it():
    model = Net().eval()
    with torch.no_grad():  # block 0: hidden units gelu(3 tanh(x_0 / 2)), fc2 adds 32 of them with weight 1e4
        fc1, fc2 = model.blocks[0].fc1, model.blocks[0].fc2
        fc1.weight.zero_()
        fc1.weight[:, 0] = 3.0
        fc1.bias.zero_()
        fc2.weight.fill_(1e4)
    rep = certify(model, _example(), precision="amp-fp16")
    cert = rep.stack("amp-fp16", r0=1.0)
    f = cert.first_failure
    assert not cert.ok and f.kind == "forward" and f.index == 0
    assert "blocks.0.fc2" in f.reason and "fp16" in f.reason and "keep blocks.0.fc2 in fp32" in f.fix
    # and it does overflow there: x_0 = 1 gives fc2 outputs of about 32 * 1e4 * gelu(3 tanh(1/2)) = 4e5
    x = torch.zeros(2, 5, 8)
    x[..., 0] = 1.0
    assert _fp16_run(model, x)[torch.float16] == float("inf")
    assert torch.isfinite(model(x)).all()  # in fp32 nothing overflows: it is the fp16 output of fc2


def test_a_cast_of_an_fp32_value_past_65504_is_refused_naming_the_cast():
    model = CastNet().eval()
    x = _example()
    x = x / x.norm(dim=-1, keepdim=True)
    cert = certify(model, x, precision="amp-fp16").stack("amp-fp16", r0=1.0)
    f = cert.first_failure
    assert not cert.ok and "a cast of an fp32 value to fp16, read by fc" in f.reason and "_to_copy" in f.reason
    assert "keep fc in fp32" in f.fix
    assert _fp16_run(model, x)[torch.float16] == float("inf")  # the cast of 1e5 x to fp16


def test_a_model_certified_in_bf16_autocast_runs_finite():
    model = Net(bias=8000.0).eval()
    rep = certify(model, _example(), precision="amp-bf16")
    assert rep.stack("amp-bf16", r0=1e30).ok
    x = _example()
    x = 1e30 * x / x.norm(dim=-1, keepdim=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rec = held_intermediates(copy.deepcopy(model), x)
    assert all(float(total.detach()) < float("inf") for total, _ in rec.values())

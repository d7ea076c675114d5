"""The tracer uses a module's own certificate (certblocks.trace.own): whole velocities and nested calls."""

from __future__ import annotations

import math
from typing import ClassVar, List, Optional

import pytest
import torch
from torch import nn

import certblocks
from certblocks import GatedMLP, LinearGrowthMamba, QKNormAttention
from certblocks.bounds import op_norm, product_norm
from certblocks.certificate import BlockCertificate, Peak, certify_stack
from certblocks.exponents import Exponents
from certblocks.protocol import CertifiedBlock
from certblocks.trace.capture import CapturedGraph, capture
from certblocks.trace.own import is_certified, own_certificate, rules_only
from certblocks.trace.residual import find_residual_updates

SEQ, DIM = 16, 32


def _blocks() -> List[nn.Module]:
    torch.manual_seed(0)
    return [LinearGrowthMamba(DIM), GatedMLP(DIM, 2 * DIM), QKNormAttention(DIM, 4),
            LinearGrowthMamba(DIM), GatedMLP(DIM, 2 * DIM), QKNormAttention(DIM, 4)]


def _traced(stack: nn.Module, shape=(1, SEQ, DIM)) -> List[Optional[BlockCertificate]]:
    g = capture(stack, (torch.randn(*shape),))
    return [own_certificate(g, x, f, f"update {k}") for k, (x, f, _) in enumerate(find_residual_updates(g))]


def _fields(c: BlockCertificate) -> tuple:
    return (c.q, c.sigma, c.c, c.b, c.l1, c.l0, c.peak)


@pytest.fixture(scope="module")
def blocks() -> List[nn.Module]:
    return _blocks()


def test_stack_updates_are_the_blocks_own_certificates(blocks):
    stack = certblocks.build_stack(blocks, "bf16", seq_len=SEQ, certify=False).eval()
    traced = _traced(stack)
    assert len(traced) == len(blocks)
    for cert, block in zip(traced, blocks):
        assert cert is not None, type(block).__name__
        assert _fields(cert) == _fields(block.certificate(seq_len=SEQ)), type(block).__name__


@pytest.mark.parametrize("dt", [1.0, 0.5])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_certified_depth_matches_the_built_stack(blocks, dtype, dt):
    r0, lip_g = 3.0, 2.0
    stack = certblocks.build_stack(blocks, dtype, seq_len=SEQ, certify=False, dt=dt, r0=r0, lip_g=lip_g).eval()
    traced = _traced(stack)
    assert all(c is not None for c in traced)
    # the traced velocities are dt * v: their stack runs with step 1
    mine = certify_stack(traced, dtype, dt=1.0, r0=r0, lip_g=lip_g)
    assert mine.certified_depth == stack.certificate().certified_depth
    assert mine.forward_depth == stack.certificate().forward_depth


def test_scaled_velocity_scales_the_coefficients_and_keeps_the_peak(blocks):
    for dt in (0.5, 2.0):
        stack = certblocks.build_stack(blocks[:3], "bf16", seq_len=SEQ, certify=False, dt=dt).eval()
        for cert, block in zip(_traced(stack), blocks):
            own = block.certificate(seq_len=SEQ)
            for k in ("c", "b", "l1", "l0"):
                assert dt * getattr(own, k) <= getattr(cert, k) <= dt * getattr(own, k) * (1 + 1e-12)
            if dt <= 1:  # the block's peak covers its output, hence dt times it
                assert cert.peak == own.peak
            else:
                assert cert.peak.c >= max(own.peak.c, dt * own.c) and cert.peak.b >= max(own.peak.b, dt * own.b)


class ProductBlock(nn.Module):
    """A user velocity ``W2 W1 x`` stating its own (exact) certificate, tighter than ``||W2|| ||W1||``."""

    exponents: ClassVar[Exponents] = Exponents(1.0, 0.0)

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(d, 3 * d, bias=False)
        self.lin2 = nn.Linear(3 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x))

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        c = product_norm(self.lin2.weight, self.lin1.weight)
        return BlockCertificate(1.0, 0.0, c=c, b=0.0, l1=0.0, l0=c, name="ProductBlock",
                                peak=Peak(1.0, max(c, op_norm(self.lin1.weight)), 0.0, "lin1"))


def test_user_module_following_the_protocol_is_used(soundness):
    torch.manual_seed(1)
    user = ProductBlock(DIM)
    assert isinstance(user, CertifiedBlock) and is_certified(user)
    stack = certblocks.build_stack([user, GatedMLP(DIM, 2 * DIM)], "bf16", seq_len=SEQ, certify=False).eval()
    traced = _traced(stack)
    assert _fields(traced[0]) == _fields(user.certificate(seq_len=SEQ))
    x = torch.randn(1, SEQ, DIM)
    with rules_only():
        assert _traced(stack) == [None, None]
        generic = certblocks.certify(user, x, residual=None).certificate
    # the rules read ||W2|| ||W1||; the module states ||W2 W1||
    assert traced[0].c < generic.c
    whole = certblocks.certify(user, x, residual=None)  # the captured module itself is a call
    assert any(r.rule == "own certificate of ProductBlock ()" for r in whole.nodes), whole.explain()
    assert _fields(own_certificate(*_whole_velocity(user, x))) == _fields(traced[0])
    soundness(user, traced[0], (4, SEQ, DIM))


class NormedAttention(nn.Module):
    """A user velocity with a certified block inside: ``proj(attn(norm(x)))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = QKNormAttention(d, 4)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attn(self.norm(x)))


class MixerMLP(nn.Module):
    """Two certified blocks and a plain layer in one velocity: ``mlp(lin(attn(x)))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = QKNormAttention(d, 4, causal=False)
        self.lin = nn.Linear(d, d)
        self.mlp = GatedMLP(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.lin(self.attn(x)))


@pytest.mark.parametrize("make", [NormedAttention, MixerMLP])
def test_nested_certified_blocks_are_collapsed_soundly(make, soundness):
    torch.manual_seed(2)
    m = make(DIM).eval()
    x = torch.randn(1, 8, DIM)
    tc = certblocks.certify(m, x, residual=None)
    rules = [r.rule for r in tc.nodes]
    assert any(r.startswith("own certificate of QKNormAttention (attn)") for r in rules), tc.explain()
    assert not any("scaled_dot_product" in r.op for r in tc.nodes)  # the attention's nodes are hidden
    cert = tc.certificate
    # composition: GatedMLP (1, 1) after attention (1, 1) is (1, 1 + 1)
    assert cert.exponents == Exponents(*((0.0, 0.0) if make is NormedAttention else (1.0, 2.0)))
    assert tc.coefficients_derived and cert.peak is not None
    soundness(m, cert, (4, 8, DIM))


def test_nested_attention_uses_the_blocks_bounds():
    torch.manual_seed(3)
    m = NormedAttention(DIM).eval()
    cert = certblocks.certify(m, torch.randn(1, 8, DIM), residual=None).certificate
    own = m.attn.certificate(seq_len=8)
    a = float(m.norm.weight.detach().abs().max()) * math.sqrt(DIM) + float(m.norm.bias.detach().norm())
    # ||proj(attn(y))|| <= ||W_p|| (c a + b) + ||b_p|| for every LayerNorm output y
    expected = op_norm(m.proj.weight) * (own.c * a + own.b) + float(m.proj.bias.norm())
    assert cert.q == 0.0 and cert.b + cert.c <= expected * (1 + 1e-6)


class Twice(nn.Module):
    """The same certified block called twice: two calls, not one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = GatedMLP(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.mlp(x))


def _whole_velocity(m: nn.Module, x: torch.Tensor) -> tuple:
    g: CapturedGraph = capture(m, (x,))
    return g, g.user_inputs[0], g.outputs[0]


def test_not_one_call_gives_no_own_certificate(soundness):
    torch.manual_seed(4)
    x = torch.randn(1, SEQ, DIM)
    twice = Twice(DIM).eval()
    assert own_certificate(*_whole_velocity(twice, x)) is None
    tc = certblocks.certify(twice, x, residual=None)
    assert sum(r.rule.startswith("own certificate of GatedMLP") for r in tc.nodes) == 2, tc.explain()
    assert tc.exponents == Exponents(1.0, 2.0)  # (1, 1) after (1, 1)
    soundness(twice, tc.certificate, (4, SEQ, DIM))
    # one call followed by another op than a constant scaling
    mlp = GatedMLP(DIM, 2 * DIM).eval()
    g, xin, out = _whole_velocity(mlp, x)
    assert own_certificate(g, xin, out) is not None

    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = mlp

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.mlp(x))

    assert own_certificate(*_whole_velocity(Shifted(), x)) is None


def test_active_dropout_gives_no_own_certificate():
    torch.manual_seed(5)
    x = torch.randn(1, SEQ, DIM)
    attn = QKNormAttention(DIM, 4, attn_dropout=0.1, resid_dropout=0.1)
    assert own_certificate(*_whole_velocity(attn.train(), x)) is None
    assert _fields(own_certificate(*_whole_velocity(attn.eval(), x))) == _fields(attn.certificate(seq_len=SEQ))


# -- own certificates only for the certified class's own forward (issue 31, item 3) ---------------------------------
class LoudMLP(GatedMLP):
    """A subclass that overrides ``forward`` and keeps GatedMLP's certificate: its certificate does not bound it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1e6 * super().forward(x)


class CertifiedLoudMLP(LoudMLP):
    """A subclass that overrides ``forward`` and states a certificate for it: its own certificate is used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1e6 * GatedMLP.forward(self, x)

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        from certblocks.trace.own import scaled_certificate

        return scaled_certificate(GatedMLP.certificate(self, seq_len=seq_len, r0=r0), 1e6, "CertifiedLoudMLP")


def _own_rows(tc) -> List[str]:
    return [r.rule for r in tc.nodes if r.rule.startswith("own certificate")]


def _loud_hook(module, inputs, output):
    return output * 1e6


@pytest.mark.parametrize("where", ["module", "submodule", "global", "pre"])
def test_a_hooked_certified_block_is_traced_generically(where, soundness):
    torch.manual_seed(6)
    mlp = GatedMLP(DIM, 2 * DIM).eval()
    x = torch.randn(1, SEQ, DIM)
    plain = certblocks.certify(mlp, x, residual=None)
    assert _own_rows(plain) and not plain.notes, plain.explain()
    if where == "module":
        handle = mlp.register_forward_hook(_loud_hook)
    elif where == "submodule":
        handle = next(m for m in mlp.modules() if isinstance(m, nn.Linear)).register_forward_hook(_loud_hook)
    elif where == "global":
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, i, o: o * 1e6 if m is mlp else o)
    else:
        handle = mlp.register_forward_pre_hook(lambda m, args: (args[0] * 1e6,))
    try:
        tc = certblocks.certify(mlp, x, residual=None)
        assert not _own_rows(tc), tc.explain()
        assert any("GatedMLP" in n and "hook" in n and "traced op by op" in n for n in tc.notes), tc.notes
        assert tc.coefficients_derived
        assert tc.certificate.c + tc.certificate.b > 1e5 * (plain.certificate.c + plain.certificate.b)
        soundness(mlp, tc.certificate, (4, SEQ, DIM), f"hooked ({where})")
    finally:
        handle.remove()
    again = certblocks.certify(mlp, x, residual=None)
    assert _fields(again.certificate) == _fields(plain.certificate) and not again.notes


def test_a_subclass_overriding_forward_is_traced_generically(soundness):
    torch.manual_seed(7)
    loud = LoudMLP(DIM, 2 * DIM).eval()
    x = torch.randn(1, SEQ, DIM)
    tc = certblocks.certify(loud, x, residual=None)
    assert not _own_rows(tc), tc.explain()
    assert any("LoudMLP.forward is LoudMLP's, not the forward of GatedMLP" in n for n in tc.notes), tc.notes
    soundness(loud, tc.certificate, (4, SEQ, DIM), "LoudMLP")
    # nested in a user velocity: the call is interpreted op by op, and the note names its path
    outer = NormedAttention(DIM).eval()
    outer.attn = LoudMLP(DIM, 2 * DIM).eval()
    nested = certblocks.certify(outer, torch.randn(1, 8, DIM), residual=None)
    assert any("(attn)" in n for n in nested.notes) and not _own_rows(nested)
    soundness(outer, nested.certificate, (4, 8, DIM), "nested LoudMLP")


def test_a_subclass_that_declares_its_certificate_opts_in():
    torch.manual_seed(8)
    m = CertifiedLoudMLP(DIM, 2 * DIM).eval()
    tc = certblocks.certify(m, torch.randn(1, SEQ, DIM), residual=None)
    assert _own_rows(tc) and not tc.notes
    assert _fields(tc.certificate) == _fields(m.certificate(seq_len=SEQ))


def test_a_forward_set_on_the_instance_is_traced_generically():
    torch.manual_seed(9)
    mlp = GatedMLP(DIM, 2 * DIM).eval()
    inner = mlp.forward
    mlp.forward = lambda x: 1e6 * inner(x)
    tc = certblocks.certify(mlp, torch.randn(1, SEQ, DIM), residual=None)
    assert not _own_rows(tc) and any("forward set on the instance" in n for n in tc.notes), tc.notes

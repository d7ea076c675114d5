"""The rules on a plain-torch QK-norm attention come within 2x of QKNormAttention's own certificate, soundly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks import QKNormAttention
from certblocks.trace import certify
from certblocks.trace.own import rules_only

T = 8


class PlainQKNormAttention(nn.Module):
    """QK-norm attention from nn.Linear and F.scaled_dot_product_attention, with QKNorm's conventions:
    ``"rms"`` is ``g x / sqrt(mean(x^2) + eps)``, ``"l2"`` is ``g x / sqrt(||x||^2 + eps)`` written as QKNorm does."""

    def __init__(self, dim: int, heads: int, kind: str = "rms", eps: float = 1e-6, causal: bool = True) -> None:
        super().__init__()
        self.h, self.hd, self.kind, self.eps, self.causal = heads, dim // heads, kind, eps, causal
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.gq = nn.Parameter(torch.ones(self.hd))
        self.gk = nn.Parameter(torch.ones(self.hd))

    def norm(self, t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return F.rms_norm(t, (self.hd,), g, self.eps)
        return F.rms_norm(t, (self.hd,), g, self.eps / self.hd) * self.hd ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = (lin(x).view(B, L, self.h, self.hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self.norm(q, self.gq), self.norm(k, self.gk), v, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(B, L, C))  # (B, L, heads * head_dim)


def _pair(dim: int, heads: int, kind: str, seed: int):
    torch.manual_seed(seed)
    block = QKNormAttention(dim, heads, qk_norm=kind).eval()
    with torch.no_grad():
        block.q_norm.weight.uniform_(0.5, 1.5)
        block.k_norm.weight.uniform_(0.5, 1.5)
    plain = PlainQKNormAttention(dim, heads, kind).eval()
    with torch.no_grad():
        w, b = block.c_attn.weight, block.c_attn.bias
        for i, lin in enumerate((plain.q, plain.k, plain.v)):
            lin.weight.copy_(w[i * dim:(i + 1) * dim])
            lin.bias.copy_(b[i * dim:(i + 1) * dim])
        plain.o.weight.copy_(block.c_proj.weight)
        plain.o.bias.copy_(block.c_proj.bias)
        plain.gq.copy_(block.q_norm.weight)
        plain.gk.copy_(block.k_norm.weight)
    x = torch.randn(2, T, dim)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), block(x), rtol=1e-5, atol=1e-5)
    return block, plain


CASES = [(32, 4, "rms", 0), (32, 4, "l2", 1), (64, 8, "rms", 2), (48, 12, "rms", 3), (64, 4, "l2", 4)]


@pytest.mark.parametrize("dim,heads,kind,seed", CASES)
def test_plain_attention_within_2x_of_the_block(dim, heads, kind, seed):
    block, plain = _pair(dim, heads, kind, seed)
    own = block.certificate(seq_len=T)
    with rules_only():  # the rules alone (the block would otherwise not be traced at all: it is not in the graph)
        traced = certify(plain, torch.randn(1, T, dim), residual=None).certificate
    assert traced.exponents == own.exponents
    assert traced.peak is not None and traced.peak.q == own.peak.q
    peak_b = own.peak.b
    if kind == "l2":
        # QKNorm's l2 is rms_norm(x, eps / d_k) / sqrt(d_k): the rms_norm in between has entries up to
        # sqrt(d_k) ||g||_inf (a token concentrated on one coordinate), which the block's peak leaves out
        gmax = max(float(block.q_norm.weight.detach().abs().max()), float(block.k_norm.weight.detach().abs().max()))
        peak_b = max(peak_b, (dim // heads) ** 0.5 * gmax)
    ratios = {"c": traced.c / own.c, "l1": traced.l1 / own.l1, "l0": traced.l0 / own.l0,
              "peak c": traced.peak.c / own.peak.c, "peak b": traced.peak.b / peak_b}
    assert all(r <= 2.0 for r in ratios.values()), (ratios, traced, own)


@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_plain_attention_certificate_is_sound(kind, soundness):
    _, plain = _pair(32, 4, kind, 5)
    with torch.no_grad():  # a large value bias: the spread rule removes it from the Jacobian bound
        plain.v.bias.mul_(20.0)
    traced = certify(plain, torch.randn(1, T, 32), residual=None).certificate
    soundness(plain, traced, (4, T, 32))


class AcrossHeads(nn.Module):
    """Attention over the head axis (no transpose): the value bias differs from key to key, so it stays."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        with torch.no_grad():
            self.qkv.bias.normal_(0.0, 10.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.h, self.hd).unbind(2)  # (B, L, heads, head_dim): keys = heads
        q, k = F.rms_norm(q, (self.hd,), eps=1e-4), F.rms_norm(k, (self.hd,), eps=1e-4)
        return F.scaled_dot_product_attention(q, k, v).reshape(B, L, C)


def test_value_bias_varying_along_the_keys_is_kept(soundness):
    torch.manual_seed(6)
    m = AcrossHeads().eval()
    tc = certify(m, torch.randn(1, T, 16), residual=None)
    # the bias enters the Jacobian bound: its constant term is at least s * (J_q A_k + A_q J_k) * ||b_v||
    assert tc.certificate.l0 > 10 * tc.certificate.c, tc.explain()
    soundness(m, tc.certificate, (4, T, 16))

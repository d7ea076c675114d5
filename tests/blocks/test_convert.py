"""Drop-in: each from_module source loads by name (strict=True) and the block computes the intended function."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.blocks.attention import Attention, QKNormAttention
from certblocks.blocks.mlp import MLP, GatedMLP

D, H, T = 32, 4, 7
ATOL = 1e-6


class NanoGPTCausalSelfAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (model.py), flash path, written from its published structure."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoGPTMLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool = True) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class TotoStyleGLU(nn.Module):
    """Toto-style feed-forward: fused fc1 (value half, then gate half), SiLU gate, fc2."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(a * F.silu(gate))


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, T, D)


def _qk_norm_reference(block, x, norm) -> torch.Tensor:
    """The intended QK-normalized function, written from the source's weights."""
    B, T_, C = x.shape
    w, b = block.in_proj.weight, block.in_proj.bias
    q, k, v = F.linear(x, w, b).split(C, dim=2)
    q, k, v = (t.view(B, T_, H, C // H).transpose(1, 2) for t in (q, k, v))
    q, k = norm(q), norm(k)
    logits = q @ k.transpose(-2, -1) / math.sqrt(C // H)
    if block.causal:
        logits = logits.masked_fill(~torch.ones(T_, T_, dtype=torch.bool).tril(), float("-inf"))
    y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, T_, C)
    return block.out_proj(y)


def test_nanogpt_attention(x):
    src = NanoGPTCausalSelfAttention(D, H).eval()
    Attention(D, H).load_state_dict(src.state_dict(), strict=True)
    block = Attention.from_module(src).eval()
    assert block.naming == "gpt2" and block.causal
    torch.testing.assert_close(block(x), src(x), atol=ATOL, rtol=0)
    qk = QKNormAttention.from_module(src).eval()
    torch.testing.assert_close(qk.c_attn.weight, src.c_attn.weight)
    ref = _qk_norm_reference(qk, x, lambda t: F.rms_norm(t, (D // H,), eps=1e-6))
    torch.testing.assert_close(qk(x), ref, atol=ATOL, rtol=0)
    nobias = NanoGPTCausalSelfAttention(D, H, bias=False)
    Attention(D, H, bias=False).load_state_dict(nobias.state_dict(), strict=True)
    torch.testing.assert_close(Attention.from_module(nobias)(x), nobias(x), atol=ATOL, rtol=0)


def test_hf_gpt2_attention(x):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cfg = transformers.GPT2Config(n_embd=D, n_head=H, attn_pdrop=0.0, resid_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    src = GPT2Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        src.c_attn.bias.normal_()
        src.c_proj.bias.normal_()
    block = Attention.from_module(src).eval()
    torch.testing.assert_close(block.c_attn.weight, src.c_attn.weight.T)  # Conv1D weights are (in, out)
    torch.testing.assert_close(block(x), src(x)[0], atol=ATOL, rtol=0)
    qk = QKNormAttention.from_module(src, qk_norm="l2").eval()
    ref = _qk_norm_reference(qk, x, lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(qk(x), ref, atol=ATOL, rtol=0)


def test_timm_attention(x):
    timm_layers = pytest.importorskip("timm.layers")
    torch.manual_seed(2)
    src = timm_layers.Attention(D, num_heads=H, qkv_bias=True).eval()
    Attention(D, H, causal=False, qkv_bias=True, naming="timm").load_state_dict(src.state_dict(), strict=True)
    block = Attention.from_module(src).eval()
    assert block.naming == "timm" and not block.causal and set(block.state_dict()) == set(src.state_dict())
    torch.testing.assert_close(block(x), src(x), atol=ATOL, rtol=0)
    for norm_layer, kind in ((timm_layers.RmsNorm, "rms"), (nn.LayerNorm, "layer")):
        src = timm_layers.Attention(D, num_heads=H, qk_norm=True, norm_layer=norm_layer).eval()
        with torch.no_grad():
            for p in list(src.q_norm.parameters()) + list(src.k_norm.parameters()):
                p.uniform_(0.5, 1.5)
        target = QKNormAttention(D, H, causal=False, bias=False, proj_bias=True, qk_norm=kind, naming="timm",
                                 qk_norm_eps=src.q_norm.eps)
        target.load_state_dict(src.state_dict(), strict=True)
        block = QKNormAttention.from_module(src).eval()
        assert block.qk_norm == kind
        torch.testing.assert_close(block(x), src(x), atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="QKNormAttention"):
            Attention.from_module(src)
    gated = timm_layers.Attention(D, num_heads=H, gated=True)
    with pytest.raises(ValueError, match="gated"):
        Attention.from_module(gated)


def test_mlp_sources(x):
    timm_layers = pytest.importorskip("timm.layers")
    src = timm_layers.Mlp(D, 48).eval()
    MLP(D, 48).load_state_dict(src.state_dict(), strict=True)
    torch.testing.assert_close(MLP.from_module(src)(x), src(x), atol=ATOL, rtol=0)
    nano = NanoGPTMLP(D).eval()
    block = MLP.from_module(nano)
    assert block.hidden_dim == 4 * D and block.act == "gelu"
    torch.testing.assert_close(block(x), nano(x), atol=ATOL, rtol=0)


def test_gated_mlp_sources(x):
    timm_layers = pytest.importorskip("timm.layers")
    torch.manual_seed(3)
    # timm SwiGLU: split fc1_g / fc1_x, act(fc1_g x) * fc1_x x
    src = timm_layers.SwiGLU(D, 48).eval()
    block = GatedMLP.from_module(src)
    assert block.gate == "silu" and block.exponents.q == 2
    torch.testing.assert_close(block(x), src(x), atol=ATOL, rtol=0)
    certified = GatedMLP.from_module(src, gate="sigmoid")
    want = src.fc2(src.fc1_x(x) * torch.sigmoid(src.fc1_g(x)))
    torch.testing.assert_close(certified(x), want, atol=ATOL, rtol=0)
    # SwiGLUPacked: fused fc1, gate FIRST (gate_last=False)
    src = timm_layers.SwiGLUPacked(D, 48).eval()
    torch.testing.assert_close(GatedMLP.from_module(src)(x), src(x), atol=ATOL, rtol=0)
    # GluMlp: fused fc1, value first, sigmoid gate last: loads by name
    src = timm_layers.GluMlp(D, 48).eval()
    GatedMLP(D, 24, bias=True).load_state_dict(src.state_dict(), strict=True)
    block = GatedMLP.from_module(src)
    assert block.gate == "sigmoid"
    torch.testing.assert_close(block(x), src(x), atol=ATOL, rtol=0)
    # Toto-style fc1/fc2
    src = TotoStyleGLU(D, 24).eval()
    GatedMLP(D, 24, gate="silu").load_state_dict(src.state_dict(), strict=True)
    torch.testing.assert_close(GatedMLP.from_module(src)(x), src(x), atol=ATOL, rtol=0)
    want = src.fc2(src.fc1(x).chunk(2, -1)[0] * torch.sigmoid(src.fc1(x).chunk(2, -1)[1]))
    torch.testing.assert_close(GatedMLP.from_module(src, gate="sigmoid")(x), want, atol=ATOL, rtol=0)


def test_llama_mlp(x):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    for bias in (False, True):
        cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=40, hidden_act="silu", mlp_bias=bias)
        src = LlamaMLP(cfg).eval()
        block = GatedMLP.from_module(src)
        assert block.hidden_dim == 40 and block.gate == "silu"
        torch.testing.assert_close(block(x), src(x), atol=ATOL, rtol=0)
        want = src.down_proj(src.up_proj(x) * torch.sigmoid(src.gate_proj(x)))
        torch.testing.assert_close(GatedMLP.from_module(src, gate="sigmoid")(x), want, atol=ATOL, rtol=0)


def test_unsupported_sources():
    with pytest.raises(TypeError, match="cannot convert"):
        Attention.from_module(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="cannot convert"):
        GatedMLP.from_module(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="cannot convert"):
        MLP.from_module(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="nn.Module"):
        QKNormAttention.from_module("c_attn")


def test_timm_naming_aliases():
    block = QKNormAttention(D, H, naming="timm")
    assert block.in_proj is block.qkv and block.out_proj is block.proj
    assert set(block.state_dict()) == {"qkv.weight", "qkv.bias", "q_norm.weight", "k_norm.weight", "proj.weight",
                                       "proj.bias"}
    gpt = QKNormAttention(D, H)
    assert gpt.in_proj is gpt.c_attn and not hasattr(gpt, "qkv")

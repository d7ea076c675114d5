"""RotaryQKNormAttention: HF Llama-family conventions (RoPE, GQA, partial rotary), weights loaded strictly, its
certificate sound at every position and under caps (the counterexample searches: tests/blocks/test_soundness.py)."""

from __future__ import annotations

import math

import pytest
import torch

import certblocks
from certblocks.blocks.rotary import ROPE_ROUNDING, RotaryQKNormAttention, apply_rope, rope_cos_sin, rope_inv_freq

transformers = pytest.importorskip("transformers")

D, H, HKV, T = 32, 4, 2, 7


def _randomized(block: RotaryQKNormAttention, seed: int = 0) -> RotaryQKNormAttention:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else p.shape[-1] ** -0.5))
    return block


def _qwen3(**kw):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    cfg = Qwen3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=12,
                      intermediate_size=16, num_hidden_layers=1, **kw)
    cfg._attn_implementation = "sdpa"
    src = Qwen3Attention(cfg, 0).eval()
    with torch.no_grad():
        src.q_norm.weight.uniform_(0.5, 1.5)
        src.k_norm.weight.uniform_(0.5, 1.5)
    return src, Qwen3RotaryEmbedding(cfg)


@pytest.mark.parametrize("offset", [0, 5])
def test_qwen3_attention_is_copied_exactly(offset):
    # Qwen3's attention is this block (QK-norm before RoPE, GQA, head_dim != hidden / heads): same function
    torch.manual_seed(0)
    src, rotary = _qwen3(rope_parameters={"rope_theta": 500.0, "rope_type": "default"})
    block = RotaryQKNormAttention.from_module(src).eval()
    assert (block.num_kv_heads, block.head_dim, block.rope_theta) == (HKV, 12, 500.0)
    x = torch.randn(2, T, D, requires_grad=True)
    pos = torch.arange(offset, offset + T)[None].expand(2, T)
    cos, sin = rotary(x, pos)
    ref = src(x, (cos, sin), None)[0]
    for y in (block(x, position_ids=pos), block(x, position_embeddings=(cos, sin))):
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    gx_ref, = torch.autograd.grad(ref.square().sum(), x)
    gx, = torch.autograd.grad(block(x, position_ids=pos).square().sum(), x)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-5)


def test_llama_attention_loads_strictly_with_fresh_qk_norms():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    cfg = LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, intermediate_size=16,
                      num_hidden_layers=1, attention_bias=True,
                      rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    src = LlamaAttention(cfg, 0)
    block = RotaryQKNormAttention.from_module(src)
    src_sd, sd = src.state_dict(), block.state_dict()
    assert set(sd) - set(src_sd) == {"q_norm.weight", "k_norm.weight"}
    for k, v in src_sd.items():
        assert torch.equal(sd[k], v), k
    assert torch.equal(sd["q_norm.weight"], torch.ones(D // H))
    assert block.rope_theta == 1e6 and block.scale == src.scaling and block.causal


def test_phi3_fused_projection_and_partial_rotary():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding, apply_rotary_pos_emb

    cfg = Phi3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, intermediate_size=16,
                     num_hidden_layers=1, pad_token_id=0,
                     rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    src = Phi3Attention(cfg, 0)
    block = RotaryQKNormAttention.from_module(src)
    assert block.rotary_dim == D // H // 2
    w = torch.cat([block.q_proj.weight, block.k_proj.weight, block.v_proj.weight])
    assert torch.equal(w, src.qkv_proj.weight)
    # the rotation itself: the block's cos/sin and rotation are HF's
    x = torch.randn(2, T, D)
    pos = torch.arange(3, 3 + T)[None].expand(2, T)
    cos, sin = Phi3RotaryEmbedding(cfg)(x, pos)
    c2, s2 = block.rope(x, pos)
    torch.testing.assert_close((c2, s2), (cos, sin))
    q, k = torch.randn(2, H, T, D // H), torch.randn(2, HKV, T, D // H)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref)


CASES = {
    "gqa": dict(num_kv_heads=2),
    "mha-bias": dict(bias=True),
    "mqa-partial": dict(num_kv_heads=1, partial_rotary_factor=0.5, qkv_bias=True),
    "gqa-layer-scaled": dict(num_kv_heads=2, qk_norm="layer", rope_attention_scaling=1.25, head_dim=6),
    "bidirectional-l2": dict(num_kv_heads=2, causal=False, qk_norm="l2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_reference(case):
    block = _randomized(RotaryQKNormAttention(D, H, **CASES[case]).double().eval(), 1)
    x = torch.randn(3, T, D, dtype=torch.float64)
    pos = torch.tensor([[4, 5, 6, 7, 8, 9, 10]])
    mask = torch.rand(3, 1, T, T) > 0.3
    for kw in ({}, {"position_ids": pos}, {"attn_mask": mask}):
        torch.testing.assert_close(block(x, **kw), block.forward_reference(x, **kw), rtol=1e-10, atol=1e-12)


def test_rope_is_an_isometry_per_token():
    inv = rope_inv_freq(8, 10000.0)
    cos, sin = rope_cos_sin(inv, torch.arange(50)[None], torch.float64)
    x = torch.randn(2, 3, 50, 12, dtype=torch.float64)  # rotary_dim 8 of head_dim 12
    y = apply_rope(x, cos, sin)
    # cos and sin are float32 values (HF's): orthogonal up to float32 rounding
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=2.0**-22, atol=0)
    assert not torch.allclose(y, x)
    # cast to bf16, the rotation's norm stays below ROPE_ROUNDING (what the certificate allows), and reaches
    # more than half of its excess over 1 on some angle
    cb, sb = (t.to(torch.bfloat16).double() for t in rope_cos_sin(inv, torch.arange(4096)[None], torch.float32))
    gain = (cb.square() + sb.square()).sqrt().max().item()
    assert 1.0 + 0.5 * (ROPE_ROUNDING - 1.0) < gain <= ROPE_ROUNDING


def test_certificate_does_not_depend_on_position_and_reads_the_groups():
    block = _randomized(RotaryQKNormAttention(D, H, 2)).eval()
    cert = block.certificate()
    assert (cert.q, cert.sigma) == (1, 1) and "RoPE" in cert.culprit
    # the value path of query head h is W_O^h W_V^{h // 2}: one token, the block is that linear map exactly
    one = block.certificate(seq_len=1)
    wv = block.v_proj.weight.double().reshape(2, -1, D).repeat_interleave(2, dim=0).reshape(-1, D)
    exact = torch.linalg.matrix_norm(block.o_proj.weight.double() @ wv, ord=2).item()
    assert exact <= one.c <= exact * (1 + 1e-9)
    # a RoPE scaling m multiplies the normalized vectors: l1 by m^2 (A and G both scale), c unchanged
    scaled = RotaryQKNormAttention(D, H, 2, rope_attention_scaling=2.0)
    scaled.load_state_dict(block.state_dict())
    c2 = scaled.certificate()
    assert c2.c == cert.c and math.isclose(c2.l1, 4.0 * cert.l1, rel_tol=1e-12)
    assert cert.l1 > 0


@pytest.mark.parametrize("case", ["gqa", "gqa-layer-scaled"])
def test_certificate_from_caps_dominates_the_certificate(case):
    block = _randomized(RotaryQKNormAttention(D, H, **CASES[case]))
    caps = {}
    for slot in block.cap_slots():
        t = getattr(slot.module, slot.name).detach().double()
        value = (torch.linalg.matrix_norm(t, ord=2) if slot.kind == "matrix" else
                 t.norm() if slot.kind == "vector" else t.abs().max()).item()
        caps[slot.keys[0]] = value * (1 + 1e-9)
    got, worst = block.certificate(), block.certificate_from_caps(caps)
    for f in ("c", "b", "l1", "l0"):
        assert getattr(worst, f) >= getattr(got, f) * (1 - 1e-9), f


def test_enforce_keeps_a_rotary_stack_certified():
    torch.manual_seed(0)
    blocks = [_randomized(RotaryQKNormAttention(D, H, 2), s) for s in range(3)]
    stack = certblocks.build_stack(blocks, "fp16", certify=False)
    rep = certblocks.enforce(stack, "fp16", depth=6)
    with torch.no_grad():  # the optimizer can move the underlying parameters anywhere
        for p in stack.parameters():
            p.mul_(50.0).add_(torch.randn_like(p))
    certs = [b.certificate() for b in blocks]
    assert certblocks.certificate.certify_stack(certs * 2, "fp16").ok, rep


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        RotaryQKNormAttention(D, 4, 3)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RotaryQKNormAttention(D, 4, partial_rotary_factor=0.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryQKNormAttention(D, 4, partial_rotary_factor=0.1)
    with pytest.raises(ValueError, match="rope_attention_scaling"):
        RotaryQKNormAttention(D, 4, rope_attention_scaling=0.5)
    with pytest.raises(ValueError, match="qk_norm"):
        RotaryQKNormAttention(D, 4, qk_norm="batch")
    with pytest.raises(ValueError, match="position_ids"):
        RotaryQKNormAttention(D, 4)(torch.randn(1, T, D), position_ids=torch.arange(T + 1)[None])
    with pytest.raises(TypeError, match="HF Llama-family attention"):
        RotaryQKNormAttention.from_module(torch.nn.Linear(4, 4))

"""convert() on the HF Llama family, and conversion that never weakens a model silently.

Tiny random configs of Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma: every attention becomes a
RotaryQKNormAttention, every gated MLP a sigmoid GatedMLP, with ``remove_norms`` every traced update is at most
(1, 1); the converted model generates with HF's KV cache exactly as without it.  A conversion that lowers the
certified depth warns (ConversionWarning) or refuses (strict=True), with a reason and fixes that certify again.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from certblocks import QKNormAttention, RotaryQKNormAttention
from certblocks.blocks import Attention
from certblocks.blocks.mlp import GatedMLP
from certblocks.conversion import ConversionError, ConversionWarning, IdentityNorm, convert

tr = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(**COMMON)),
    "mistral": lambda: tr.MistralForCausalLM(tr.MistralConfig(**COMMON, sliding_window=4)),
    "qwen2": lambda: tr.Qwen2ForCausalLM(tr.Qwen2Config(**COMMON)),
    "qwen3": lambda: tr.Qwen3ForCausalLM(tr.Qwen3Config(**COMMON, head_dim=8)),
    "phi3": lambda: tr.Phi3ForCausalLM(tr.Phi3Config(
        **COMMON, rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})),
    "gemma": lambda: tr.GemmaForCausalLM(tr.GemmaConfig(**COMMON, head_dim=8)),
}


def _ids(n: int = 12) -> torch.Tensor:
    return torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_converts_certifies_and_generates_cached(family):
    torch.manual_seed(0)
    src = FAMILIES[family]().eval()
    ids = _ids()
    rep = convert(src, remove_norms=True, example_input={"input_ids": ids, "use_cache": False})
    m = rep.model
    layers = m.model.layers
    for layer in layers:
        assert isinstance(layer.self_attn, RotaryQKNormAttention)
        assert isinstance(layer.mlp, GatedMLP) and layer.mlp.gate == "sigmoid"
        assert isinstance(layer.input_layernorm, IdentityNorm)
    after = rep.certificate_after
    assert after is not None, rep.trace_error_after
    assert [(u.q, u.sigma) for u in after.updates if u.is_update] == [(1, 1)] * (2 * len(layers))
    assert rep.certificate_before is not None and [d.dtype for d in rep.depths] == ["fp16", "bf16", "fp32"]
    # HF's KV cache is used (no use_cache note), and generating with it gives the tokens recomputing gives
    assert not rep.notes and m.config.use_cache
    prompt = ids[:, :5]
    cached = m.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    fresh = m.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, fresh)
    with torch.no_grad():  # a prefix of the sequence: the same logits with and without cache
        full = m(cached, use_cache=False).logits
        out = m(cached[:, :8], use_cache=True)
        step = m(cached[:, 8:9], cache=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], full[:, 8], rtol=1e-4, atol=1e-5)
    # the converted checkpoint loads strictly into another conversion of the same model
    other = convert(FAMILIES[family]().eval(), remove_norms=True).model
    other.load_state_dict(m.state_dict(), strict=True)


def test_qwen3_attention_is_kept_exactly():
    torch.manual_seed(1)
    src = FAMILIES["qwen3"]().eval()
    ids = _ids()
    rep = convert(src, filter_fn=lambda path, mod: not path.endswith("mlp"))
    assert {s.after for s in rep.swaps} == {"RotaryQKNormAttention"}
    # Qwen3 already normalizes queries and keys
    assert all((s.exponents_before.q, s.exponents_before.sigma) == (1, 1) for s in rep.swaps)
    with torch.no_grad():
        torch.testing.assert_close(rep.model(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-5)


def test_remove_norms_refuses_to_leave_an_attention_behind_and_loses_nothing():
    torch.manual_seed(2)
    src = FAMILIES["llama"]().eval()
    state = {k: v.clone() for k, v in src.state_dict().items()}
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.self_attn \(LlamaAttention: excluded by filter_fn"):
        convert(src, remove_norms=True, inplace=True, filter_fn=lambda path, mod: path != "model.layers.1.self_attn")
    assert type(src.model.layers[1].input_layernorm).__name__ == "LlamaRMSNorm"  # reverted
    assert type(src.model.layers[0].self_attn).__name__ == "LlamaAttention"
    assert all(torch.equal(v, state[k]) for k, v in src.state_dict().items())


def test_remove_norms_refuses_an_attention_it_cannot_convert():
    cfg = tr.Gemma2Config(**COMMON, head_dim=8)
    src = tr.Gemma2ForCausalLM(cfg).eval()
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn \(Gemma2Attention: certblocks has no"):
        convert(src, remove_norms=True)
    rep = convert(src)  # without removing norms the unknown attention stays behind its norm
    assert all(s.after == "GatedMLP" for s in rep.swaps)


class _Bare(nn.Module):
    """Residual attention without norms: x + a_k(x)."""

    def __init__(self, n: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(dim, 2) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def test_a_lowered_depth_warns_with_reason_and_fixes_that_certify_again():
    torch.manual_seed(3)
    src = _Bare().eval()
    x = torch.randn(1, 8, 16)
    with pytest.warns(ConversionWarning, match="lowers the certified depth") as rec:
        rep = convert(src, example_input=x, r0=0.05, dtypes=("fp16",), dtype="fp16")
    assert all(isinstance(b, QKNormAttention) for b in rep.model.blocks)
    (low,) = rep.lowered
    assert low.dtype == "fp16" and low.after < low.before
    assert "QK-normalized" in low.reason and "qk_norm_eps" in low.reason
    assert "qk_norm_eps" in str(rec[0].message) and "-" in rep.table()
    fixes = {f.lever: f for f in low.fixes}
    assert "qk_norm_eps" in fixes and "dt" not in fixes  # a converted model has no residual step: no dt lever
    # apply the eps fix for real: rebuild the norms' eps, trace again: the depth before is certified again
    eps = fixes["qk_norm_eps"].value
    for b in rep.model.blocks:
        b.q_norm.eps = b.k_norm.eps = eps
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionWarning)
        again = convert(rep.model, example_input=x, r0=0.05, dtypes=("fp16",), dtype="fp16")
    assert again.certificate_before.certified_depth >= low.before
    # 10% less eps is not enough (the value is the boundary, rounded on the safe side)
    for b in rep.model.blocks:
        b.q_norm.eps = b.k_norm.eps = eps * 0.8
    assert convert(rep.model, example_input=x, r0=0.05, dtype="fp16").certificate_before.certified_depth < low.before


def test_strict_refuses_a_lowering_and_restores_the_model():
    torch.manual_seed(3)
    src = _Bare().eval()
    x = torch.randn(1, 8, 16)
    with pytest.raises(ConversionError, match="lowers the certified depth"):
        convert(src, example_input=x, r0=0.05, dtype="fp16", inplace=True, strict=True)
    assert all(type(b) is Attention for b in src.blocks)


def test_report_without_example_input_has_no_depths():
    rep = convert(FAMILIES["llama"]())
    assert rep.depths == [] and "not available" in rep.table()
    with pytest.raises(TypeError, match="dtypes"):
        convert(nn.Linear(2, 2), dtypes="bf16")


def test_enforced_converted_llama_stays_certified_whatever_the_weights():
    import certblocks

    torch.manual_seed(4)
    model = convert(FAMILIES["qwen2"]().eval(), remove_norms=True).model
    updates = [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    rep = certblocks.enforce(model, "bf16", r0=3.0, lip_g=50.0)
    with torch.no_grad():  # the optimizer may move the underlying parameters anywhere
        for p in model.parameters():
            p.mul_(30.0).add_(torch.randn_like(p))
    certs = [m.certificate() for m in updates]
    assert certblocks.certificate.certify_stack(certs, "bf16", r0=3.0, lip_g=50.0).ok, rep
    ids = _ids()
    assert torch.isfinite(model(ids).logits).all()
    certblocks.enforcement.unenforce(model)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())

"""certblocks.convert on timm ViT, HF GPT-2, HF Mamba and mamba_ssm.Mamba."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from certblocks.blocks.attention import QKNormAttention
from certblocks.blocks.gain import LayerScale
from certblocks.blocks.mamba import LinearGrowthMamba
from certblocks.blocks.mlp import GatedMLP
from certblocks.conversion import ConversionReport, ConversionWarning, convert
from certblocks.exponents import Exponents
from certblocks.trace import certify


def test_timm_vit_tiny():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    src = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32).eval()
    x = torch.randn(1, 3, 32, 32)
    y0 = src(x)
    with pytest.warns(ConversionWarning, match="lowers the certified depth"):
        rep = convert(src, example_input=x)
    assert isinstance(rep, ConversionReport)
    assert rep.model is not src and type(src.blocks[0].attn).__name__ == "Attention"  # source untouched
    assert len(rep.swaps) == 12 and all(s.after == "QKNormAttention" for s in rep.swaps)
    assert rep.swaps[0].path == "blocks.0.attn"
    assert rep.swaps[0].exponents_before == Exponents(1, 2) and rep.swaps[0].exponents_after == Exponents(1, 1)
    assert isinstance(rep.model.blocks[3].attn, QKNormAttention) and not rep.model.training
    assert rep.model(x).shape == (1, 1000)
    assert rep.certificate_before is not None and rep.certificate_after is not None, rep.trace_error_after
    assert rep.max_q_after <= 1
    # the Q/K/V projections are the source's
    torch.testing.assert_close(rep.model.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    # timm's gain slots (nn.Identity without init_values) hold certified gains 1: the function is unchanged, and a
    # lowered depth is fixed with the lever the model has, init_values (a converted backbone has no dt)
    assert isinstance(rep.model.blocks[0].ls1, LayerScale) and isinstance(rep.model.blocks[11].ls2, LayerScale)
    assert any("LayerScale gains" in n for n in rep.notes)
    low = rep.lowered[0]
    fixes = {f.lever: f for f in low.fixes}
    assert "init_values" in fixes and "dt" not in fixes, low.fixes
    assert "init_values <=" in rep.table()
    # the culprit is the attention that grows, not the dropout that ends it (certificates are for eval mode)
    traced = certify(rep.model, x)
    attn = next(u for u in traced if u.name == "blocks.0.attn")
    assert "blocks.0.attn (TimmQKNormAttention)" in attn.culprit and "dropout" not in attn.culprit
    with torch.no_grad():  # apply the fix for real: every gain at the value found, traced again
        for blk in rep.model.blocks:
            blk.ls1.gamma.fill_(fixes["init_values"].value)
            blk.ls2.gamma.fill_(fixes["init_values"].value)
    again = convert(rep.model, example_input=x, dtypes=(low.dtype,), dtype=low.dtype)
    assert again.certificate_before.certified_depth >= low.before
    reverted = rep.revert()
    assert isinstance(reverted.blocks[0].ls1, nn.Identity)
    torch.testing.assert_close(reverted(x), y0)


def test_timm_remove_norms_and_filter():
    timm = pytest.importorskip("timm")
    src = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2)
    rep = convert(src, remove_norms=True, filter_fn=lambda path, m: not path.startswith("blocks.1."))
    paths = [s.path for s in rep.swaps]
    assert paths == ["blocks.0.norm1", "blocks.0.attn", "blocks.0.norm2"]  # module order
    assert isinstance(rep.model.blocks[0].norm1, nn.Identity) and isinstance(rep.model.norm, nn.LayerNorm)
    assert rep.model.training  # train mode kept
    assert "no example_input" in rep.trace_error_after


def test_hf_gpt2_small_config():
    tr = pytest.importorskip("transformers")
    cfg = tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    src = tr.GPT2LMHeadModel(cfg).eval().double()
    ids = torch.randint(0, 64, (1, 8))
    rep = convert(src, remove_norms=True, example_input={"input_ids": ids, "use_cache": False})
    kinds = [(s.path, s.after) for s in rep.swaps]
    assert ("transformer.h.0.attn", "QKNormAttention") in kinds and ("transformer.h.1.ln_2", "Identity") in kinds
    assert len(rep.swaps) == 6
    attn = rep.model.transformer.h[0].attn
    assert attn.c_attn.weight.dtype == torch.float64
    out = rep.model(ids).logits
    assert out.shape == (1, 8, 64) and torch.isfinite(out).all()
    gen = rep.model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 11)
    assert rep.max_q_before <= 1  # through the pre-LN
    assert rep.certificate_after is not None, rep.trace_error_after
    assert rep.max_q_after <= 1
    chain = rep.certificate_after.updates  # the chain: the embedding stem (a map), the updates
    assert [u.exponents for u in chain if u.is_update] == [Exponents(1, 1), Exponents(1, 0)] * 2
    assert chain[0].kind == "map" and chain[0].q == 0 and rep.certificate_after.head is not None


def _hf_mamba():
    tr = pytest.importorskip("transformers")
    cfg = tr.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                         use_mambapy=False)
    torch.manual_seed(0)
    return tr.MambaForCausalLM(cfg).eval()


def test_hf_mamba_small_config():
    src = _hf_mamba()
    ids = torch.randint(0, 64, (1, 8))
    rep = convert(src, remove_norms=True)
    mixers = [s for s in rep.swaps if s.after == "LinearGrowthMamba"]
    assert [s.path for s in mixers] == ["backbone.layers.0.mixer", "backbone.layers.1.mixer"]
    assert all(s.exponents_before == Exponents(5, 5) and s.exponents_after == Exponents(1, 1) for s in mixers)
    norms = [s.path for s in rep.swaps if s.after == "Identity"]
    assert norms == ["backbone.layers.0.norm", "backbone.layers.1.norm"]
    assert isinstance(rep.model.backbone.layers[0].mixer, LinearGrowthMamba)
    out = rep.model(ids).logits  # convert switched the HF cache off
    assert out.shape == (1, 8, 64) and torch.isfinite(out).all()
    assert rep.notes and rep.model.config.use_cache is False and src.config.use_cache is True
    torch.testing.assert_close(rep.model.backbone.layers[1].mixer.A_log, src.backbone.layers[1].mixer.A_log)


def test_hf_mamba_traced_certificate_after():
    src = _hf_mamba()
    ids = torch.randint(0, 64, (1, 8))
    rep = convert(src, remove_norms=True, example_input={"input_ids": ids, "use_cache": False})
    assert rep.max_q_after is not None and rep.max_q_after <= 1, rep.trace_error_after


class _Residual(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(x)


def test_mamba_ssm_mamba(monkeypatch):
    mamba_ssm = pytest.importorskip("mamba_ssm")
    from mamba_ssm.modules import mamba_simple
    from mamba_ssm.ops.selective_scan_interface import selective_scan_ref

    monkeypatch.setattr(mamba_simple, "selective_scan_fn", selective_scan_ref)  # CPU run of the source (tests only)
    torch.manual_seed(0)
    src = _Residual(mamba_ssm.Mamba(16, d_state=4, use_fast_path=False))
    x = torch.randn(2, 8, 16)
    assert torch.isfinite(src(x)).all()
    rep = convert(src, example_input=x)
    assert [str(s.path) for s in rep.swaps] == ["mixer"]
    assert rep.swaps[0].exponents_before == Exponents(5, 5) and rep.swaps[0].exponents_after == Exponents(1, 1)
    # the tracer captures mamba_ssm's reference scan but does not derive its exponents (q = 5 is the blocks'
    # value, recorded in the swap); the certificate before conversion is therefore not certified
    assert rep.certificate_before is not None, rep.trace_error_before
    assert rep.max_q_before is None or rep.max_q_before >= 5
    assert not rep.certificate_before.ok
    y = rep.model(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.sum().backward()
    assert rep.model.mixer.in_proj.weight.grad is not None
    assert rep.model.mixer.training  # mode kept


def test_swiglu_to_sigmoid_gate():
    pytest.importorskip("timm")
    from timm.layers import SwiGLU

    torch.manual_seed(0)
    src = nn.Sequential(_Residual(SwiGLU(16, 32)))
    rep = convert(src, example_input=torch.randn(1, 4, 16))
    assert len(rep.swaps) == 1 and rep.swaps[0].after == "GatedMLP"
    assert rep.swaps[0].exponents_before == Exponents(2, 1) and rep.swaps[0].exponents_after == Exponents(1, 1)
    g = rep.model[0].mixer
    assert isinstance(g, GatedMLP) and g.gate == "sigmoid"
    assert rep.max_q_before == 2 and rep.max_q_after == 1


def test_convert_inplace_and_errors():
    timm = pytest.importorskip("timm")
    src = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    rep = convert(src, inplace=True)
    assert rep.model is src and isinstance(src.blocks[0].attn, QKNormAttention)
    rep.revert()
    assert type(src.blocks[0].attn).__name__ == "Attention"
    with pytest.raises(TypeError, match="model"):
        convert("not a model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="filter_fn"):
        convert(src, filter_fn=3)  # type: ignore[arg-type]


class _NanoAttention(nn.Module):
    """A minimal module with nanoGPT's CausalSelfAttention attributes and forward (written for this test)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


CausalSelfAttention = type("CausalSelfAttention", (_NanoAttention,), {})


def test_nanogpt_causal_self_attention():
    torch.manual_seed(0)
    src = nn.Sequential(_Residual(CausalSelfAttention(32, 4)), _Residual(CausalSelfAttention(32, 4))).eval()
    x = torch.randn(2, 6, 32)
    rep = convert(src, example_input=x)
    assert [s.path for s in rep.swaps] == ["0.mixer", "1.mixer"]
    assert all(s.before == "CausalSelfAttention" and s.after == "QKNormAttention" for s in rep.swaps)
    assert rep.max_q_before == 1 and [u.sigma for u in rep.certificate_before.updates] == [2, 2]
    assert [u.exponents for u in rep.certificate_after.updates] == [Exponents(1, 1)] * 2
    new = rep.model[0].mixer
    assert new.causal and torch.equal(new.c_attn.weight, src[0].mixer.c_attn.weight)
    # with QK-norm scales g the logits differ from the source's; the causal structure is kept
    y = rep.model(x)
    x2 = x.clone()
    x2[:, -1] += 1.0
    torch.testing.assert_close(rep.model(x2)[:, :-1], y[:, :-1])


def test_converted_hf_gpt2_refuses_a_kv_cache_by_name():
    tr = pytest.importorskip("transformers")
    src = tr.GPT2Model(tr.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)).eval()
    rep = convert(src)
    attn = rep.model.h[0].attn
    with pytest.raises(ValueError, match="use_cache=False"):
        attn(torch.randn(1, 4, 16), past_key_values=object())
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        attn(torch.randn(1, 4, 16), encoder_hidden_states=torch.randn(1, 4, 16))


def test_zoo_base_is_abstract():
    from certblocks.zoo._base import ZooModel

    with pytest.raises(TypeError, match="abstract"):
        ZooModel()

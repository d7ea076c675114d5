"""Whole models from their graphs: timm ViT, HF GPT-2, HF PatchTST, HF Mamba (random weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from certblocks.certificate import StackCertificate
from certblocks.exponents import Exponents
from certblocks.trace import ModelCertificate, certify

ZERO = Exponents(0, 0)
ATTN = Exponents(1, 2)
MLP = Exponents(1, 0)


def _strip_norms(model: nn.Module, types=(nn.LayerNorm,)) -> nn.Module:
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, types):
                setattr(mod, name, nn.Identity())
    return model


@pytest.fixture(scope="module")
def vit_certs():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 224, 224)
    built = certify(timm.create_model("vit_tiny_patch16_224", pretrained=False).eval(), x)
    bare = certify(_strip_norms(timm.create_model("vit_tiny_patch16_224", pretrained=False)).eval(), x)
    return built, bare


@pytest.mark.slow
def test_vit_tiny_24_updates_all_bounded(vit_certs):
    built, _ = vit_certs
    assert isinstance(built, ModelCertificate)
    assert len(built) == 24
    assert all(u.exponents == ZERO for u in built), built.explain()
    assert built.names[:4] == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    assert built.names[-1] == "blocks.11.mlp"
    assert all(u.coefficients_derived for u in built)


def test_vit_tiny_without_norms(vit_certs):
    _, bare = vit_certs
    assert len(bare) == 24
    for k, u in enumerate(bare):
        assert u.exponents == (ATTN if k % 2 == 0 else MLP), (u.name, u.exponents)
        assert u.name.endswith(".attn" if k % 2 == 0 else ".mlp")
    st = bare.stack("fp16", r0=1.0)
    assert isinstance(st, StackCertificate) and st.depth == 24


def _gpt2(n_layer=2):
    tr = pytest.importorskip("transformers")
    cfg = tr.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    return tr.GPT2Model(cfg).eval()


def test_gpt2_small_config():
    ids = torch.randint(0, 64, (1, 8))
    built = certify(_gpt2(), ids)
    assert built.names == ["h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp"]
    assert all(u.exponents == ZERO for u in built), built.explain()
    bare = certify(_strip_norms(_gpt2()).eval(), ids)
    assert [u.exponents for u in bare] == [ATTN, MLP, ATTN, MLP], bare.explain()
    # the GELU written out with tanh and x**3 (NewGELUActivation) is collapsed into a Lipschitz atom
    mlp_rules = " ".join(r.rule for r in bare[1].nodes)
    assert "atom GELU" in mlp_rules
    assert bare.stack("fp32").ok


def test_gpt2_module_patterns():
    ids = torch.randint(0, 64, (1, 8))
    sel = certify(_gpt2(), ids, residual="h.*.attn")
    assert sel.names == ["h.0.attn", "h.1.attn"]
    # the attention module alone, as a map of its own (normalized) input
    assert all(u.exponents == ATTN for u in sel)


def _patchtst(**kw):
    tr = pytest.importorskip("transformers")
    from transformers.models.patchtst.modeling_patchtst import PatchTSTEncoderLayer

    cfg = tr.PatchTSTConfig(num_input_channels=2, context_length=32, patch_length=8, patch_stride=8, d_model=16,
                            num_attention_heads=2, ffn_dim=32, **kw)
    torch.manual_seed(0)
    return PatchTSTEncoderLayer(cfg).eval()


def test_patchtst_encoder_layer():
    x = torch.randn(1, 2, 4, 16)
    built = certify(_patchtst(pre_norm=True, norm_type="layernorm"), x)
    assert built.names == ["self_attn", "ff"]
    assert [u.exponents for u in built] == [ZERO, ZERO], built.explain()
    bare = certify(_strip_norms(_patchtst(pre_norm=True, norm_type="layernorm")).eval(), x)
    assert [u.exponents for u in bare] == [ATTN, MLP], bare.explain()


def test_patchtst_batchnorm_is_affine_in_eval():
    """BatchNorm at inference is an affine map (running statistics): it does not bound the state."""
    x = torch.randn(1, 2, 4, 16)
    c = certify(_patchtst(pre_norm=True, norm_type="batchnorm"), x)
    assert [u.exponents for u in c] == [ATTN, MLP]
    assert any("batch_norm in eval mode" in r.rule for r in c[0].nodes)


def test_hf_mamba_slow_path():
    tr = pytest.importorskip("transformers")
    cfg = tr.MambaConfig(hidden_size=8, state_size=3, num_hidden_layers=2, vocab_size=32, expand=2, conv_kernel=3)
    torch.manual_seed(0)
    model = tr.MambaModel(cfg).eval()
    ids = torch.randint(0, 32, (1, 4))
    built = certify(model, ids)
    assert built.names == ["layers.0.mixer", "layers.1.mixer"]
    assert all(u.exponents == ZERO for u in built), built.explain()
    mixers = certify(model, ids, residual="layers.*.mixer")
    for u in mixers:
        assert u.q == 5 and 4 <= u.sigma <= 5, u.explain()

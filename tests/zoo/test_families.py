"""Family specifics: GPT-2 checkpoints, timm registration, torch.compile."""

from __future__ import annotations

import pytest
import torch
from certblocks.zoo import GPT2QKNorm, create_model

from certblocks.exponents import Exponents


def _hf_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab=64):
    tr = pytest.importorskip("transformers")
    cfg = tr.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=vocab,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return tr.GPT2LMHeadModel(cfg)


def test_load_hf_gpt2_state_dict():
    hf = _hf_gpt2()
    sd = hf.state_dict()
    m = create_model("gpt2_qknorm_test", act="gelu_tanh")
    rep = m.load_gpt2_state_dict(sd, qk_scale_init=0.5)
    assert rep.source == "hf"
    assert {k.split(".")[-2] for k in rep.dropped if "ln_" in k} == {"ln_1", "ln_2"}
    assert len([k for k in rep.dropped if ".ln_1." in k or ".ln_2." in k]) == 2 * 2 * 2  # weight+bias, 2 layers
    assert len(rep.initialized) == 2 * 4  # q_norm, k_norm, ls1, ls2 per layer
    assert torch.equal(m.transformer.h[0].attn.q_norm.weight, torch.full((16,), 0.5))
    assert torch.equal(m.transformer.h[1].ls2.gamma, torch.ones(32))  # the checkpoint's branches had no gain
    # with unit gains the model computes the HF model's function minus its residual LayerNorms: a gain-free twin agrees
    twin = create_model("gpt2_qknorm_test", act="gelu_tanh", init_values=None)
    twin.load_gpt2_state_dict(sd, qk_scale_init=0.5)
    ids = torch.randint(0, 64, (1, 16))
    torch.testing.assert_close(m(ids)[0], twin(ids)[0])
    torch.testing.assert_close(m.transformer.h[1].attn.c_attn.weight, sd["transformer.h.1.attn.c_attn.weight"].T)
    torch.testing.assert_close(m.transformer.h[0].mlp.fc2.weight, sd["transformer.h.0.mlp.c_proj.weight"].T)
    assert m.lm_head.weight is m.transformer.wte.weight
    assert "ln_1" in str(rep) or "dropped" in str(rep)
    assert torch.isfinite(m(torch.randint(0, 64, (1, 16)))[0]).all()


def test_load_nanogpt_state_dict():
    hf = _hf_gpt2().state_dict()
    # nanoGPT layout: nn.Linear weights (out, in), an lm_head tied to wte, the causal-mask buffers absent
    sd = {}
    for k, v in hf.items():
        if k.endswith(".attn.bias") or k.endswith(".attn.masked_bias"):
            continue
        if any(k.endswith(s) for s in ("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            v = v.T.contiguous()
        sd[k] = v
    m = create_model("gpt2_qknorm_test")
    rep = m.load_gpt2_state_dict(sd)
    assert rep.source == "nanogpt"
    torch.testing.assert_close(m.transformer.h[0].attn.c_attn.weight, sd["transformer.h.0.attn.c_attn.weight"])
    assert torch.equal(m.transformer.h[1].attn.k_norm.weight, torch.ones(16))
    assert any(".ln_2." in k for k in rep.dropped)
    with pytest.raises(ValueError, match="shape"):
        create_model("gpt2_qknorm_test", n_embd=64).load_gpt2_state_dict(sd)


def test_gpt2_config_checks():
    with pytest.raises(ValueError, match="n_head"):
        GPT2QKNorm(n_layer=1, n_head=3, n_embd=32, block_size=8, vocab_size=16)
    with pytest.raises(TypeError, match="n_layer"):
        GPT2QKNorm(n_layer=1.5)  # type: ignore[arg-type]
    m = create_model("gpt2_qknorm_test")
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 17, dtype=torch.long))
    assert m.certificate().r0 == pytest.approx(m.input_radius())


def test_timm_registration():
    timm = pytest.importorskip("timm")
    import certblocks.zoo  # noqa: F401  (registers the models in timm)

    for size in ("tiny", "small", "base"):
        assert f"certblocks_vit_{size}_patch16_224" in timm.list_models("certblocks_*")
    m = timm.create_model("certblocks_vit_small_patch16_224", num_classes=10, img_size=32, depth=2)
    assert m.pretrained_cfg["architecture"] == "certblocks_vit_small_patch16_224"
    assert m.num_classes == 10 and m.embed_dim == 384
    x = torch.randn(2, 3, 32, 32)
    feats = m.forward_features(x)
    assert feats.shape == (2, 5, 384)
    assert m.forward_head(feats).shape == (2, 10)
    m.reset_classifier(3)
    assert m(x).shape == (2, 3)
    assert not any(isinstance(mod, torch.nn.LayerNorm) for mod in m.blocks.modules())
    cert = m.certificate("bf16")
    assert [u.name for u in cert.updates] == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    assert [u.exponents for u in cert.updates] == [Exponents(1, 1), Exponents(1, 0)] * 2
    with pytest.raises(ValueError, match="pretrained"):
        timm.create_model("certblocks_vit_tiny_patch16_224", pretrained=True)


def test_timm_full_size_certified_by_default_and_refused_without_gains():
    """ViT-Ti/16 (24 updates) at its defaults (branch gains 1e-3) is certified in bf16; without gains it is past
    the bf16 budget and refused unless certify=False."""
    timm = pytest.importorskip("timm")
    import certblocks.zoo

    import certblocks

    m = timm.create_model("certblocks_vit_tiny_patch16_224")
    cert = m.certificate("bf16")
    assert cert.ok and cert.depth == 24 and cert.head is not None
    with pytest.raises(certblocks.CertificationError, match="certify=False"):
        timm.create_model("certblocks_vit_tiny_patch16_224", init_values=0)
    m = timm.create_model("certblocks_vit_tiny_patch16_224", init_values=0, certify=False)
    assert m.certificate("bf16").depth == 24 and not m.certificate("bf16").ok


# one small model per family; inductor (C++ codegen, 10-60 s each on 2 cores: slow) for two of them, the graph
# capture and AOT autograd path (aot_eager) for the others to stay within the test-time budget
@pytest.mark.parametrize("name,backend", [pytest.param("gpt2_qknorm_test", "inductor", marks=pytest.mark.slow),
                                          pytest.param("mamba_forecaster_lg_test", "inductor", marks=pytest.mark.slow),
                                          ("patchtst_noln_test", "aot_eager"), ("toto_style_test", "aot_eager"),
                                          ("certblocks_vit_test", "aot_eager")])
def test_torch_compile(name, backend):
    torch.manual_seed(0)
    m = create_model(name).eval()
    if name.startswith("gpt2"):
        x = torch.randint(0, 64, (2, 16))
    elif name.startswith("toto"):
        x = torch.randn(2, 3, 32)
    elif name.startswith("certblocks_vit"):
        x = torch.randn(2, 3, 32, 32)
    else:
        x = torch.randn(2, m.seq_len, m.n_vars)
    ref = m(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    cm = torch.compile(m, backend=backend)
    out = cm(x)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_toto_style_layout_and_qk_norm_option():
    m = create_model("toto_style_test", n_layer=8, certify=False)  # 16 updates: past the bf16 budget
    axes = [layer.attention.axis for layer in m.layers]
    assert axes == ["time", "time", "time", "variate"] * 2
    assert [u.exponents for u in m.certificate().updates[:2]] == [Exponents(1, 1), Exponents(1, 1)]
    plain = create_model("toto_style_test", qk_norm=False, certify=False)
    assert plain.certificate().updates[0].exponents == Exponents(1, 2)
    x = torch.randn(2, 3, 32)
    y = m(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("name", ["patchtst_noln_test", "patchtst_periln_test", "mamba_forecaster_lg_test",
                                  "mamba_forecaster_rms_test"])
def test_forecaster_shapes(name):
    m = create_model(name).eval()
    x = torch.randn(3, m.seq_len, m.n_vars) * 10 + 5
    y = m(x)
    assert y.shape == (3, m.pred_len, m.n_vars)
    assert m.certificate().depth == 2 * len(m.layers)
    assert m.certificate_seq_len() == m.patch.num_patches
    with pytest.raises(ValueError, match="shape"):
        m(torch.randn(3, m.seq_len + 1, m.n_vars))

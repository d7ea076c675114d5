"""Checkpoints: converted models keep their source's names and layouts and round-trip; zoo models save and load.

A stock class loading a converted checkpoint is exact or fails loudly (strict=True raises on what it lacks); the
round trip through save_pretrained / load_converted (converted) and save_pretrained / from_pretrained (zoo) gives the
same outputs bit for bit.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from certblocks.blocks.attention import QKNormAttention
from certblocks.conversion import CONFIG_KEY, ConversionWarning, convert, load_converted

tr = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _ids(n: int = 10, vocab: int = 64) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))


def _perturb(model: nn.Module) -> nn.Module:
    """Move every weight off its initial value (QK-norm scales, gains and markers included) so a round trip that
    dropped or re-initialized a tensor would show."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _assert_source_tensors_kept(src: nn.Module, conv: nn.Module) -> None:
    """Every tensor the converted checkpoint shares with the source's has its name, shape and values (a layout
    mapped the wrong way round, or a transposed square matrix, would differ)."""
    mine, theirs = conv.state_dict(), src.state_dict()
    shared = [k for k in theirs if k in mine]
    assert shared and all(torch.equal(mine[k], theirs[k]) for k in shared), [
        k for k in shared if not torch.equal(mine[k], theirs[k])]


def _gpt2(n_layer: int = 2) -> nn.Module:
    cfg = tr.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    return tr.GPT2LMHeadModel(cfg).eval()


# ---------------------------------------------------------------------------------------------- HF GPT-2
def test_converted_gpt2_stores_hf_conv1d_layout_and_certifies_the_map_it_computes():
    src = _gpt2()
    rep = convert(src)
    attn = rep.model.transformer.h[0].attn
    sd = rep.model.state_dict()
    # HF's Conv1D layout (in, out), as the stock model's
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == src.transformer.h[0].attn.c_attn.weight.shape == (32, 96)
    assert torch.equal(sd["transformer.h.0.attn.c_attn.weight"], src.transformer.h[0].attn.c_attn.weight)
    assert torch.equal(sd["transformer.h.0.attn.c_proj.weight"], src.transformer.h[0].attn.c_proj.weight)
    # inside, the block keeps nn.Linear's (out, in): its certificate is that of the same map as a plain block's
    plain = QKNormAttention.from_module(src.transformer.h[0].attn).eval()
    assert torch.equal(attn.c_attn.weight, plain.c_attn.weight) and attn.c_attn.weight.shape == (96, 32)
    a, b = attn.certificate(), plain.certificate()
    assert (a.c, a.b, a.l1, a.l0) == (b.c, b.b, b.l1, b.l0)
    x = torch.randn(1, 5, 32)
    torch.testing.assert_close(attn(x)[0], plain(x), rtol=0, atol=0)


def test_a_stock_gpt2_refuses_a_converted_checkpoint_loudly_and_the_shared_tensors_are_exact():
    src = _gpt2()
    conv = _perturb(convert(src).model)
    sd = conv.state_dict()
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*q_norm.weight"):
        _gpt2().load_state_dict(sd, strict=True)
    stock = _gpt2()
    result = stock.load_state_dict(sd, strict=False)
    assert result.missing_keys == [] and all(".q_norm." in k or ".k_norm." in k for k in result.unexpected_keys)
    for i in range(2):  # what the stock model shares with the converted one is the same map
        for name in ("c_attn", "c_proj"):
            ours, theirs = getattr(conv.transformer.h[i].attn, name), getattr(stock.transformer.h[i].attn, name)
            assert torch.equal(theirs.weight, ours.weight.T) and torch.equal(theirs.bias, ours.bias)


@pytest.mark.parametrize("remove_norms", [False, True])
def test_gpt2_save_pretrained_then_load_converted_round_trips(tmp_path, remove_norms):
    conv = _perturb(convert(_gpt2(), remove_norms=remove_norms).model)
    record = getattr(conv.config, CONFIG_KEY)
    assert set(record["converted"]) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert bool(record["norms"]) == remove_norms
    ids = _ids()
    with torch.no_grad():
        want = conv(ids).logits
    conv.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[CONFIG_KEY] == record
    back = load_converted(tmp_path)
    assert type(back.transformer.h[0].attn) is type(conv.transformer.h[0].attn)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)
    # HF's own (non-strict) loader names what the stock class lacks: unexpected QK-norm scales, missing norms
    stock, info = tr.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert any(k.endswith("attn.q_norm.weight") for k in info["unexpected_keys"])
    assert any(".ln_1." in k for k in info["missing_keys"]) == remove_norms


def test_revert_removes_the_conversion_record():
    src = _gpt2(1)
    rep = convert(src)
    assert hasattr(rep.model.config, CONFIG_KEY) and not hasattr(src.config, CONFIG_KEY)
    rep.revert()
    assert not hasattr(rep.model.config, CONFIG_KEY)


def test_load_converted_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_converted(tmp_path)
    with pytest.raises(TypeError, match="source must be"):
        load_converted(3)  # type: ignore[arg-type]
    conv = convert(_gpt2(1)).model
    sd = conv.state_dict()
    sd.pop("transformer.h.0.attn.q_norm.weight")
    with pytest.raises(ValueError, match=r"missing \['transformer.h.0.attn.q_norm.weight'\]"):
        load_converted(_gpt2(1), sd)


# ---------------------------------------------------------------------------------------------- the Llama family
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_llama_family_checkpoints_keep_hf_names_and_round_trip(tmp_path, family):
    torch.manual_seed(0)
    build = {"llama": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA)),
             "phi3": lambda: tr.Phi3ForCausalLM(tr.Phi3Config(**LLAMA))}[family]
    src = build().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        conv = convert(src, remove_norms=True).model
    _assert_source_tensors_kept(src, conv)
    _perturb(conv)
    stock_sd, sd = src.state_dict(), conv.state_dict()
    # every tensor of the source is there, same name and shape (the norms taken out excepted)
    kept = {k: v.shape for k, v in stock_sd.items() if "layernorm" not in k}
    assert {k: sd[k].shape for k in kept} == kept
    extra = sorted({k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1] for k in set(sd) - set(stock_sd)})
    assert extra == ["k_norm.weight", "mlp.certblocks_converted", "q_norm.weight"]
    with pytest.raises(RuntimeError, match="Unexpected key"):
        build().load_state_dict(sd, strict=True)
    ids = _ids(vocab=97)
    with torch.no_grad():
        want = conv(ids, use_cache=False).logits
    conv.save_pretrained(tmp_path)
    back = load_converted(tmp_path)
    with torch.no_grad():
        assert torch.equal(back(ids, use_cache=False).logits, want)
    # the same from a freshly built source and the weights file
    again = load_converted(build().eval(), tmp_path, remove_norms=True)
    with torch.no_grad():
        assert torch.equal(again(ids, use_cache=False).logits, want)


def test_qwen3_attention_is_exact_so_a_stock_qwen3_loads_it_exactly():
    torch.manual_seed(1)
    src = tr.Qwen3ForCausalLM(tr.Qwen3Config(**LLAMA, head_dim=8)).eval()
    _perturb(src)
    conv = convert(src, filter_fn=lambda path, m: path.endswith("self_attn")).model
    sd = conv.state_dict()
    assert set(sd) == set(src.state_dict())  # nothing to mark: the function is the source's
    stock = tr.Qwen3ForCausalLM(tr.Qwen3Config(**LLAMA, head_dim=8)).eval()
    stock.load_state_dict(sd, strict=True)
    ids = _ids(vocab=97)
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, conv(ids).logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- mixers and MLPs
def test_hf_mamba_checkpoint_is_marked_and_round_trips(tmp_path):
    cfg = tr.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                         use_mambapy=False)
    torch.manual_seed(0)
    src = tr.MambaForCausalLM(cfg).eval()
    conv = convert(src).model
    _assert_source_tensors_kept(src, conv)
    _perturb(conv)
    sd = conv.state_dict()
    assert set(sd) - set(src.state_dict()) == {f"backbone.layers.{i}.mixer.certblocks_converted" for i in range(2)}
    with pytest.raises(RuntimeError, match="certblocks_converted"):
        tr.MambaForCausalLM(cfg).load_state_dict(sd, strict=True)
    convert(tr.MambaForCausalLM(cfg)).model.load_state_dict(src.state_dict(), strict=True)  # the source's loads
    ids = _ids()
    with torch.no_grad():
        want = conv(ids).logits
    conv.save_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(load_converted(tmp_path)(ids).logits, want)


def test_timm_glu_mlps_keep_timm_names_and_are_marked():
    timm = pytest.importorskip("timm")
    from timm.layers import GluMlp, SwiGLU

    class Res(nn.Module):
        def __init__(self, mlp: nn.Module) -> None:
            super().__init__()
            self.mlp = mlp

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(x)

    assert timm is not None
    for make in (lambda: SwiGLU(16, 32), lambda: GluMlp(16, 32, act_layer=nn.SiLU, gate_last=False)):
        torch.manual_seed(0)
        src = Res(make())
        conv = convert(src).model
        _assert_source_tensors_kept(src, conv)
        _perturb(conv)
        sd = conv.state_dict()
        assert {k: v.shape for k, v in sd.items() if k != "mlp.certblocks_converted"} == \
            {k: v.shape for k, v in src.state_dict().items()}
        with pytest.raises(RuntimeError, match="certblocks_converted"):
            Res(make()).load_state_dict(sd, strict=True)
        back = load_converted(Res(make()), sd)
        x = torch.randn(2, 3, 16)
        assert torch.equal(back(x), conv(x))


def test_hf_patchtst_attention_converts_with_hf_names():
    cfg = tr.PatchTSTConfig(num_input_channels=2, context_length=32, patch_length=8, patch_stride=8, d_model=16,
                            num_attention_heads=2, num_hidden_layers=2, ffn_dim=32, prediction_length=8)
    torch.manual_seed(0)
    src = tr.PatchTSTForPrediction(cfg).eval()
    rep = convert(src)
    assert [s.after for s in rep.swaps] == ["QKNormAttention"] * 2
    _assert_source_tensors_kept(src, rep.model)
    sd = _perturb(rep.model).state_dict()
    assert {k: v.shape for k, v in sd.items() if "_norm." not in k} == {k: v.shape for k, v in src.state_dict().items()}
    x = torch.randn(1, 32, 2)
    with torch.no_grad():
        want = rep.model(past_values=x).prediction_outputs
    back = load_converted(tr.PatchTSTForPrediction(cfg).eval(), sd)
    with torch.no_grad():
        assert torch.equal(back(past_values=x).prediction_outputs, want)


# ---------------------------------------------------------------------------------------------- timm ViT
def test_timm_vit_checkpoint_round_trips_and_a_stock_vit_refuses_it(tmp_path):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    def build(**kw):
        torch.manual_seed(0)
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, **kw).eval()

    conv = convert(build()).model
    _assert_source_tensors_kept(build(), conv)
    _perturb(conv)
    sd = conv.state_dict()
    assert {"blocks.0.ls1.gamma", "blocks.0.ls2.gamma", "blocks.0.attn.q_norm.weight"} <= set(sd)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        build().load_state_dict(sd, strict=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    x = torch.randn(1, 3, 32, 32)
    back = load_converted(build(), tmp_path / "model.safetensors")
    assert torch.equal(back(x), conv(x))
    # a timm ViT built with gains loads the converted gains by name (timm's LayerScale: ls1.gamma)
    res = build(init_values=1.0).load_state_dict(sd, strict=False)
    assert not res.missing_keys and all("_norm." in k for k in res.unexpected_keys)


# ---------------------------------------------------------------------------------------------- zoo models
ZOO = ["gpt2_qknorm_test", "certblocks_vit_test", "patchtst_noln_test", "mamba_forecaster_lg_test", "toto_style_test"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_save_pretrained_from_pretrained_round_trips(tmp_path, name):
    from certblocks.zoo import ZooModel, create_model

    torch.manual_seed(0)
    model = _perturb(create_model(name)).eval()
    x = model.example_input(8)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model"] == name and cfg["class"].startswith("certblocks.zoo.") and "kwargs" in cfg
    back = ZooModel.from_pretrained(tmp_path)
    assert type(back) is type(model) and not back.training
    got, want = back(x), model(x)
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    assert torch.equal(got, want)
    assert back.certificate().certified_depth == model.certificate().certified_depth


def test_zoo_gpt2_keeps_its_dtype_its_tie_and_saves_a_tied_weight_once(tmp_path):
    from certblocks.zoo import GPT2QKNorm
    from safetensors import safe_open

    m = GPT2QKNorm(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, dtype=torch.bfloat16)
    sd = m.state_dict()
    assert "transformer.wte.weight" in sd and "lm_head.weight" not in sd  # once
    m.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # noqa: SIM118
    back = GPT2QKNorm.from_pretrained(tmp_path)
    assert back.lm_head.weight is back.transformer.wte.weight and back.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(back.lm_head.weight, m.lm_head.weight)
    # a checkpoint with both names (nanoGPT's habit) still loads strictly
    both = dict(sd, **{"lm_head.weight": sd["transformer.wte.weight"]})
    GPT2QKNorm(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32).load_state_dict(both, strict=True)


def test_zoo_from_pretrained_errors_and_overrides(tmp_path):
    from certblocks.zoo import GPT2QKNorm, PatchTSTForecaster, create_model

    from certblocks import CertificationError

    m = create_model("gpt2_qknorm_test")
    m.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="not PatchTSTForecaster"):
        PatchTSTForecaster.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        GPT2QKNorm.from_pretrained(tmp_path / "nothing")
    with pytest.raises(ValueError, match="do not match"):
        GPT2QKNorm.from_pretrained(tmp_path, n_embd=64, n_head=2)
    with torch.no_grad():  # weights far past the budget: loaded, refused only when asked
        m.transformer.h[0].mlp.fc2.weight.mul_(1e4)
        m.transformer.h[1].mlp.fc2.weight.mul_(1e4)
    m.save_pretrained(tmp_path)
    loaded = GPT2QKNorm.from_pretrained(tmp_path)
    assert not loaded.certificate("fp16").ok
    with pytest.raises(CertificationError):
        GPT2QKNorm.from_pretrained(tmp_path, certify=True, cert_dtype="fp16")


def test_zoo_save_pretrained_names_an_argument_json_cannot_hold(tmp_path):
    from certblocks.zoo import create_model

    m = create_model("certblocks_vit_test", act_layer=nn.GELU)
    with pytest.raises(TypeError, match="act_layer"):
        m.save_pretrained(tmp_path)


def test_mamba_block_checkpoint_keeps_mamba_ssm_names_and_is_marked():
    from certblocks.blocks.mamba import LinearGrowthMamba, Mamba

    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = Mamba(16, d_state=4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mixer(x)

    torch.manual_seed(0)
    src = Res()
    conv = convert(src).model
    assert isinstance(conv.mixer, LinearGrowthMamba)
    _assert_source_tensors_kept(src, conv)  # mamba_ssm's names (in_proj, conv1d, x_proj, dt_proj, A_log, D, ...)
    sd = _perturb(conv).state_dict()
    assert set(sd) - set(src.state_dict()) == {"mixer.certblocks_converted"}
    with pytest.raises(RuntimeError, match="certblocks_converted"):
        Res().load_state_dict(sd, strict=True)
    back = load_converted(Res(), sd)
    x = torch.randn(1, 6, 16)
    assert torch.equal(back(x), conv(x))

"""``convert(model, norm="dyt")``: every normalizer of a timm ViT, an HF GPT-2 and an HF Llama becomes a DyT (its
weight and bias kept as gamma and beta, alpha at the DyT paper's 0.5, every other tensor unchanged); the before /
after report per dtype shows the fp16 depth recovered; the converted model's certificate survives the counterexample
search; a saved conversion loads back (docs/dyt.md, docs/theory.md section 7.2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.blocks import DyT
from certblocks.conversion import CONFIG_KEY, convert, load_converted
from certblocks.exponents import SATURATING

timm = pytest.importorskip("timm")
tr = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2).eval()


def _gpt2() -> nn.Module:
    return tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                            bos_token_id=0, eos_token_id=0)).eval()


def _llama() -> nn.Module:
    return tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA)).eval()


def _ids(vocab: int) -> dict:
    return {"input_ids": torch.randint(3, vocab, (1, 10), generator=torch.Generator().manual_seed(0)),
            "use_cache": False}


#: (build, example input, the normalizers' paths, the fp16 depth before the conversion)
CASES = {
    "timm-vit": (_vit, lambda: torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
                 ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]),
    "hf-gpt2": (_gpt2, lambda: _ids(64),
                ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1", "transformer.h.1.ln_2",
                 "transformer.ln_f"]),
    "hf-llama": (_llama, lambda: _ids(97),
                 ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                  "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]),
}


def _randomize_norms(model: nn.Module) -> None:
    """Weights and biases off their initial values, so that a conversion that dropped them would show."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if "norm" in type(m).__name__.lower():
                for p in m.parameters(recurse=False):
                    p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_normalizer_becomes_a_dyt_and_fp16_is_certified_after(name):
    build, example, norms = CASES[name]
    torch.manual_seed(0)
    src = build()
    _randomize_norms(src)
    before_sd = {k: v.clone() for k, v in src.state_dict().items()}
    rep = convert(src, norm="dyt", example_input=example())
    m = rep.model
    assert [s.path for s in rep.swaps] == norms and all(s.after == "DyT" and s.exponents_after == SATURATING
                                                     for s in rep.swaps)
    assert torch.equal(src.state_dict()[next(iter(before_sd))], next(iter(before_sd.values())))  # source untouched
    for path in norms:
        old, new = src.get_submodule(path), m.get_submodule(path)
        assert isinstance(new, DyT) and not isinstance(old, DyT)
        assert torch.equal(new.weight, old.weight) and float(new.alpha.detach()) == 0.5
        assert torch.equal(new.bias, old.bias) if getattr(old, "bias", None) is not None else \
            torch.equal(new.bias, torch.zeros_like(new.bias))
    # every tensor that is not a normalizer's is unchanged, under its own name
    sd = m.state_dict()
    kept = [k for k in before_sd if k.rpartition(".")[0] not in norms]
    assert kept and all(torch.equal(sd[k], before_sd[k]) for k in kept)
    # the report: the before / after depths in each dtype; after the conversion every update certified in fp16
    assert [d.dtype for d in rep.depths] == ["fp16", "bf16", "fp32"], rep.trace_error_after
    fp16 = rep.depths[0]
    assert fp16.after > fp16.before and fp16.depth_after == fp16.depth_before == 4, rep.table()
    assert fp16.after == rep.certificate_after.in_dtype("fp16").certified_depth
    assert all(d.after == d.depth_after for d in rep.depths[1:]), rep.table()
    assert "fp16" in rep.table()
    # the traced certificate after: every update (0, 0) behind its DyT
    after = rep.certificate_after
    assert all((u.q, u.sigma) == (0, 0) for u in after.updates if u.is_update), after


def test_converted_vit_is_sound_against_the_search():
    """The traced certificate of the converted timm ViT (stem, four pre-DyT updates, head) against the search over
    the output, every intermediate, the state and the costate at every boundary (float64)."""
    from certblocks.trace import certify

    torch.manual_seed(0)
    m = convert(_vit(), norm="dyt", dyt_alpha=2.0).model.double().eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rep = certify(m, x)
    st = rep.stack("bf16", loss="cross_entropy", r0=float(x.norm(dim=1).max()))
    assert st.ok, st.explain()
    report = cbt.assert_model_sound(m, st, x, count=6, restarts=1, from_best=1, steps=6, rtol=1e-6,
                                    loss="cross_entropy", model_certificate=rep)
    assert all(r.ratio > 0 for r in report.checks), report


def test_dyt_alpha_per_path_and_the_arguments_are_checked():
    torch.manual_seed(0)
    m = convert(_gpt2(), norm="dyt", dyt_alpha=lambda path, mod: 2.0 if path.endswith("ln_1") else 0.25).model
    alphas = {p: float(mod.alpha.detach()) for p, mod in m.named_modules() if isinstance(mod, DyT)}
    assert alphas == {"transformer.h.0.ln_1": 2.0, "transformer.h.0.ln_2": 0.25, "transformer.h.1.ln_1": 2.0,
                      "transformer.h.1.ln_2": 0.25, "transformer.ln_f": 0.25}
    only = convert(_gpt2(), norm="dyt", filter_fn=lambda path, mod: path == "transformer.ln_f").model
    assert isinstance(only.transformer.ln_f, DyT) and isinstance(only.transformer.h[0].ln_1, nn.LayerNorm)
    with pytest.raises(ValueError, match="norm must be one of"):
        convert(_gpt2(), norm="rms")
    with pytest.raises(ValueError, match="remove_norms"):
        convert(_gpt2(), norm="dyt", remove_norms=True)
    with pytest.raises(ValueError, match="dyt_alpha"):
        convert(_gpt2(), norm="dyt", dyt_alpha=0.0)


def test_a_saved_dyt_conversion_loads_back_exactly(tmp_path):
    torch.manual_seed(0)
    conv = convert(_llama(), norm="dyt").model
    with torch.no_grad():
        for p in conv.parameters():  # alpha and every other tensor off its initial value
            p.add_(0.05 * torch.randn(p.shape))
    assert getattr(conv.config, CONFIG_KEY)["norm"] == "dyt"
    conv.save_pretrained(tmp_path)
    back = load_converted(tmp_path)
    assert isinstance(back.model.norm, DyT) and isinstance(back.model.layers[1].input_layernorm, DyT)
    ids = _ids(97)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(back(ids, use_cache=False).logits, conv(ids, use_cache=False).logits, rtol=0,
                                   atol=0)

"""The DyT zoo: every model certified in pure fp16 at its defaults (full size, at initialization, head included), the
defaults the largest round gains that certify, timm registration, and the whole models searched for counterexamples
(docs/dyt.md, "The zoo models")."""

from __future__ import annotations

import math

import pytest
import torch

import certblocks.testing as cbt
from certblocks.blocks import DyT, PreNormed, QKDyTAttention
from certblocks.certificate import certify_stack
from certblocks.trace import ModelCertificate, certify

timm = pytest.importorskip("timm")
from certblocks.zoo import create_model, list_models, model_entry  # noqa: E402

GPT = ("gpt2_dyt_tiny", "gpt2_dyt_mini", "gpt2_dyt_124m")
VIT = tuple(f"certblocks_vit_dyt_{s}_patch16_224" for s in ("tiny", "small", "base"))
#: the next round value above each default (1, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, ...), refused in fp16
ROUND = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.005, 0.003, 0.002, 0.001)
SLOW = {"gpt2_dyt_124m", "certblocks_vit_dyt_small_patch16_224", "certblocks_vit_dyt_base_patch16_224"}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


def _build(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model(name, **kw)


def test_registered_in_the_zoo_and_in_timm():
    assert set(GPT) | set(VIT) <= set(list_models())
    assert {"gpt2_dyt_test", "certblocks_vit_dyt_test"} <= set(list_models(include_test=True))
    assert {model_entry(n).family for n in GPT} == {"gpt2_dyt"} and {model_entry(n).family for n in VIT} == {"vit_dyt"}
    assert set(VIT) <= set(timm.list_models("certblocks_vit_dyt_*"))
    m = timm.create_model("certblocks_vit_dyt_tiny_patch16_224", num_classes=7, img_size=32, patch_size=8, depth=2)
    assert isinstance(m.blocks[0].norm1, DyT) and isinstance(m.norm, DyT) and isinstance(m.blocks[0].attn,
                                                                                         QKDyTAttention)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("certblocks_vit_dyt_tiny_patch16_224", pretrained=True)
    with pytest.raises(ValueError, match="norm_layer"):
        timm.create_model("certblocks_vit_dyt_tiny_patch16_224", norm_layer=torch.nn.LayerNorm)


@pytest.mark.parametrize("name", _params(GPT + VIT))
def test_certified_in_pure_fp16_at_the_defaults_and_the_next_round_gain_is_refused(name):
    m = _build(name)  # certify=True, cert_dtype fp16: refused at construction if not certified
    assert m.cert_dtype == "fp16"
    for dtype in ("fp16", "bf16"):
        cert = m.certificate(dtype)
        assert cert.ok and cert.certified_depth == cert.depth == 2 * len(getattr(m, "blocks", None)
                                                                          or m.transformer.h), cert.explain()
        assert cert.head is not None and "head" in cert.head.name  # Lip(G) from the DyT head, not assumed
    assert all((u.q, u.sigma, u.c, u.l1) == (0, 0, 0, 0) for u in m.certificate("fp16").updates)
    default = m.init_values
    above = [v for v in ROUND if v > default * (1 + 1e-9)]
    if above:  # the default is the largest round value that certifies
        assert not _build(name, init_values=above[-1], certify=False).certificate("fp16").ok, (name, above[-1])


def test_the_budget_is_spent_per_update_whatever_the_radius():
    m = _build("gpt2_dyt_tiny")
    near, far = m.certificate("fp16"), m.certificate("fp16", r0=1e3)
    assert near.ok and far.ok and near.log_factors == far.log_factors


@pytest.mark.parametrize("name,overrides", [("gpt2_dyt_test", dict(n_layer=2)),
                                            ("certblocks_vit_dyt_test", dict(depth=2))])
def test_whole_model_is_sound_against_the_search(name, overrides):
    """The zoo's own update and head certificates in the chain, with the traced stem: the search tries to beat the
    output, every intermediate, each segment's peak, the state and the costate at every boundary (float64)."""
    m = _build(name, **overrides).eval()
    gpt = name.startswith("gpt2")
    x = torch.randint(0, m.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)) if gpt else \
        torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    rep = certify(m, x)
    assert isinstance(rep, ModelCertificate) and rep.chained and rep.stem is not None, rep
    traced = rep.stack("fp16", loss="cross_entropy", **({} if gpt else {"r0": float(x.norm(dim=1).max())}))
    updates = m.update_certificates(seq_len=8 if gpt else None)
    assert [u.name for u in rep.updates] == [u.name for u in updates]
    head = m.head_certificate()
    stem = traced.updates[0]  # the traced stem as the stack reads it (token ids: a table lookup, sigma 0)
    own = certify_stack([stem] + updates, "fp16", r0=traced.r0, head=head, loss_grad=traced.loss_grad)
    assert own.ok and len(own.updates) == len(traced.updates), own.explain()
    search = dict(count=6, restarts=1, from_best=1, steps=6, rtol=1e-6, loss="cross_entropy", model_certificate=rep)
    for st in (own, traced):
        report = cbt.assert_model_sound(m, st, x, **search)
        assert all(r.ratio > 0 for r in report.checks), report
    # a planted too-small bound is found: the head's Lip(G) divided by 100 breaks the costate bound
    bad = certify_stack([stem] + updates, "fp16", r0=traced.r0, lip_g=head.l0 * math.sqrt(2) / 100)
    assert not cbt.search_model(m, bad, x, **{**search, "model_certificate": rep}, checks=["costate"]).ok


def test_pre_ln_baseline_builds_and_is_not_fp16_certified():
    m = create_model("gpt2_dyt_mini", norm="layer", qk_norm=None, init_values=None, certify=False, vocab_size=256,
                     block_size=64)
    assert isinstance(m.transformer.h[0].ln_1, torch.nn.LayerNorm) and m.transformer.h[0].ls1.__class__.__name__ == \
        "Identity"
    cert = m.certificate("fp16")
    assert not cert.ok and isinstance(m.residual_updates()[0][1], PreNormed)
    v = create_model("certblocks_vit_dyt_test", norm="layer", qk_norm=None, init_values=None, certify=False)
    assert isinstance(v.norm, torch.nn.LayerNorm) and v.certificate("fp16").depth == 4


def test_gpt2_dyt_refuses_checkpoints_and_points_at_convert():
    m = _build("gpt2_dyt_test")
    with pytest.raises(TypeError, match="certblocks.convert"):
        m.load_gpt2_state_dict({})


def test_gpt2_dyt_scales_its_embedded_tokens_and_its_radius_bounds_them():
    """The learnable scalar after the embedding (sqrt(n_embd) with DyTs, none for the Pre-LN baseline or with
    ``emb_scale=None``): the forward's embedded tokens are the scaled ones and ``input_radius()`` bounds every one."""
    m = _build("gpt2_dyt_test")
    assert m.emb_scale is not None and float(m.emb_scale.scale.detach()) == pytest.approx(math.sqrt(m.n_embd))
    assert "emb_scale.scale" in m.state_dict() and any(p is m.emb_scale.scale for p in m.parameters())
    plain = _build("gpt2_dyt_test", emb_scale=None)
    assert plain.emb_scale is None and plain.input_radius() == pytest.approx(m.input_radius() / math.sqrt(m.n_embd))
    idx = torch.arange(m.vocab_size).reshape(4, -1)[:, :m.block_size]  # every token id, at every position
    with torch.no_grad():
        emb = m.embed(idx)
        assert torch.equal(emb, plain.embed(idx) * m.emb_scale.scale)
        m.emb_scale.scale.fill_(-7.5)  # trained to a negative value: the radius takes its magnitude
        assert float(m.embed(idx).norm(dim=-1).max()) <= m.input_radius() * (1 + 1e-6)
    m.emb_scale.reset_parameters()
    logits, loss = m(idx, idx)
    loss.backward()
    assert m.emb_scale.scale.grad is not None and torch.isfinite(m.emb_scale.scale.grad)
    assert create_model("gpt2_dyt_test", norm="layer", qk_norm=None, init_values=None, certify=False).emb_scale is None
    assert float(_build("gpt2_dyt_test", emb_scale=2.0).emb_scale.scale.detach()) == 2.0
    for bad in (0.0, -1.0, float("nan"), "sqrt"):
        with pytest.raises((ValueError, TypeError), match="emb_scale"):
            _build("gpt2_dyt_test", emb_scale=bad)

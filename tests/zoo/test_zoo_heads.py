"""The zoo's heads: their map certificates are sound and give the models' Lip(G)."""

from __future__ import annotations

import math

import pytest
import torch
from certblocks.zoo import create_model
from torch import nn

import certblocks.testing as cbt
from certblocks.certificate import cross_entropy_gradient


def _heads():
    torch.manual_seed(0)
    gpt = create_model("gpt2_qknorm_test", certify=False).eval()
    with torch.no_grad():  # non-trivial gains and biases
        gpt.transformer.ln_f.weight.uniform_(-2.0, 2.0)
        gpt.transformer.ln_f.bias.uniform_(-1.0, 1.0)
    yield "gpt2", gpt, nn.Sequential(gpt.transformer.ln_f, gpt.lm_head), (6, gpt.lm_head.in_features)
    vit = create_model("certblocks_vit_tiny_patch16_224", certify=False, img_size=32, depth=2, num_classes=7).eval()
    with torch.no_grad():
        vit.head.bias.uniform_(-1.0, 1.0)
    d = vit.embed_dim
    yield "vit", vit, nn.Sequential(vit.norm, vit.head), (5, d)  # per token: the class-token pool selects one


@pytest.mark.parametrize("name,model,head,shape", list(_heads()), ids=["gpt2", "vit"])
def test_head_certificate_is_sound_and_gives_lip_g(name, model, head, shape):
    cert = model.head_certificate()
    assert cert.kind == "map" and cert.q == 0 and cert.sigma == 0
    cbt.assert_sound(head, cert, shape, radii=(0.01, 1.0, 100.0), count=8, restarts=2, steps=4)
    st = model.certificate("bf16")
    assert st.head == cert and st.lip_g == pytest.approx(cert.l0 * cross_entropy_gradient, rel=1e-12)
    assert model.certificate("bf16", lip_g=1.0).lip_g == 1.0 and model.certificate("bf16", lip_g=1.0).head is None
    assert math.isfinite(st.output_bound)


def test_forecasters_have_no_head_certificate():
    m = create_model("patchtst_noln_test", certify=False)
    assert m.head_certificate() is None and m.certificate("bf16").lip_g == 1.0


def test_a_planted_small_head_bound_is_found():
    import dataclasses

    name, model, head, shape = next(_heads())
    cert = model.head_certificate()
    with pytest.raises(AssertionError):
        cbt.assert_sound(head, dataclasses.replace(cert, b=cert.b / 100, l0=cert.l0 / 100, peak=None), shape,
                         radii=(1.0,), count=8, restarts=2, steps=4)

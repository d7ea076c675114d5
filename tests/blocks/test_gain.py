"""Branch gains: a gained update's certificate (the branch's times max |gamma|) against counterexample searches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import certblocks.testing as cbt
from certblocks.blocks import MLP, LayerScale, QKNormAttention, ScaledBranch, gain_param_groups


def _gained(branch: torch.nn.Module, dim: int, low: float, high: float) -> ScaledBranch:
    gain = LayerScale(dim, 1.0)
    with torch.no_grad():  # per-channel gains of both signs, some above 1 (the peak scales then)
        gain.gamma.uniform_(low, high)
        gain.gamma[::2] *= -1
    return ScaledBranch(branch, gain, ("attn" if isinstance(branch, QKNormAttention) else "mlp", "ls1")).eval()


@pytest.mark.parametrize("kind,low,high", [("mlp", 0.05, 0.3), ("mlp", 0.5, 3.0), ("attn", 0.01, 0.2),
                                           ("attn", 1.0, 2.5)])
def test_gained_update_is_sound(kind, low, high):
    torch.manual_seed(0)
    dim = 16
    branch = MLP(dim, 32) if kind == "mlp" else QKNormAttention(dim, 2, qk_norm_eps=1e-3)
    block = _gained(branch, dim, low, high)
    cert = block.certificate(seq_len=6)
    inner = branch.certificate(seq_len=6)
    g = block.gain.bound()
    assert cert.c == pytest.approx(g * inner.c) and cert.l1 == pytest.approx(g * inner.l1)
    assert cert.exponents == inner.exponents
    cbt.assert_sound(block, cert, (6, dim), radii=(0.1, 1.0, 10.0), count=8, restarts=2, steps=4)


def test_a_planted_small_gain_is_found():
    torch.manual_seed(0)
    block = _gained(MLP(16, 32), 16, 1.5, 3.0)
    cert = block.certificate(seq_len=6)
    too_small = dataclasses.replace(cert, c=cert.c / 4, b=cert.b / 4, l1=cert.l1 / 4, l0=cert.l0 / 4, peak=None)
    with pytest.raises(AssertionError):
        cbt.assert_sound(block, too_small, (6, 16), radii=(1.0,), count=8, restarts=2, steps=4)


def test_enforce_caps_the_gain():
    from certblocks.enforcement import cap_factor

    torch.manual_seed(0)
    block = _gained(MLP(16, 32), 16, 0.5, 0.9)
    keys = [k for sl in block.cap_slots() for k in sl.keys]
    assert keys[-1] == "gain"
    worst = block.certificate_from_caps({k: 1.0 for k in keys}, seq_len=6)
    half = block.certificate_from_caps({**{k: 1.0 for k in keys}, "gain": 0.5}, seq_len=6)
    assert half.c == pytest.approx(0.5 * worst.c) and half.l0 == pytest.approx(0.5 * worst.l0)
    alpha, stack = cap_factor([("u", block)], "fp16", r0=1.0)
    assert alpha > 0 and stack.ok


def test_gain_param_groups_put_every_gain_in_its_own_group_at_the_scaled_rate():
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_dyt_test")  # tied embedding / head, DyTs, gains
    groups = gain_param_groups(model, 1e-3, weight_decay=0.1, gain_lr_scale=30.0)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}  # each once, tied once
    matrices, vectors, gains = groups
    assert gains["lr"] == pytest.approx(0.03) and gains["weight_decay"] == 0.0
    assert {id(p) for p in gains["params"]} == {id(m.gamma) for m in model.modules() if isinstance(m, LayerScale)}
    assert matrices["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in matrices["params"])
    assert vectors["weight_decay"] == 0.0 and all(p.ndim < 2 for p in vectors["params"])
    opt = torch.optim.AdamW(groups, lr=1e-3)  # the groups' own rates and a scheduler scales each
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-4, 1.5e-2]) and sched is not None
    vit_like = gain_param_groups(model, 1e-3, weight_decay=0.1, no_decay=("transformer.wpe.weight",))
    assert all(p is not model.transformer.wpe.weight for p in vit_like[0]["params"])  # a named matrix without decay
    assert any(p is model.transformer.wpe.weight for p in vit_like[1]["params"])
    plain = torch.nn.Linear(3, 3)  # no gains: no gain group
    assert len(gain_param_groups(plain, 1e-3)) == 2
    for kw in ({"gain_lr_scale": 0.0}, {"weight_decay": -1.0}, {"gain_lr_scale": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            gain_param_groups(model, 1e-3, **kw)

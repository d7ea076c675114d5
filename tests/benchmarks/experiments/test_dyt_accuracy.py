"""benchmarks/experiments/dyt_accuracy.py: the branch gains' own learning-rate group and the grid over its scale
(only for models with gains), in the script's --quick mode."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from dyt_accuracy import build_gpt, main, optimizer_groups

pytest.importorskip("timm")


def test_the_gains_are_one_group_at_the_scaled_rate_without_weight_decay() -> None:
    from certblocks.zoo import create_model

    from certblocks.blocks import LayerScale

    torch.manual_seed(0)
    model = create_model("gpt2_dyt_mini", vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    groups = optimizer_groups(model, 0.1, 30.0)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # every parameter once
    gains = {id(m.gamma) for m in model.modules() if isinstance(m, LayerScale)}
    assert len(gains) == 4  # two updates in each of two layers
    (gain_group,) = [g for g in groups if g["lr_scale"] == 30.0]
    assert {id(p) for p in gain_group["params"]} == gains and gain_group["weight_decay"] == 0.0
    assert all(g["lr_scale"] == 1.0 for g in groups if g is not gain_group)


def test_quick_grid_scales_only_the_models_with_gains(tmp_path) -> None:
    out = tmp_path / "dyt.json"
    result = main(["--vit", "--quick", "--variants", "dyt", "preln", "--seeds", "0", "--vit-lrs", "1e-3",
                   "--gain-lr-scales", "1", "30", "--out", str(out)])
    runs = result["vit"]["runs"]
    assert sorted((r["variant"], r["gain_lr_scale"]) for r in runs) == [("dyt", 1.0), ("dyt", 30.0), ("preln", 1.0)]
    assert {r["variant"]: r["has_gains"] for r in runs} == {"dyt": True, "preln": False}
    best = result["vit"]["best_lr"]
    assert best["preln"] == [1e-3, 1.0] and best["dyt"][1] in (1.0, 30.0)
    (dyt_row,) = [r for r in result["vit"]["summary"] if r["variant"] == "dyt"]
    assert dyt_row["gain_lr_scale"] == best["dyt"][1] and set(dyt_row["lr_grid"]) == {"0.001", "0.001 x30"}
    assert json.loads(out.read_text())["vit"]["best_lr"] == best


def test_float32_state_adamw_is_adamw_and_keeps_fp16_moments_from_underflowing() -> None:
    from dyt_accuracy import Float32StateAdamW

    torch.manual_seed(0)
    w0 = torch.randn(8, 5)
    grads = [torch.randn(8, 5) * 10.0 ** -k for k in range(4)]  # gradients from 1 down to 1e-3
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}], lr=1e-2, eps=1e-8)
    ours = Float32StateAdamW([{"params": [b], "weight_decay": 0.1}], lr=1e-2, eps=1e-8)
    for g in grads:  # float32 parameters: torch's AdamW, step for step
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    # fp16 parameters with gradients of 1e-3: (1 - beta2) g^2 = 1e-9 is 0 in fp16, not in float32
    h16, f16 = w0.half().requires_grad_(), w0.half().requires_grad_()
    torch_opt = torch.optim.AdamW([h16], lr=1e-3, eps=1e-4)
    ours16 = Float32StateAdamW([f16], lr=1e-3, eps=1e-4)
    for _ in range(3):
        h16.grad = f16.grad = torch.full_like(h16, 1e-3)
        torch_opt.step()
        ours16.step()
    assert torch_opt.state[h16]["exp_avg_sq"].eq(0).all()  # the underflow the option exists for
    v = ours16.state[f16]["exp_avg_sq"]
    assert v.dtype == torch.float32 and v.gt(0).all() and f16.dtype == torch.float16
    # Adam's step is about lr whatever the gradient's scale; torch's fp16 one is lr m / eps, its size set by the
    # gradient's (here m = 1e-3: ten times Adam's; gradients below eps give steps below Adam's)
    moved = float((w0.half().float() - f16.detach().float()).abs().mean())
    moved_torch = float((w0.half().float() - h16.detach().float()).abs().mean())
    assert 2e-3 < moved < 4e-3 and 2e-2 < moved_torch < 4e-2


def test_dyt_overrides_reach_only_the_dyt_variant_and_are_recorded(tmp_path) -> None:
    result = main(["--gpt", "--quick", "--variants", "dyt", "preln", "--seeds", "0", "--gpt-lrs", "1e-3",
                   "--dyt-overrides", '{"alpha_init": 1.0, "init_values": 0.05}', "--out", str(tmp_path / "d.json")])
    runs = {r["variant"]: r for r in result["gpt"]["runs"]}
    assert runs["dyt"]["overrides"] == {"alpha_init": 1.0, "init_values": 0.05} and runs["preln"]["overrides"] == {}
    args = argparse.Namespace(gpt_block=16, quick=True, dyt_overrides={"alpha_init": 1.0, "init_values": 0.05})
    model = build_gpt("dyt", 0, args)
    assert model.alpha_init == 1.0 and model.init_values == 0.05
    assert float(model.transformer.h[0].ls1.gamma.detach()[0]) == pytest.approx(0.05)
    assert build_gpt("preln", 0, args).norm_kind == "layer"  # the baselines keep their own constructors


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_dyt_overrides_must_be_a_json_object(text: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--gpt", "--quick", "--dyt-overrides", text])
    assert "--dyt-overrides: must be a JSON object" in capsys.readouterr().err


def test_dyt_edit_changes_the_built_gpt_and_vit_as_named() -> None:
    from dyt_accuracy import apply_edit, build_vit

    from certblocks.blocks import DyT

    edit = {"mlp_gain": 0.5, "qk_gamma": 2.0, "proj_scale": 0.0, "kind": "erf"}
    args = argparse.Namespace(gpt_block=16, quick=True, dyt_overrides={}, dyt_edit=edit)
    plain = argparse.Namespace(gpt_block=16, quick=True, dyt_overrides={}, dyt_edit=None)
    gpt, ref = build_gpt("dyt", 0, args), build_gpt("dyt", 0, plain)
    vit = build_vit("dyt", 0, args)
    for model, out in ((gpt, "c_proj"), (vit, "proj")):
        blocks = model.transformer.h if model is gpt else model.blocks
        for b in blocks:
            assert bool((b.ls2.gamma == 0.5).all()) and bool((b.ls1.gamma != 0.5).all())
            assert bool((b.attn.q_norm.weight == 2.0).all()) and bool((b.attn.k_norm.weight == 2.0).all())
            assert float(getattr(b.attn, out).weight.detach().abs().max()) == 0.0
            assert float(b.mlp.fc2.weight.detach().abs().max()) == 0.0
        assert {m.kind for m in model.modules() if isinstance(m, DyT)} == {"erf"}
    # nothing else moved: the edited GPT's other parameters are the unedited one's
    edited = {n for n, _ in gpt.named_parameters() if n.endswith(("ls2.gamma", "q_norm.weight", "k_norm.weight",
                                                                   "c_proj.weight", "fc2.weight"))}
    for (n, p), (_, q) in zip(gpt.named_parameters(), ref.named_parameters()):
        assert n in edited or torch.equal(p, q), n
    # the baselines are never edited
    assert build_gpt("preln", 0, args).transformer.h[0].mlp.fc2.weight.abs().max() > 0
    with pytest.raises(ValueError, match="unknown keys"):
        apply_edit(gpt, {"gain": 1.0})


def test_dyt_edit_is_checked_at_the_command_line(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--gpt", "--quick", "--dyt-edit", '{"kind": "relu"}'])
    assert "kind must be one of ['tanh', 'erf']" in capsys.readouterr().err

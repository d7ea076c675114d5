"""benchmarks/experiments/stability.py: the train loop runs, detects a forced blow-up, and the summary is relative."""

from __future__ import annotations

import json
import math

import pytest
import torch
from stability import VARIANTS, build_model, certificate_summary, summarize, table, train_run
from torch.utils.data import DataLoader, TensorDataset


def _loaders(n_vars: int, seq_len: int = 32, pred_len: int = 8, n: int = 64):
    g = torch.Generator().manual_seed(0)
    t = torch.arange(n + seq_len + pred_len, dtype=torch.float32)
    series = torch.stack([torch.sin(t / (3 + c)) for c in range(n_vars)], 1) + 0.1 * torch.randn(
        len(t), n_vars, generator=g)
    x = torch.stack([series[i:i + seq_len] for i in range(n)])
    y = torch.stack([series[i + seq_len:i + seq_len + pred_len] for i in range(n)])
    ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=8, shuffle=True, generator=g), DataLoader(ds, batch_size=32)


def _tiny(variant: str, **kw):
    size = dict(seq_len=32, patch_len=8, stride=4, d_model=16, n_vars=2)
    if VARIANTS[variant][1] == "mamba":
        size.update(d_ff=16, d_state=4, dt_rank=4)
    else:
        size.update(n_heads=2, d_ff=32)
    return build_model(variant, 1, 8, seed=0, **size, **kw)


def test_train_loop_runs_and_reports_certificate():
    torch.set_num_threads(1)
    train, test = _loaders(2)
    model = _tiny("patchtst_noln")
    cert = certificate_summary(model, "fp32")
    assert cert["q"] == 1.0 and cert["sigma"] == 2.0 and cert["updates"] == 2
    res = train_run(model, train, test, precision="fp32", steps=5, lr=1e-3)
    assert not res.blew_up and res.steps_done == 5
    assert res.test_mse is not None and math.isfinite(res.test_mse) and res.test_mse < 10


def test_forced_blowup_is_detected():
    # the free Mamba (q = 5) with an absurd learning rate in fp16: the loss leaves the fp16 range
    torch.set_num_threads(1)
    train, test = _loaders(2)
    model = _tiny("mamba_free")
    assert certificate_summary(model, "fp16")["q"] == 5.0
    res = train_run(model, train, test, precision="fp16", steps=30, lr=1e4)
    assert res.blew_up, res
    assert "non-finite" in res.reason or "test MSE" in res.reason


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        train_run(torch.nn.Linear(1, 1), [], [], precision="fp8", steps=1, lr=1.0)
    with pytest.raises(ValueError, match="variant"):
        build_model("nope", 1, 8, 0)


def test_summary_is_relative_to_normalized_median():
    def run(v, mse, blew=False):
        c = {"ok": True, "certified_depth": 6}
        return {"variant": v, "depth": 3, "pred_len": 96, "precision": "fp32", "blew_up": blew,
                "test_mse": mse, "cert_init": c, "cert_final": c}

    runs = [run("mamba_rms", 0.4), run("mamba_preln", 0.5), run("mamba_periln", 0.6), run("mamba_lg", 0.45),
            run("mamba_lg", 0.55), run("mamba_free", None, True), run("mamba_free", 0.5)]
    rows = {r["variant"]: r for r in summarize(runs)}
    assert rows["mamba_lg"]["ref_mse"] == pytest.approx(0.5)
    assert rows["mamba_lg"]["rel_mean"] == pytest.approx(0.0)
    assert rows["mamba_lg"]["rel_sd"] == pytest.approx(0.0707107 / 0.5, rel=1e-4)
    assert rows["mamba_free"]["blowups"] == 1 and rows["mamba_free"]["runs"] == 2
    assert rows["mamba_rms"]["rel_mean"] == pytest.approx(-0.2)
    assert "1/2" in table(list(rows.values()))


def test_resume_log_keeps_only_runs_with_the_same_settings(tmp_path):
    from stability import _load_done

    same = {"width": 64, "steps": 64}
    runs = [{"variant": "mamba_lg", "depth": 3, "pred_len": 96, "precision": "fp16", "seed": 1, "settings": same},
            {"variant": "mamba_lg", "depth": 3, "pred_len": 96, "precision": "fp16", "seed": 2,
             "settings": {"width": 128, "steps": 64}}]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in runs) + "\n")
    done = _load_done(str(log), same)
    assert list(done) == [("mamba_lg", 3, 96, "fp16", 1)]
    assert _load_done(str(tmp_path / "missing.jsonl"), same) == {}


def test_width_overrides_build_the_named_size():
    from stability import width_overrides

    m = build_model("mamba_lg", 1, 8, 0, seq_len=32, n_vars=2, d_state=4, **width_overrides("mamba", 16))
    p = build_model("patchtst_noln", 1, 8, 0, seq_len=32, patch_len=8, stride=4, n_vars=2,
                    **width_overrides("patchtst", 16))
    for model in (m, p):
        widths = {mod.normalized_shape[0] for mod in model.modules() if isinstance(mod, torch.nn.LayerNorm)}
        linear_in = {mod.in_features for mod in model.modules() if isinstance(mod, torch.nn.Linear)}
        assert 16 in linear_in and widths <= {16}


def test_command_line_rejects_bad_settings():
    from stability import main

    for argv in (["--lr-scale", "0"], ["--lr-scale", "nan"], ["--steps", "0"], ["--variants", "nope"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2

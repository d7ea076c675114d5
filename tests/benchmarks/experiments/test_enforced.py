"""benchmarks/experiments/enforced.py: a smoke run on a synthetic ETT file, toto's rolled forecast and its training
target."""

from __future__ import annotations

import json

import pytest
import torch
from enforced import build, forecast, main, train_loss


def _write_csv(path, n_rows: int = 14400, n_ch: int = 7) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(n_rows, dtype=torch.float64)[:, None]
    data = torch.sin(t / torch.arange(3, 3 + n_ch, dtype=torch.float64)) + 0.1 * torch.randn(
        n_rows, n_ch, generator=g, dtype=torch.float64)
    with open(path, "w") as f:
        f.write("date," + ",".join(f"c{i}" for i in range(n_ch)) + "\n")
        for i, row in enumerate(data.tolist()):
            f.write(f"2016-07-01 {i:05d}," + ",".join(repr(v) for v in row) + "\n")


def test_toto_forecast_rolls_patches_forward():
    torch.set_num_threads(1)
    model = build("toto_style", 0, d_model=16, n_heads=2, mlp_hidden=24, n_layer=2).eval()
    x = torch.randn(2, 96, 3)
    with torch.no_grad():
        y = forecast(model, x)
        first = model(x.transpose(1, 2))[..., -32:].transpose(1, 2)  # the patch after the context
        second = model(torch.cat([x[:, 32:], first], 1).transpose(1, 2))[..., -32:].transpose(1, 2)
    assert y.shape == (2, 96, 3)
    torch.testing.assert_close(y[:, :32], first)
    torch.testing.assert_close(y[:, 32:64], second)
    # the training target: the input shifted by one patch, closed by the first patch of the horizon
    target = torch.randn(2, 96, 3)
    with torch.no_grad():
        out = model(x.transpose(1, 2)).transpose(1, 2)
    expected = (out - torch.cat([x[:, 32:], target[:, :32]], 1)).square().mean()
    torch.testing.assert_close(train_loss(model, x, target), expected)


@pytest.mark.slow
def test_smoke_run(tmp_path, capsys):
    csv = tmp_path / "ett.csv"
    _write_csv(csv)
    out = tmp_path / "enforced.json"
    rc = main(["--data", str(csv), "--seeds", "0", "--steps", "3", "--test-stride", "400", "--variants", "plain",
               "fp16", "--time-steps", "1", "--time-repeats", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {(r["model"], r["variant"]) for r in res["runs"]} == {
        (m, v) for m in ("mamba_forecaster_lg", "toto_style") for v in ("plain", "fp16")}
    for r in res["runs"]:
        assert r["finite"] and r["test_mse"] > 0 and r["test_mae"] > 0 and r["ms_per_step"] > 0
        if r["variant"] == "fp16":
            assert 0 < r["alpha"] < 1  # fp16's budget: caps below the initial norms
            assert all(c["ok"] and c["dtype"] == "fp16" for c in r["certificates"])
        else:
            assert r["alpha"] is None and {c["dtype"] for c in r["certificates"]} == {"bf16", "fp16"}
    rows = {(r["model"], r["variant"]): r for r in res["summary"]}
    assert rows[("toto_style", "plain")]["step_ratio"] == 1.0 and rows[("toto_style", "fp16")]["ms_per_step"] > 0
    assert set(res["timing_ms_per_step"]) == {"mamba_forecaster_lg", "toto_style"}
    assert "| toto_style | enforced fp16 |" in capsys.readouterr().out

"""benchmarks/experiments/fp8_scales.py: the comparison runs end to end in its quick mode, the certified static
scales never saturate and never fall below the observed amax, and the goals are read from the figures."""

from __future__ import annotations

import json
import math

import torch
from fp8_scales import digits_split, goals, main


def test_quick_runs_and_reports(tmp_path) -> None:
    out = tmp_path / "fp8.json"
    res = main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["meta"]["command"].endswith("--quick --out " + str(out))
    for part in ("bytes", "digits"):
        r = res[part]
        assert r["linears"] and all(p["certified"] for p in r["linears"]), r["linears"]
        assert r["static"]["input"]["saturated"] == 0 and r["static"]["weight"]["saturated"] == 0
        assert r["dynamic"]["input"]["saturated"] == 0 and r["dynamic"]["input"]["values"] > 0
        for p in r["linears"]:  # the certified peak bounds what the data holds
            assert p["observed_amax"] > 0 and p["ratio"] >= 1.0, p
        for mode in ("fp32", "bf16"):
            assert all(math.isfinite(v) for v in r[mode].values())
        assert all(math.isfinite(v) for v in r["static"]["metric"].values())
        assert set(r["goals"]) >= {"ratio_goal_met", "loss_goal_met", "static_vs_dynamic_loss"}
    assert "accuracy_goal_met" in res["digits"]["goals"]


def test_goals_are_read_from_the_figures() -> None:
    def res(static: float, dynamic: float, within: float):
        return {"static": {"metric": {"loss": static, "accuracy": 0.9}, "input": {"saturated": 0},
                           "weight": {"saturated": 0}},
                "dynamic": {"metric": {"loss": dynamic, "accuracy": 0.95}},
                "ratio_summary": {"fraction_within_16x": within}}

    g = goals(res(1.01, 1.0, 0.8))
    assert g["loss_goal_met"] and g["ratio_goal_met"] and not g["accuracy_goal_met"]
    assert abs(g["static_vs_dynamic_loss"] - 0.01) < 1e-12
    g = goals(res(1.05, 1.0, 0.5))
    assert not g["loss_goal_met"] and not g["ratio_goal_met"]


def test_digits_split_is_stratified() -> None:
    images = torch.rand(100, 8, 8) * 16
    labels = torch.arange(100) % 10
    x_tr, y_tr, x_te, y_te = digits_split(images, labels, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert x_tr.shape[1:] == (3, 32, 32) and len(y_tr) == 80 and len(y_te) == 20
    assert torch.bincount(y_te).tolist() == [2] * 10
    assert float(x_tr.abs().max()) <= 1.0 + 1e-6  # pixels in [0, 1] normalized by 0.5 / 0.5

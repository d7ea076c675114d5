"""benchmarks/experiments/lr_sensitivity.py: a tiny grid runs end to end, an absurd learning rate is critical, the
figures."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lr_sensitivity import VARIANTS, critical_lr, headroom_prediction, lr_sensitivity, main, metric, summarize, table

TINY = ["--quick", "--multipliers", "1", "1e7", "--lr", "1e-3", "1e-3", "--steps", "3", "--byte-steps", "3",
        "--depth", "1", "--pred-len", "8", "--width", "8", "--test-stride", "400", "--batch-size", "4",
        "--layers", "1", "--byte-width", "16", "--heads", "2", "--block", "16", "--byte-batch", "2",
        "--eval-windows", "4", "--corpus-bytes", "20000", "--headroom-steps", "0", "1"]


def _write_csv(path, n_rows: int = 14400, n_ch: int = 7) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(n_rows, dtype=torch.float64)
    data = torch.stack([torch.sin(t / (5 + c)) for c in range(n_ch)], 1) + 0.1 * torch.randn(
        n_rows, n_ch, generator=g, dtype=torch.float64)
    lines = ["date," + ",".join(f"c{c}" for c in range(n_ch))]
    lines += [f"2016-07-01 {i}," + ",".join(f"{v:.5f}" for v in row) for i, row in enumerate(data.tolist())]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("lrs")
    csv = d / "ett.csv"
    _write_csv(csv)
    argv = TINY + ["--data", str(csv), "--out", str(d)]
    assert main(argv) == 0
    return d, argv, json.loads((d / "lr_sensitivity_quick.json").read_text())


@pytest.mark.slow  # the module's smoke grid
def test_every_variant_is_summarized_and_the_absurd_lr_is_critical(smoke):
    d, _, s = smoke
    rows = {(r["dataset"], r["variant"]): r for r in s["rows"]}
    assert set(rows) == {(ds, v) for ds in VARIANTS for v in VARIANTS[ds]}
    for (ds, v), r in rows.items():
        assert r["precision"] == "fp16" and r["runs"] == 2 and r["q"] == VARIANTS[ds][v]
        # 1e7 x the default: every model leaves the fp16 range (or its loss is absurd) -> the critical lr
        assert r["blowups"] == 1, r
        assert r["critical_lr"] == pytest.approx(1e4) and r["first_blowup_lr"] == pytest.approx(1e4)
        assert r["sensitivity"] >= 0 and math.isfinite(r["best_loss"])
    runs = [json.loads(line) for line in (d / "lr_sensitivity_quick.jsonl").read_text().splitlines()]
    assert len(runs) == 14
    for r in runs:
        assert r["blew_up"] == (r["multiplier"] == 1e7)
        if not r["blew_up"]:  # the default lr trains: finite loss, finite headroom checks before steps 0 and 1
            assert math.isfinite(r["final_loss"]) and r["final_loss"] < r["init_loss"] * 10
            assert [s for s, _ in r["headroom"]] == [0, 1]
            # fp16: log M = 11.09 nats; a finite positive headroom (the Mamba mixers' Jacobians are estimated
            # through the reference scan: the fast scan's jvp is zero and would give -inf)
            assert all(0 < h < 11.1 for _, h in r["headroom"]), r["headroom"]
    assert (d / "lr_sensitivity_quick.png").stat().st_size > 0
    out = table(s)
    assert "1/2" in out and "critical learning rate" in out


@pytest.mark.slow  # the module's smoke grid
def test_resume_reads_the_log_without_training(smoke, monkeypatch, capsys):
    import lr_sensitivity

    d, argv, s = smoke

    def fail(*a, **k):
        raise AssertionError("a logged run was trained again")

    monkeypatch.setattr(lr_sensitivity, "run_etth1", fail)
    monkeypatch.setattr(lr_sensitivity, "run_bytes", fail)
    assert main(argv + ["--resume"]) == 0
    again = json.loads((d / "lr_sensitivity_quick.json").read_text())
    assert [r["sensitivity"] for r in again["rows"]] == [r["sensitivity"] for r in s["rows"]]


def _run(lr, seed, init, final, blew=False):
    return {"lr": lr, "seed": seed, "init_loss": init, "final_loss": final, "blew_up": blew}


def test_sensitivity_formula_on_hand_made_runs():
    # seed 0 (init 10): 4, 3, blown -> 4, 3, 10; seed 1 (init 12): 5, 20 (worse than init) -> 12, 2
    runs = [_run(1, 0, 10, 4), _run(2, 0, 10, 3), _run(3, 0, 10, None, True),
            _run(1, 1, 12, 5), _run(2, 1, 12, 20), _run(3, 1, 12, 2)]
    assert [metric(r) for r in runs] == [4, 3, 10, 5, 12, 2]
    s = lr_sensitivity(runs)
    assert s["curve"] == {1: 4.5, 2: 7.5, 3: 6.0}
    assert s["best"] == 4.5
    assert s["sensitivity"] == pytest.approx(6.0 - 4.5)  # mean over the grid of L(lr), minus its minimum
    assert s["per_seed"][0] == pytest.approx(17 / 3 - 3) and s["per_seed"][1] == pytest.approx(19 / 3 - 2)
    # a blown run whose final loss is finite (absurd) still counts its init loss
    assert metric(_run(1, 0, 10, 0.5, True)) == 10


def test_critical_lr_is_the_first_majority_blowup():
    runs = [_run(lr, s, 1, 1, blew) for lr, blown in ((1, 0), (2, 1), (4, 2), (8, 1)) for s, blew in
            enumerate([True] * blown + [False] * (3 - blown))]
    assert critical_lr(runs) == (4, 2)
    assert critical_lr([_run(1, 0, 1, 1), _run(2, 0, 1, 1)]) == (None, None)


def test_headroom_prediction_and_welch_rows():
    r = {"nonfinite_step": 6, "headroom": [[0, 5.0], [4, 0.5], [8, -3.0]]}
    assert headroom_prediction(r) == {"checks": 2, "min_headroom": 0.5, "alert_step": 4, "steps_ahead": 2}
    assert headroom_prediction({"nonfinite_step": None, "headroom": [[0, 3.0]]})["alert_step"] is None
    r["headroom_measured"] = [[0, 7.0], [4, 2.0], [8, -1.0]]  # the measured headroom: no alert before step 6
    assert headroom_prediction(r, "headroom_measured")["alert_step"] is None

    def run(v, lr, seed, final, blew=False):
        return {"dataset": "bytes", "variant": v, "precision": "bf16", "lr": lr, "seed": seed, "init_loss": 8.0,
                "final_loss": final, "blew_up": blew, "nonfinite_step": None, "headroom": []}

    runs = [run("sigmoid_noln", 1e-3, s, 3.0 + 0.1 * s) for s in range(3)]
    runs += [run("swiglu_noln", 1e-3, s, 4.0 + 0.1 * s) for s in range(3)]
    runs += [run("sigmoid_noln", 1e-2, s, 3.5 + 0.2 * s) for s in range(3)]
    runs += [run("swiglu_noln", 1e-2, 0, 4.0), run("swiglu_noln", 1e-2, 1, None, True),
             run("swiglu_noln", 1e-2, 2, None, True)]
    runs[-1].update(nonfinite_step=5, headroom=[[0, 0.5]], headroom_measured=[[0, 4.0], [4, 0.2]])
    runs[-3].update(headroom=[[0, 0.5]], headroom_measured=[[0, 4.0]])  # survived: an estimate false alarm
    s = summarize(runs)
    t = {tt["lr"]: tt for tt in s["tests"] if tt["variant"] == "sigmoid_noln"}
    assert t[1e-3]["welch"]["t"] < 0 and t[1e-3]["welch"]["p"] < 1e-3 and t[1e-3]["n"] == [3, 3]
    assert t[1e-2]["welch"] is None and t[1e-2]["n"] == [3, 1]  # one surviving peer seed: no test
    rows = {r["variant"]: r for r in s["rows"]}
    assert rows["swiglu_noln"]["critical_lr"] == 1e-2 and rows["sigmoid_noln"]["critical_lr"] is None
    sw = rows["swiglu_noln"]
    assert (sw["blowups_predicted"], sw["false_alarms"]) == (1, 1)
    measured = (sw["blowups_predicted_measured"], sw["false_alarms_measured"], sw["survivors_checked_measured"])
    assert measured == (1, 0, 1)
    assert any("sigmoid_noln (q 1) raises the critical learning rate" in v for v in s["verdicts"])


def test_command_line_rejects_bad_settings():
    for argv in (["--multipliers", "0"], ["--steps", "0"], ["--variants", "nope"], ["--headroom-steps", "-1"],
                 ["--lr", "1e-3", "nan"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2

"""benchmarks/experiments/monitor_rules.py: the replayed alert rules on hand-made monitor records."""

from __future__ import annotations

import csv
import json

from monitor_rules import default_rules, evaluate, load_runs, main, replay


def _write(tmp_path, form: str, first_nonfinite, measured, estimate) -> str:
    """A monitor_gpt JSON with one run and its records CSV (``measured``/``estimate``: headroom per check)."""
    steps = list(range(0, 2 * len(measured), 2))
    # monitor_gpt<tag>.json and monitor_gpt<tag>_<form>.csv, the tag "_t_<form>"
    with open(tmp_path / f"monitor_gpt_t_{form}_{form}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["step", "data/headroom_measured", "data/headroom"])
        w.writeheader()
        for s, m, e in zip(steps, measured, estimate):
            w.writerow({"step": s, "data/headroom_measured": m, "data/headroom": e})
    path = tmp_path / f"monitor_gpt_t_{form}.json"
    path.write_text(json.dumps({"summary": {"args": {"lr": 1e-3, "warmup": 0, "layers": 2, "width": 8},
                                            "results": [{"form": form, "first_nonfinite": first_nonfinite,
                                                         "steps_run": 2 * len(measured)}]}}))
    return str(path)


def test_threshold_and_trend_replay() -> None:
    falling = [(s, 10.0 - 0.5 * s) for s in range(0, 20, 2)]  # 10, 9, ..., 1.0 at step 18
    assert replay(falling, threshold=1.0, horizon=None, window=5) == []  # never below 1
    assert replay(falling + [(20, 0.0)], threshold=1.0, horizon=None, window=5) == [20]
    # the trend (slope -0.5/step) reaches 0 within 8 steps from step 4 on (h 8 at step 4): alerts at 4 and after
    hits = replay(falling, threshold=None, horizon=16, window=3)
    assert hits[0] == 4 and hits == list(range(4, 20, 2))
    flat = [(s, 5.0) for s in range(0, 20, 2)]
    assert replay(flat, threshold=1.0, horizon=100, window=5) == []


def test_evaluate_counts_steps_ahead_and_false_alarms(tmp_path, capsys) -> None:
    bad = _write(tmp_path, "noln", 12, [9, 8, 6, 4, 2, 0.5], [3, 2, 0.5, 0.2, 0.1, -1])
    ok = _write(tmp_path, "preln", None, [6, 6, 6, 6, 6, 6], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    runs = load_runs([bad, ok])
    assert [r["first_nonfinite"] for r in runs] == [12, None]
    rows = {(r["rule"]["basis"], r["rule"]["threshold"], r["rule"]["horizon"], r["rule"]["window"]): r
            for r in evaluate(runs, default_rules())}
    meas = rows[("measured", 1.0, None, 5)]
    assert meas["diverging"][0]["steps_ahead"] == 2 and meas["finishing"][0]["alerts"] == 0  # alert at step 10
    est = rows[("estimate", 1.0, None, 5)]
    assert est["diverging"][0]["steps_ahead"] == 8 and est["finishing"][0]["alerts"] == 6  # every check alerts
    out = main([bad, ok, "--out", str(tmp_path / "rules.json")])
    assert len(out) == len(default_rules()) and "| measured, below 1 nat | 2 | 0 / 6 |" in capsys.readouterr().out

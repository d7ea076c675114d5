"""benchmarks/trajectory_cost.py: every case runs and reports a cost in passes."""

from __future__ import annotations

import json

from trajectory_cost import main


def test_smoke_every_case(tmp_path) -> None:
    rows = main(["--repeats", "1", "--steps", "2", "--out", str(tmp_path / "cost.json")])
    assert len(rows) >= 2 and json.loads((tmp_path / "cost.json").read_text())[0]["model"] == rows[0]["model"]
    for row in rows:
        assert row["forward_backward_s"] > 0 and row["steps_2"]["passes"] > 1.0  # more than one pass, measured

"""benchmarks/trajectory_cost.py: every case runs and reports a cost in passes."""

from __future__ import annotations

import json

import pytest
from trajectory_cost import main


@pytest.mark.slow
def test_smoke_every_case(tmp_path) -> None:
    out = main(["--repeats", "1", "--no-mini", "--settings", "steps=4", "jacobians=False",
                "--out", str(tmp_path / "cost.json")])
    rows = out["trajectory"]
    assert len(rows) >= 2 and json.loads((tmp_path / "cost.json").read_text())["trajectory"][0]["model"] == \
        rows[0]["model"]
    for row in rows:
        assert row["forward_backward_s"] > 0 and row["steps=4"]["passes"] > 1.0  # more than one pass, measured
        # measured figures only: no estimate, the measured headroom is there
        assert row["jacobians=False"]["log_gradient_bound"] is None
        assert row["jacobians=False"]["headroom_measured"] is not None

"""benchmarks/experiments/fp16_overflow_probe.py: the probe runs the grid's loop and names the first non-finite
output."""

from __future__ import annotations

import math

import lr_sensitivity as lrs
import torch
from fp16_overflow_probe import Probe, main, summary_line


def test_smoke_runs_and_reports(tmp_path) -> None:
    out = main(["--variants", "qknorm_noln", "--precisions", "fp16", "--byte-steps", "3", "--corpus-bytes",
                "200000", "--out", str(tmp_path / "p.json")])
    (r,) = out
    assert len(r["steps"]) == 3 and r["nonfinite_step"] is None  # the default lr does not blow up in 3 steps
    s = r["steps"][0]
    assert 0 < s["stream_max"] < math.inf and s["scale"] == 65536.0
    assert s["largest"].startswith(("stack", "head", "ln_f"))
    assert "finite for 3 steps" in summary_line(r)


def test_probe_names_the_first_overflowing_module() -> None:
    torch.manual_seed(0)
    model = lrs.ByteLM("qknorm_noln", 1, 16, 2, 8)
    with torch.no_grad():
        model.stack.blocks[1].fc2.weight.mul_(1e6)  # the MLP's second linear overflows fp16, nothing before it
    probe = Probe(model)
    idx = torch.randint(0, 256, (2, 8))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(idx, idx)
    probe.remove()
    assert not math.isfinite(float(loss))
    first = probe.first_nonfinite()
    assert first == {"module": "stack.blocks.1.fc2", "max": math.inf, "dtype": "float16"}

"""benchmarks/gpu_validate.py: the driver runs every stage, merges their reports, and fails on what went wrong.

On a machine without CUDA the smoke run goes through the same stages: the gpu tests skip (with their reason),
the benchmarks run at tiny sizes with the Triton kernels in Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gpu_validate as gv
import pytest
import torch

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode (a GPU runs the real thing)")

GPU_TESTS = '''
import pytest

pytestmark = pytest.mark.gpu


def test_ok():
    assert 1 + 1 == 2


def test_wrong():
    assert 1 + 1 == 3, "arithmetic is off"


@pytest.mark.skip(reason="not on this machine")
def test_skipped():
    pass
'''


def _run(tmp_path: Path, *argv: str):
    out = tmp_path / "report.json"
    rc = gv.main(["--cpu-smoke", "--out", str(out), *argv])
    return rc, json.loads(out.read_text()), out


@NO_CUDA
@pytest.mark.slow
def test_cpu_smoke_runs_every_stage_and_merges_their_reports(tmp_path):
    rc, rep, out = _run(tmp_path, "--budget-s", "3600")  # no caps in smoke mode; the budget only guards a hang
    log = out.with_suffix(".log").read_text()
    assert rc == 0 and rep["all_passed"], log[-4000:]
    assert [s["name"] for s in rep["stages"]] == list(gv.STAGES) and rep["skipped"] == []
    assert all(s["status"] == "ok" and s["exit_code"] == 0 for s in rep["stages"])
    # the gpu tests were collected and each skipped with its reason (no CUDA here)
    t = rep["tests"]
    assert t["counts"]["skipped"] == len(t["cases"]) >= 40 and t["counts"]["failed"] == t["counts"]["error"] == 0
    assert all("test_gpu_shapes" in c["test"] and "needs a CUDA device" in c["message"] for c in t["cases"])
    # each benchmark's own JSON, merged
    scan = rep["results"]["bench_selective_scan"]
    assert scan["config"]["copy_bandwidth_Bps"] > 0 and scan["config"]["exp_rate_per_s"] > 0
    for kind in ("fwd", "fwd+bwd", "decode"):
        assert scan["results"][f"D=8/certblocks triton/{kind}"]["median_s"] > 0
        assert scan["results"][f"D=8/bound/{kind}"]["by"] in ("HBM", "exp")
    assert any("fraction of the bound" in k for k in scan["summary"])
    block = rep["results"]["bench_mamba_block"]
    assert [r["name"] for r in block["rows"]] == ["certblocks LinearGrowthMamba", "certblocks Mamba (free)"]
    assert [r["status"] for r in rep["results"]["throughput"]["rows"]] == ["ok"]
    for k in ("torch", "triton", "date_utc", "gpu", "mode"):
        assert rep["env"][k], k
    assert "== summary ==" in log and "ALL CHECKS PASSED" in log


@NO_CUDA
def test_a_failing_gpu_test_fails_the_run(tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_marked.py").write_text(GPU_TESTS)
    (tests / "test_unmarked.py").write_text("def test_not_selected():\n    assert False\n")
    rc, rep, out = _run(tmp_path, "--stages", "tests", "--tests", str(tests))
    assert rc == 1 and not rep["all_passed"]
    assert rep["stages"][0]["status"] == "failed" and rep["stages"][0]["exit_code"] == 1
    assert rep["tests"]["counts"] == dict(passed=1, failed=1, error=0, skipped=1)  # -m gpu: the unmarked file is out
    failed = [c for c in rep["tests"]["cases"] if c["outcome"] == "failed"]
    assert len(failed) == 1 and failed[0]["test"].endswith("test_wrong") and "arithmetic is off" in failed[0]["message"]
    assert "SOME CHECKS FAILED" in out.with_suffix(".log").read_text()


@NO_CUDA
def test_no_gpu_test_collected_is_a_failure(tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_unmarked.py").write_text("def test_not_selected():\n    pass\n")
    rc, rep, _ = _run(tmp_path, "--stages", "tests", "--tests", str(tests))
    assert rc == 1 and rep["stages"][0]["exit_code"] == 5 and rep["stages"][0]["status"] == "failed"


@NO_CUDA
def test_spent_budget_skips_every_stage_and_fails(tmp_path):
    rc, rep, out = _run(tmp_path, "--budget-s", "0")
    assert rc == 1 and rep["stages"] == [] and rep["skipped"] == list(gv.STAGES) and not rep["all_passed"]
    assert rep["env"]["date_utc"]  # the environment is recorded even when nothing ran
    assert "SKIPPED (budget" in out.with_suffix(".log").read_text()


@NO_CUDA
def test_gpu_mode_refuses_to_run_without_cuda(tmp_path):
    with pytest.raises(SystemExit) as exc:
        gv.main(["--out", str(tmp_path / "r.json")])
    assert exc.value.code == 2


def _state(pid: int) -> str:
    """The process's state letter (Z: a zombie), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_stage_past_its_cap_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(600)']); open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    log = gv.Log(tmp_path / "stage.log")
    for cap in (3.0, 10.0, 30.0, 100.0):  # long enough for the stage to start its child on a loaded machine
        rec = gv.run_stage([sys.executable, "-c", code], cap, dict(os.environ), log)
        assert rec["status"] == "timed out" and rec["exit_code"] is None
        if pidfile.exists() and pidfile.read_text():
            break
    grandchild = int(pidfile.read_text())
    for _ in range(300):  # the kill is sent at once; the state changes when the kernel has delivered it
        if _state(grandchild) in ("gone", "Z"):
            break
        time.sleep(0.1)
    assert _state(grandchild) in ("gone", "Z")


def test_verbose_output_of_a_killed_test_run_is_read():
    text = ("== tests ==\n"
            "tests/kernels/test_gpu_shapes.py::test_forward_every_dtype_and_gate[torch.float32-silu] PASSED [  1%]\n"
            "tests/kernels/test_gpu_shapes.py::test_decode_steps[torch.float16-None-grouped] FAILED [  2%]\n"
            "tests/kernels/test_gpu_shapes.py::test_scan_against_mamba_ssm_cuda[torch.float32] SKIPPED (no) [  3%]\n"
            "tests/kernels/test_gpu_shapes.py::test_linear_growth_mamba_compiled_with_cuda_graphs ")
    cases = gv.parse_verbose(text)
    assert [c["outcome"] for c in cases] == ["passed", "failed", "skipped"]
    assert gv.test_summary(cases)["counts"] == dict(passed=1, failed=1, error=0, skipped=1)


@pytest.mark.slow
def test_package_laid_out_without_install_imports(tmp_path):
    """A bare checkout's package laid out as pyproject.toml installs it imports, with its kernels and zoo."""
    dest = gv.stage_package(tmp_path)
    kernels = dest / "certblocks" / "kernels"
    assert (kernels / "scan.py").is_file() and not kernels.is_symlink()
    code = "import certblocks.kernels, certblocks.zoo; print(certblocks.kernels.__file__)"
    env = dict(os.environ, PYTHONPATH=str(dest))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith(str(dest / "certblocks" / "kernels"))

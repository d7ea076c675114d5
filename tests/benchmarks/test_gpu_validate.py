"""benchmarks/gpu_validate.py: its CPU smoke run passes, its checks can fail, its budget guard skips.

The smoke run executes every section of the GPU script (correctness, throughput, blocks, the rest of the
matrix) on the CPU at tiny shapes, with the Triton kernels in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 on a machine without CUDA).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import time
from pathlib import Path

import gpu_validate as gv
import pytest
import torch

KERNEL_TESTS = Path(__file__).resolve().parents[1] / "kernels"


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU smoke run of the whole script: (exit code, stdout, JSON report, wall time)."""
    if torch.cuda.is_available():
        pytest.skip("the smoke run is for machines without CUDA (the GPU run is the real thing there)")
    out = tmp_path_factory.mktemp("gpu_validate") / "report.json"
    n = torch.get_num_threads()
    t = time.perf_counter()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = gv.main(["--cpu-smoke", "--out", str(out), "--budget-s", "600"])
    wall = time.perf_counter() - t
    torch.set_num_threads(n)
    print(f"gpu_validate --cpu-smoke wall time: {wall:.1f} s")
    return rc, buf.getvalue(), json.loads(out.read_text()), wall, out


def test_cpu_smoke_runs_every_section_and_passes(smoke):
    rc, text, rep, wall, out = smoke
    assert rc == 0, text[-3000:]
    assert "ALL CHECKS PASSED" in text
    assert rep["all_checks_passed"] is True and rep["mode"] == "cpu-smoke"
    c = rep["counts"]
    assert c["fail"] == 0 and c["error"] == 0 and c["peer-error"] == 0 and c["skipped"] == 0, c
    graded = [r for r in rep["checks"] if r["status"] == "pass"]
    assert len(graded) >= 15
    assert all(0.0 <= r["worst"] <= 1.0 for r in graded)
    # the plan covers every kernel, dtype, gate and B/C layout
    assert {r["kernel"] for r in graded} == {"scan", "decode", "scan+decode", "block"}
    assert {r["dtype"] for r in graded} == set(gv.DTYPES)
    assert {r["gate"] for r in graded} == set(gv.GATES)
    assert {"variable", "grouped", "cu_seqlens"} <= {r["variant"] for r in graded}
    assert {r["section"] for r in graded} == {"correctness", "paths", "compile", "matrix-rest"}
    # issue 19's paths: every dstate, channel-last, packed with empty / length-1 sequences, reruns, permuted decode
    names = " | ".join(r["name"] for r in graded if r["section"] == "paths")
    for part in ("N=1 ", "N=12 ", "N=16 ", "N=64 ", "channel-last", "cu=[0, 0, 1, 1,", "bit-identical", "permuted"):
        assert part in names, part
    assert any(r.get("peer_impl") for r in graded)  # the mamba-ssm comparison path ran (pure-torch stand-ins)
    # figures with the environment they were measured in
    for k in ("torch", "triton", "date_utc", "gpu", "selective_scan_cuda"):
        assert rep["env"].get(k), k
    assert rep["ceilings"]["copy_bandwidth_Bps"] > 0 and rep["ceilings"]["exp_rate_per_s"] > 0
    passes = {(r["impl"], r["pass_"]) for r in rep["throughput"] if r.get("median_s", 0) > 0}
    for p in ("fwd", "fwd+bwd", "decode"):
        assert ("certblocks triton (silu)", p) in passes, p
    for r in rep["throughput"]:
        assert r["bound_s"] > 0 and r["fraction_of_bound"] > 0
    kinds = {r["kind"] for r in rep["blocks"] if r.get("forward_tokens_per_s", 0) > 0}
    assert kinds == {"block", "forecaster", "compile"}
    assert any("speedup_forward_over_peer" in r for r in rep["blocks"])
    log = out.with_suffix(".log").read_text()  # everything printed, teed beside the JSON
    assert "== summary ==" in log and "ALL CHECKS PASSED" in log
    md = out.with_suffix(".md").read_text()
    assert "GPU validation" in md and "| check | status |" in md
    assert wall < 120  # the GPU run is sized separately (--budget-s); this only guards against a runaway smoke run


def test_compare_detects_a_perturbed_tensor():
    g = torch.Generator().manual_seed(0)
    want = {"out": torch.randn(4, 8, 16, generator=g), "dA": torch.randn(8, 4, generator=g)}
    same = {k: v.clone() for k, v in want.items()}
    assert gv.compare(same, want, "float32")["passed"]
    rtol, atol = gv.TOL["float32"]
    close = {k: v + 0.5 * atol for k, v in want.items()}  # inside the tolerance
    r = gv.compare(close, want, "float32")
    assert r["passed"] and 0.0 < r["worst"] < 1.0
    bad = {k: v.clone() for k, v in want.items()}
    bad["dA"][3, 1] += 10 * (atol + rtol * abs(float(want["dA"][3, 1])))
    r = gv.compare(bad, want, "float32")
    assert not r["passed"] and r["tensors"]["dA"]["n_bad"] == 1 and r["worst_tensor"] == "dA" and r["worst"] > 1
    assert r["tensors"]["out"]["n_bad"] == 0
    # the same perturbation passes under the bf16 tolerance only if it is small enough: 0.2 * atol(bf16) does
    small = {k: v.clone() for k, v in want.items()}
    small["out"][0, 0, 0] += 0.2 * gv.TOL["bfloat16"][1]
    assert gv.compare(small, want, "bfloat16")["passed"] and not gv.compare(small, want, "float32")["passed"]
    nan = {k: v.clone() for k, v in want.items()}
    nan["out"][1, 2, 3] = float("nan")
    assert not gv.compare(nan, want, "float32")["passed"]
    assert not gv.compare({"out": want["out"]}, want, "float32")["passed"]  # a missing tensor
    assert not gv.compare({"out": want["out"][:, :, :8], "dA": want["dA"]}, want, "float32")["passed"]  # shape
    half = {k: v.half() for k, v in want.items()}
    assert not gv.compare(half, want, "bfloat16")["passed"]  # dtype
    assert gv.compare(half, want, "bfloat16", check_dtype=False)["passed"]


def test_report_fails_on_a_wrong_result_and_on_a_crash(tmp_path):
    x = {"out": torch.ones(3, 5)}
    rep = gv.Report(budget_s=100.0, out_path=tmp_path / "r.json", mode="cpu-smoke", inject_fault=True)
    r = rep.check("correctness", "perturbed", lambda: [gv.Cmp("a vs b", dict(x), dict(x), "float32")])
    assert r["status"] == "fail" and r["fault_injected"] and rep.exit_code() == 1
    rep = gv.Report(budget_s=100.0, out_path=tmp_path / "r.json", mode="cpu-smoke")
    r = rep.check("correctness", "equal", lambda: [gv.Cmp("a vs b", dict(x), dict(x), "float32")])
    assert r["status"] == "pass"
    assert rep.exit_code() == 0
    r = rep.check("correctness", "peer crash", lambda: 1 / 0, peer=True)
    assert r["status"] == "peer-error" and rep.exit_code() == 0  # an optional peer that breaks is reported only

    def crash():
        raise RuntimeError("kernel launch failed")

    r = rep.check("correctness", "kernel crash", crash)
    assert r["status"] == "error" and "kernel launch failed" in r["error"] and rep.exit_code() == 1
    rep.save()
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["counts"]["pass"] == 1 and saved["counts"]["error"] == 1 and not saved["all_checks_passed"]


def test_budget_guard_skips_remaining_sections(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU smoke mode only")
    out = tmp_path / "r.json"
    rc = gv.main(["--cpu-smoke", "--out", str(out), "--budget-s", "0"])
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["checks"] == []
    assert rep["skipped"] == [f"section {s}" for s in gv.SECTIONS]
    assert "SKIPPED (budget" in text
    assert rep["env"]["date_utc"]  # the environment is recorded even when nothing else ran


def test_tolerances_are_the_cpu_tests():
    spec = importlib.util.spec_from_file_location("_kernel_test_helpers", KERNEL_TESTS / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, dtype in gv.TORCH_DTYPE.items():
        assert gv.TOL[name] == (mod.TOL[dtype]["rtol"], mod.TOL[dtype]["atol"]), name


def test_matrix_is_a_latin_square_then_the_rest():
    core, rest = gv.matrix_split()
    assert len(core) == 9 and len(rest) == 18 and len(set(core) | set(rest)) == 27
    for i, j in ((0, 1), (0, 2), (1, 2)):  # every pair of levels of two factors appears exactly once
        assert len({(c[i], c[j]) for c in core}) == 9
    assert list(gv.GPU_PLAN.matrix_core) == core and list(gv.GPU_PLAN.matrix_rest) == rest


def test_main_exits_nonzero_when_a_kernel_result_is_wrong(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU smoke mode only")
    out = tmp_path / "r.json"
    rc = gv.main(["--cpu-smoke", "--out", str(out), "--sections", "matrix-rest", "--inject-fault"])
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rc == 1 and "SOME CHECKS FAILED" in text and not rep["all_checks_passed"]
    failed = [r for r in rep["checks"] if r["status"] == "fail"]
    assert len(failed) == 1 and failed[0]["fault_injected"]
    assert rep["counts"]["pass"] == len(rep["checks"]) - 1 >= 1  # the other checks still ran and passed


def test_each_check_is_saved_at_once(tmp_path):
    """The JSON is rewritten after every check: a run killed mid-section keeps what it checked."""
    x = {"out": torch.ones(2)}
    rep = gv.Report(budget_s=100.0, out_path=tmp_path / "r.json", mode="cpu-smoke")
    rep.check("paths", "first", lambda: [gv.Cmp("a vs b", dict(x), dict(x), "float32")])
    assert [r["name"] for r in json.loads((tmp_path / "r.json").read_text())["checks"]] == ["first"]


def test_section_deadline_skips_the_rest_of_a_section(tmp_path):
    x = {"out": torch.ones(2)}
    rep = gv.Report(budget_s=100.0, out_path=tmp_path / "r.json", mode="cpu-smoke")
    rep.section_deadline = time.perf_counter() - 1.0
    assert rep.check("paths", "late", lambda: [gv.Cmp("a vs b", dict(x), dict(x), "float32")]) is None
    assert rep.skipped == ["paths: late"]
    assert dict(gv.GPU_PLAN.section_s)["paths"] > 0 and set(dict(gv.GPU_PLAN.section_s)) == set(gv.SECTIONS)


def test_copy_checkout_installs_without_pip(tmp_path):
    """The fallback when pip cannot install: the package copied onto sys.path imports with its kernels and zoo."""
    import subprocess
    import sys

    gv.copy_checkout(tmp_path)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import certblocks.kernels, certblocks.zoo; "
            "print(certblocks.kernels.__file__)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith(str(tmp_path / "certblocks" / "kernels"))


def test_static_figures_of_a_kernel():
    """--static's parsing on one kernel: the sm_90 decode step compiles on the CPU and its SASS is counted.
    Runs in a subprocess (the interpreter flag of this process would turn the compile off)."""
    import subprocess
    import sys

    code = ("import os, sys, json; os.environ.pop('TRITON_INTERPRET', None); sys.path.insert(0, 'benchmarks'); "
            "import gpu_validate as gv; from certblocks.kernels import triton_decode as td; "
            "k = gv._sm90(td._state_update_kernel, dict(BLOCK_D=32, BLOCK_N=16, HAS_D=True, HAS_Z=True, "
            "HAS_BIAS=True, SOFTPLUS=True, GATE=1), 4); print(json.dumps(gv._sass_stats(k)))")
    root = Path(gv.__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170, cwd=root, env=env)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not available")
    assert r.returncode == 0, r.stderr[-3000:]
    st = json.loads(r.stdout.strip().splitlines()[-1])
    assert st["regs"] > 0 and st["sass"] > 100 and st["stack_bytes"] == 0
    assert st["loop_sass"] is None  # the decode step has no loop

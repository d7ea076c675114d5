"""GPU validation: the kernel tests marked ``gpu`` at realistic shapes, then the benchmarks' GPU modes, one JSON.

Device machine (one NVIDIA H200; python3 with torch, triton, pytest, timm and transformers; no network, no
certblocks install, no mamba-ssm): one command from the repository root, run with ``timeout_s=420``; the stages
stop after ``--budget-s`` (350 s) in all, each after its own cap::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_validate.py

Stages, in this order, each a subprocess whose output is appended to the log; a stage's cap is cut to what the
budget has left, and a stage past it is killed (with its children) and reported as timed out:

1. ``tests`` (200 s): ``pytest -m gpu tests/kernels`` -- tests/kernels/test_gpu_shapes.py: every Triton kernel
   compiled, at L=2048, D=2048, N=16 (batch 8 and 2) and at the chunked kernels' edge shapes, against the
   reference loop with the CPU tests' tolerances; LinearGrowthMamba under ``torch.compile`` with CUDA graphs;
   mamba-ssm's CUDA kernels where they import.
2. ``bench_selective_scan`` (50 s): ``bench_selective_scan.py --gpu``: forward, forward+backward and decode of
   the Triton kernels (and mamba-ssm's, when available) against max(bytes / copy bandwidth, exponentials / tl.exp
   rate), both ceilings measured in the same run.
3. ``bench_mamba_block`` (40 s): ``bench_mamba_block.py --gpu --compile``: the LinearGrowthMamba and Mamba blocks
   (eager and compiled) against ``mamba_ssm.Mamba`` when it imports.
4. ``throughput`` (60 s): ``throughput.py --gpu --repeats 5 --warmup 1``: every certified block and zoo model
   against its uncertified peer, bf16.

The children import certblocks as they find it.  Where it is not importable (a bare checkout: pyproject.toml
installs ``kernels/`` and ``zoo/`` inside the ``certblocks`` package), this script lays the package out in a
temporary folder and puts that first on the children's ``PYTHONPATH``.

Writes ``$OUT/gpu_validate.json`` (``OUT`` set) or ``benchmarks/out/gpu_validate.json``, rewritten after every
stage: the environment, each stage (command, exit code, seconds, status), the tests (counts and every case with
its outcome, time and message) and each benchmark's own JSON under ``results``; every child's output goes to a
``.log`` beside it.  Exit code 0 only when every stage ran to the end with exit code 0 and, on a GPU, at least
one test ran and none failed.

CPU smoke run of the same code paths (the gpu tests skip without CUDA; the benchmarks at tiny sizes, the Triton
kernels in Triton's interpreter)::

    python benchmarks/gpu_validate.py --cpu-smoke

The static sm_90 figures of the kernels (no GPU needed) are ``benchmarks/tools/sass.py``'s.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
STAGES = ("tests", "bench_selective_scan", "bench_mamba_block", "throughput")
CAPS_S = dict(tests=200.0, bench_selective_scan=50.0, bench_mamba_block=40.0, throughput=60.0)
_SMOKE_ARGS = dict(  # tiny sizes on the CPU
    bench_selective_scan=["--gpu", "--device", "cpu", "--gpu-dims", "8", "--gpu-batch", "1", "--gpu-seqlen", "16",
                          "--repeats", "1"],
    bench_mamba_block=["--batch", "1", "--seqlen", "16", "--d-model", "8", "--hf-repeats", "0", "--repeats", "1"],
    throughput=["--smoke", "--device", "cpu", "--only", "block/mamba_lg_vs_free"],
)
_GPU_ARGS = dict(bench_selective_scan=["--gpu"], bench_mamba_block=["--gpu", "--compile"],
                 throughput=["--gpu", "--repeats", "5", "--warmup", "1"])


class Log:
    """Prints a line and appends it to the log file; children append their output to the same file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        with open(self.path, "a") as f:
            f.write(msg + "\n")


def stage_package(dest: Path, root: Path = ROOT) -> Path:
    """Lay the package out in ``dest`` as pyproject.toml installs it: ``certblocks/`` with ``kernels/`` and
    ``zoo/`` inside; returns ``dest`` (to put on ``PYTHONPATH``)."""

    def ignore(folder: str, names: List[str]) -> List[str]:
        top = Path(folder) == root / "certblocks"
        return [n for n in names if n == "__pycache__" or n.endswith(".pyc") or (top and n in ("kernels", "zoo"))]

    target = dest / "certblocks"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root / "certblocks", target, ignore=ignore)
    for sub in ("kernels", "zoo"):
        shutil.copytree(root / sub, target / sub, ignore=ignore)
    return dest


def child_env(smoke: bool, log: Log) -> Dict[str, str]:
    """The children's environment: certblocks importable (staged when it is not), the interpreter on CPU."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if smoke:
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
    try:  # this process sees what a child sees: sys.path[0] is benchmarks/ here, the children run outside the checkout
        import certblocks.kernels  # noqa: F401
        import certblocks.zoo  # noqa: F401
    except ImportError as exc:
        dest = stage_package(Path(tempfile.mkdtemp(prefix="certblocks-")))
        env["PYTHONPATH"] = os.pathsep.join([str(dest)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        log(f"certblocks is not importable here ({type(exc).__name__}: {exc}); package laid out in {dest}")
    return env


def collect_env(smoke: bool) -> Dict[str, Any]:
    """GPU, driver, clocks and versions."""
    import torch

    env: Dict[str, Any] = dict(date_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                               python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
                               torch_cuda=torch.version.cuda, cpu_count=os.cpu_count(),
                               mode="cpu-smoke" if smoke else "gpu")
    for dist in ("triton", "mamba-ssm", "causal-conv1d", "timm", "transformers"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # optional: recorded, not required
            env[dist] = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   gpu_memory_GiB=round(props.total_memory / 2**30, 1))
        q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        try:
            r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30)
            env["nvidia_smi"] = dict(zip(q.split(","), (v.strip() for v in r.stdout.splitlines()[0].split(","))))
        except Exception as exc:
            env["nvidia_smi"] = f"unavailable ({type(exc).__name__}: {exc})"
    else:
        env["gpu"] = "none"
    return env


def part(stage: str, parts: Path) -> Path:
    """Where a stage writes its report (bench_selective_scan takes a folder)."""
    return parts / {"tests": "tests.xml", "bench_selective_scan": "bench_selective_scan"}.get(stage, f"{stage}.json")


def command(stage: str, smoke: bool, parts: Path, tests: Sequence[str]) -> List[str]:
    if stage == "tests":
        return [sys.executable, "-m", "pytest", "-m", "gpu", *tests, "-v", "-p", "no:cacheprovider",
                f"--junitxml={part(stage, parts)}"]
    extra = _SMOKE_ARGS[stage] if smoke else _GPU_ARGS[stage]
    return [sys.executable, str(BENCH / f"{stage}.py"), *extra, "--out", str(part(stage, parts))]


def run_stage(cmd: Sequence[str], cap_s: float, env: Dict[str, str], log: Log) -> Dict[str, Any]:
    """Run ``cmd`` (output appended to the log) for at most ``cap_s`` seconds; past it the process group is
    killed.  Returns exit code, seconds and status ("ok", "failed" or "timed out")."""
    t = time.perf_counter()
    with open(log.path, "a") as f:
        # cwd outside the checkout: `python -m pytest` puts its cwd first on sys.path, where a bare checkout's
        # certblocks/ (no kernels/ inside) would shadow the installed or staged package
        proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir(),
                                start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=max(cap_s, 0.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    status = "timed out" if rc is None else ("ok" if rc == 0 else "failed")
    return dict(command=" ".join(cmd), exit_code=rc, seconds=round(time.perf_counter() - t, 1), status=status,
                cap_s=round(cap_s, 1))


def parse_junit(path: Path) -> List[Dict[str, Any]]:
    """Every test case of a JUnit XML report: test id, outcome, seconds, message."""
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = tc.find(tag)
            if el is not None:
                outcome, message = name, (el.get("message") or el.text or "")[:600]
                break
        cases.append(dict(test=f"{tc.get('classname')}::{tc.get('name')}", outcome=outcome,
                          seconds=float(tc.get("time") or 0.0), message=message))
    return cases


def parse_verbose(text: str) -> List[Dict[str, Any]]:
    """The outcomes printed by ``pytest -v`` (a killed run writes no XML report)."""
    pat = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", re.M)
    names = dict(PASSED="passed", FAILED="failed", SKIPPED="skipped", ERROR="error")
    return [dict(test=m.group(1), outcome=names[m.group(2)], seconds=None, message="") for m in pat.finditer(text)]


def test_summary(cases: List[Dict[str, Any]]) -> Dict[str, Any]:
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return dict(counts=counts, cases=cases)


def read_json(path: Path) -> Optional[Any]:
    if path.is_dir():
        found = sorted(path.glob("*.json"))
        path = found[0] if found else path / "missing.json"
    return json.loads(path.read_text()) if path.is_file() else None


def passed(report: Dict[str, Any]) -> bool:
    stages = report["stages"]
    counts = report["tests"].get("counts", {})
    ran = len(stages) == len(report["plan"]) and all(s["status"] == "ok" for s in stages)
    tests_ok = not counts.get("failed") and not counts.get("error")
    return ran and tests_ok and (report["env"]["mode"] == "cpu-smoke" or counts.get("passed", 0) > 0)


def summary(report: Dict[str, Any], log: Log) -> None:
    log("\n== summary ==")
    e = report["env"]
    smi = e.get("nvidia_smi") if isinstance(e.get("nvidia_smi"), dict) else {}
    log(f"{e['gpu']} | driver {smi.get('driver_version', '-')} | torch {e['torch']} CUDA {e['torch_cuda']} | triton "
        f"{e['triton']} | mamba-ssm {e['mamba-ssm']} | {e['date_utc']}")
    for s in report["stages"]:
        log(f"  {s['name']:<22} {s['status']:<10} {s['seconds']:7.1f} s (cap {s['cap_s']:.0f} s)")
    for name in report["skipped"]:
        log(f"  {name:<22} skipped (budget spent)")
    t = report["tests"]
    if t:
        log(f"tests: {t['counts']}")
        for c in t["cases"]:
            if c["outcome"] in ("failed", "error"):
                log(f"  {c['outcome'].upper()} {c['test']}: {c['message'][:300]}")
    res = report["results"]
    for k, v in ((res.get("bench_selective_scan") or {}).get("summary") or {}).items():
        log(f"  scan | {k}: {v:.3g}")
    for r in (res.get("bench_mamba_block") or {}).get("rows", []):
        log(f"  block | {r['name']}: forward {r['forward_s'] * 1e3:.3f} ms, fwd+bwd {r['fwd_bwd_s'] * 1e3:.3f} ms")
    for r in (res.get("throughput") or {}).get("rows", []):
        rat = (f"ratio fwd {r['fwd']['ratio_cert_over_peer']:.2f}, f+b {r['fwd+bwd']['ratio_cert_over_peer']:.2f}"
               if r["status"] == "ok" else f"{r['status']}: {r['reason'][:120]}")
        log(f"  throughput | {r['name']}: {rat}")
    log(f"JSON: {report['out']}")
    log("ALL CHECKS PASSED" if report["all_passed"] else "SOME CHECKS FAILED OR DID NOT RUN")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="the same stages on the CPU at tiny sizes")
    ap.add_argument("--budget-s", type=float, default=350.0,
                    help="seconds for all stages (on a GPU each within its own cap; --cpu-smoke: no caps)")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--tests", nargs="+", default=[str(ROOT / "tests" / "kernels")],
                    help="paths given to pytest -m gpu (default tests/kernels)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_validate.json or benchmarks/out/)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.budget_s < 0:
        ap.error(f"--budget-s must be >= 0, got {args.budget_s}")
    smoke = args.cpu_smoke
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or BENCH / "out") / "gpu_validate.json"
    log = Log(out.with_suffix(".log"))
    env = collect_env(smoke)
    if not smoke and env["gpu"] == "none":
        ap.error("no CUDA device: run on a GPU machine, or pass --cpu-smoke")
    t0 = time.perf_counter()
    report: Dict[str, Any] = dict(benchmark="gpu_validate", command=" ".join(["gpu_validate.py", *sys.argv[1:]]),
                                  budget_s=args.budget_s, env=env, plan=list(args.stages), stages=[], skipped=[],
                                  tests={}, results={}, out=str(out), all_passed=False)
    log("== environment ==\n" + json.dumps(env, indent=1))
    children: Optional[Dict[str, str]] = None
    with tempfile.TemporaryDirectory(prefix="gpu_validate-") as tmp:
        parts = Path(tmp)
        for stage in args.stages:
            left = args.budget_s - (time.perf_counter() - t0)
            if left <= 0:
                report["skipped"].append(stage)
                log(f"\n== {stage}: SKIPPED (budget of {args.budget_s:.0f} s spent) ==")
                continue
            children = children or child_env(smoke, log)
            cmd = command(stage, smoke, parts, args.tests)
            log(f"\n== {stage} ==\n$ {' '.join(cmd)}")
            offset = log.path.stat().st_size
            cap = left if smoke else min(CAPS_S[stage], left)  # the caps are sized for the GPU
            rec = dict(name=stage, **run_stage(cmd, cap, children, log))
            log(f"-- {stage}: {rec['status']} (exit code {rec['exit_code']}, {rec['seconds']} s)")
            if stage == "tests":
                xml = part(stage, parts)
                cases = parse_junit(xml) if xml.is_file() else parse_verbose(log.path.read_text()[offset:])
                report["tests"] = test_summary(cases)
                if rec["exit_code"] == 5:
                    rec["status"] = "failed"
                    log("-- tests: no test marked gpu was collected")
            else:
                try:
                    report["results"][stage] = read_json(part(stage, parts))
                except (OSError, ValueError) as exc:
                    report["results"][stage] = None
                    rec["json_error"] = f"{type(exc).__name__}: {exc}"
            report["stages"].append(rec)
            report["all_passed"] = passed(report)
            out.write_text(json.dumps(report, indent=1, default=str))
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    report["all_passed"] = passed(report)
    out.write_text(json.dumps(report, indent=1, default=str))
    summary(report, log)
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

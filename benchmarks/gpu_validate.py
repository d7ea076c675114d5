"""GPU validation of the Triton selective-scan kernels: correctness, throughput, blocks (issue 9).

Device machine (one NVIDIA H200; its image has python3 with torch, triton, einops and mpmath, no network and no
mamba-ssm): one command from the repository root, run with ``timeout_s=420`` (``--install-to`` pip-installs this
checkout there first, offline and without dependencies, and copies the package onto ``sys.path`` when pip fails);
the checks stop after ``--budget-s`` (300 s), each section after its own cap (``Plan.section_s``)::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_validate.py --install-to /tmp/cb

A fresh machine with network access instead (python3 and pip only; torch's CUDA wheel from the default index)::

    python3 -m venv /tmp/gv && . /tmp/gv/bin/activate && pip install -q torch && pip install -q -e '.[triton]' \\
        && python benchmarks/gpu_validate.py

Static figures without a GPU (sm_90 compile on the CPU: registers, spills, barriers, SASS per element, old kernels
against new; see benchmarks/RESULTS.md)::

    python benchmarks/gpu_validate.py --static

CPU smoke run: the same code paths at tiny shapes, the Triton kernels in Triton's interpreter::

    TRITON_INTERPRET=1 python benchmarks/gpu_validate.py --cpu-smoke

Sections, in this order.  ``--budget-s`` skips whatever remains, with a printed note, once that many seconds have
passed, and a section's cap skips the rest of that section; the JSON (and its Markdown) is rewritten after every
check and every printed line is appended to a ``.log`` beside it, so a killed run keeps everything done so far.

1. ``env``: GPU name, driver, torch / CUDA / triton / mamba-ssm versions, date; the two ceilings, measured: the
   device-to-device copy bandwidth and the rate of ``tl.exp`` (a Triton kernel that only chains exponentials).
2. ``correctness``: every Triton kernel (forward, backward, decode) against the reference loop with the CPU tests'
   tolerances (:data:`TOL`): the dtype x gate x variant matrix at a medium shape, first the 9 combinations of a
   Latin square (every pair of dtype, gate and variant appears once), the other 18 at the end (``matrix-rest``);
   at the realistic shape (B=8, L=2048, D=2048, N=16) forward for every dtype x gate, forward+backward for a
   subset (each dtype and gate once, cu_seqlens, mamba's parameter regime); the decode step for every
   dtype x gate x B/C layout and prefill + decode chains; for gate silu, mamba-ssm's CUDA ``selective_scan_fn``
   and Triton ``selective_state_update`` when ``selective_scan_cuda`` imports (reported "unavailable" otherwise;
   this script never builds it).
3. ``paths`` (issue 19): the chunked kernels' paths at GPU size: dstate 1, 12, 16, 64 with dim not a multiple of
   32 and L not a multiple of the chunk; channel-last inputs; a packed batch with empty and length-1 sequences;
   bit-identical reruns; the decode step with permuted inputs.
4. ``throughput``: bf16, B=8, L=2048, N=16, D=2048 and 4096: forward, forward+backward and decode step of the
   Triton kernels against mamba-ssm (when available) and against the bound max(bytes / copy bandwidth,
   exponentials / exp rate).  CUDA events, medians of repeats after warm-up.
5. ``blocks``: tokens/s of LinearGrowthMamba and certblocks Mamba against ``mamba_ssm.Mamba``, and of the zoo's
   Mamba forecaster against the same forecaster with ``mamba_ssm.Mamba`` mixers (same weights).
6. ``compile``: LinearGrowthMamba (triton) under ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (CUDA
   graphs) against eager, outputs and input gradients, then both timed.
7. ``matrix-rest``: the remaining 18 combinations of the correctness matrix, and one case without D, delta_bias
   and softplus.

Writes a report to stdout, JSON to ``$OUT/gpu_validate.json`` (``$OUT`` set) or ``benchmarks/out/gpu_validate.json``
(``gpu_validate_cpu_smoke.json`` for ``--cpu-smoke``) and a Markdown section for benchmarks/RESULTS.md beside it.
Exit code 1 if any correctness check failed (all of them are run first), 0 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# Tolerances (rtol, atol) of the CPU tests, by compared dtype: tests/kernels/conftest.py TOL (used by
# test_triton_backend.py, test_torch_backend.py, test_reference.py); the float32 row is also the one
# test_decode.py and test_triton_backend.py pass to torch.testing.assert_close directly.
TOL: Dict[str, Tuple[float, float]] = {
    "float32": (6e-4, 2e-3),
    "bfloat16": (3e-2, 5e-2),
    "float16": (3e-2, 5e-2),
}
DTYPES = ("float32", "bfloat16", "float16")
GATES: Tuple[Optional[str], ...] = ("silu", "sigmoid", None)
VARIANTS = ("variable", "grouped", "cu_seqlens")  # 3-D B/C, 4-D (grouped) B/C, packed batch (grouped B/C)
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def matrix_split() -> Tuple[List[tuple], List[tuple]]:
    """The 27 (dtype, gate, variant) combinations: a Latin square of 9 first (every pair of factors once), then 18."""
    core = [(DTYPES[i], GATES[j], VARIANTS[(i + j) % 3]) for i in range(3) for j in range(3)]
    rest = [c for c in itertools.product(DTYPES, GATES, VARIANTS) if c not in core]
    return core, rest


@dataclass(frozen=True)
class Shape:
    batch: int
    dim: int
    dstate: int
    seqlen: int
    ngroups: int
    cu_seqlens: Tuple[int, ...]  # packed batch (batch 1) for the "cu_seqlens" variant; ends at its seqlen

    def text(self, variant: str = "variable") -> str:
        if variant == "cu_seqlens":
            cu = list(self.cu_seqlens)
            return f"B=1 D={self.dim} N={self.dstate} L={cu[-1]} G={self.ngroups} cu={cu}"
        g = f" G={self.ngroups}" if variant == "grouped" else ""
        return f"B={self.batch} D={self.dim} N={self.dstate} L={self.seqlen}{g}"


@dataclass(frozen=True)
class Plan:
    """Shapes and repeat counts of one mode (GPU or CPU smoke)."""

    medium: Shape
    realistic: Shape
    matrix_core: Sequence[tuple]
    matrix_rest: Sequence[tuple]
    realistic_fwd: Sequence[tuple]  # (dtype, gate): forward only, variable B/C
    realistic_grad: Sequence[tuple]  # (dtype, gate, variant): forward + backward
    peer_scan: Sequence[tuple]  # (dtype, variant) for gate silu against mamba-ssm
    peer_shape: Shape
    decode: Shape  # batch, dim, dstate, ngroups; seqlen = number of consecutive steps
    decode_combos: Sequence[tuple]  # (dtype, gate, grouped)
    chain: Shape  # seqlen = total length; prefill = seqlen - decode steps
    chain_prefill: int
    chain_combos: Sequence[tuple]  # (dtype, gate, grouped)
    thr_batch: int
    thr_seqlen: int
    thr_dstate: int
    thr_dims: Sequence[int]
    repeats: int
    warmup: int
    decode_calls: int
    block_batch: int
    block_seqlen: int
    block_dmodels: Sequence[int]
    forecaster_size: str  # "" (full) or "_test"
    forecaster_batch: int
    copy_bytes: int
    exp_block: int
    exp_programs_per_sm: int
    exp_iters: int
    paths: Shape = Shape(2, 264, 16, 1041, 1, (0,))  # issue 19's paths: dim not a multiple of 32, L not of the chunk
    compile_dmodel: int = 512  # LinearGrowthMamba under torch.compile / CUDA graphs (batch, seqlen of the blocks)
    section_s: Tuple[Tuple[str, float], ...] = (("correctness", 110.0), ("paths", 50.0), ("throughput", 60.0),
                                               ("blocks", 40.0), ("compile", 45.0), ("matrix-rest", 40.0))


_CORE, _REST = matrix_split()

GPU_PLAN = Plan(
    medium=Shape(2, 256, 16, 256, 4, (0, 37, 37, 150, 256)),
    realistic=Shape(8, 2048, 16, 2048, 4, (0, 1500, 1500, 3600, 5648, 8192, 11000, 13100, 16384)),
    matrix_core=_CORE,
    matrix_rest=_REST,
    realistic_fwd=list(itertools.product(DTYPES, GATES)),
    realistic_grad=[("float32", "silu", "variable"), ("bfloat16", "sigmoid", "grouped"),
                    ("float16", None, "variable"), ("bfloat16", "silu", "cu_seqlens")],
    peer_scan=[("float32", "variable"), ("bfloat16", "variable"), ("float16", "variable"), ("bfloat16", "grouped")],
    peer_shape=Shape(8, 2048, 16, 2048, 4, (0, 2048)),
    decode=Shape(8, 2048, 16, 4, 4, (0, 4)),
    decode_combos=list(itertools.product(DTYPES, GATES, (False, True))),
    chain=Shape(8, 2048, 16, 80, 4, (0, 80)),
    chain_prefill=72,
    chain_combos=[("float32", "silu", False), ("bfloat16", "sigmoid", True), ("float16", None, False)],
    thr_batch=8, thr_seqlen=2048, thr_dstate=16, thr_dims=(2048, 4096), repeats=20, warmup=3, decode_calls=100,
    block_batch=8, block_seqlen=2048, block_dmodels=(1024, 2048), forecaster_size="", forecaster_batch=256,
    copy_bytes=512 * 2**20, exp_block=1024, exp_programs_per_sm=32, exp_iters=1024,
)

SMOKE_PLAN = Plan(
    medium=Shape(1, 8, 4, 66, 2, (0, 9, 9, 50, 66)),  # batch > 1 is covered by the "realistic" smoke shape
    realistic=Shape(2, 8, 4, 24, 2, (0, 7, 7, 18, 24)),
    matrix_core=[("float32", "silu", "variable"), ("bfloat16", "sigmoid", "grouped"), ("float16", None, "cu_seqlens")],
    matrix_rest=[("float32", "sigmoid", "variable")],
    realistic_fwd=[("float32", "sigmoid"), ("bfloat16", None)],
    realistic_grad=[("float16", "silu", "variable")],
    peer_scan=[("float32", "variable")],
    peer_shape=Shape(2, 8, 4, 16, 2, (0, 16)),
    decode=Shape(2, 8, 4, 2, 2, (0, 2)),
    decode_combos=[("float32", "silu", False), ("bfloat16", "sigmoid", True), ("float16", None, False)],
    chain=Shape(2, 8, 4, 12, 2, (0, 12)),
    chain_prefill=7,
    chain_combos=[("float32", "silu", False)],
    thr_batch=1, thr_seqlen=8, thr_dstate=4, thr_dims=(8,), repeats=1, warmup=0, decode_calls=2,
    block_batch=1, block_seqlen=8, block_dmodels=(4,), forecaster_size="_test", forecaster_batch=1,
    copy_bytes=4 * 2**20, exp_block=64, exp_programs_per_sm=1, exp_iters=8,
    paths=Shape(1, 6, 4, 37, 1, (0,)), compile_dmodel=8,
    section_s=(),  # no per-section caps (the whole run has --budget-s)
)


# ----------------------------------------------------------------------------------------------- comparison
def compare(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], dtype: str,
            check_dtype: bool = True) -> Dict[str, Any]:
    """Compare two dicts of tensors the way ``torch.testing.assert_close`` does with ``TOL[dtype]``.

    An element passes when ``|got - want| <= atol + rtol * |want|`` (both finite; NaN never passes).  Returns
    ``{"passed", "worst" (largest |got - want| / (atol + rtol |want|) over all tensors: <= 1 passes),
    "worst_tensor", "tensors" (per tensor: max_abs_err, worst, n_bad, numel), "problems"}``.
    """
    rtol, atol = TOL[dtype]
    res: Dict[str, Any] = {"passed": True, "worst": 0.0, "worst_tensor": None, "tensors": {}, "problems": []}
    if set(got) != set(want):
        res["passed"] = False
        res["problems"].append(f"keys differ: {sorted(got)} vs {sorted(want)}")
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k]
        if g is None or w is None:
            res["passed"] = False
            res["problems"].append(f"{k}: missing ({'got' if g is None else 'want'} is None)")
            continue
        if tuple(g.shape) != tuple(w.shape):
            res["passed"] = False
            res["problems"].append(f"{k}: shape {tuple(g.shape)} vs {tuple(w.shape)}")
            continue
        if check_dtype and g.dtype != w.dtype:
            res["passed"] = False
            res["problems"].append(f"{k}: dtype {g.dtype} vs {w.dtype}")
        gd, wd = g.detach().double(), w.detach().to(g.device).double()
        finite = torch.isfinite(gd) & torch.isfinite(wd)
        diff = (gd - wd).abs()
        ratio = torch.where(finite, diff / (atol + rtol * wd.abs()), torch.full_like(diff, float("inf")))
        worst = float(ratio.max()) if ratio.numel() else 0.0
        n_bad = int((ratio > 1.0).sum())
        max_abs = float(torch.where(finite, diff, torch.zeros_like(diff)).max()) if diff.numel() else 0.0
        res["tensors"][k] = dict(max_abs_err=max_abs, worst=worst, n_bad=n_bad, numel=g.numel(),
                                 n_nonfinite=int((~finite).sum()))
        if n_bad:
            res["passed"] = False
            res["problems"].append(f"{k}: {n_bad} of {g.numel()} elements outside rtol={rtol:g}, atol={atol:g} "
                                   f"(max |err| {max_abs:.3g}, worst {worst:.3g} x tolerance)")
        if worst > res["worst"] or res["worst_tensor"] is None:
            res["worst"], res["worst_tensor"] = worst, k
    return res


@dataclass
class Cmp:
    """One comparison of a check: ``got`` (the kernel under test) against ``want``."""

    label: str
    got: Dict[str, torch.Tensor]
    want: Dict[str, torch.Tensor]
    dtype: str
    check_dtype: bool = True


@dataclass
class Report:
    """Collects checks, figures and notes; enforces the time budget; writes JSON and Markdown."""

    budget_s: float
    out_path: Path
    mode: str
    inject_fault: bool = False
    t0: float = field(default_factory=time.perf_counter)
    env: Dict[str, Any] = field(default_factory=dict)
    ceilings: Dict[str, Any] = field(default_factory=dict)
    checks: List[Dict[str, Any]] = field(default_factory=list)
    throughput: List[Dict[str, Any]] = field(default_factory=list)
    blocks: List[Dict[str, Any]] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    sections_s: Dict[str, float] = field(default_factory=dict)
    section_deadline: float = float("inf")  # perf_counter time at which the running section stops

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self, what: str) -> bool:
        if self.elapsed() > self.budget_s:
            why = f"budget of {self.budget_s:.0f} s spent at {self.elapsed():.0f} s"
        elif time.perf_counter() > self.section_deadline:
            why = "this section's time is spent"
        else:
            return False
        self.skipped.append(what)
        say(f"  SKIPPED ({why}): {what}")
        return True

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        say(f"  note: {msg}")

    def check(self, section: str, name: str, body: Callable[[], List[Cmp]], peer: bool = False,
              **meta: Any) -> Optional[Dict[str, Any]]:
        """Run ``body`` (-> comparisons), compare, record and print.  An exception is a failure of the check
        (``status="error"``), except for a peer comparison (``peer=True``), where it is ``"peer-error"``."""
        if self.out_of_time(f"{section}: {name}"):
            return None
        t = time.perf_counter()
        rec: Dict[str, Any] = dict(section=section, name=name, **meta)
        try:
            cmps = body()
            if self.inject_fault and not any(c.get("fault_injected") for c in self.checks):
                cmps[0].got = dict(cmps[0].got)
                k = "out" if "out" in cmps[0].got else sorted(cmps[0].got)[0]
                bad = cmps[0].got[k].clone()
                bad.view(-1)[0] += 1.0 + 10.0 * bad.view(-1)[0].abs()
                cmps[0].got[k] = bad
                rec["fault_injected"] = True
            results = {c.label: compare(c.got, c.want, c.dtype, c.check_dtype) for c in cmps}
            ok = all(r["passed"] for r in results.values())
            worst_label = max(results, key=lambda lab: results[lab]["worst"])
            w = results[worst_label]
            rec.update(status="pass" if ok else "fail", tol=dict(zip(("rtol", "atol"), TOL[cmps[0].dtype])),
                       worst=w["worst"], worst_at=f"{worst_label}:{w['worst_tensor']}", comparisons=results)
        except Exception as exc:  # a crash of the kernel under test is a failure
            rec.update(status="peer-error" if peer else "error", error=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc(limit=6))
        rec["seconds"] = time.perf_counter() - t
        self.checks.append(rec)
        if rec["status"] in ("pass", "fail"):
            line = f"worst {rec['worst']:.3f} x tol at {rec['worst_at']}"
            if rec["status"] == "fail":
                probs = [p for r in rec["comparisons"].values() for p in r["problems"]]
                line += " | " + "; ".join(probs[:4])
        else:
            line = rec["error"][:300]
        say(f"  {rec['status'].upper():<10} {name} [{rec['seconds']:.1f} s] {line}")
        if self.mode == "gpu":
            torch.cuda.empty_cache()
        self.save()  # after every check: a killed run keeps everything checked so far
        return rec

    def counts(self) -> Dict[str, int]:
        c = {"pass": 0, "fail": 0, "error": 0, "peer-error": 0, "unavailable": 0}
        for r in self.checks:
            c[r["status"]] += 1
        c["skipped"] = len(self.skipped)
        return c

    def exit_code(self) -> int:
        c = self.counts()
        return 1 if c["fail"] or c["error"] else 0

    def as_dict(self) -> Dict[str, Any]:
        slim = [{k: v for k, v in r.items() if k != "traceback" or r["status"] != "pass"} for r in self.checks]
        return dict(benchmark="gpu_validate", mode=self.mode, budget_s=self.budget_s, elapsed_s=self.elapsed(),
                    env=self.env, ceilings=self.ceilings, counts=self.counts(), all_checks_passed=self.exit_code() == 0,
                    checks=slim, throughput=self.throughput, blocks=self.blocks, skipped=self.skipped,
                    notes=self.notes, sections_s=self.sections_s, tolerances=TOL)

    def save(self) -> None:
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self.out_path.write_text(json.dumps(self.as_dict(), indent=2, default=str))
        self.out_path.with_suffix(".md").write_text(markdown(self))


LOG: List[Optional[Path]] = [None]  # the log file every printed line is appended to (beside the JSON)


def say(msg: str) -> None:
    print(msg, flush=True)
    if LOG[0] is not None:
        with open(LOG[0], "a") as f:
            f.write(msg + "\n")


# ----------------------------------------------------------------------------------------------- inputs, runs
def make_scan_inputs(batch: int, dim: int, dstate: int, seqlen: int, ngroups: Optional[int], has_z: bool,
                     dtype: torch.dtype, device: torch.device, seed: int = 0) -> Dict[str, torch.Tensor]:
    """The CPU tests' input distribution (tests/kernels/conftest.py make_scan_inputs), drawn on ``device``:
    A < 0, delta around softplus range; u, delta, z, B, C in ``dtype``; A, D, delta_bias in float32."""
    g = torch.Generator(device=device).manual_seed(seed)
    bc = (batch, dstate, seqlen) if ngroups is None else (batch, ngroups, dstate, seqlen)
    randn = lambda *s: torch.randn(*s, generator=g, device=device)
    rand = lambda *s: torch.rand(*s, generator=g, device=device)
    x = dict(u=randn(batch, dim, seqlen), delta=rand(batch, dim, seqlen) * 0.5 + 0.05,
             A=-(rand(dim, dstate) * 2.0 + 0.1), B=randn(*bc), C=randn(*bc), D=randn(dim))
    if has_z:
        x["z"] = randn(batch, dim, seqlen)
    x["delta_bias"] = rand(dim) * 0.1
    for k in ("u", "delta", "z", "B", "C"):
        if k in x:
            x[k] = x[k].to(dtype)
    return x


def scan_case(shape: Shape, dtype: str, gate: Optional[str], variant: str, device: torch.device, seed: int = 0):
    """Inputs and keyword arguments of one (dtype, gate, variant) case at ``shape``."""
    cu = None
    batch, seqlen, ngroups = shape.batch, shape.seqlen, None
    if variant == "grouped":
        ngroups = shape.ngroups
    elif variant == "cu_seqlens":
        batch, seqlen, ngroups = 1, shape.cu_seqlens[-1], shape.ngroups
        cu = torch.tensor(shape.cu_seqlens, dtype=torch.int32, device=device)
    x = make_scan_inputs(batch, shape.dim, shape.dstate, seqlen, ngroups, gate is not None, TORCH_DTYPE[dtype],
                         device, seed)
    return x, dict(delta_softplus=True, gate=gate, cu_seqlens=cu)


def run_scan(fn: Callable, inputs: Dict[str, torch.Tensor], grad: bool = True, use_last: bool = True,
             round_to: Optional[torch.dtype] = None, seed: int = 1, **kw: Any) -> Dict[str, torch.Tensor]:
    """``fn(**inputs, return_last_state=True, **kw)``; with ``grad``, backprop a random projection of out (and of
    last_state if ``use_last``) and return every input's gradient too (as tests/kernels/conftest.py run_scan)."""
    if not grad:
        with torch.no_grad():
            out, last = fn(**inputs, return_last_state=True, **kw)
        return {"out": out, "last": last}
    xs = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    out, last = fn(**xs, return_last_state=True, **kw)
    g = torch.Generator(device=out.device).manual_seed(seed)
    go = torch.randn(out.shape, generator=g, device=out.device).to(round_to or out.dtype).to(out.dtype)
    loss = (out * go).float().sum()
    if use_last:
        gl = torch.randn(last.shape, generator=g, device=out.device).to(last.dtype)
        loss = loss + (last * gl).float().sum()
    loss.backward()
    res = {"out": out.detach(), "last": last.detach()}
    res.update({"d" + k: v.grad for k, v in xs.items()})
    return res


def triton_scan(**kw: Any):
    from certblocks.kernels import selective_scan

    return selective_scan(**kw, backend="triton")


def reference_scan(**kw: Any):
    from certblocks.kernels import selective_scan_reference

    return selective_scan_reference(**kw)


# ----------------------------------------------------------------------------------------------- peers
def mamba_cuda_status() -> Tuple[bool, str]:
    """Whether mamba-ssm's CUDA extension ``selective_scan_cuda`` imports (never built here)."""
    if importlib.util.find_spec("mamba_ssm") is None:
        return False, "unavailable (mamba-ssm not installed)"
    try:
        mod = importlib.import_module("selective_scan_cuda")
    except Exception as exc:
        return False, f"unavailable (selective_scan_cuda does not import: {type(exc).__name__}: {exc})"
    if not hasattr(mod, "fwd"):
        return False, "unavailable (selective_scan_cuda is a stand-in module without kernels)"
    return True, "available"


def _stub_selective_scan_cuda() -> None:
    """CPU smoke only: let mamba-ssm's pure-torch references import without its CUDA extension."""
    if "selective_scan_cuda" not in sys.modules and importlib.util.find_spec("selective_scan_cuda") is None:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")


@dataclass
class Peers:
    """mamba-ssm functions to compare with (None: unavailable, with the reason in ``status``)."""

    status: str
    scan: Optional[Callable] = None
    scan_name: str = ""
    scan_upcast: bool = False  # the pure-torch reference evaluates silu(z) in z's dtype: compare on upcast inputs
    decode: Optional[Callable] = None
    decode_name: str = ""
    block: Optional[Callable] = None  # (certblocks mixer) -> peer mixer, same sizes and weights, same device/dtype
    block_name: str = ""


def find_peers(smoke: bool, device: torch.device) -> Peers:
    ok, status = mamba_cuda_status() if device.type == "cuda" else (False, "unavailable (no CUDA device)")
    p = Peers(status=status)
    if ok:
        try:
            from mamba_ssm import Mamba as RefMamba
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update

            def peer_mixer(src: torch.nn.Module) -> torch.nn.Module:
                w = next(src.parameters())
                m = RefMamba(src.d_model, d_state=src.d_state, d_conv=src.d_conv, expand=src.expand,
                             dt_rank=src.dt_rank, device=w.device, dtype=w.dtype)
                m.load_state_dict(src.state_dict())
                return m

            p.scan, p.scan_name = selective_scan_fn, "mamba-ssm selective_scan_fn (CUDA)"
            p.decode, p.decode_name = selective_state_update, "mamba-ssm selective_state_update (Triton)"
            fast = "fast path" if importlib.util.find_spec("causal_conv1d") is not None else "no causal-conv1d"
            p.block, p.block_name = peer_mixer, f"mamba_ssm.Mamba ({fast})"
        except Exception as exc:
            p.status = f"unavailable (mamba-ssm import failed: {type(exc).__name__}: {exc})"
    elif smoke:
        # Stand-ins that run on a CPU, so that the peer code paths are exercised: mamba-ssm's pure-torch
        # references, and certblocks' own Mamba (torch backend) in place of mamba_ssm.Mamba.
        try:
            _stub_selective_scan_cuda()
            from mamba_ssm.ops.selective_scan_interface import selective_scan_ref
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update_ref

            p.scan, p.scan_upcast = selective_scan_ref, True
            p.scan_name = "mamba-ssm selective_scan_ref (smoke stand-in)"
            p.decode = selective_state_update_ref
            p.decode_name = "mamba-ssm selective_state_update_ref (smoke stand-in)"
        except Exception as exc:
            p.status += f"; smoke stand-ins unavailable ({type(exc).__name__}: {exc})"

        def stand_in(src: torch.nn.Module) -> torch.nn.Module:
            from certblocks.blocks.mamba import Mamba

            m = Mamba.from_module(src)
            m.backend = "torch"
            return m

        p.block, p.block_name = stand_in, "certblocks Mamba, torch backend (smoke stand-in for mamba_ssm.Mamba)"
    return p


# ----------------------------------------------------------------------------------------------- env, ceilings
def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_env(device: torch.device, peers: Peers) -> Dict[str, Any]:
    env: Dict[str, Any] = dict(
        date_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
        torch_cuda=torch.version.cuda, triton=_version("triton"), certblocks=_version("certblocks"),
        mamba_ssm=_version("mamba-ssm") or _version("mamba_ssm"), causal_conv1d=_version("causal-conv1d"),
        selective_scan_cuda=peers.status, device=str(device), cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(), triton_interpret=os.environ.get("TRITON_INTERPRET", "0"),
        command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), capability=f"{props.major}.{props.minor}",
                   sm_count=props.multi_processor_count, gpu_memory_GiB=round(props.total_memory / 2**30, 1))
        try:
            q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
            r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20)
            vals = [v.strip() for v in r.stdout.strip().splitlines()[0].split(",")]
            env["nvidia_smi"] = dict(zip(q.split(","), vals))
            env["driver"] = env["nvidia_smi"].get("driver_version")
        except Exception as exc:
            env["driver"] = f"unknown (nvidia-smi: {type(exc).__name__})"
    else:
        env["gpu"] = "none (CPU smoke run)"
    return env


def timers(device: torch.device):
    import bench_selective_scan as bss

    return bss.cuda_timer if device.type == "cuda" else bss.cpu_timer


def loop_time(fn: Callable[[], Any], calls: int, repeats: int, warmup: int, device: torch.device) -> float:
    """Median over ``repeats`` of (time of ``calls`` back-to-back calls) / calls, CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(calls):
                fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 1e3 / calls)
        else:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            ts.append((time.perf_counter() - t) / calls)
    return statistics.median(ts)


def graph_time(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Per-call device time of ``fn`` captured ``calls`` times in one CUDA graph (launch overhead removed)."""
    import bench_selective_scan as bss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    t, _ = bss.cuda_timer(g.replay, repeats)
    return t / calls


_EXP_KERNEL = None


def _exp_kernel():
    """A Triton kernel that only chains ``tl.exp`` (the op the scan kernels use), 8+ independent chains a thread."""
    global _EXP_KERNEL
    if _EXP_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _exp_chain_kernel(x_ptr, out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs)
            for _ in range(ITERS):
                x = tl.exp(x * -1.0001)  # stays in (0.36, 1]: no denormals, no overflow
            tl.store(out_ptr + offs, x)

        _EXP_KERNEL = _exp_chain_kernel
    return _EXP_KERNEL


def measure_ceilings(rep: Report, plan: Plan, device: torch.device) -> None:
    timer = timers(device)
    buf = torch.randint(0, 255, (plan.copy_bytes,), dtype=torch.uint8, device=device)
    t, _ = timer(buf.clone, max(plan.repeats // 2, 2), plan.warmup)
    bw = 2 * buf.numel() / t
    del buf
    rep.ceilings["copy_bandwidth_Bps"] = bw
    rep.ceilings["copy_bytes"] = plan.copy_bytes
    say(f"  copy bandwidth (clone of {plan.copy_bytes / 2**20:.0f} MiB, read + write): {bw / 1e9:.0f} GB/s")
    kern = _exp_kernel()
    sms = rep.env.get("sm_count", 1)
    n = plan.exp_block * plan.exp_programs_per_sm * sms
    x = torch.rand(n, device=device) * 0.5 + 0.5
    y = torch.empty_like(x)
    grid = (n // plan.exp_block,)
    f = lambda: kern[grid](x, y, ITERS=plan.exp_iters, BLOCK=plan.exp_block, num_warps=4)
    t, _ = timer(f, max(plan.repeats // 2, 2), plan.warmup)
    rate = n * plan.exp_iters / t
    ok = bool(torch.isfinite(y).all())
    rep.ceilings.update(exp_rate_per_s=rate, exp_kernel=dict(elements=n, iters=plan.exp_iters, seconds=t,
                                                             finite=ok))
    extra = ""
    try:
        clk = float(rep.env["nvidia_smi"]["clocks.max.sm"].split()[0]) * 1e6
        rep.ceilings["exp_rate_per_sm_per_clock_at_max_clock"] = rate / sms / clk
        extra = f" = {rate / sms / clk:.1f} per SM per clock at the max SM clock"
    except Exception:
        pass
    say(f"  tl.exp rate: {rate / 1e12:.3f} T exp/s{extra}")


# ----------------------------------------------------------------------------------------------- correctness
def _case_name(kind: str, dtype: str, gate: Optional[str], variant: str, shape: Shape) -> str:
    return f"{kind} {dtype} gate={gate} {variant} ({shape.text(variant)})"


def check_against_reference(rep: Report, section: str, shape: Shape, dtype: str, gate: Optional[str], variant: str,
                            device: torch.device, grad: bool, seed: int = 0, plain: bool = False) -> None:
    """Triton against the reference loop; ``plain``: without D, delta_bias and softplus (the optional inputs off)."""
    kind = "fwd+bwd" if grad else "fwd"

    def body() -> List[Cmp]:
        x, kw = scan_case(shape, dtype, gate, variant, device, seed)
        if plain:
            del x["D"], x["delta_bias"]
            kw["delta_softplus"] = False
        got = run_scan(triton_scan, x, grad=grad, **kw)
        want = run_scan(reference_scan, x, grad=grad, **kw)
        return [Cmp("triton vs reference", got, want, dtype)]

    name = _case_name(kind, dtype, gate, variant, shape) + (", no D / delta_bias / softplus" if plain else "")
    rep.check(section, name, body, kernel="scan", pass_=kind, dtype=dtype, gate=gate, variant=variant,
              shape=shape.text(variant), plain=plain)


def check_mamba_regime(rep: Report, section: str, shape: Shape, device: torch.device) -> None:
    """bf16, gate silu, at the benchmark's inputs (bench_selective_scan.make_inputs: mamba's small-dt regime)."""
    import bench_selective_scan as bss

    def body() -> List[Cmp]:
        x = bss.make_inputs(shape.batch, shape.dim, shape.dstate, shape.seqlen, torch.bfloat16, device)
        got = run_scan(triton_scan, x, delta_softplus=True, gate="silu")
        want = run_scan(reference_scan, x, delta_softplus=True, gate="silu")
        return [Cmp("triton vs reference", got, want, "bfloat16")]

    rep.check(section, f"fwd+bwd bfloat16 gate=silu variable, benchmark inputs (small dt) ({shape.text()})", body,
              kernel="scan", pass_="fwd+bwd", dtype="bfloat16", gate="silu", variant="variable", shape=shape.text())


def check_scan_peer(rep: Report, peers: Peers, shape: Shape, dtype: str, variant: str, device: torch.device) -> None:
    """Gate silu against mamba-ssm (its backward ignores last_state's gradient: projection of out only)."""
    name = f"fwd+bwd {dtype} gate=silu {variant} vs {peers.scan_name} ({shape.text(variant)})"
    if peers.scan is None:
        rep.checks.append(dict(section="correctness", name=name, status="unavailable", reason=peers.status))
        say(f"  {'UNAVAIL':<10} {name}: {peers.status}")
        return

    def body() -> List[Cmp]:
        x, _ = scan_case(shape, dtype, "silu", variant, device)
        got = run_scan(triton_scan, x, use_last=False, delta_softplus=True, gate="silu")
        if peers.scan_upcast:  # as the CPU tests: the pure-torch reference on the same values in float32
            xu = {k: v.float() for k, v in x.items()}
            want = run_scan(peers.scan, xu, use_last=False, round_to=TORCH_DTYPE[dtype], delta_softplus=True)
            return [Cmp("triton vs mamba-ssm", got, want, dtype, check_dtype=dtype == "float32")]
        want = run_scan(peers.scan, x, use_last=False, delta_softplus=True)
        return [Cmp("triton vs mamba-ssm", got, want, dtype)]

    rep.check("correctness", name, body, peer=True, kernel="scan", pass_="fwd+bwd", dtype=dtype, gate="silu",
              variant=variant, shape=shape.text(variant), peer_impl=peers.scan_name)


def _decode_inputs(shape: Shape, dtype: str, gate: Optional[str], grouped: bool, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    b, d, n, steps = shape.batch, shape.dim, shape.dstate, shape.seqlen
    dt_ = TORCH_DTYPE[dtype]
    randn = lambda *s: torch.randn(*s, generator=g, device=device)
    bc = (b, shape.ngroups, n) if grouped else (b, n)
    state = randn(b, d, n)
    A = -(torch.rand(d, n, generator=g, device=device) * 2.0 + 0.1)
    D, dt_bias = randn(d), torch.rand(d, generator=g, device=device) * 0.1
    xs = []
    for _ in range(steps):
        xs.append(dict(x=randn(b, d).to(dt_), dt=(torch.rand(b, d, generator=g, device=device) * 0.5 + 0.05).to(dt_),
                       B=randn(*bc).to(dt_), C=randn(*bc).to(dt_),
                       z=randn(b, d).to(dt_) if gate is not None else None))
    return state, A, D, dt_bias, xs


def check_decode(rep: Report, shape: Shape, dtype: str, gate: Optional[str], grouped: bool,
                 device: torch.device) -> None:
    """``shape.seqlen`` consecutive triton decode steps from a random float32 state against the reference twin."""
    from certblocks.kernels import selective_state_update, selective_state_update_reference

    def body() -> List[Cmp]:
        state, A, D, bias, xs = _decode_inputs(shape, dtype, gate, grouped, device, seed=2)
        s_t, s_r = state.clone(), state.clone()
        ptr = s_t.data_ptr()
        got, want = {}, {}
        for i, a in enumerate(xs):
            got[f"out{i}"] = selective_state_update(s_t, a["x"], a["dt"], A, a["B"], a["C"], D, a["z"], bias,
                                                    dt_softplus=True, gate=gate, backend="triton")
            want[f"out{i}"] = selective_state_update_reference(s_r, a["x"], a["dt"], A, a["B"], a["C"], D, a["z"],
                                                               bias, dt_softplus=True, gate=gate)
        got["state"], want["state"] = s_t, s_r
        if s_t.data_ptr() != ptr:
            raise AssertionError("the triton decode step did not update the state in place")
        return [Cmp("triton vs reference", got, want, dtype)]

    lay = f"grouped G={shape.ngroups}" if grouped else "variable"
    rep.check("correctness", f"decode {dtype} gate={gate} {lay} (B={shape.batch} D={shape.dim} N={shape.dstate}, "
              f"{shape.seqlen} steps)", body, kernel="decode", dtype=dtype, gate=gate, variant=lay)


def check_decode_peer(rep: Report, peers: Peers, shape: Shape, dtype: str, device: torch.device) -> None:
    name = f"decode {dtype} gate=silu variable vs {peers.decode_name} (B={shape.batch} D={shape.dim} N={shape.dstate})"
    if peers.decode is None:
        rep.checks.append(dict(section="correctness", name=name, status="unavailable", reason=peers.status))
        say(f"  {'UNAVAIL':<10} decode vs mamba-ssm: {peers.status}")
        return
    from certblocks.kernels import selective_state_update

    def body() -> List[Cmp]:
        state, A, D, bias, xs = _decode_inputs(shape, dtype, "silu", False, device, seed=3)
        s_t, s_p = state.clone(), state.clone()
        got, want = {}, {}
        for i, a in enumerate(xs):
            got[f"out{i}"] = selective_state_update(s_t, a["x"], a["dt"], A, a["B"], a["C"], D, a["z"], bias,
                                                    dt_softplus=True, gate="silu", backend="triton")
            want[f"out{i}"] = peers.decode(s_p, a["x"], a["dt"], A, a["B"], a["C"], D=D, z=a["z"], dt_bias=bias,
                                           dt_softplus=True)
        got["state"], want["state"] = s_t, s_p
        return [Cmp("triton vs mamba-ssm", got, want, dtype)]

    rep.check("correctness", name, body, peer=True, kernel="decode", dtype=dtype, gate="silu", variant="variable",
              peer_impl=peers.decode_name)


def check_chain(rep: Report, shape: Shape, prefill: int, dtype: str, gate: Optional[str], grouped: bool,
                device: torch.device) -> None:
    """Triton prefill of ``prefill`` steps, then triton decode steps, against the reference full scan."""
    from certblocks.kernels import selective_scan, selective_state_update

    def body() -> List[Cmp]:
        x, kw = scan_case(shape, dtype, gate, "grouped" if grouped else "variable", device, seed=4)
        kw.pop("cu_seqlens")
        with torch.no_grad():
            full, last = reference_scan(**x, **kw, return_last_state=True)
            pre = {k: (v[..., :prefill] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
            out_p, state = selective_scan(**pre, **kw, return_last_state=True, backend="triton")
            got, want = {"prefill": out_p}, {"prefill": full[..., :prefill]}
            for t in range(prefill, shape.seqlen):
                got[f"step{t}"] = selective_state_update(
                    state, x["u"][..., t], x["delta"][..., t], x["A"], x["B"][..., t], x["C"][..., t], x["D"],
                    x["z"][..., t] if "z" in x else None, x["delta_bias"], dt_softplus=True, gate=gate,
                    backend="triton")
                want[f"step{t}"] = full[..., t]
            got["state"], want["state"] = state, last
        return [Cmp("triton prefill + decode vs reference scan", got, want, dtype)]

    lay = f"grouped G={shape.ngroups}" if grouped else "variable"
    rep.check("correctness", f"prefill {prefill} + decode {shape.seqlen - prefill} {dtype} gate={gate} {lay} "
              f"(B={shape.batch} D={shape.dim} N={shape.dstate})", body, kernel="scan+decode", dtype=dtype,
              gate=gate, variant=lay)


def section_correctness(rep: Report, plan: Plan, peers: Peers, device: torch.device) -> None:
    say(f"\n== correctness: Latin square of the dtype x gate x variant matrix ({plan.medium.text()}) ==")
    for dtype, gate, variant in plan.matrix_core:
        check_against_reference(rep, "correctness", plan.medium, dtype, gate, variant, device, grad=True)
    say(f"\n== correctness at the realistic shape ({plan.realistic.text()}) ==")
    for dtype, gate in plan.realistic_fwd:
        check_against_reference(rep, "correctness", plan.realistic, dtype, gate, "variable", device, grad=False)
    for dtype, gate, variant in plan.realistic_grad:
        check_against_reference(rep, "correctness", plan.realistic, dtype, gate, variant, device, grad=True)
    check_mamba_regime(rep, "correctness", plan.realistic, device)
    say("\n== correctness: decode step ==")
    for dtype, gate, grouped in plan.decode_combos:
        check_decode(rep, plan.decode, dtype, gate, grouped, device)
    for dtype, gate, grouped in plan.chain_combos:
        check_chain(rep, plan.chain, plan.chain_prefill, dtype, gate, grouped, device)
    say(f"\n== correctness against mamba-ssm, gate silu: {peers.status} ==")
    for dtype, variant in plan.peer_scan:
        check_scan_peer(rep, peers, plan.peer_shape, dtype, variant, device)
    for dtype in ("float32", "bfloat16"):
        check_decode_peer(rep, peers, plan.decode, dtype, device)


def section_matrix_rest(rep: Report, plan: Plan, device: torch.device) -> None:
    say(f"\n== correctness: rest of the dtype x gate x variant matrix ({plan.medium.text()}) ==")
    for dtype, gate, variant in plan.matrix_rest:
        check_against_reference(rep, "matrix-rest", plan.medium, dtype, gate, variant, device, grad=True)
    check_against_reference(rep, "matrix-rest", plan.medium, "float32", "silu", "variable", device, grad=True,
                            plain=True)


# ----------------------------------------------------------------------------------------------- issue 19's paths
def _channel_last(v: torch.Tensor) -> torch.Tensor:
    """The same values stored time-major along the last two axes (stride 1 along channels / states)."""
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


def section_paths(rep: Report, plan: Plan, device: torch.device) -> None:
    """The paths of the chunked kernels the CPU tests cover at tiny shapes, at GPU size: dstate 1, 12, 16, 64;
    dim not a multiple of 32 and L not a multiple of the chunk; channel-last inputs; packed batches with empty
    and length-1 sequences; bit-identical reruns; decode with permuted inputs."""
    sh = plan.paths
    say(f"\n== issue 19 paths (B={sh.batch} D={sh.dim} L={sh.seqlen}) ==")
    for n in (1, 12, 16, 64):
        shape = Shape(sh.batch, sh.dim, n, sh.seqlen, sh.ngroups, (0, sh.seqlen))
        check_against_reference(rep, "paths", shape, "float32", "silu", "variable", device, grad=True, seed=n)

    def channel_last() -> List[Cmp]:
        x, kw = scan_case(sh, "bfloat16", "silu", "variable", device, seed=5)
        nc = {k: _channel_last(v) if k in ("u", "delta", "z", "B", "C") else v for k, v in x.items()}
        return [Cmp("triton channel-last vs reference", run_scan(triton_scan, nc, **kw),
                    run_scan(reference_scan, x, **kw), "bfloat16")]

    rep.check("paths", f"fwd+bwd bfloat16 channel-last u/delta/z/B/C ({sh.text()})", channel_last, kernel="scan",
              dtype="bfloat16", gate="silu", variant="channel-last")
    L = sh.seqlen
    cu = (0, 0, 1, 1, L // 2, L // 2 + 1, L, L)
    packed = Shape(1, sh.dim, sh.dstate, L, 2 if sh.dim % 2 == 0 else 1, cu)
    check_against_reference(rep, "paths", packed, "float32", "sigmoid", "cu_seqlens", device, grad=True, seed=6)

    def rerun() -> List[Cmp]:
        x, kw = scan_case(sh, "bfloat16", "silu", "grouped", device, seed=7)
        a, b = run_scan(triton_scan, x, **kw), run_scan(triton_scan, x, **kw)
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        if differ:
            raise AssertionError(f"two runs differ bit for bit in {differ}")
        return [Cmp("triton run 1 vs run 2 (bit-identical)", a, b, "bfloat16")]

    rep.check("paths", f"fwd+bwd bfloat16 reruns bit-identical ({sh.text()})", rerun, kernel="scan", dtype="bfloat16",
              gate="silu", variant="grouped")

    def decode_permuted() -> List[Cmp]:
        from certblocks.kernels import selective_state_update, selective_state_update_reference

        g = torch.Generator(device=device).manual_seed(8)
        b, d, n = 4, sh.dim, 12
        randn = lambda *s: torch.randn(*s, generator=g, device=device)
        args = dict(A=-torch.rand(d, n, generator=g, device=device), B=randn(b, n), C=randn(b, n), D=randn(d),
                    dt_bias=randn(d), dt_softplus=True, gate="silu")
        x, dt, z = (randn(d, b).t() for _ in range(3))  # (batch, dim) views of (dim, batch) storage
        state = randn(b, n, d).transpose(1, 2)
        s_ref = state.contiguous()
        want = selective_state_update_reference(s_ref, x.contiguous(), dt.contiguous(), z=z.contiguous(), **args)
        s_got = state.clone()
        got = selective_state_update(s_got, x, dt, z=z, **args, backend="triton")
        return [Cmp("triton decode, permuted x/dt/z/state, vs reference", dict(out=got, state=s_got),
                    dict(out=want, state=s_ref), "float32")]

    rep.check("paths", f"decode float32 permuted x/dt/z/state (B=4 D={sh.dim} N=12)", decode_permuted,
              kernel="decode", dtype="float32", gate="silu", variant="permuted")


def section_compile(rep: Report, plan: Plan, device: torch.device) -> None:
    """LinearGrowthMamba (triton backend) under ``torch.compile(fullgraph=True)`` -- with CUDA graphs
    (``mode="reduce-overhead"``) on a GPU -- against eager: outputs and input gradients, and timings."""
    from certblocks.blocks.mamba import LinearGrowthMamba

    dm, B, L = plan.compile_dmodel, plan.block_batch, plan.block_seqlen
    say(f"\n== LinearGrowthMamba compiled (d_model={dm}, B={B}, L={L}) ==")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mode = "reduce-overhead" if device.type == "cuda" else None
    # CPU smoke: dynamo's full-graph capture only (backend "eager"); inductor's CPU codegen would take minutes
    backend = "inductor" if device.type == "cuda" else "eager"
    holder: Dict[str, Any] = {}

    def body() -> List[Cmp]:
        torch.manual_seed(0)
        lg = LinearGrowthMamba(dm, d_state=16, device=device, dtype=dtype)
        _set_backend(lg, "triton")
        x = torch.randn(B, L, dm, device=device, dtype=dtype)
        compiled = torch.compile(lg, fullgraph=True, mode=mode, backend=backend)
        res = {}
        for name, m in (("eager", lg), ("compiled", compiled)):
            outs = []
            for _ in range(3):  # CUDA graphs record on a later call: compare the replayed result
                xr = x.detach().clone().requires_grad_(True)
                y = m(xr)
                y.float().square().mean().backward()
                outs.append(dict(out=y.detach().clone(), dx=xr.grad.clone()))
                lg.zero_grad(set_to_none=True)
            res[name] = outs[-1]
        holder.update(lg=lg, compiled=compiled, x=x)
        tol = "bfloat16" if dtype == torch.bfloat16 else "float32"
        return [Cmp(f"compiled ({mode or 'default'}) vs eager", res["compiled"], res["eager"], tol)]

    rec = rep.check("compile", f"LinearGrowthMamba torch.compile(fullgraph, {mode or 'default'}) vs eager "
                    f"(d_model={dm})", body, kernel="block", dtype=str(dtype).replace("torch.", ""),
                    gate="sigmoid", variant="block")
    if rec is not None and rec["status"] == "pass" and not rep.out_of_time("compile: timings"):
        _time_module(rep, plan, "compile", f"LinearGrowthMamba eager d_model={dm}", holder["lg"], holder["x"],
                     B * L, device, "compile")
        _time_module(rep, plan, "compile", f"LinearGrowthMamba compiled ({mode or 'default'}) d_model={dm}",
                     holder["compiled"], holder["x"], B * L, device, "compile")


# ----------------------------------------------------------------------------------------------- throughput
def scan_bounds(batch: int, dim: int, dstate: int, seqlen: int, esz: int) -> Dict[str, Dict[str, float]]:
    """Fewest bytes and exponentials of each pass (per-(batch, time) tensors only; parameters are negligible).

    fwd: read u, delta, z, B, C and write out: esz * B * L * (4 D + 2 N) bytes; B * D * L * N exponentials.
    fwd+bwd: that, then the backward reads u, delta, z, B, C, dout and writes du, ddelta, dz, dB, dC:
    esz * B * L * (11 D + 6 N) bytes in all; 2 B D L N exponentials (the backward needs every decay again and
    storing them would cost 4 B D L N bytes, more time than recomputing).
    """
    bdl = batch * dim * seqlen
    return {"fwd": dict(bytes=esz * batch * seqlen * (4 * dim + 2 * dstate), exps=bdl * dstate),
            "fwd+bwd": dict(bytes=esz * batch * seqlen * (11 * dim + 6 * dstate), exps=2 * bdl * dstate)}


def decode_bounds(batch: int, dim: int, dstate: int, esz: int) -> Dict[str, float]:
    """One decode step: float32 state read and written, A read, x, dt, z read and out written, B, C, D, dt_bias."""
    nbytes = 8 * batch * dim * dstate + 4 * dim * dstate + esz * 4 * batch * dim + esz * 2 * batch * dstate + 8 * dim
    return dict(bytes=nbytes, exps=batch * dim * dstate)


def _bound_fields(b: Dict[str, float], ceil: Dict[str, Any]) -> Dict[str, float]:
    t_hbm = b["bytes"] / ceil["copy_bandwidth_Bps"]
    t_exp = b["exps"] / ceil["exp_rate_per_s"]
    return dict(bytes=b["bytes"], exps=b["exps"], hbm_bound_s=t_hbm, exp_bound_s=t_exp, bound_s=max(t_hbm, t_exp),
                bound_by="HBM" if t_hbm >= t_exp else "exp")


def section_throughput(rep: Report, plan: Plan, peers: Peers, device: torch.device) -> None:
    import bench_selective_scan as bss
    from certblocks.kernels import selective_scan

    timer = timers(device)
    B, L, N = plan.thr_batch, plan.thr_seqlen, plan.thr_dstate
    say(f"\n== throughput: bf16, B={B} L={L} N={N}, D in {list(plan.thr_dims)} (median of {plan.repeats} after "
        f"warm-up) ==")
    scans: List[Tuple[str, Callable]] = [
        ("certblocks triton (silu)", lambda **k: selective_scan(**k, delta_softplus=True, gate="silu",
                                                                backend="triton")),
        ("certblocks triton (sigmoid)", lambda **k: selective_scan(**k, delta_softplus=True, gate="sigmoid",
                                                                   backend="triton")),
    ]
    if peers.scan is not None and device.type == "cuda":
        scans.append((peers.scan_name, lambda **k: peers.scan(**k, delta_softplus=True)))
    else:
        rep.note(f"mamba-ssm selective_scan_fn: {peers.status}")
    for D in plan.thr_dims:
        if rep.out_of_time(f"throughput D={D}"):
            continue
        x = bss.make_inputs(B, D, N, L, torch.bfloat16, device)
        bounds = scan_bounds(B, D, N, L, 2)
        for name, scan in scans:
            for kind, mk in (("fwd", bss.fwd_fn), ("fwd+bwd", bss.fwdbwd_fn)):
                row: Dict[str, Any] = dict(D=D, impl=name, pass_=kind, batch=B, seqlen=L, dstate=N, dtype="bfloat16")
                try:
                    t, ts = timer(mk(scan, x), plan.repeats, plan.warmup)
                    bf = _bound_fields(bounds[kind], rep.ceilings)
                    row.update(median_s=t, min_s=min(ts), repeats=len(ts), **bf, fraction_of_bound=bf["bound_s"] / t,
                               achieved_GBps=bf["bytes"] / t / 1e9)
                except Exception as exc:
                    row.update(error=f"{type(exc).__name__}: {exc}")
                rep.throughput.append(row)
                _say_row(row)
        _decode_throughput(rep, plan, peers, device, D, x["A"], x["D"], x["delta_bias"])
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # speed-ups over mamba-ssm
    for r in rep.throughput:
        if r["impl"].startswith("certblocks") and "median_s" in r:
            for p in rep.throughput:
                if p["impl"].startswith("mamba-ssm") and p["D"] == r["D"] and p["pass_"] == r["pass_"] \
                        and "median_s" in p:
                    r["speedup_over_mamba_ssm"] = p["median_s"] / r["median_s"]


def _decode_throughput(rep: Report, plan: Plan, peers: Peers, device: torch.device, D: int, A: torch.Tensor,
                       Dskip: torch.Tensor, bias: torch.Tensor) -> None:
    """Decode step, bf16 inputs, float32 state: back-to-back calls (Python dispatch included) and, on a GPU, the
    replay of a CUDA graph of those calls (device time only)."""
    from certblocks.kernels import selective_state_update

    B, N = plan.thr_batch, plan.thr_dstate
    g = torch.Generator(device="cpu").manual_seed(1)
    xs, dts, zs = (torch.randn(B, D, generator=g).to(device, torch.bfloat16) for _ in range(3))
    Bs, Cs = (torch.randn(B, N, generator=g).to(device, torch.bfloat16) for _ in range(2))
    state = torch.zeros(B, D, N, device=device, dtype=torch.float32)

    def ours() -> None:
        selective_state_update(state, xs, dts, A, Bs, Cs, Dskip, zs, bias, dt_softplus=True, gate="silu",
                               backend="triton")

    def theirs() -> None:
        peers.decode(state, xs, dts, A, Bs, Cs, D=Dskip, z=zs, dt_bias=bias, dt_softplus=True)

    dec = [("certblocks triton (silu)", ours)]
    if peers.decode is not None and device.type == "cuda":
        dec.append((peers.decode_name, theirs))
    bf = _bound_fields(decode_bounds(B, D, N, 2), rep.ceilings)
    for name, f in dec:
        row: Dict[str, Any] = dict(D=D, impl=name, pass_="decode", batch=B, dstate=N, dtype="bfloat16", **bf)
        try:
            t = loop_time(f, plan.decode_calls, plan.repeats, plan.warmup, device)
            row.update(median_s=t, fraction_of_bound=bf["bound_s"] / t, timing="loop of calls")
            if device.type == "cuda":
                try:
                    tg = graph_time(f, plan.decode_calls, plan.repeats)
                    row.update(graph_median_s=tg, graph_fraction_of_bound=bf["bound_s"] / tg)
                except Exception as exc:
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        rep.throughput.append(row)
        _say_row(row)


def _say_row(r: Dict[str, Any]) -> None:
    if "error" in r:
        say(f"  D={r['D']:<5} {r['pass_']:<8} {r['impl']:<44} ERROR {r['error'][:200]}")
        return
    g = f", graph {r['graph_median_s'] * 1e6:.2f} us ({r['graph_fraction_of_bound']:.0%})" if "graph_median_s" in r \
        else (f", graph failed: {r['graph_error'][:80]}" if "graph_error" in r else "")
    unit, scale = ("us", 1e6) if r["pass_"] == "decode" else ("ms", 1e3)
    say(f"  D={r['D']:<5} {r['pass_']:<8} {r['impl']:<44} {r['median_s'] * scale:9.3f} {unit}  bound "
        f"{r['bound_s'] * scale:.3f} {unit} ({r['bound_by']}; HBM {r['hbm_bound_s'] * scale:.3f}, exp "
        f"{r['exp_bound_s'] * scale:.3f}) -> {r['fraction_of_bound']:.0%} of bound{g}")


# ----------------------------------------------------------------------------------------------- blocks
def _module_fns(module: torch.nn.Module, x: torch.Tensor):
    def fwd() -> None:
        with torch.no_grad():
            module(x)

    def fwd_bwd() -> None:
        xr = x.detach().requires_grad_(True)
        module(xr).float().square().mean().backward()
        module.zero_grad(set_to_none=True)

    return fwd, fwd_bwd


def _time_module(rep: Report, plan: Plan, kind: str, name: str, module: torch.nn.Module, x: torch.Tensor,
                 tokens: int, device: torch.device, group: str, is_peer: bool = False) -> None:
    """Median forward and forward+backward times (CUDA events) of ``module`` on ``x``; rows of one ``group`` are
    compared with that group's peer row."""
    timer = timers(device)
    fwd, fwd_bwd = _module_fns(module, x)
    row: Dict[str, Any] = dict(kind=kind, group=group, impl=name, is_peer=is_peer, tokens_per_call=tokens,
                               dtype=str(x.dtype), input_shape=list(x.shape))
    try:
        module.eval()
        t_f, _ = timer(fwd, plan.repeats, plan.warmup)
        module.train()
        t_b, _ = timer(fwd_bwd, plan.repeats, plan.warmup)
        row.update(forward_s=t_f, fwd_bwd_s=t_b, forward_tokens_per_s=tokens / t_f, fwd_bwd_tokens_per_s=tokens / t_b)
        say(f"  {name:<66} forward {tokens / t_f:10.4g} tok/s ({t_f * 1e3:8.3f} ms)   fwd+bwd {tokens / t_b:10.4g} "
            f"tok/s ({t_b * 1e3:8.3f} ms)")
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        say(f"  {name:<66} ERROR {row['error'][:200]}")
    rep.blocks.append(row)


def _set_backend(model: torch.nn.Module, backend: str) -> None:
    from certblocks.blocks.mixer import SelectiveScanMixer

    for m in model.modules():
        if isinstance(m, SelectiveScanMixer):
            m.backend = backend


def section_blocks(rep: Report, plan: Plan, peers: Peers, device: torch.device) -> None:
    from certblocks.blocks.mamba import LinearGrowthMamba, Mamba

    dtype = torch.bfloat16
    B, L = plan.block_batch, plan.block_seqlen
    say(f"\n== blocks: tokens/s, bf16, B={B} L={L}, d_state=16 (peer: {peers.block_name or peers.status}) ==")
    if peers.block is None:
        rep.note(f"mamba_ssm.Mamba: {peers.status}")
    for dm in plan.block_dmodels:
        if rep.out_of_time(f"blocks d_model={dm}"):
            continue
        torch.manual_seed(0)
        x = torch.randn(B, L, dm, device=device, dtype=dtype)
        lg = LinearGrowthMamba(dm, d_state=16, device=device, dtype=dtype)  # A_log, D stay float32
        free = Mamba.from_module(lg)
        _set_backend(lg, "triton")
        _set_backend(free, "triton")
        grp = f"block d_model={dm}"
        _time_module(rep, plan, "block", f"certblocks LinearGrowthMamba d_model={dm}", lg, x, B * L, device, grp)
        _time_module(rep, plan, "block", f"certblocks Mamba d_model={dm}", free, x, B * L, device, grp)
        if peers.block is not None:
            try:
                ref = peers.block(free)
            except Exception as exc:
                rep.note(f"{peers.block_name} d_model={dm} could not be built: {type(exc).__name__}: {exc}")
            else:
                _time_module(rep, plan, "block", f"{peers.block_name} d_model={dm}", ref, x, B * L, device, grp,
                             is_peer=True)
                del ref
        del lg, free, x
    if not rep.out_of_time("blocks: Mamba forecaster"):
        from certblocks.zoo import create_model

        size, nb = plan.forecaster_size, plan.forecaster_batch
        dd = dict(device=device, dtype=dtype)
        lg_f = create_model(f"mamba_forecaster_lg{size}", certify=False, **dd)  # timed here, not certified
        free_f = create_model(f"mamba_forecaster_free{size}", certify=False, **dd)
        _set_backend(lg_f, "triton")
        _set_backend(free_f, "triton")
        xs = torch.randn(nb, lg_f.seq_len, lg_f.n_vars, **dd)
        npatch = lg_f.patch.num_patches
        tokens = nb * lg_f.n_vars * npatch  # patch tokens through the Mamba layers per call
        grp = f"forecaster mamba_forecaster{size}"
        say(f"  Mamba forecaster (mamba_forecaster_*{size}): batch {nb} x {lg_f.n_vars} series x {npatch} patches "
            f"= {tokens} patch tokens per call, d_model {lg_f.layers[0].mixer.d_model}")
        _time_module(rep, plan, "forecaster", "zoo forecaster, LinearGrowthMamba mixers (triton)", lg_f, xs, tokens,
                     device, grp)
        _time_module(rep, plan, "forecaster", "zoo forecaster, certblocks Mamba mixers (triton)", free_f, xs,
                     tokens, device, grp)
        if peers.block is not None:
            peer_f = copy.deepcopy(free_f)
            try:
                for layer in peer_f.layers:
                    layer.mixer = peers.block(layer.mixer)
            except Exception as exc:
                rep.note(f"forecaster with {peers.block_name} mixers could not be built: {type(exc).__name__}: {exc}")
            else:
                _time_module(rep, plan, "forecaster", f"zoo forecaster, {peers.block_name} mixers", peer_f, xs,
                             tokens, device, grp, is_peer=True)
    for r in rep.blocks:
        peer = [p for p in rep.blocks if p["is_peer"] and p["group"] == r["group"] and "forward_s" in p]
        if not r["is_peer"] and "forward_s" in r and peer:
            r["speedup_forward_over_peer"] = peer[0]["forward_s"] / r["forward_s"]
            r["speedup_fwd_bwd_over_peer"] = peer[0]["fwd_bwd_s"] / r["fwd_bwd_s"]


# ----------------------------------------------------------------------------------------------- report
def markdown(rep: Report) -> str:
    e = rep.env
    c = rep.counts()
    lines = [f"### GPU validation (benchmarks/gpu_validate.py, {rep.mode})", ""]
    lines.append(f"{e.get('gpu')}, driver {e.get('driver')}, torch {e.get('torch')} (CUDA {e.get('torch_cuda')}), "
                 f"triton {e.get('triton')}, mamba-ssm {e.get('mamba_ssm')} (selective_scan_cuda: "
                 f"{e.get('selective_scan_cuda')}), {e.get('date_utc')}.")
    if rep.ceilings:
        lines.append(f"Measured ceilings: copy bandwidth {rep.ceilings.get('copy_bandwidth_Bps', 0) / 1e9:.0f} GB/s, "
                     f"tl.exp {rep.ceilings.get('exp_rate_per_s', 0) / 1e12:.3f} T exp/s.")
    lines += ["", f"Correctness: {c['pass']} passed, {c['fail']} failed, {c['error']} errors, {c['peer-error']} "
              f"peer errors, {c['skipped']} skipped (budget); tolerances (rtol, atol) of the CPU tests: "
              + ", ".join(f"{k} {v}" for k, v in TOL.items()) + ".", "",
              "| check | status | worst error / tolerance | s |", "|---|---|---|---|"]
    for r in rep.checks:
        w = f"{r['worst']:.3f} ({r['worst_at']})" if "worst" in r else r.get("error", r.get("reason", ""))[:120]
        lines.append(f"| {r['name']} | {r['status']} | {w} | {r.get('seconds', 0):.1f} |")
    if rep.throughput:
        lines += ["", "| D | pass | implementation | median | bound (HBM / exp) | of bound | speed-up vs mamba-ssm |",
                  "|---|---|---|---|---|---|---|"]
        for r in rep.throughput:
            if "median_s" not in r:
                lines.append(f"| {r['D']} | {r['pass_']} | {r['impl']} | error: {r.get('error', '')[:80]} | | | |")
                continue
            dec = r["pass_"] == "decode"
            u, s = ("us", 1e6) if dec else ("ms", 1e3)
            med = f"{r['median_s'] * s:.3f} {u}"
            if "graph_median_s" in r:
                med += f" (graph {r['graph_median_s'] * s:.3f} {u})"
            sp = f"{r['speedup_over_mamba_ssm']:.2f}x" if "speedup_over_mamba_ssm" in r else "-"
            lines.append(f"| {r['D']} | {r['pass_']} | {r['impl']} | {med} | {r['bound_s'] * s:.3f} {u} "
                         f"({r['hbm_bound_s'] * s:.3f} / {r['exp_bound_s'] * s:.3f}) | {r['fraction_of_bound']:.0%} "
                         f"| {sp} |")
    if rep.blocks:
        lines += ["", "| model | forward tok/s | fwd+bwd tok/s | speed-up vs peer (fwd / fwd+bwd) |",
                  "|---|---|---|---|"]
        for r in rep.blocks:
            if "forward_s" not in r:
                lines.append(f"| {r['impl']} | error: {r.get('error', '')[:80]} | | |")
                continue
            sp = (f"{r['speedup_forward_over_peer']:.2f}x / {r['speedup_fwd_bwd_over_peer']:.2f}x"
                  if "speedup_forward_over_peer" in r else "-")
            lines.append(f"| {r['impl']} | {r['forward_tokens_per_s']:.4g} | {r['fwd_bwd_tokens_per_s']:.4g} | {sp} |")
    if rep.skipped or rep.notes:
        lines += [""] + [f"- skipped (budget): {s}" for s in rep.skipped] + [f"- note: {n}" for n in rep.notes]
    return "\n".join(lines) + "\n"


def summary(rep: Report) -> None:
    c = rep.counts()
    say("\n== summary ==")
    e = rep.env
    say(f"{e.get('gpu')} | driver {e.get('driver')} | torch {e.get('torch')} CUDA {e.get('torch_cuda')} | triton "
        f"{e.get('triton')} | mamba-ssm {e.get('mamba_ssm')} ({e.get('selective_scan_cuda')}) | {e.get('date_utc')}")
    graded = [r for r in rep.checks if "worst" in r]
    if graded:
        w = max(graded, key=lambda r: r["worst"])
        say(f"worst error / tolerance over all checks: {w['worst']:.3f} ({w['name']}, {w['worst_at']})")
    for r in rep.throughput:
        if "median_s" in r:
            u, s = ("us", 1e6) if r["pass_"] == "decode" else ("ms", 1e3)
            sp = f", {r['speedup_over_mamba_ssm']:.2f}x mamba-ssm" if "speedup_over_mamba_ssm" in r else ""
            say(f"  D={r['D']} {r['pass_']:<8} {r['impl'][:34]:<34} {r['median_s'] * s:.3f} {u} "
                f"({r['fraction_of_bound']:.0%} of bound{sp})")
    for r in rep.blocks:
        if "forward_s" in r:
            say(f"  {r['impl'][:60]:<60} fwd {r['forward_tokens_per_s']:.3g} tok/s, fwd+bwd "
                f"{r['fwd_bwd_tokens_per_s']:.3g} tok/s")
    for s in rep.skipped:
        say(f"  skipped (budget): {s}")
    bad = [r for r in rep.checks if r["status"] in ("fail", "error")]
    for r in bad:
        say(f"  {r['status'].upper()}: {r['name']}")
    say(f"correctness: {c['pass']} passed, {c['fail']} failed, {c['error']} errors, {c['peer-error']} peer errors, "
        f"{c['skipped']} skipped; wall time {rep.elapsed():.1f} s; JSON: {rep.out_path}")
    say("ALL CHECKS PASSED" if rep.exit_code() == 0 else "SOME CHECKS FAILED")


def default_out(smoke: bool) -> Path:
    name = "gpu_validate_cpu_smoke.json" if smoke else "gpu_validate.json"
    out = os.environ.get("OUT")
    return Path(out) / name if out else HERE / "out" / name


SECTIONS = ("correctness", "paths", "throughput", "blocks", "compile", "matrix-rest")


def copy_checkout(target: Path) -> None:
    """The install without pip: ``certblocks/`` copied into ``target`` with ``kernels/`` and ``zoo/`` inside it
    (the package-dir mapping of pyproject.toml)."""
    import shutil

    root = HERE.parent
    dst = target / "certblocks"
    if dst.exists():
        shutil.rmtree(dst)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "certblocks", dst, ignore=ignore)
    for sub in ("kernels", "zoo"):
        shutil.copytree(root / sub, dst / sub, ignore=ignore)


def install_checkout(target: Path) -> None:
    """pip-install the repository holding this script into ``target`` (offline) and put it first on sys.path."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
           "--upgrade", "--target", str(target), str(HERE.parent)]
    say(f"installing this checkout: {' '.join(cmd)}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        say((r.stdout + r.stderr)[-2000:])
        say(f"pip install into {target} failed (exit {r.returncode}); copying the package onto sys.path instead")
        copy_checkout(target)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    say(f"  done in {time.perf_counter() - t:.1f} s")


# ----------------------------------------------------------------------------------------------------------------
# --static: sm_90 compile of the kernels on the CPU (no GPU): registers, spill stack, barriers, SASS per element

STATIC_OLD_REV = "dbfebe7"  # the per-step kernels before issue 19 (kernels/triton_scan.py at that commit)
_UNIT_STRIDES = ("s_ul", "s_tl", "s_zl", "s_ol", "s_gl", "s_Bl", "s_Cl", "s_sn", "s_Bn", "s_Cn",
                 "s_xd", "s_td", "s_zd", "s_od")  # stride-1 arguments the JIT specializes on a contiguous input


def _load_source(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sm90(fn, consts: Dict[str, Any], warps: int, dtype: str = "bf16"):
    """Compile ``fn`` for sm_90 ahead of time; every pointer bf16 (i32 for sequence indices), ints i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts, **{a: 1 for a in fn.arg_names if a in _UNIT_STRIDES and a not in consts})
    float_io = ("u_ptr", "delta_ptr", "z_ptr", "out_ptr", "B_ptr", "C_ptr", "dout_ptr", "du_ptr", "ddelta_ptr",
                "dz_ptr", "x_ptr", "dt_ptr")
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = "*i32" if a in ("seq_ptr", "lastidx_ptr") else ("*" + dtype if a in float_io else "*fp32")
        else:
            sig[a] = "i32"
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))


def _sass_stats(kernel) -> Dict[str, Any]:
    """Registers and stack (cuobjdump), SASS instruction and barrier counts of the whole kernel and of its
    innermost loops (summed: the old backward has two per step)."""
    import re
    import tempfile

    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dis = subprocess.run([str(bindir / "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    instrs, labels, pending = [], {}, []
    for ln in dis.splitlines():
        lab = re.match(r"^\s*(\.L\w+):", ln)
        if lab:
            pending.append(lab.group(1))
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            addr = int(m.group(1), 16)
            for p in pending:
                labels[p] = addr
            pending = []
            instrs.append((addr, m.group(2).strip()))
    loops = []  # (start, end, sass, barriers, MUFU) of every loop (a backward branch)
    for addr, text in instrs:
        m = re.search(r"BRA\s+(?:`\()?(\.L\w+)", text)
        if m and m.group(1) in labels and labels[m.group(1)] <= addr:
            body = [t for a, t in instrs if labels[m.group(1)] <= a <= addr]
            if len(body) > 8:
                loops.append((labels[m.group(1)], addr, len(body), sum("BAR" in t for t in body),
                              sum("MUFU" in t for t in body)))
    # the innermost loops (containing no other loop) run once per step (old) or per chunk and block (new)
    inner = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    hot = [sum(lp[i] for lp in inner) for i in (2, 3, 4)] if inner else [None] * 3
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return dict(regs=int(reg.group(1)) if reg else None, stack_bytes=int(stack.group(1)) if stack else None,
                sass=len(instrs), barriers=sum("BAR" in t for _, t in instrs),
                loop_sass=hot[0], loop_barriers=hot[1], loop_mufu=hot[2])


def static_rows(old_source: Optional[Path]) -> List[Dict[str, Any]]:
    """One row per (kernel, version, dstate): the figures of :func:`_sass_stats` and warp-instructions per
    (b, d, t) element = hot-loop SASS x warps / (b, d, t) elements one loop iteration covers, times the passes
    of the loop over one element (the backward's state tiles, ``NT``, run one after the other by a program)."""
    from certblocks.kernels import triton_decode as decode
    from certblocks.kernels import triton_scan as new

    flags = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, GATE=1, HAS_RESET=False)
    dec = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, GATE=1)
    rows = []

    def row(kernel, version, n, fn, consts, warps, elems, extra="", passes=1):
        st = _sass_stats(_sm90(fn, consts, warps))
        per = (st["loop_sass"] if kernel != "decode" else st["sass"]) * warps * passes / elems
        rows.append(dict(kernel=kernel, version=version, dstate=n, warps=warps, config=extra,
                         warp_instr_per_elem=round(per, 1), **st))

    for n in (16, 64):
        if old_source is not None:
            old = _load_source(old_source, "certblocks_old_triton_scan")
            c = dict(K=64, BLOCK_D=32, BLOCK_N=n, **flags)
            row("forward", "old", n, old._scan_fwd_kernel, dict(c, NUM_STAGES=2), 4, 32, "32 ch, 1 step")
            row("backward", "old", n, old._scan_bwd_kernel, dict(c, HAS_DLAST=True), 4, 32, "32 ch, 1 step")
            row("decode", "old", n, old._state_update_kernel, dict(BLOCK_D=32, BLOCK_N=n, **dec), 4, 32, "32 ch")
        T = 32
        bd, bn = new.blocks(4096, 4096, n, T, new.FWD_TILE)
        row("forward", "new", n, new._scan_fwd_kernel, dict(T=T, BLOCK_D=bd, BLOCK_N=bn, **flags), 4, bd * T,
            f"{bd} ch x {T} steps")
        c = new.bwd_config(4096, n, T)
        w = c.pop("num_warps")
        tiles = f" x {c['NT']} state tiles in turn" if c["NT"] > 1 else ""
        row("backward", "new", n, new._scan_bwd_kernel, dict(T=T, HAS_DLAST=True, FAST=True, **c, **flags), w,
            c["BLOCK_D"] * c["BT"], f"{c['BLOCK_D']} ch x {c['BT']} steps, {w} warps{tiles}", passes=c["NT"])
        row("decode", "new", n, decode._state_update_kernel, dict(BLOCK_D=32, BLOCK_N=n, **dec), 4, 32, "32 ch")
    return rows


def static_main(args) -> int:
    """``--static``: the table of :func:`static_rows` (old kernels from git revision ``--static-old``)."""
    os.environ.pop("TRITON_INTERPRET", None)
    old_source = None
    if args.static_old:
        text = subprocess.run(["git", "-C", str(HERE.parent), "show", f"{args.static_old}:kernels/triton_scan.py"],
                              capture_output=True, text=True)
        if text.returncode == 0:
            old_source = Path(os.environ.get("TMPDIR", "/tmp")) / "certblocks_old_triton_scan.py"
            old_source.write_text(text.stdout)
        else:
            say(f"old kernels unavailable ({text.stderr.strip()}); new kernels only")
    rows = static_rows(old_source)
    say("| kernel | version | N | tile / program step | regs | stack B | barriers in loop | SASS in loop | "
        "warp-instr per (b,d,t) |")
    say("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        say(f"| {r['kernel']} | {r['version']} | {r['dstate']} | {r['config']} | {r['regs']} | {r['stack_bytes']} | "
            f"{r['loop_barriers'] if r['kernel'] != 'decode' else r['barriers']} | "
            f"{r['loop_sass'] if r['kernel'] != 'decode' else r['sass']} | {r['warp_instr_per_elem']} |")
    out = Path(args.out) if args.out else default_out(False).with_name("gpu_static.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(rows=rows, old_rev=args.static_old), indent=1))
    say(f"JSON: {out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every section on the CPU at tiny shapes (Triton's interpreter, TRITON_INTERPRET=1)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="skip the remaining checks and sections once this many seconds have passed")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_validate.json or benchmarks/out/)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU smoke default: 1)")
    ap.add_argument("--install-to", default=None, metavar="DIR",
                    help="first pip-install this checkout into DIR (no dependencies, no index, no build isolation: "
                         "works offline) and import certblocks from there")
    ap.add_argument("--inject-fault", action="store_true",
                    help="perturb the first checked result (shows that a wrong kernel output is reported as a failure)")
    ap.add_argument("--static", action="store_true",
                    help="no GPU: compile the kernels for sm_90 on the CPU and print registers, spills, barriers and "
                         "SASS instructions per element (old kernels from git revision --static-old)")
    ap.add_argument("--static-old", default=STATIC_OLD_REV, metavar="REV",
                    help="git revision whose kernels/triton_scan.py is the 'old' column of --static ('' for none)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.static:
        return static_main(args)

    if args.install_to:
        install_checkout(Path(args.install_to))
    try:
        import certblocks.kernels  # noqa: F401
    except ImportError as exc:
        say(f"certblocks is not importable ({exc}): pip install this checkout, or pass --install-to DIR")
        return 2
    smoke = args.cpu_smoke
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            if "triton" in sys.modules:
                say("warning: triton was imported before TRITON_INTERPRET=1 was set; the kernels may not run on CPU")
            os.environ["TRITON_INTERPRET"] = "1"
        from certblocks.kernels._interpreter import vectorize_interpreter_scan

        vectorize_interpreter_scan()  # the interpreter's associative scan, slice by slice (same results)
        torch.set_num_threads(args.threads or 1)
        device = torch.device("cpu")
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        if not torch.cuda.is_available():
            ap.error("no CUDA device: run on a GPU, or pass --cpu-smoke (Triton interpreter, tiny shapes)")
        device = torch.device("cuda")
    plan = SMOKE_PLAN if smoke else GPU_PLAN
    rep = Report(budget_s=args.budget_s, out_path=Path(args.out) if args.out else default_out(smoke),
                 mode="cpu-smoke" if smoke else "gpu", inject_fault=args.inject_fault)

    LOG[0] = rep.out_path.with_suffix(".log")
    LOG[0].parent.mkdir(parents=True, exist_ok=True)
    LOG[0].write_text("")
    say("== environment ==")
    peers = find_peers(smoke, device)
    rep.env = collect_env(device, peers)
    for k in ("gpu", "capability", "sm_count", "driver", "torch", "torch_cuda", "triton", "mamba_ssm",
              "causal_conv1d", "selective_scan_cuda", "date_utc", "triton_interpret"):
        say(f"  {k}: {rep.env.get(k)}")
    t = time.perf_counter()
    try:
        measure_ceilings(rep, plan, device)
    except Exception as exc:
        rep.note(f"ceilings could not be measured ({type(exc).__name__}: {exc}); bounds unavailable")
        rep.ceilings.setdefault("copy_bandwidth_Bps", float("nan"))
        rep.ceilings.setdefault("exp_rate_per_s", float("nan"))
    rep.sections_s["env"] = time.perf_counter() - t
    rep.save()
    runners = {"correctness": lambda: section_correctness(rep, plan, peers, device),
               "throughput": lambda: section_throughput(rep, plan, peers, device),
               "paths": lambda: section_paths(rep, plan, device),
               "blocks": lambda: section_blocks(rep, plan, peers, device),
               "compile": lambda: section_compile(rep, plan, device),
               "matrix-rest": lambda: section_matrix_rest(rep, plan, device)}
    for name in SECTIONS:
        if name not in args.sections or rep.out_of_time(f"section {name}"):
            continue
        t = time.perf_counter()
        rep.section_deadline = t + dict(plan.section_s).get(name, float("inf"))
        try:
            runners[name]()
        except Exception as exc:  # a broken section must not lose the others' results
            rep.note(f"section {name} stopped: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            if name in ("correctness", "paths", "compile", "matrix-rest"):
                rep.checks.append(dict(section=name, name=f"section {name}", status="error",
                                       error=f"{type(exc).__name__}: {exc}"))
        rep.sections_s[name] = time.perf_counter() - t
        rep.section_deadline = float("inf")
        rep.save()
    summary(rep)
    rep.save()
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())

"""Static sm_90 figures of the Triton selective-scan kernels, without a GPU.

Each kernel is compiled ahead of time for sm_90 (Hopper) with Triton's bundled ptxas, disassembled with its
nvdisasm, and counted: registers and stack (spilled registers) from cuobjdump, SASS instructions and barriers of
the whole kernel and of its innermost loops, and warp-instructions per (b, d, t) element.  "old" is
``kernels/triton_scan.py`` at git revision ``--old`` (default dbfebe7, the per-step kernels before the chunked
ones), "new" the kernels of this checkout.  The figures are in benchmarks/results/kernels.md.

Usage (CPU only; about a minute on 2 cores)::

    python benchmarks/tools/sass.py [--old REV | --old ''] [--out PATH]

Prints a Markdown table and writes JSON to ``--out`` (default ``$OUT/gpu_static.json`` when ``OUT`` is set, else
``benchmarks/out/gpu_static.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
OLD_REV = "dbfebe7"  # the per-step kernels before the chunked ones (kernels/triton_scan.py at that commit)
_UNIT_STRIDES = ("s_ul", "s_tl", "s_zl", "s_ol", "s_gl", "s_Bl", "s_Cl", "s_sn", "s_Bn", "s_Cn",
                 "s_xd", "s_td", "s_zd", "s_od")  # stride-1 arguments the JIT specializes on a contiguous input
_FLOAT_IO = ("u_ptr", "delta_ptr", "z_ptr", "out_ptr", "B_ptr", "C_ptr", "dout_ptr", "du_ptr", "ddelta_ptr",
             "dz_ptr", "x_ptr", "dt_ptr")  # pointers in the inputs' dtype; the other pointers are float32


def _load_source(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_sm90(fn, consts: Dict[str, Any], warps: int, dtype: str = "bf16"):
    """Compile the Triton kernel ``fn`` for sm_90 ahead of time: the float I/O pointers in ``dtype``, the
    sequence-index pointers int32, the other pointers float32, every integer argument int32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts, **{a: 1 for a in fn.arg_names if a in _UNIT_STRIDES and a not in consts})
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = "*i32" if a in ("seq_ptr", "lastidx_ptr") else ("*" + dtype if a in _FLOAT_IO else "*fp32")
        else:
            sig[a] = "i32"
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))


def parse_sass(disassembly: str, resources: str) -> Dict[str, Any]:
    """Counts of an ``nvdisasm -c`` listing and a ``cuobjdump -res-usage`` report.

    A loop is a backward branch (``BRA`` to a label at or before it) over more than 8 instructions; the innermost
    loops (containing no other loop) are summed: ``loop_sass``, ``loop_barriers``, ``loop_mufu`` (None when the
    kernel has no loop).  ``sass`` and ``barriers`` count the whole kernel; ``regs`` and ``stack_bytes`` come from
    the resource report.
    """
    instrs, labels, pending = [], {}, []
    for ln in disassembly.splitlines():
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
    loops = []  # (start, end, sass, barriers, MUFU) of every loop
    for addr, text in instrs:
        m = re.search(r"BRA\s+(?:`\()?(\.L\w+)", text)
        if m and m.group(1) in labels and labels[m.group(1)] <= addr:
            body = [t for a, t in instrs if labels[m.group(1)] <= a <= addr]
            if len(body) > 8:
                loops.append((labels[m.group(1)], addr, len(body), sum("BAR" in t for t in body),
                              sum("MUFU" in t for t in body)))
    inner = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    hot = [sum(lp[i] for lp in inner) for i in (2, 3, 4)] if inner else [None] * 3
    reg = re.search(r"REG:(\d+)", resources)
    stack = re.search(r"STACK:(\d+)", resources)
    return dict(regs=int(reg.group(1)) if reg else None, stack_bytes=int(stack.group(1)) if stack else None,
                sass=len(instrs), barriers=sum("BAR" in t for _, t in instrs),
                loop_sass=hot[0], loop_barriers=hot[1], loop_mufu=hot[2])


def sass_stats(kernel) -> Dict[str, Any]:
    """:func:`parse_sass` of a compiled kernel (Triton's bundled nvdisasm and cuobjdump)."""
    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dis = subprocess.run([str(bindir / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True)
        res = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True)
    return parse_sass(dis.stdout, res.stdout)


def static_rows(old_source: Optional[Path]) -> List[Dict[str, Any]]:
    """One row per (kernel, version, dstate): :func:`sass_stats` and warp-instructions per (b, d, t) element =
    hot-loop SASS x warps / (b, d, t) elements one loop iteration covers, times the passes of the loop over one
    element (the backward's state tiles, ``NT``, run one after the other by a program)."""
    from certblocks.kernels import triton_decode as decode
    from certblocks.kernels import triton_scan as new

    flags = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, GATE=1, HAS_RESET=False)
    dec = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, GATE=1)
    rows = []

    def row(kernel, version, n, fn, consts, warps, elems, extra="", passes=1):
        st = sass_stats(compile_sm90(fn, consts, warps))
        per = (st["loop_sass"] if kernel != "decode" else st["sass"]) * warps * passes / elems
        rows.append(dict(kernel=kernel, version=version, dstate=n, warps=warps, config=extra,
                         warp_instr_per_elem=round(per, 1), **st))

    old = _load_source(old_source, "certblocks_old_triton_scan") if old_source is not None else None
    for n in (16, 64):
        if old is not None:
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


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """The rows as the Markdown table of benchmarks/results/kernels.md."""
    lines = ["| kernel | version | N | tile / program step | regs | stack B | barriers in loop | SASS in loop | "
             "warp-instr per (b,d,t) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dec = r["kernel"] == "decode"
        lines.append(f"| {r['kernel']} | {r['version']} | {r['dstate']} | {r['config']} | {r['regs']} | "
                     f"{r['stack_bytes']} | {r['barriers'] if dec else r['loop_barriers']} | "
                     f"{r['sass'] if dec else r['loop_sass']} | {r['warp_instr_per_elem']} |")
    return "\n".join(lines)


def old_kernels(rev: str) -> Optional[Path]:
    """``kernels/triton_scan.py`` at git revision ``rev`` written to a temporary file (None if git cannot)."""
    if not rev:
        return None
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/triton_scan.py"], capture_output=True,
                          text=True)
    if text.returncode != 0:
        print(f"old kernels unavailable ({text.stderr.strip()}); new kernels only", file=sys.stderr)
        return None
    path = Path(tempfile.gettempdir()) / "certblocks_old_triton_scan.py"
    path.write_text(text.stdout)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=OLD_REV, metavar="REV",
                    help="git revision whose kernels/triton_scan.py is the 'old' column ('' for none)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_static.json or benchmarks/out/)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing (read when triton is imported)
    rows = static_rows(old_kernels(args.old))
    print(table(rows))
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or ROOT / "benchmarks" / "out") / "gpu_static.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(rows=rows, old_rev=args.old), indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

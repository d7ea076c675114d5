"""benchmarks/tools/sass.py: the static sm_90 figures (registers, stack, SASS in the innermost loops)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sass

# An nvdisasm -c listing in miniature: an outer loop (.L_x_1) around an inner one (.L_x_2), then a forward branch.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   IADD3 R2, R0, 0x1, RZ ;
.L_x_2:
""" + "".join(f"        /*{0x30 + 16 * i:04x}*/              FFMA R{i % 8}, R2, R3, R4 ;\n" for i in range(8)) + """
        /*00b0*/                   MUFU.EX2 R5, R5 ;
        /*00c0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00d0*/              @P0 BRA `(.L_x_2) ;
""" + "".join(f"        /*{0xe0 + 16 * i:04x}*/                   IMAD R6, R6, R7, RZ ;\n" for i in range(4)) + """
        /*0120*/              @P1 BRA `(.L_x_1) ;
        /*0130*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0140*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0150*/                   EXIT ;
"""
RESOURCES = "Function _scan_fwd_kernel:\n REG:217 STACK:24 SHARED:0 LOCAL:0 CONSTANT[0]:512 TEXTURE:0 SURFACE:0"


def test_parse_counts_the_innermost_loop_only():
    st = sass.parse_sass(LISTING, RESOURCES)
    assert st["regs"] == 217 and st["stack_bytes"] == 24
    assert st["sass"] == 2 + 1 + 8 + 3 + 4 + 2 + 2  # every instruction of the kernel
    assert st["barriers"] == 2
    # the inner loop: 8 FFMA, MUFU, BAR, its branch (the outer loop contains it and is not counted)
    assert (st["loop_sass"], st["loop_barriers"], st["loop_mufu"]) == (11, 1, 1)


def test_a_kernel_without_loop():
    st = sass.parse_sass("        /*0000*/                   EXIT ;\n", "REG:16 STACK:0")
    assert st["loop_sass"] is None and st["sass"] == 1 and st["regs"] == 16 and st["stack_bytes"] == 0


def test_table_has_a_row_per_kernel():
    rows = [dict(kernel="forward", version="new", dstate=16, config="16 ch x 32 steps", regs=217, stack_bytes=0,
                 barriers=20, loop_barriers=16, sass=2000, loop_sass=1516, warp_instr_per_elem=11.8),
            dict(kernel="decode", version="new", dstate=16, config="32 ch", regs=46, stack_bytes=0, barriers=3,
                 loop_barriers=None, sass=648, loop_sass=None, warp_instr_per_elem=81.0)]
    lines = sass.table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| forward | new | 16 | 16 ch x 32 steps | 217 | 0 | 16 | 1516 | 11.8 |"
    assert lines[3] == "| decode | new | 16 | 32 ch | 46 | 0 | 3 | 648 | 81.0 |"  # a decode step: whole kernel


def test_static_figures_of_the_decode_kernel():
    """The sm_90 decode step compiles on the CPU and its SASS is counted.  In a subprocess: the interpreter flag
    of this process would turn the compile off."""
    code = ("import json, sass; from certblocks.kernels import triton_decode as td; "
            "k = sass.compile_sm90(td._state_update_kernel, dict(BLOCK_D=32, BLOCK_N=16, HAS_D=True, HAS_Z=True, "
            "HAS_BIAS=True, SOFTPLUS=True, GATE=1), 4); print(json.dumps(sass.sass_stats(k)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(sass.__file__).parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not available")
    assert r.returncode == 0, r.stderr[-3000:]
    st = json.loads(r.stdout.strip().splitlines()[-1])
    assert st["regs"] > 0 and st["sass"] > 100 and st["stack_bytes"] == 0
    assert st["loop_sass"] is None  # the decode step has no loop

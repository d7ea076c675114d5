"""The Triton kernels compile for a real GPU target (sm_90 cubin) even on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) checks the numerics but not that the kernels lower through
Triton's GPU pipeline (typing of branches, layouts, ptxas); this test compiles them ahead of time in
a subprocess (the interpreter flag is process-wide), with a fresh kernel cache.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from certblocks.kernels import triton_decode as td
    from certblocks.kernels import triton_scan as ts

    def compile_(fn, ptr_types, consts):
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ptr_types.get(name, "*fp32")
            else:
                sig[name] = "i32"
        k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert len(k.asm["cubin"]) > 0
        return k

    dt = "bf16"
    io = {k: "*" + dt for k in ("u_ptr", "delta_ptr", "z_ptr", "out_ptr", "B_ptr", "C_ptr", "dout_ptr")}
    io["seq_ptr"] = "*i32"
    io.update({k: "*" + dt for k in ("du_ptr", "ddelta_ptr", "dz_ptr")})
    for n, reset in ((16, True), (64, False)):
        flags = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, GATE=1, HAS_RESET=reset)
        bd, bn = ts.blocks(4096, 4096, n, 32, ts.FWD_TILE)
        compile_(ts._scan_fwd_kernel, io, dict(T=32, BLOCK_D=bd, BLOCK_N=bn, **flags))
        c = ts.bwd_config(4096, n, 32)
        c.pop("num_warps")
        compile_(ts._scan_bwd_kernel, io, dict(T=32, HAS_DLAST=True, FAST=True, **c, **flags))
    io2 = {k: "*" + dt for k in ("x_ptr", "dt_ptr", "z_ptr", "out_ptr", "B_ptr", "C_ptr")}
    c2 = dict(BLOCK_D=32, BLOCK_N=16, HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, GATE=2)
    compile_(td._state_update_kernel, io2, c2)
    print("compiled")
    """
)


@pytest.mark.subprocess
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=170)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("triton's ptxas is not available")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "compiled" in res.stdout

"""Triton kernels (forward and backward) against the reference loop and mamba-ssm.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the
shapes are small: batch 2, dim 8..32, dstate 4..16, seqlen up to 64 (> the checkpoint stride, so the
backward's chunked recomputation is exercised).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from certblocks.kernels import selective_scan, selective_scan_reference

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    # (dim, dstate, seqlen, options)
    (8, 4, 64, dict()),
    (16, 16, 40, dict(ngroups=2, has_z=False)),
    (32, 8, 64, dict(has_D=False, has_bias=False, softplus=False)),
    (24, 5, 33, dict(gate="sigmoid", ngroups=3)),
    (8, 4, 20, dict(use_last=False, has_z=False, has_D=False)),
]


def _to(x, dev):
    return {k: v.to(dev) for k, v in x.items()}


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_triton_matches_reference_fp32(scan_tools, case):
    dim, dstate, seqlen, cfg = case
    cfg = dict(cfg)
    softplus, gate, use_last = cfg.pop("softplus", True), cfg.pop("gate", "silu"), cfg.pop("use_last", True)
    x = scan_tools.make_inputs(batch=2, dim=dim, dstate=dstate, seqlen=seqlen, **cfg)
    kw = dict(delta_softplus=softplus, gate=gate, use_last=use_last)
    got = scan_tools.run(scan_tools.backend("triton"), _to(x, DEV), **kw)
    got = {k: v.cpu() for k, v in got.items()}
    want = scan_tools.run(selective_scan_reference, x, **kw)
    scan_tools.assert_close(got, want, torch.float32, "triton vs reference")
    if gate == "silu":
        mref = scan_tools.run(scan_tools.mamba_ref(), x, delta_softplus=softplus, use_last=use_last)
        scan_tools.assert_close(got, mref, torch.float32, "triton vs mamba_ssm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_low_precision(scan_tools, dtype):
    x = scan_tools.make_inputs(batch=2, dim=16, dstate=8, seqlen=48, ngroups=2, dtype=dtype)
    got = scan_tools.run(scan_tools.backend("triton"), _to(x, DEV), delta_softplus=True)
    got = {k: v.cpu() for k, v in got.items()}
    want = scan_tools.run(selective_scan_reference, x, delta_softplus=True)
    scan_tools.assert_close(got, want, dtype, "triton vs reference")
    mref = scan_tools.run(scan_tools.mamba_ref(), scan_tools.upcast(x), delta_softplus=True, round_to=dtype)
    scan_tools.assert_close(got, mref, dtype, "triton vs mamba_ssm (upcast inputs)", check_dtype=False)


def test_triton_cu_seqlens(scan_tools):
    x = scan_tools.make_inputs(batch=1, dim=8, dstate=4, seqlen=50, ngroups=2)
    cu = torch.tensor([0, 9, 9, 37, 50])
    got = scan_tools.run(scan_tools.backend("triton"), _to(x, DEV), cu_seqlens=cu.to(DEV), delta_softplus=True)
    got = {k: v.cpu() for k, v in got.items()}
    want = scan_tools.run(selective_scan_reference, x, cu_seqlens=cu, delta_softplus=True)
    assert got["last"].shape == (4, 8, 4)
    scan_tools.assert_close(got, want, torch.float32, "triton vs reference (cu_seqlens)")


def test_triton_forward_without_grad_matches_torch(scan_tools):
    x = _to(scan_tools.make_inputs(batch=2, dim=16, dstate=4, seqlen=16), DEV)
    a, la = selective_scan(**x, backend="triton", return_last_state=True)
    b, lb = selective_scan(**x, backend="torch", return_last_state=True)
    torch.testing.assert_close(a, b, rtol=6e-4, atol=2e-3)
    torch.testing.assert_close(la, lb, rtol=6e-4, atol=2e-3)


def test_triton_non_contiguous_inputs(scan_tools):
    x = scan_tools.make_inputs(batch=2, dim=8, dstate=4, seqlen=24)
    nc = {k: (v.transpose(1, 2).contiguous().transpose(1, 2) if k in ("B", "C") else v) for k, v in x.items()}
    nc["u"] = torch.cat([x["u"], x["u"]], dim=1)[:, :8]
    assert not nc["B"].is_contiguous() and not nc["u"].is_contiguous()
    got = scan_tools.run(scan_tools.backend("triton"), _to(nc, DEV), delta_softplus=True)
    got = {k: v.cpu() for k, v in got.items()}
    want = scan_tools.run(selective_scan_reference, x, delta_softplus=True)
    scan_tools.assert_close(got, want, torch.float32, "triton, non-contiguous inputs")

"""The reference loop against mamba-ssm's selective_scan_ref, and the semantics of gate / cu_seqlens."""

from __future__ import annotations

import pytest
import torch
from certblocks.kernels import selective_scan_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(ngroups=2, has_z=False),
        dict(has_D=False, has_bias=False, softplus=False),
        dict(ngroups=1, dim=12, dstate=5),
    ],
)
def test_reference_matches_mamba_ssm(scan_tools, cfg, dtype):
    cfg = dict(cfg)
    softplus = cfg.pop("softplus", True)
    ref = scan_tools.mamba_ref()
    x = scan_tools.make_inputs(seqlen=24, dtype=dtype, **cfg)
    got = scan_tools.run(selective_scan_reference, x, delta_softplus=softplus, gate="silu")
    want = scan_tools.run(ref, x, delta_softplus=softplus)
    scan_tools.assert_close(got, want, dtype, "reference vs mamba_ssm")


def test_sigmoid_gate_and_no_gate(scan_tools):
    x = scan_tools.make_inputs(seqlen=20)
    z = x.pop("z")
    plain = selective_scan_reference(**x, gate=None)
    sig = selective_scan_reference(**x, z=z, gate="sigmoid")
    silu = selective_scan_reference(**x, z=z, gate="silu")
    torch.testing.assert_close(sig, plain * torch.sigmoid(z))
    torch.testing.assert_close(silu, plain * torch.nn.functional.silu(z))


def test_reference_cu_seqlens_equals_separate_runs(scan_tools):
    x = scan_tools.make_inputs(batch=1, seqlen=30, ngroups=2, dim=8)
    cu = torch.tensor([0, 7, 7, 19, 30])
    out, last = selective_scan_reference(**x, cu_seqlens=cu, return_last_state=True, delta_softplus=True)
    assert last.shape == (4, 8, 4)
    for i in range(4):
        s, e = int(cu[i]), int(cu[i + 1])
        xi = {k: (v[..., s:e] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
        oi, li = selective_scan_reference(**xi, return_last_state=True, delta_softplus=True)
        torch.testing.assert_close(out[..., s:e], oi)
        torch.testing.assert_close(last[i], li[0] if e > s else torch.zeros_like(li[0]))

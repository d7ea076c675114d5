"""The fast torch backend against the reference loop and mamba-ssm: outputs, last state, all gradients."""

from __future__ import annotations

import pytest
import torch
from certblocks.kernels import selective_scan, selective_scan_reference, torch_scan

CASES = [
    dict(),
    dict(ngroups=2),
    dict(ngroups=4, dim=16, dstate=8, has_z=False),
    dict(has_D=False, has_bias=False, softplus=False),
    dict(has_z=True, has_D=False, gate="sigmoid"),
    dict(dim=12, dstate=5, use_last=False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CASES, ids=[str(i) for i in range(len(CASES))])
def test_torch_matches_reference(scan_tools, cfg, dtype):
    cfg = dict(cfg)
    softplus, gate, use_last = cfg.pop("softplus", True), cfg.pop("gate", "silu"), cfg.pop("use_last", True)
    # seqlen spans several blocks of the blocked scan, the last one partial
    seqlen = (2 if dtype == torch.float32 else 1) * torch_scan.CHUNK + 37
    x = scan_tools.make_inputs(seqlen=seqlen, dtype=dtype, **cfg)
    kw = dict(delta_softplus=softplus, gate=gate, use_last=use_last)
    got = scan_tools.run(scan_tools.backend("torch"), x, **kw)
    want = scan_tools.run(selective_scan_reference, x, **kw)
    scan_tools.assert_close(got, want, dtype, "torch vs reference")
    if gate == "silu":
        # mamba-ssm's selective_scan_ref evaluates silu(z) in z's dtype (bf16/fp16 rounding of the gate feeds
        # every gradient), whereas the kernels keep fp32 throughout: compare with it on the same values upcast.
        mref = scan_tools.run(
            scan_tools.mamba_ref(), scan_tools.upcast(x), delta_softplus=softplus, use_last=use_last, round_to=dtype
        )
        scan_tools.assert_close(got, mref, dtype, "torch vs mamba_ssm", check_dtype=dtype == torch.float32)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_cu_seqlens_equals_separate_runs(scan_tools, backend):
    """Packed batch: outputs, last states and all gradients equal those of the sequences run one by one."""
    x = scan_tools.make_inputs(batch=1, dim=8, dstate=4, seqlen=150, ngroups=2)
    cu = torch.tensor([0, 3, 3, 131, 150], dtype=torch.int32)
    packed = scan_tools.run(scan_tools.backend(backend), x, cu_seqlens=cu, delta_softplus=True)
    assert packed["last"].shape == (4, 8, 4)
    # same random projections, split per sequence: recompute the separate losses by hand
    xs = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    g = torch.Generator().manual_seed(1)
    go = torch.randn(packed["out"].shape, generator=g)
    gl = torch.randn(packed["last"].shape, generator=g)
    loss = 0.0
    for i in range(4):
        s, e = int(cu[i]), int(cu[i + 1])
        xi = {k: (v[..., s:e] if k in ("u", "delta", "z", "B", "C") else v) for k, v in xs.items()}
        oi, li = selective_scan_reference(**xi, return_last_state=True, delta_softplus=True)
        torch.testing.assert_close(packed["out"][..., s:e], oi.detach(), rtol=6e-4, atol=2e-3)
        torch.testing.assert_close(packed["last"][i], li[0].detach(), rtol=6e-4, atol=2e-3)
        loss = loss + (oi * go[..., s:e]).sum() + (li[0] * gl[i]).sum()
    loss.backward()
    for k, v in xs.items():
        torch.testing.assert_close(packed["d" + k], v.grad, rtol=6e-4, atol=2e-3, msg=lambda m, k=k: f"d{k}: {m}")


def test_auto_is_torch_on_cpu(scan_tools):
    x = scan_tools.make_inputs(seqlen=10)
    torch.testing.assert_close(selective_scan(**x), selective_scan(**x, backend="torch"), rtol=0, atol=0)


def test_no_grad_and_long_decay_stay_finite():
    """Large delta*|A| (decays underflow to 0) and long sequences: no NaN, no overflow."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(1, 4, 300, generator=g)
    delta = torch.full((1, 4, 300), 50.0)
    A = -torch.full((4, 3), 10.0)
    B = torch.randn(1, 3, 300, generator=g)
    C = torch.randn(1, 3, 300, generator=g)
    out = selective_scan(u, delta, A, B, C, backend="torch", gate=None)
    ref = selective_scan_reference(u, delta, A, B, C, gate=None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=6e-4, atol=2e-3)


def test_non_contiguous_inputs(scan_tools):
    """Views such as mamba's ``xz.chunk(2, dim=1)`` and ``rearrange(x_dbl, "(b l) n -> b n l")``."""
    x = scan_tools.make_inputs(batch=2, dim=8, dstate=4, seqlen=40)
    nc = {}
    for k, v in x.items():
        if k in ("u", "delta", "z", "B", "C"):
            w = torch.cat([v, torch.zeros_like(v)], dim=1)[:, : v.shape[1]]  # non-contiguous batch stride
            nc[k] = w.transpose(1, 2).contiguous().transpose(1, 2) if k in ("B", "C") else w
            assert not nc[k].is_contiguous()
        else:
            nc[k] = v
    got = scan_tools.run(scan_tools.backend("torch"), nc, delta_softplus=True)
    want = scan_tools.run(selective_scan_reference, x, delta_softplus=True)
    scan_tools.assert_close(got, want, torch.float32, "torch, non-contiguous inputs")


@pytest.mark.parametrize(
    "batch, dim, dstate, seqlen, ngroups",
    [
        (1, 4, 1, 1, None),
        (3, 6, 3, torch_scan.CHUNK, 6),
        (2, 4, 2, torch_scan.CHUNK + 1, 2),
        (1, 5, 7, 2 * torch_scan.CHUNK, 1),
    ],
)
def test_torch_edge_shapes(scan_tools, batch, dim, dstate, seqlen, ngroups):
    """Block boundaries (L = 1, K, K + 1, 2K), dstate = 1, one group per channel."""
    x = scan_tools.make_inputs(batch=batch, dim=dim, dstate=dstate, seqlen=seqlen, ngroups=ngroups, seed=seqlen)
    got = scan_tools.run(scan_tools.backend("torch"), x, delta_softplus=True)
    want = scan_tools.run(selective_scan_reference, x, delta_softplus=True)
    scan_tools.assert_close(got, want, torch.float32, "torch vs reference")

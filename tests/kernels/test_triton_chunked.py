"""The chunked Triton scan (forward and backward) and the decode kernel on the paths a GPU run takes:
L not a multiple of the chunk, dstate 1, 12, 16, 64, dim not a multiple of 32, channel-last and permuted
inputs, packed batches with empty and length-1 sequences, bit-identical reruns, a permuted decode input.

The reference loop is the oracle.  Without a GPU the kernels run in Triton's interpreter, so shapes are
tiny (conftest.py runs the interpreter's associative scan on whole slices to keep this fast).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from certblocks.kernels import selective_scan_reference, selective_state_update, selective_state_update_reference
from certblocks.kernels.ops import TRITON_CHUNK

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
K = TRITON_CHUNK


def _to(x, dev=DEV):
    return {k: v.to(dev) for k, v in x.items()}


def _cpu(r):
    return {k: v.cpu() for k, v in r.items()}


@pytest.mark.parametrize(
    "dim, dstate, seqlen, ngroups",
    [
        (40, 1, K + 7, None),  # dstate 1, dim not a multiple of 32, one group
        (6, 12, 2 * K + 1, 2),  # dstate 12 (padded to 16), 3 channels a group, 3 chunks, the last of one step
        (16, 16, K - 1, 1),  # one partial chunk; 4 channel blocks summed in one backward program
        (2, 64, K + 5, 1),  # dstate 64 (one channel a program)
    ],
)
def test_chunked_matches_reference(scan_tools, dim, dstate, seqlen, ngroups):
    x = scan_tools.make_inputs(batch=2, dim=dim, dstate=dstate, seqlen=seqlen, ngroups=ngroups, seed=dstate)
    got = _cpu(scan_tools.run(scan_tools.backend("triton"), _to(x), delta_softplus=True))
    want = scan_tools.run(selective_scan_reference, x, delta_softplus=True)
    scan_tools.assert_close(got, want, torch.float32, f"triton vs reference (N={dstate}, L={seqlen})")


def _channel_last(v: torch.Tensor) -> torch.Tensor:
    """The same values stored (batch, seqlen, channels): stride 1 along dim, as LinearGrowthMamba's views."""
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_channel_last_and_permuted_inputs(scan_tools):
    """u/delta/z channel-last, B/C (batch, L, N) storage, a permuted batch axis and a channel-last
    output gradient: every tensor read through its own strides."""
    x = scan_tools.make_inputs(batch=2, dim=12, dstate=4, seqlen=K + 3, ngroups=3)
    nc = {}
    for k, v in x.items():
        if k in ("u", "delta", "z", "B", "C"):
            nc[k] = _channel_last(v)
        else:
            nc[k] = v
    nc["u"] = x["u"].permute(2, 0, 1).contiguous().permute(1, 2, 0)  # (L, batch, dim) storage
    assert nc["u"].stride(2) == 2 * 12 and nc["delta"].stride(1) == 1 and nc["B"].stride(2) == 1
    g = torch.Generator().manual_seed(5)
    go = torch.randn(2, K + 3, 12, generator=g)

    def run(fn, xs):
        xs = {k: v.detach().clone().requires_grad_() for k, v in xs.items()}
        out, last = fn(**xs, delta_softplus=True, return_last_state=True)
        ((out.transpose(1, 2) * go).sum() + last.sum()).backward()  # dout arrives channel-last
        return {"out": out.detach(), "last": last.detach(), **{"d" + k: v.grad for k, v in xs.items()}}

    got = _cpu(run(scan_tools.backend("triton"), _to(nc)))
    want = run(selective_scan_reference, x)
    scan_tools.assert_close(got, want, torch.float32, "triton, channel-last / permuted")


def test_cu_seqlens_empty_and_single_step(scan_tools):
    L = K + 9
    cu = torch.tensor([0, 0, 1, 1, 40, 41, L, L])  # empty, length 1, empty, 39, 1, the rest, empty
    x = scan_tools.make_inputs(batch=1, dim=8, dstate=4, seqlen=L, ngroups=2)
    got = _cpu(scan_tools.run(scan_tools.backend("triton"), _to(x), cu_seqlens=cu.to(DEV), delta_softplus=True))
    want = scan_tools.run(selective_scan_reference, x, cu_seqlens=cu, delta_softplus=True)
    assert got["last"].shape == (7, 8, 4)
    assert not got["last"][[0, 2, 6]].any()  # empty sequences keep a zero state
    scan_tools.assert_close(got, want, torch.float32, "triton vs reference (cu_seqlens)")


def test_seq_index_on_device():
    from certblocks.kernels.triton_scan import seq_index

    cu = torch.tensor([0, 0, 2, 2, 3, 5])
    assert seq_index(cu, 5, torch.device("cpu")).tolist() == [1, 1, 3, 4, 4]


def test_reruns_are_bit_identical(scan_tools):
    x = _to(scan_tools.make_inputs(batch=2, dim=32, dstate=8, seqlen=K + 11))
    a = scan_tools.run(scan_tools.backend("triton"), x, delta_softplus=True)
    b = scan_tools.run(scan_tools.backend("triton"), x, delta_softplus=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_backward_writes_input_dtype(scan_tools):
    """du, ddelta, dz come out of the kernel in bf16 (no float32 buffer cast afterwards)."""
    from certblocks.kernels import triton_scan

    x = scan_tools.make_inputs(batch=1, dim=8, dstate=4, seqlen=K + 2, dtype=torch.bfloat16)
    B, C = x["B"].unsqueeze(1), x["C"].unsqueeze(1)
    xd = _to(x)
    args = (xd["u"], xd["delta"], xd["A"], B.to(DEV), C.to(DEV), xd["D"], xd["z"], xd["delta_bias"], True, "silu", None)
    out, _, ckpt = triton_scan.scan_fwd(*args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    du, ddelta, dA, dB, dC, dD, dz, ddb = triton_scan.scan_bwd(dout.to(DEV), None, *args, ckpt)
    assert (du.dtype, ddelta.dtype, dz.dtype) == (torch.bfloat16,) * 3
    assert dA.dtype == dB.dtype == torch.float32
    xs = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    ref = selective_scan_reference(**xs, delta_softplus=True)
    ref.backward(dout)
    for got, k in ((du, "u"), (ddelta, "delta"), (dz, "z")):
        torch.testing.assert_close(got.cpu().float(), xs[k].grad.float(), rtol=3e-2, atol=5e-2)


def test_decode_permuted_inputs():
    """x, dt, z given as (dim, batch) storage and a permuted state: the output must not be scrambled."""
    g = torch.Generator().manual_seed(7)
    b, d, n = 3, 40, 12
    args = dict(
        A=-torch.rand(d, n, generator=g), B=torch.randn(b, 2, n, generator=g), C=torch.randn(b, 2, n, generator=g),
        D=torch.randn(d, generator=g), dt_bias=torch.randn(d, generator=g), dt_softplus=True, gate="silu",
    )
    x, dt, z = (torch.randn(d, b, generator=g).t() for _ in range(3))
    assert not x.is_contiguous()
    state = torch.randn(b, n, d, generator=g).transpose(1, 2)
    s_ref = state.contiguous().clone()
    want = selective_state_update_reference(s_ref, x.contiguous(), dt.contiguous(), z=z.contiguous(), **args)
    s_got = state.clone().to(DEV)  # keeps the permuted layout
    assert not s_got.is_contiguous()
    dev_args = {k: v.to(DEV) if torch.is_tensor(v) else v for k, v in args.items()}
    got = selective_state_update(s_got, x.to(DEV), dt.to(DEV), z=z.to(DEV), **dev_args, backend="triton")
    torch.testing.assert_close(got.cpu(), want, rtol=6e-4, atol=2e-3)
    torch.testing.assert_close(s_got.cpu(), s_ref, rtol=6e-4, atol=2e-3)


@pytest.mark.parametrize(
    "dstate, seqlen, opts",
    [
        (17, K + 5, {}),  # two state tiles, the second of one state
        (40, 2 * K + 3, dict(has_D=False, ngroups=2)),  # three tiles, the last half full; no D
        (33, K - 3, dict(has_z=False, has_bias=False)),  # no gate: no dz sums; no ddelta_bias
        (64, K + 1, dict(has_bias=False)),  # four full tiles; the last block of one step
    ],
)
def test_backward_state_tiles(scan_tools, dstate, seqlen, opts):
    """dstate > 16: a program runs over tiles of 16 states in turn; du, ddelta, dz summed over the tiles in its
    float32 scratch and written by the last tile (D u, dy D and dD from the first tile, ddelta_bias from the
    last); N not a multiple of the tile."""
    from certblocks.kernels.triton_scan import bwd_config

    assert bwd_config(4, dstate, K)["NT"] == -(-dstate // 16)
    x = scan_tools.make_inputs(batch=2, dim=4, dstate=dstate, seqlen=seqlen, seed=dstate, **opts)
    got = _cpu(scan_tools.run(scan_tools.backend("triton"), _to(x), delta_softplus=True))
    want = scan_tools.run(selective_scan_reference, x, delta_softplus=True)
    scan_tools.assert_close(got, want, torch.float32, f"triton vs reference (N={dstate}, state tiles)")
    again = _cpu(scan_tools.run(scan_tools.backend("triton"), _to(x), delta_softplus=True))
    for k in got:
        assert torch.equal(got[k], again[k]), k


def test_backward_state_tiles_cu_seqlens_bf16(scan_tools):
    """State tiles with packed sequences (the final-state gradient read per tile) and bf16 outputs cast from
    the float32 sums over the tiles."""
    L = K + 9
    cu = torch.tensor([0, 1, 1, 30, L])
    x = scan_tools.make_inputs(batch=1, dim=4, dstate=24, seqlen=L, ngroups=2, dtype=torch.bfloat16, seed=3)
    got = _cpu(scan_tools.run(scan_tools.backend("triton"), _to(x), cu_seqlens=cu.to(DEV), delta_softplus=True))
    want = scan_tools.run(selective_scan_reference, scan_tools.upcast(x), cu_seqlens=cu, delta_softplus=True,
                          round_to=torch.bfloat16)
    assert (got["du"].dtype, got["ddelta"].dtype, got["dz"].dtype) == (torch.bfloat16,) * 3
    scan_tools.assert_close(got, want, torch.bfloat16, "triton vs reference (N=24, cu_seqlens, bf16)",
                            check_dtype=False)

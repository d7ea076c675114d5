"""Decode step: prefill + selective_state_update steps equal the full scan; state updated in place."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from certblocks.kernels import selective_scan, selective_scan_reference, selective_state_update

HAS_TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
BACKENDS = ["reference", "torch"] + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ngroups", [None, 2])
@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
def test_prefill_then_steps_equals_full_scan(scan_tools, backend, ngroups, gate):
    L, P = 12, 7
    x = scan_tools.make_inputs(batch=2, dim=8, dstate=4, seqlen=L, ngroups=ngroups)
    full = selective_scan_reference(**x, delta_softplus=True, gate=gate)
    pre = {k: (v[..., :P] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    out_p, state = selective_scan(**pre, delta_softplus=True, gate=gate, return_last_state=True, backend=backend)
    torch.testing.assert_close(out_p, full[..., :P], rtol=6e-4, atol=2e-3)
    state_ptr = state.data_ptr()
    for t in range(P, L):
        y = selective_state_update(
            state, x["u"][..., t], x["delta"][..., t], x["A"], x["B"][..., t], x["C"][..., t], x["D"],
            x["z"][..., t], x["delta_bias"], dt_softplus=True, gate=gate, backend=backend,
        )
        torch.testing.assert_close(y, full[..., t], rtol=6e-4, atol=2e-3)
    assert state.data_ptr() == state_ptr  # updated in place
    _, last = selective_scan_reference(**x, delta_softplus=True, gate=gate, return_last_state=True)
    torch.testing.assert_close(state, last, rtol=6e-4, atol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matches_mamba_ssm_ref(backend):
    if importlib.util.find_spec("mamba_ssm") is None:
        pytest.skip("mamba-ssm is not installed")
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update_ref

    g = torch.Generator().manual_seed(3)
    b, d, n = 2, 16, 8
    state = torch.randn(b, d, n, generator=g)
    args = dict(
        x=torch.randn(b, d, generator=g), dt=torch.randn(b, d, generator=g), A=-torch.rand(d, n, generator=g),
        B=torch.randn(b, n, generator=g), C=torch.randn(b, n, generator=g), D=torch.randn(d, generator=g),
        z=torch.randn(b, d, generator=g), dt_bias=torch.randn(d, generator=g), dt_softplus=True,
    )
    s1, s2 = state.clone(), state.clone()
    want = selective_state_update_ref(s1, **args)
    got = selective_state_update(s2, **args, backend=backend)
    torch.testing.assert_close(got, want, rtol=6e-4, atol=2e-3)
    torch.testing.assert_close(s2, s1, rtol=6e-4, atol=2e-3)

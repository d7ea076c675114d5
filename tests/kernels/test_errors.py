"""Invalid arguments raise ValueError / TypeError naming the argument and what is allowed."""

from __future__ import annotations

import pytest
import torch
from certblocks.kernels import selective_scan, selective_state_update


def _x(**over):
    g = torch.Generator().manual_seed(0)
    x = dict(
        u=torch.randn(2, 8, 5, generator=g), delta=torch.rand(2, 8, 5, generator=g), A=-torch.rand(8, 4, generator=g),
        B=torch.randn(2, 4, 5, generator=g), C=torch.randn(2, 4, 5, generator=g),
    )
    x.update(over)
    return x


@pytest.mark.parametrize(
    "over, exc, pattern",
    [
        (dict(u=torch.randn(2, 8)), ValueError, r"u has shape \(2, 8\); expected \(batch, dim, seqlen\)"),
        (dict(delta=torch.rand(2, 8, 6)), ValueError, r"delta has shape \(2, 8, 6\); expected the shape of u"),
        (dict(A=torch.rand(7, 4)), ValueError, r"A has shape \(7, 4\); expected \(dim, dstate\) with dim=8"),
        (dict(B=torch.randn(2, 3, 5)), ValueError, r"B has shape \(2, 3, 5\); expected \(batch, dstate, seqlen\)"),
        (dict(C=torch.randn(2, 3, 4, 5)), ValueError, r"C has shape \(2, 3, 4, 5\).*ngroups dividing dim=8"),
        (dict(C=torch.randn(5)), ValueError, r"C has 1 dimensions"),
        (dict(D=torch.randn(7)), ValueError, r"D has shape \(7,\); expected \(dim,\)"),
        (dict(delta_bias=torch.randn(2, 8)), ValueError, r"delta_bias has shape"),
        (dict(z=torch.randn(2, 8, 4)), ValueError, r"z has shape \(2, 8, 4\)"),
        (dict(u=torch.randn(2, 8, 5).double()), TypeError, r"u has dtype torch.float64; allowed: torch.float32"),
        (dict(B=torch.randint(0, 3, (2, 4, 5))), TypeError, r"B has dtype torch.int64"),
        (dict(u=[1, 2]), TypeError, r"u must be a torch.Tensor, got list"),
        (dict(gate="relu"), ValueError, r"gate='relu' is not supported; allowed: 'silu', 'sigmoid', None"),
        (dict(gate=1), TypeError, r"gate must be a str or None"),
        (dict(backend="cuda"), ValueError, r"backend='cuda' is not supported; allowed: 'auto', 'reference'"),
        (dict(z=torch.randn(2, 8, 5), gate=None), ValueError, r"z was given but gate=None"),
        (dict(delta_softplus=1), TypeError, r"delta_softplus must be a bool"),
        (dict(return_last_state="yes"), TypeError, r"return_last_state must be a bool"),
        (dict(cu_seqlens=torch.tensor([0, 2, 5])), ValueError, r"cu_seqlens needs a packed batch of size 1"),
    ],
)
def test_scan_errors(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        selective_scan(**_x(**over))


@pytest.mark.parametrize(
    "cu, exc, pattern",
    [
        (torch.tensor([0, 2, 4]), ValueError, r"must start at 0, be non-decreasing and end at seqlen=5"),
        (torch.tensor([0, 3, 2, 5]), ValueError, r"non-decreasing"),
        (torch.tensor([0.0, 5.0]), TypeError, r"cu_seqlens has dtype torch.float32; allowed: torch.int32"),
        (torch.tensor([[0, 5]]), ValueError, r"cu_seqlens has shape \(1, 2\)"),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_cu_seqlens_errors(cu, exc, pattern, backend):
    x = _x(u=torch.randn(1, 8, 5), delta=torch.rand(1, 8, 5), B=torch.randn(1, 4, 5), C=torch.randn(1, 4, 5))
    with pytest.raises(exc, match=pattern):
        selective_scan(**x, cu_seqlens=cu, backend=backend)


def test_triton_backend_unavailable_message(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='triton' cannot run on device cpu"):
        selective_scan(**_x(), backend="triton")


@pytest.mark.parametrize(
    "over, exc, pattern",
    [
        (dict(state=torch.zeros(2, 8)), ValueError, r"state has shape \(2, 8\); expected \(batch, dim, dstate\)"),
        (dict(x=torch.zeros(2, 7)), ValueError, r"x has shape \(2, 7\); expected \(batch, dim\)"),
        (dict(B=torch.zeros(2, 3, 4)), ValueError, r"B has shape \(2, 3, 4\)"),
        (dict(gate="tanh"), ValueError, r"gate='tanh' is not supported"),
        (dict(dt=torch.zeros(2, 8, dtype=torch.float64)), TypeError, r"dt has dtype torch.float64"),
        (dict(backend="numpy"), ValueError, r"backend='numpy' is not supported"),
    ],
)
def test_state_update_errors(over, exc, pattern):
    args = dict(
        state=torch.zeros(2, 8, 4), x=torch.zeros(2, 8), dt=torch.zeros(2, 8), A=-torch.ones(8, 4),
        B=torch.zeros(2, 4), C=torch.zeros(2, 4),
    )
    args.update(over)
    with pytest.raises(exc, match=pattern):
        selective_state_update(**args)

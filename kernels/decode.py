"""Decode step: ``selective_state_update`` (one new token, state updated in place)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import FLOAT_DTYPES, check_gate


def check_decode_args(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    dt_softplus: bool,
    gate: Optional[str],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validate the arguments of a decode step; return B and C viewed as (batch, ngroups, dstate)."""
    for name, t, opt in (
        ("state", state, False), ("x", x, False), ("dt", dt, False), ("A", A, False), ("B", B, False),
        ("C", C, False), ("D", D, True), ("z", z, True), ("dt_bias", dt_bias, True),
    ):
        if t is None and opt:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if opt else ''}, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; allowed: torch.float32, torch.float16, torch.bfloat16")
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus must be a bool, got {type(dt_softplus).__name__}")
    gate = check_gate(gate)
    if state.dim() != 3:
        raise ValueError(f"state has shape {tuple(state.shape)}; expected (batch, dim, dstate)")
    batch, dim, dstate = state.shape
    for name, t in (("x", x), ("dt", dt), ("z", z)):
        if t is not None and tuple(t.shape) != (batch, dim):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (batch, dim) = {(batch, dim)}")
    if tuple(A.shape) != (dim, dstate):
        raise ValueError(f"A has shape {tuple(A.shape)}; expected (dim, dstate) = {(dim, dstate)}")
    out = []
    for name, t in (("B", B), ("C", C)):
        if t.dim() == 2 and tuple(t.shape) == (batch, dstate):
            out.append(t.unsqueeze(1))
        elif t.dim() == 3 and (t.shape[0], t.shape[2]) == (batch, dstate) and t.shape[1] >= 1 and dim % t.shape[1] == 0:
            out.append(t)
        else:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected (batch, dstate) = {(batch, dstate)} or "
                f"(batch, ngroups, dstate) with ngroups dividing dim={dim}"
            )
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None and tuple(t.shape) != (dim,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (dim,) = ({dim},)")
    if z is not None and gate is None:
        raise ValueError("z was given but gate=None (no gating); pass gate='silu' or 'sigmoid', or z=None")
    return out[0], out[1]

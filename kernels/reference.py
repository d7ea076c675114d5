"""Plain per-timestep reference twins of the selective scan and of the decode step.

These loops are what the tests trust: every fast backend (``torch``, ``triton``) is checked
against them.  They compute in float32 and differentiate through ordinary autograd.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ._checks import check_gate, check_scan_args


def apply_gate(z: torch.Tensor, gate: Optional[str]) -> torch.Tensor:
    """Return ``gate(z)`` for ``gate`` in ``{"silu", "sigmoid"}`` (computed in z's dtype)."""
    if gate == "silu":
        return F.silu(z)
    if gate == "sigmoid":
        return torch.sigmoid(z)
    raise ValueError(f"gate={gate!r} has no gate function; allowed: 'silu', 'sigmoid'")


def _expand_groups(x: torch.Tensor, dim: int) -> torch.Tensor:
    """(batch, G, N, L) -> (batch, dim, N, L): channel d reads group d // (dim // G)."""
    g = x.shape[1]
    return x.repeat_interleave(dim // g, dim=1) if g != dim else x


def selective_scan_reference(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    gate: Optional[str] = "silu",
    return_last_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Selective scan as a plain loop over time (the twin of :func:`certblocks.kernels.selective_scan`).

    Same arguments and result as :func:`certblocks.kernels.selective_scan` with ``backend="reference"``.
    """
    a = check_scan_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens)
    batch, dim, seqlen = u.shape
    uf, dt = a.u.float(), a.delta.float()
    if a.delta_bias is not None:
        dt = dt + a.delta_bias.float()[:, None]
    if a.delta_softplus:
        dt = F.softplus(dt)
    Af = a.A.float()
    Bf = _expand_groups(a.B.float(), dim)  # (batch, dim, N, L)
    Cf = _expand_groups(a.C.float(), dim)
    if a.cu_seqlens is None:
        bounds = [(0, seqlen)]
    else:
        cs = [int(v) for v in a.cu_seqlens.tolist()]
        bounds = list(zip(cs[:-1], cs[1:]))
    # per-step views through unbind: its backward stacks the step gradients once (linear in L)
    dts, us = dt.unbind(2), uf.unbind(2)
    Bs, Cs = Bf.unbind(3), Cf.unbind(3)
    ys, lasts = [], []
    for start, stop in bounds:
        h = uf.new_zeros(batch, dim, Af.shape[1])
        for t in range(start, stop):
            dA = torch.exp(dts[t][:, :, None] * Af)  # (batch, dim, N)
            h = dA * h + (dts[t] * us[t])[:, :, None] * Bs[t]
            ys.append((h * Cs[t]).sum(-1))
        lasts.append(h)
    y = torch.stack(ys, dim=2) if ys else uf.new_zeros(batch, dim, 0)
    if a.D is not None:
        y = y + uf * a.D.float()[:, None]
    if a.z is not None:
        y = y * apply_gate(a.z.float(), a.gate)
    out = y.to(u.dtype)
    if not return_last_state:
        return out
    last = lasts[0] if a.cu_seqlens is None else torch.cat(lasts, dim=0)
    return out, last


def selective_state_update_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    gate: Optional[str] = "silu",
) -> torch.Tensor:
    """One decode step, updating ``state`` in place (twin of :func:`certblocks.kernels.selective_state_update`).

    Shapes: ``state`` (batch, dim, dstate); ``x``, ``dt``, ``z`` (batch, dim); ``A`` (dim, dstate);
    ``B``, ``C`` (batch, dstate) or grouped (batch, ngroups, dstate); ``D``, ``dt_bias`` (dim,).
    Returns ``out`` (batch, dim) in x's dtype.
    """
    from .decode import check_decode_args

    Bc, Cc = check_decode_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate)
    gate = check_gate(gate)
    dim = x.shape[1]
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    Bf = Bc.float().repeat_interleave(dim // Bc.shape[1], dim=1)  # (batch, dim, N)
    Cf = Cc.float().repeat_interleave(dim // Cc.shape[1], dim=1)
    h = torch.exp(d[:, :, None] * A.float()) * state.float() + (d * x.float())[:, :, None] * Bf
    state.copy_(h.to(state.dtype))
    y = (h * Cf).sum(-1)
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * apply_gate(z.float(), gate)
    return y.to(x.dtype)

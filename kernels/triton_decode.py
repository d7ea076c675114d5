"""Triton kernel of the decode step (``selective_state_update``: one new token, the state updated in place).

One program per (batch, block of 32 channels), all ``dstate`` states: ``h = exp(dt A) h + dt x B``,
``y = C h (+ D x)``, gated by ``z``.  Every tensor is read with its own strides; offsets in int64.  Imported
lazily, like :mod:`.triton_scan` (whose helpers it shares).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_scan import _GATES, _channels, _on, _opt, _softplus

__all__ = ["state_update"]


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr,
    DIM, N, H,
    s_sb, s_sd, s_sn, s_xb, s_xd, s_tb, s_td, s_zb, s_zd, s_ob, s_od,
    s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    GATE: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    offs_d, offs_n, mask_d, mask_n, d64, dn, mask_dn, A, A2, Dv, bias = _channels(
        A_ptr, D_ptr, bias_ptr, tl.program_id(1), DIM, N, BLOCK_D, BLOCK_N, HAS_D, HAS_BIAS)
    n64 = offs_n.to(tl.int64)
    g = d64 // H
    sp = state_ptr + pid_b * s_sb + d64[:, None] * s_sd + n64[None, :] * s_sn
    h = tl.load(sp, mask=mask_dn, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * s_xb + d64 * s_xd, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * s_tb + d64 * s_td, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += bias
    if SOFTPLUS:
        dt = _softplus(dt)
    Bv = tl.load(B_ptr + pid_b * s_Bb + g[:, None] * s_Bg + n64[None, :] * s_Bn, mask=mask_dn, other=0.0)
    Cv = tl.load(C_ptr + pid_b * s_Cb + g[:, None] * s_Cg + n64[None, :] * s_Cn, mask=mask_dn, other=0.0)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * Bv.to(tl.float32)
    tl.store(sp, h.to(state_ptr.dtype.element_ty), mask=mask_dn)
    y = tl.sum(h * Cv.to(tl.float32), axis=1)
    if HAS_D:
        y += x * Dv
    if HAS_Z:
        zz = tl.load(z_ptr + pid_b * s_zb + d64 * s_zd, mask=mask_d, other=0.0).to(tl.float32)
        sz = tl.sigmoid(zz)
        if GATE == 1:
            y = y * zz * sz
        else:
            y = y * sz
    tl.store(out_ptr + pid_b * s_ob + d64 * s_od, y.to(out_ptr.dtype.element_ty), mask=mask_d)


def state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate):
    """Decode step kernel launcher (state updated in place); arguments as in selective_state_update.
    Every tensor is read with its own strides; ``out`` is a new contiguous (batch, dim) tensor."""
    batch, dim, N = state.shape
    Bc = B if B.dim() == 3 else B.unsqueeze(1)
    Cc = C if C.dim() == 3 else C.unsqueeze(1)
    H = dim // Bc.shape[1]
    out = torch.empty((batch, dim), device=x.device, dtype=x.dtype)
    A = A.contiguous()
    D = D.contiguous() if D is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    BD = min(32, triton.next_power_of_2(dim))
    grid = (batch, triton.cdiv(dim, BD))
    with _on(state.device):
        _state_update_kernel[grid](
            state, x, dt, A, Bc, Cc, _opt(D, x), _opt(z, x), _opt(dt_bias, x), out,
            dim, N, H, *state.stride(), *x.stride(), *dt.stride(),
            *(z.stride() if z is not None else (0, 0)), *out.stride(), *Bc.stride(), *Cc.stride(),
            BLOCK_D=BD, BLOCK_N=triton.next_power_of_2(N),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
            GATE=_GATES[gate],
        )
    return out

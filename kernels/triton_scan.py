"""Triton kernels for the selective scan: forward, backward and decode step.

Imported lazily (only when ``backend="triton"`` runs).  On a machine without a GPU the kernels run
in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is imported.

Forward (``_scan_fwd_kernel``): one program per (batch, block of ``BLOCK_D`` channels), all ``dstate``
states of those channels in registers, sequential over time.  Gate fused in the epilogue.  The state
is written to ``ckpt`` every ``K`` steps (and at the last step).

Backward (``_scan_bwd_kernel``): same grid; the chunks of ``K`` steps are visited in reverse.  For
each chunk the states are recomputed from the previous checkpoint into a per-program scratch slab,
then the adjoint ``lam_t = C_t dy_t + a_{t+1} lam_{t+1}`` runs backwards in time.  ``dB``/``dC`` are
reduced over the block's channels inside the program and written as per-block partials (a block
never straddles two groups), summed afterwards in torch; ``dA``, ``dD``, ``ddelta_bias`` are per-batch
partials summed afterwards.  No atomics.

``cu_seqlens``: a float ``keep`` vector is 0 at the first step of every sequence (the decay is zeroed,
which resets the state and stops the adjoint); an int ``last_idx`` vector says which sequence ends
at each step (-1: none) so the kernel stores / receives the last state there.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_GATES = {None: 0, "silu": 1, "sigmoid": 2}


@triton.jit
def _softplus(x):
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def _scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, keep_ptr, lastidx_ptr,
    out_ptr, last_ptr, ckpt_ptr,
    L, DIM, N, H,
    s_ub, s_ud, s_ul,
    s_Bb, s_Bg, s_Bn, s_Bl,
    s_Cb, s_Cg, s_Cn, s_Cl,
    K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    GATE: tl.constexpr, HAS_RESET: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < DIM
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    g = (pid_d * BLOCK_D) // H  # a block never straddles two groups
    A = tl.load(A_ptr + offs_d[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    row = pid_b * s_ub + offs_d * s_ud
    Bp = B_ptr + pid_b * s_Bb + g * s_Bg + offs_n * s_Bn
    Cp = C_ptr + pid_b * s_Cb + g * s_Cg + offs_n * s_Cn
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for t in tl.range(0, L, num_stages=NUM_STAGES):
        uu = tl.load(u_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
        dt = tl.load(delta_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt = dt + bias
        if SOFTPLUS:
            dt = _softplus(dt)
        Bt = tl.load(Bp + t * s_Bl, mask=mask_n, other=0.0).to(tl.float32)
        Ct = tl.load(Cp + t * s_Cl, mask=mask_n, other=0.0).to(tl.float32)
        a = tl.exp(dt[:, None] * A)
        if HAS_RESET:
            a = tl.where(tl.load(keep_ptr + t) > 0.0, a, 0.0)
        h = a * h + (dt * uu)[:, None] * Bt[None, :]
        y = tl.sum(h * Ct[None, :], axis=1)
        if HAS_D:
            y = y + Dv * uu
        if HAS_Z:
            zz = tl.load(z_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
            sz = tl.sigmoid(zz)
            if GATE == 1:
                y = y * zz * sz
            else:
                y = y * sz
        tl.store(out_ptr + row + t * s_ul, y.to(out_ptr.dtype.element_ty), mask=mask_d)
        if ((t + 1) % K == 0) | (t == L - 1):
            c = t // K
            cp = ckpt_ptr + ((c * tl.num_programs(0) + pid_b) * DIM + offs_d[:, None]) * N + offs_n[None, :]
            tl.store(cp, h, mask=mask_dn)
        li = tl.load(lastidx_ptr + t)
        if li >= 0:
            lp = last_ptr + ((pid_b + li) * DIM + offs_d[:, None]) * N + offs_n[None, :]
            tl.store(lp, h, mask=mask_dn)


@triton.jit
def _scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, keep_ptr, lastidx_ptr,
    dout_ptr, dlast_ptr, ckpt_ptr, scratch_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dD_ptr, dbias_ptr, dBp_ptr, dCp_ptr,
    L, DIM, N, H, NBLK,
    s_ub, s_ud, s_ul,
    s_Bb, s_Bg, s_Bn, s_Bl,
    s_Cb, s_Cg, s_Cn, s_Cl,
    K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    GATE: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DLAST: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    nb = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < DIM
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    g = (pid_d * BLOCK_D) // H
    dn_off = offs_d[:, None] * N + offs_n[None, :]
    A = tl.load(A_ptr + dn_off, mask=mask_dn, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    row = pid_b * s_ub + offs_d * s_ud
    Bp = B_ptr + pid_b * s_Bb + g * s_Bg + offs_n * s_Bn
    Cp = C_ptr + pid_b * s_Cb + g * s_Cg + offs_n * s_Cn
    # per-program scratch slab (K, BLOCK_D, BLOCK_N) for the recomputed states of one chunk
    scr = scratch_ptr + (pid_b * tl.num_programs(1) + pid_d) * (K * BLOCK_D * BLOCK_N)
    scr_off = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + offs_n[None, :]
    part = (pid_b * NBLK + pid_d) * N  # row of the dB / dC partials
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    lam_next = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)  # a_{t+1} * lam_{t+1}
    nchunks = (L + K - 1) // K
    for cr in range(0, nchunks):
        c = nchunks - 1 - cr
        s = c * K
        e = tl.minimum(s + K, L)
        if c > 0:
            cp = ckpt_ptr + ((c - 1) * nb + pid_b) * DIM * N + dn_off
            h = tl.load(cp, mask=mask_dn, other=0.0)
        else:
            h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
        h0 = h
        # recompute the chunk's states
        for t in range(s, e):
            uu = tl.load(u_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
            dt = tl.load(delta_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
            if HAS_BIAS:
                dt = dt + bias
            if SOFTPLUS:
                dt = _softplus(dt)
            Bt = tl.load(Bp + t * s_Bl, mask=mask_n, other=0.0).to(tl.float32)
            a = tl.exp(dt[:, None] * A)
            if HAS_RESET:
                a = tl.where(tl.load(keep_ptr + t) > 0.0, a, 0.0)
            h = a * h + (dt * uu)[:, None] * Bt[None, :]
            tl.store(scr + (t - s) * (BLOCK_D * BLOCK_N) + scr_off, h)
        tl.debug_barrier()
        # adjoint, backwards in time
        for tr in range(s, e):
            t = e - 1 - (tr - s)
            uu = tl.load(u_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
            dt_raw = tl.load(delta_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
            if HAS_BIAS:
                dt_raw = dt_raw + bias
            if SOFTPLUS:
                dt = _softplus(dt_raw)
            else:
                dt = dt_raw
            Bt = tl.load(Bp + t * s_Bl, mask=mask_n, other=0.0).to(tl.float32)
            Ct = tl.load(Cp + t * s_Cl, mask=mask_n, other=0.0).to(tl.float32)
            a = tl.exp(dt[:, None] * A)
            if HAS_RESET:
                a = tl.where(tl.load(keep_ptr + t) > 0.0, a, 0.0)
            ht = tl.load(scr + (t - s) * (BLOCK_D * BLOCK_N) + scr_off)
            if t > s:
                hp = tl.load(scr + (t - s - 1) * (BLOCK_D * BLOCK_N) + scr_off)
            else:
                hp = h0
            dout = tl.load(dout_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
            if HAS_Z:
                zz = tl.load(z_ptr + row + t * s_ul, mask=mask_d, other=0.0).to(tl.float32)
                sz = tl.sigmoid(zz)
                y = tl.sum(ht * Ct[None, :], axis=1)
                if HAS_D:
                    y = y + Dv * uu
                if GATE == 1:
                    gz = zz * sz
                    gp = sz * (1.0 + zz * (1.0 - sz))
                else:
                    gz = sz
                    gp = sz * (1.0 - sz)
                tl.store(dz_ptr + row + t * s_ul, (dout * y * gp).to(dz_ptr.dtype.element_ty), mask=mask_d)
                dy = dout * gz
            else:
                dy = dout
            lam = lam_next + dy[:, None] * Ct[None, :]
            if HAS_DLAST:
                li = tl.load(lastidx_ptr + t)
                if li >= 0:
                    lp = dlast_ptr + (pid_b + li) * DIM * N + dn_off
                    lam += tl.load(lp, mask=mask_dn, other=0.0).to(tl.float32)
            lam = tl.where(mask_dn, lam, 0.0)
            # dB, dC partials reduced over the block's channels
            dyv = tl.where(mask_d, dy, 0.0)
            dC_t = tl.sum(ht * dyv[:, None], axis=0)
            dB_t = tl.sum(lam * (dt * uu)[:, None], axis=0)
            tl.store(dCp_ptr + (part + offs_n) * L + t, dC_t, mask=mask_n)
            tl.store(dBp_ptr + (part + offs_n) * L + t, dB_t, mask=mask_n)
            ddtu = tl.sum(lam * Bt[None, :], axis=1)
            dlog = lam * a * hp
            ddt = tl.sum(dlog * A, axis=1) + ddtu * uu
            dA_acc += dlog * dt[:, None]
            du = ddtu * dt
            if HAS_D:
                du += dy * Dv
                dD_acc += dy * uu
            if SOFTPLUS:
                ddt = ddt * tl.sigmoid(dt_raw)
            db_acc += ddt
            tl.store(du_ptr + row + t * s_ul, du.to(du_ptr.dtype.element_ty), mask=mask_d)
            tl.store(ddelta_ptr + row + t * s_ul, ddt.to(ddelta_ptr.dtype.element_ty), mask=mask_d)
            lam_next = a * lam
        tl.debug_barrier()
    tl.store(dA_ptr + pid_b * DIM * N + dn_off, dA_acc, mask=mask_dn)
    if HAS_D:
        tl.store(dD_ptr + pid_b * DIM + offs_d, dD_acc, mask=mask_d)
    if HAS_BIAS:
        tl.store(dbias_ptr + pid_b * DIM + offs_d, db_acc, mask=mask_d)


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr,
    DIM, N, H,
    s_sb, s_sd, s_sn, s_xb, s_xd, s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    GATE: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < DIM
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    g = offs_d // H
    sp = state_ptr + pid_b * s_sb + offs_d[:, None] * s_sd + offs_n[None, :] * s_sn
    h = tl.load(sp, mask=mask_dn, other=0.0).to(tl.float32)
    xo = pid_b * s_xb + offs_d * s_xd
    x = tl.load(x_ptr + xo, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + xo, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    A = tl.load(A_ptr + offs_d[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + pid_b * s_Bb + g[:, None] * s_Bg + offs_n[None, :] * s_Bn, mask=mask_dn, other=0.0)
    Cv = tl.load(C_ptr + pid_b * s_Cb + g[:, None] * s_Cg + offs_n[None, :] * s_Cn, mask=mask_dn, other=0.0)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * Bv.to(tl.float32)
    tl.store(sp, h.to(state_ptr.dtype.element_ty), mask=mask_dn)
    y = tl.sum(h * Cv.to(tl.float32), axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_Z:
        zz = tl.load(z_ptr + xo, mask=mask_d, other=0.0).to(tl.float32)
        sz = tl.sigmoid(zz)
        if GATE == 1:
            y = y * zz * sz
        else:
            y = y * sz
    tl.store(out_ptr + xo, y.to(out_ptr.dtype.element_ty), mask=mask_d)


def _block_d(dim: int, H: int, cap: int = 32) -> int:
    """Largest power of two <= cap dividing H (so a block stays inside one group)."""
    b = 1
    while b * 2 <= cap and H % (b * 2) == 0:
        b *= 2
    return b


def _aux(cu_seqlens: Optional[torch.Tensor], L: int, device: torch.device):
    keep = torch.ones(max(L, 1), device=device, dtype=torch.float32)
    lastidx = torch.full((max(L, 1),), -1, device=device, dtype=torch.int32)
    if cu_seqlens is None:
        if L > 0:
            lastidx[L - 1] = 0
        return keep, lastidx, False
    cs = [int(v) for v in cu_seqlens.tolist()]
    for i in range(len(cs) - 1):
        if cs[i + 1] > cs[i]:
            keep[cs[i]] = 0.0
            lastidx[cs[i + 1] - 1] = i
    return keep, lastidx, True


def _strides(u, B, C):
    return (*u.stride(), *B.stride(), *C.stride())


def scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens, chunk: int = 64):
    """Forward on canonical shapes; returns (out in u.dtype, last_state fp32, checkpoints fp32)."""
    batch, dim, L = u.shape
    G, N = B.shape[1], A.shape[1]
    H = dim // G
    u, delta = u.contiguous(), delta.contiguous()
    z = z.contiguous() if z is not None else None
    A = A.contiguous()
    D = D.contiguous() if D is not None else None
    delta_bias = delta_bias.contiguous() if delta_bias is not None else None
    nlast = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    out = torch.empty_like(u)
    last = torch.zeros((nlast, dim, N), device=u.device, dtype=torch.float32)
    nck = (L + chunk - 1) // chunk
    ckpt = torch.zeros((nck, batch, dim, N), device=u.device, dtype=torch.float32)
    if L == 0:
        return out, last, ckpt
    keep, lastidx, has_reset = _aux(cu_seqlens, L, u.device)
    BD = _block_d(dim, H)
    grid = (batch, triton.cdiv(dim, BD))
    _scan_fwd_kernel[grid](
        u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
        delta_bias if delta_bias is not None else u, keep, lastidx, out, last, ckpt,
        L, dim, N, H, *_strides(u, B, C),
        K=chunk, BLOCK_D=BD, BLOCK_N=triton.next_power_of_2(N),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        GATE=_GATES[gate], HAS_RESET=has_reset, NUM_STAGES=2,
    )
    return out, last, ckpt


def scan_bwd(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens, ckpt,
             chunk: int = 64):
    """Backward on canonical shapes; float32 (or input-dtype) grads (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)."""
    batch, dim, L = u.shape
    G, N = B.shape[1], A.shape[1]
    H = dim // G
    u, delta, dout = u.contiguous(), delta.contiguous(), dout.contiguous()
    z = z.contiguous() if z is not None else None
    A = A.contiguous()
    D = D.contiguous() if D is not None else None
    delta_bias = delta_bias.contiguous() if delta_bias is not None else None
    BD = _block_d(dim, H)
    BN = triton.next_power_of_2(N)
    nblk = triton.cdiv(dim, BD)
    f32 = dict(device=u.device, dtype=torch.float32)
    du = torch.empty((batch, dim, L), **f32)
    ddelta = torch.empty((batch, dim, L), **f32)
    dz = torch.empty((batch, dim, L), **f32) if z is not None else None
    dA = torch.zeros((batch, dim, N), **f32)
    dD = torch.zeros((batch, dim), **f32)
    dbias = torch.zeros((batch, dim), **f32)
    dBp = torch.zeros((batch, nblk, N, L), **f32)
    dCp = torch.zeros((batch, nblk, N, L), **f32)
    scratch = torch.empty((batch * nblk * chunk * BD * BN,), **f32)
    keep, lastidx, has_reset = _aux(cu_seqlens, L, u.device)
    if L > 0:
        _scan_bwd_kernel[(batch, nblk)](
            u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
            delta_bias if delta_bias is not None else u, keep, lastidx,
            dout, dlast.contiguous() if dlast is not None else u, ckpt, scratch,
            du, ddelta, dz if dz is not None else du, dA, dD, dbias, dBp, dCp,
            L, dim, N, H, nblk, *_strides(u, B, C),
            K=chunk, BLOCK_D=BD, BLOCK_N=BN,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
            GATE=_GATES[gate], HAS_RESET=has_reset, HAS_DLAST=dlast is not None,
        )
    dB = dBp.view(batch, G, nblk // G, N, L).sum(2)
    dC = dCp.view(batch, G, nblk // G, N, L).sum(2)
    return (
        du, ddelta, dA.sum(0), dB, dC,
        dD.sum(0) if D is not None else None, dz, dbias.sum(0) if delta_bias is not None else None,
    )


def state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate):
    """Decode step kernel launcher (state updated in place); arguments as in selective_state_update."""
    batch, dim, N = state.shape
    Bc = B if B.dim() == 3 else B.unsqueeze(1)
    Cc = C if C.dim() == 3 else C.unsqueeze(1)
    H = dim // Bc.shape[1]
    out = torch.empty_like(x)
    A = A.contiguous()
    x, dt = x.contiguous(), dt.contiguous()
    D = D.contiguous() if D is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    z = z.contiguous() if z is not None else None
    BD = min(32, triton.next_power_of_2(dim))
    grid = (batch, triton.cdiv(dim, BD))
    _state_update_kernel[grid](
        state, x, dt, A, Bc, Cc, D if D is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else x, out,
        dim, N, H, *state.stride(), *x.stride(), *Bc.stride(), *Cc.stride(),
        BLOCK_D=BD, BLOCK_N=triton.next_power_of_2(N),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        GATE=_GATES[gate],
    )
    return out

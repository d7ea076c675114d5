"""Triton kernels for the selective scan: forward, backward and decode step.

Imported lazily (only when ``backend="triton"`` runs).  On a machine without a GPU the kernels run
in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is imported.

Forward (``_scan_fwd_kernel``): one program per (batch, block of ``BLOCK_D`` channels inside one group),
all ``dstate`` states of those channels, over the sequence in chunks of ``T`` steps.  A chunk is a
``(T, BLOCK_D, BLOCK_N)`` tile, time first (so that each thread holds a run of steps and the scan is mostly
sequential in registers): the decays ``a = exp(dt * A)`` and inputs ``b = dt * u * B`` of the whole chunk
are built at once and ``h_t = a_t h_{t-1} + b_t`` runs as one ``tl.associative_scan`` over the (a, b) pairs,
the state entering the chunk carried from the previous one (``h = prod(a) * h_in + scan(b)``).
Per-channel work (bias, softplus, ``dt * u``, the gate) is done on ``(T, BLOCK_D)`` tiles, once per channel
and step.  State and arithmetic in float32.  The state after every chunk is written to ``ckpt`` (the
backward's restart points).  Every tensor is read with its own strides: channel-last ``u``/``delta``/``z``
(and ``dout``) are read without a copy.

Backward (``_scan_bwd_kernel``): one program per (batch, ``NSUB`` blocks of ``BLOCK_D`` channels inside one
group); chunks visited in reverse, the program's blocks one after the other inside each chunk.  A block's
states are recomputed from its checkpoint with the same forward scan (in registers, no per-step scratch),
then the adjoint ``lam_t = C_t dy_t + a_{t+1} lam_{t+1}`` runs as a reverse associative scan
(``reverse=True``) over the pairs (a_{t+1}, C_t dy_t), ``a_{t+1}`` built from the inputs loaded one step
later, the adjoint entering from the later chunk carried through a ``(batch, dim, dstate)`` float32 buffer
(the size of one state).  ``a_t h_{t-1} = h_t - b_t`` gives the decay gradient without shifting a tile.
``dB``/``dC`` are summed over the program's channels in registers and written as per-program partials,
summed afterwards in torch in a fixed order (deterministic, no atomics); ``dA``, ``dD``, ``ddelta_bias``
are per-batch partials accumulated by their program and summed afterwards.  ``du``, ``ddelta``, ``dz`` are
written in the inputs' dtypes.

``cu_seqlens``: turned on the device (``torch.searchsorted``, no host sync) into a per-step sequence
index ``seq``; the kernels read it: the decay is zeroed where ``seq`` changes (the state restarts from
zero and the adjoint stops there) and the state is stored to / its gradient read from ``last[seq_t]``
at each step where a sequence ends.

Offsets that can pass 2^31 (batch x channel x time, checkpoints) are computed in int64.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

_GATES = {None: 0, "silu": 1, "sigmoid": 2}
LOG2E = 1.4426950408889634
FWD_TILE = 8192  # elements of one (T, BLOCK_D, BLOCK_N) tile of the forward
BWD_TILE = 2048  # of the backward (more live tiles)
BWD_CHANNELS = 64  # channels of one backward program (dB / dC reduced over them in the program)


@triton.jit
def _softplus(x):
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def _affine(a1, b1, a2, b2):
    # composition of x -> a1 x + b1 then x -> a2 x + b2 (the reverse scan uses it unchanged)
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _delta(delta_ptr, offs, mask, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """(raw, dt): delta (+ bias) before and after the softplus, float32."""
    raw = tl.load(delta_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw = raw + bias[None, :]
    if SOFTPLUS:
        dt = _softplus(raw)
    else:
        dt = raw
    return raw, dt


@triton.jit
def _channels(A_ptr, D_ptr, bias_ptr, pid_d, DIM, N, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A block's channel and state indices with their masks, and its per-channel constants: (offs_d, offs_n,
    mask_d, mask_n, int64 channels, offset of (d, n) in a (dim, N) array, its mask, A, A log2 e, D, bias)."""
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < DIM
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    d64 = offs_d.to(tl.int64)
    dn = d64[:, None] * N + offs_n[None, :]
    A = tl.load(A_ptr + dn, mask=mask_dn, other=0.0).to(tl.float32)
    Dv = tl.load(D_ptr + offs_d, mask=mask_d & HAS_D, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + offs_d, mask=mask_d & HAS_BIAS, other=0.0).to(tl.float32)
    # exp(dt A) = exp2(dt A log2 e)
    return offs_d, offs_n, mask_d, mask_n, d64, dn, mask_dn, A, A * 1.4426950408889634, Dv, bias


@triton.jit
def _rows(u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr, pid_b, pid_d, offs_n, H, s_ub, s_ud, s_tb, s_td, s_zb, s_zd,
          s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, BLOCK_D: tl.constexpr):
    """Row pointers of a block (int64 offsets): u, delta, z at (pid_b, d); B, C at (pid_b, group, n)."""
    d64 = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    g = ((pid_d * BLOCK_D) // H).to(tl.int64)  # a block never straddles two groups
    n64 = offs_n.to(tl.int64)
    return (
        u_ptr + pid_b * s_ub + d64 * s_ud, delta_ptr + pid_b * s_tb + d64 * s_td, z_ptr + pid_b * s_zb + d64 * s_zd,
        B_ptr + pid_b * s_Bb + g * s_Bg + n64 * s_Bn, C_ptr + pid_b * s_Cb + g * s_Cg + n64 * s_Cn,
    )


@triton.jit
def _chunk(u_row, t_row, Bp, Cp, t64, m_dt, m_nt, s_ul, s_tl, s_Bl, s_Cl, bias, HAS_BIAS: tl.constexpr,
           SOFTPLUS: tl.constexpr):
    """One chunk's inputs in float32: u, delta (+ bias) before and after the softplus (T, BLOCK_D);
    B, C (T, BLOCK_N)."""
    uu = tl.load(u_row[None, :] + t64[:, None] * s_ul, mask=m_dt, other=0.0).to(tl.float32)
    raw, dt = _delta(t_row[None, :] + t64[:, None] * s_tl, 0, m_dt, bias, HAS_BIAS, SOFTPLUS)
    Bt = tl.load(Bp[None, :] + t64[:, None] * s_Bl, mask=m_nt, other=0.0).to(tl.float32)
    Ct = tl.load(Cp[None, :] + t64[:, None] * s_Cl, mask=m_nt, other=0.0).to(tl.float32)
    return uu, raw, dt, Bt, Ct


@triton.jit
def _scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr,
    out_ptr, last_ptr, ckpt_ptr,
    L, DIM, N, H,
    s_ub, s_ud, s_ul, s_tb, s_td, s_tl, s_zb, s_zd, s_zl, s_ob, s_od, s_ol,
    s_Bb, s_Bg, s_Bn, s_Bl,
    s_Cb, s_Cg, s_Cn, s_Cl,
    T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    GATE: tl.constexpr, HAS_RESET: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    nb = tl.num_programs(0)
    pid_d = tl.program_id(1)
    offs_t = tl.arange(0, T)
    offs_d, offs_n, mask_d, mask_n, d64, dn, mask_dn, A, A2, Dv, bias = _channels(
        A_ptr, D_ptr, bias_ptr, pid_d, DIM, N, BLOCK_D, BLOCK_N, HAS_D, HAS_BIAS)
    u_row, t_row, z_row, Bp, Cp = _rows(
        u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr, pid_b, pid_d, offs_n, H, s_ub, s_ud, s_tb, s_td, s_zb, s_zd,
        s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, BLOCK_D)
    o_row = out_ptr + pid_b * s_ob + d64 * s_od
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    nchunks = tl.cdiv(L, T)
    for c in range(0, nchunks):
        t = c * T + offs_t
        mask_t = t < L
        t64 = t.to(tl.int64)
        m_dt = mask_t[:, None] & mask_d[None, :]
        m_nt = mask_t[:, None] & mask_n[None, :]
        uu, _, dt, Bt, Ct = _chunk(u_row, t_row, Bp, Cp, t64, m_dt, m_nt, s_ul, s_tl, s_Bl, s_Cl, bias, HAS_BIAS,
                                   SOFTPLUS)
        a = tl.exp2(dt[:, :, None] * A2[None, :, :])  # (T, BLOCK_D, BLOCK_N)
        if HAS_RESET:
            sq = tl.load(seq_ptr + t, mask=mask_t, other=-1)
            sq_prev = tl.load(seq_ptr + t - 1, mask=mask_t & (t > 0), other=-1)
            a = tl.where((sq == sq_prev)[:, None, None], a, 0.0)
        b = (dt * uu)[:, :, None] * Bt[:, None, :]
        ac, bc = tl.associative_scan((a, b), 0, _affine)
        hs = ac * h[None, :, :] + bc
        y = tl.sum(hs * Ct[:, None, :], axis=2)  # (T, BLOCK_D)
        if HAS_D:
            y = y + Dv[None, :] * uu
        if HAS_Z:
            zz = tl.load(z_row[None, :] + t64[:, None] * s_zl, mask=m_dt, other=0.0).to(tl.float32)
            sz = tl.sigmoid(zz)
            if GATE == 1:
                y = y * zz * sz
            else:
                y = y * sz
        tl.store(o_row[None, :] + t64[:, None] * s_ol, y.to(out_ptr.dtype.element_ty), mask=m_dt)
        last_t = tl.minimum(L - c * T, T) - 1
        h = tl.sum(tl.where((offs_t == last_t)[:, None, None], hs, 0.0), axis=0)
        tl.store(ckpt_ptr + (c * nb + pid_b) * DIM * N + dn, h, mask=mask_dn)
        if HAS_RESET:
            sq_next = tl.load(seq_ptr + t + 1, mask=(t + 1) < L, other=-1)
            ends = mask_t & (sq_next != sq)
            lp = last_ptr + sq.to(tl.int64)[:, None, None] * DIM * N + dn[None, :, :]
            tl.store(lp, hs, mask=mask_dn[None, :, :] & ends[:, None, None])
    if not HAS_RESET:
        tl.store(last_ptr + pid_b * DIM * N + dn, h, mask=mask_dn)


@triton.jit
def _accumulate(ptr, x, mask, ADD):
    """ptr[...] = x, or += x when ADD (a float32 per-program accumulator in global memory)."""
    if ADD:
        x += tl.load(ptr, mask=mask, other=0.0)
    tl.store(ptr, x, mask=mask)


@triton.jit
def _scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr,
    dout_ptr, dlast_ptr, ckpt_ptr, lamc_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dD_ptr, dbias_ptr, dBp_ptr, dCp_ptr,
    L, DIM, N, H, NPROG,
    s_ub, s_ud, s_ul, s_tb, s_td, s_tl, s_zb, s_zd, s_zl, s_gb, s_gd, s_gl,
    s_Bb, s_Bg, s_Bn, s_Bl,
    s_Cb, s_Cg, s_Cn, s_Cl,
    T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    GATE: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DLAST: tl.constexpr,
):
    # one program: NSUB blocks of BLOCK_D channels (one group), their dB / dC summed inside the program
    pid_b = tl.program_id(0).to(tl.int64)
    nb = tl.num_programs(0)
    pid_p = tl.program_id(1)
    offs_t = tl.arange(0, T)
    offs_n = tl.arange(0, BLOCK_N)
    part = ((pid_b * NPROG + pid_p) * N + offs_n) * L  # rows of the dB / dC partials, (BLOCK_N,)
    nchunks = tl.cdiv(L, T)
    for cr in range(0, nchunks):
        c = nchunks - 1 - cr
        t = c * T + offs_t
        mask_t = t < L
        mask_t1 = (t + 1) < L
        t64 = t.to(tl.int64)
        m_nt = mask_t[:, None] & (offs_n < N)[None, :]
        keep1 = mask_t1
        if HAS_RESET:
            sq = tl.load(seq_ptr + t, mask=mask_t, other=-1)
            sq_prev = tl.load(seq_ptr + t - 1, mask=mask_t & (t > 0), other=-1)
            sq_next = tl.load(seq_ptr + t + 1, mask=mask_t1, other=-1)
            keep1 = keep1 & (sq_next == sq)
        dB_acc = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        dC_acc = tl.zeros((T, BLOCK_N), dtype=tl.float32)
        for sub in range(0, NSUB):
            blk = pid_p * NSUB + sub
            offs_d, offs_n, mask_d, mask_n, d64, dn, mask_dn, A, A2, Dv, bias = _channels(
                A_ptr, D_ptr, bias_ptr, blk, DIM, N, BLOCK_D, BLOCK_N, HAS_D, HAS_BIAS)
            u_row, t_row, z_row, Bp, Cp = _rows(
                u_ptr, delta_ptr, z_ptr, B_ptr, C_ptr, pid_b, blk, offs_n, H, s_ub, s_ud, s_tb, s_td, s_zb, s_zd,
                s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, BLOCK_D)
            g_row = dout_ptr + pid_b * s_gb + d64 * s_gd
            o_row = pid_b * DIM * L + d64 * L  # du, ddelta, dz: (batch, dim, L) contiguous
            m_dt = mask_t[:, None] & mask_d[None, :]
            uu, raw, dt, Bt, Ct = _chunk(u_row, t_row, Bp, Cp, t64, m_dt, m_nt, s_ul, s_tl, s_Bl, s_Cl, bias, HAS_BIAS,
                                         SOFTPLUS)
            _, dt1 = _delta(t_row[None, :] + (t64[:, None] + 1) * s_tl, 0, mask_t1[:, None] & mask_d[None, :], bias,
                            HAS_BIAS, SOFTPLUS)
            dout = tl.load(g_row[None, :] + t64[:, None] * s_gl, mask=m_dt, other=0.0).to(tl.float32)
            a = tl.exp2(dt[:, :, None] * A2[None, :, :])
            if HAS_RESET:
                a = tl.where((sq == sq_prev)[:, None, None], a, 0.0)
            a1 = tl.where(keep1[:, None, None], tl.exp2(dt1[:, :, None] * A2[None, :, :]), 0.0)  # a_{t+1}
            if c > 0:
                h0 = tl.load(ckpt_ptr + ((c - 1) * nb + pid_b) * DIM * N + dn, mask=mask_dn, other=0.0)
            else:
                h0 = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
            dtu = dt * uu
            b = dtu[:, :, None] * Bt[:, None, :]
            ac, bc = tl.associative_scan((a, b), 0, _affine)
            hs = ac * h0[None, :, :] + bc  # h_t
            if HAS_Z:
                zz = tl.load(z_row[None, :] + t64[:, None] * s_zl, mask=m_dt, other=0.0).to(tl.float32)
                sz = tl.sigmoid(zz)
                y = tl.sum(hs * Ct[:, None, :], axis=2)
                if HAS_D:
                    y = y + Dv[None, :] * uu
                if GATE == 1:
                    gz = zz * sz
                    gp = sz * (1.0 + zz * (1.0 - sz))
                else:
                    gz = sz
                    gp = sz * (1.0 - sz)
                tl.store(dz_ptr + o_row[None, :] + t64[:, None], (dout * y * gp).to(dz_ptr.dtype.element_ty), mask=m_dt)
                dy = dout * gz
            else:
                dy = dout
            gin = dy[:, :, None] * Ct[:, None, :]
            if HAS_DLAST:
                if HAS_RESET:
                    ends = mask_t & (sq_next != sq)
                    lp = dlast_ptr + sq.to(tl.int64)[:, None, None] * DIM * N + dn[None, :, :]
                    gin += tl.load(lp, mask=mask_dn[None, :, :] & ends[:, None, None], other=0.0).to(tl.float32)
                else:
                    dl = tl.load(dlast_ptr + pid_b * DIM * N + dn, mask=mask_dn & (cr == 0), other=0.0).to(tl.float32)
                    gin += tl.where((t == L - 1)[:, None, None], dl[None, :, :], 0.0)
            # lam_t = gin_t + a_{t+1} lam_{t+1}; the later chunk's adjoint enters through a_{t+1} at the last step
            lc, gc = tl.associative_scan((a1, gin), 0, _affine, reverse=True)
            if cr > 0:
                lam_in = tl.load(lamc_ptr + pid_b * DIM * N + dn, mask=mask_dn, other=0.0)
            else:
                lam_in = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
            lam = lc * lam_in[None, :, :] + gc
            tl.store(lamc_ptr + pid_b * DIM * N + dn, tl.sum(tl.where((offs_t == 0)[:, None, None], lam, 0.0), axis=0),
                     mask=mask_dn)
            dlog = lam * (hs - b)  # lam_t a_t h_{t-1}
            dC = tl.sum(hs * dy[:, :, None], axis=1)  # (T, BLOCK_N)
            dB = tl.sum(lam * dtu[:, :, None], axis=1)
            dC_acc += dC
            dB_acc += dB
            ddtu = tl.sum(lam * Bt[:, None, :], axis=2)  # (T, BLOCK_D)
            ddt = tl.sum(dlog * A[None, :, :], axis=2) + ddtu * uu
            _accumulate(dA_ptr + pid_b * DIM * N + dn, tl.sum(dlog * dt[:, :, None], axis=0), mask_dn, cr > 0)
            du = ddtu * dt
            if HAS_D:
                du += dy * Dv[None, :]
                _accumulate(dD_ptr + pid_b * DIM + offs_d, tl.sum(dy * uu, axis=0), mask_d, cr > 0)
            if SOFTPLUS:
                ddt = ddt * tl.sigmoid(raw)
            ddt = tl.where(m_dt, ddt, 0.0)
            if HAS_BIAS:
                _accumulate(dbias_ptr + pid_b * DIM + offs_d, tl.sum(ddt, axis=0), mask_d, cr > 0)
            tl.store(du_ptr + o_row[None, :] + t64[:, None], du.to(du_ptr.dtype.element_ty), mask=m_dt)
            tl.store(ddelta_ptr + o_row[None, :] + t64[:, None], ddt.to(ddelta_ptr.dtype.element_ty), mask=m_dt)
        tl.store(dCp_ptr + part[None, :] + t64[:, None], dC_acc, mask=m_nt)
        tl.store(dBp_ptr + part[None, :] + t64[:, None], dB_acc, mask=m_nt)
        tl.debug_barrier()  # the adjoint carry and the accumulators are read back by other threads


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
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < DIM
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    d64 = offs_d.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    g = d64 // H
    sp = state_ptr + pid_b * s_sb + d64[:, None] * s_sd + n64[None, :] * s_sn
    h = tl.load(sp, mask=mask_dn, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * s_xb + d64 * s_xd, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * s_tb + d64 * s_td, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    A = tl.load(A_ptr + d64[:, None] * N + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + pid_b * s_Bb + g[:, None] * s_Bg + n64[None, :] * s_Bn, mask=mask_dn, other=0.0)
    Cv = tl.load(C_ptr + pid_b * s_Cb + g[:, None] * s_Cg + n64[None, :] * s_Cn, mask=mask_dn, other=0.0)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * Bv.to(tl.float32)
    tl.store(sp, h.to(state_ptr.dtype.element_ty), mask=mask_dn)
    y = tl.sum(h * Cv.to(tl.float32), axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_Z:
        zz = tl.load(z_ptr + pid_b * s_zb + d64 * s_zd, mask=mask_d, other=0.0).to(tl.float32)
        sz = tl.sigmoid(zz)
        if GATE == 1:
            y = y * zz * sz
        else:
            y = y * sz
    tl.store(out_ptr + pid_b * s_ob + d64 * s_od, y.to(out_ptr.dtype.element_ty), mask=mask_d)


def _on(device: torch.device):
    """``torch.cuda.device(device)`` around a launch on a CUDA tensor (the kernel runs on the tensor's
    GPU, not the current one); nothing on the CPU (interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _block_d(H: int, cap: int) -> int:
    """Largest power of two <= cap dividing H (so a block stays inside one group)."""
    b = 1
    while b * 2 <= cap and H % (b * 2) == 0:
        b *= 2
    return b


def blocks(dim: int, H: int, N: int, chunk: int, tile: int):
    """(BLOCK_D, BLOCK_N) of a scan kernel: a (chunk, BLOCK_D, BLOCK_N) tile of at most ``tile`` elements."""
    BN = triton.next_power_of_2(N)
    return _block_d(H, max(1, tile // (BN * chunk))), BN


def seq_index(cu_seqlens: Optional[torch.Tensor], L: int, device: torch.device) -> Optional[torch.Tensor]:
    """int32 (L,): the packed sequence each step belongs to (None without cu_seqlens).  On the device, no
    host sync: step t is in the last sequence i with cu_seqlens[i] <= t (empty sequences own no step)."""
    if cu_seqlens is None:
        return None
    steps = torch.arange(L, device=device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens.to(device), steps, right=True) - 1).to(torch.int32)


def _opt(x: Optional[torch.Tensor], ref: torch.Tensor) -> torch.Tensor:
    return ref if x is None else x


def _s3(x: Optional[torch.Tensor]):
    return tuple(x.stride()) if x is not None else (0, 0, 0)


def scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens, chunk: int = 32):
    """Forward on canonical shapes; returns (out in u.dtype, last_state fp32, checkpoints fp32)."""
    batch, dim, L = u.shape
    G, N = B.shape[1], A.shape[1]
    H = dim // G
    A = A.contiguous()
    D = D.contiguous() if D is not None else None
    delta_bias = delta_bias.contiguous() if delta_bias is not None else None
    f32 = dict(device=u.device, dtype=torch.float32)
    out = torch.empty((batch, dim, L), device=u.device, dtype=u.dtype)
    if cu_seqlens is None:
        last = torch.empty((batch, dim, N), **f32) if L > 0 else torch.zeros((batch, dim, N), **f32)
    else:
        last = torch.zeros((cu_seqlens.shape[0] - 1, dim, N), **f32)  # an empty sequence keeps zeros
    nck = (L + chunk - 1) // chunk
    ckpt = torch.empty((nck, batch, dim, N), **f32)
    if L == 0:
        return out, last, ckpt
    seq = seq_index(cu_seqlens, L, u.device)
    BD, BN = blocks(dim, H, N, chunk, FWD_TILE)
    grid = (batch, triton.cdiv(dim, BD))
    with _on(u.device):
        _scan_fwd_kernel[grid](
            u, delta, A, B, C, _opt(D, u), _opt(z, u), _opt(delta_bias, u), _opt(seq, u),
            out, last, ckpt,
            L, dim, N, H, *u.stride(), *delta.stride(), *_s3(z), *out.stride(), *B.stride(), *C.stride(),
            T=chunk, BLOCK_D=BD, BLOCK_N=BN,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
            GATE=_GATES[gate], HAS_RESET=seq is not None,
        )
    return out, last, ckpt


def scan_bwd(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens, ckpt,
             chunk: int = 32):
    """Backward on canonical shapes: (du, ddelta, dz) in the inputs' dtypes, (dA, dB, dC, dD, ddelta_bias)
    in float32."""
    batch, dim, L = u.shape
    G, N = B.shape[1], A.shape[1]
    H = dim // G
    A = A.contiguous()
    D = D.contiguous() if D is not None else None
    delta_bias = delta_bias.contiguous() if delta_bias is not None else None
    BN = triton.next_power_of_2(N)
    BD = _block_d(H, max(4, BWD_TILE // (BN * chunk)))  # 4 channels at N 16 and 64: fewest instructions, least spilled
    per_prog = _block_d(H, max(BD, BWD_CHANNELS))  # channels of one program (a multiple of BD inside one group)
    nprog = dim // per_prog
    dev = u.device
    f32 = dict(device=dev, dtype=torch.float32)
    # every element below is written by the kernel (when L > 0)
    new = torch.empty if L > 0 else torch.zeros
    lamc = torch.empty((batch, dim, N), **f32)  # the adjoint carried from one chunk to the one before
    du = torch.empty((batch, dim, L), device=dev, dtype=u.dtype)
    ddelta = torch.empty((batch, dim, L), device=dev, dtype=delta.dtype)
    dz = torch.empty((batch, dim, L), device=dev, dtype=z.dtype) if z is not None else None
    dA = new((batch, dim, N), **f32)
    dD = new((batch, dim), **f32)
    dbias = new((batch, dim), **f32)
    dBp = torch.empty((batch, nprog, N, L), **f32)
    dCp = torch.empty((batch, nprog, N, L), **f32)
    if L > 0:
        seq = seq_index(cu_seqlens, L, dev)
        with _on(dev):
            _scan_bwd_kernel[(batch, nprog)](
                u, delta, A, B, C, _opt(D, u), _opt(z, u), _opt(delta_bias, u), _opt(seq, u),
                dout, _opt(dlast.contiguous() if dlast is not None else None, u), ckpt, lamc,  # (batch, dim, N)
                du, ddelta, _opt(dz, du), dA, dD, dbias, dBp, dCp,
                L, dim, N, H, nprog,
                *u.stride(), *delta.stride(), *_s3(z), *dout.stride(), *B.stride(), *C.stride(),
                T=chunk, BLOCK_D=BD, BLOCK_N=BN, NSUB=per_prog // BD,
                HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
                SOFTPLUS=delta_softplus, GATE=_GATES[gate], HAS_RESET=seq is not None, HAS_DLAST=dlast is not None,
            )
    dB = dBp.view(batch, G, nprog // G, N, L).sum(2)
    dC = dCp.view(batch, G, nprog // G, N, L).sum(2)
    return (
        du, ddelta, dA.sum(0), dB, dC,
        dD.sum(0) if D is not None else None, dz, dbias.sum(0) if delta_bias is not None else None,
    )


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

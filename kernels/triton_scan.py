"""Triton kernels for the selective scan: forward and backward (the decode step: :mod:`.triton_decode`).

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
group); blocks of ``BT`` steps visited in reverse (``BT`` divides the forward's chunk), the program's channel
blocks one after the other inside each.  Tiles are ``(BT, NP, BLOCK_D, NL)`` (:func:`bwd_config`): a thread holds
the block's steps, so both scans run in registers, with no shuffle or barrier.  A block's states are recomputed
from its forward checkpoint (an earlier block of the same forward chunk first scans the steps before it to its
start state), the entering state folded into the first step; the adjoint ``lam_t = C_t dy_t + a_{t+1} lam_{t+1}``
is a forward scan of the time-flipped pairs (a_{t+1}, C_t dy_t) (``reverse=True`` would flip the lanes with
shuffles), ``a_{t+1}`` built from the inputs one step later, the later block's adjoint folded into the last step
and carried between blocks through a ``(batch, dim, dstate)`` float32 buffer (the size of one state).
``h_t - b_t = a_t h_{t-1}`` gives the decay gradient.  ``dB``/``dC`` accumulate over the program's channel
blocks elementwise in registers, are summed over the block's channels once per step block and written as
per-program partials, summed afterwards in torch in a fixed order (deterministic, no atomics); ``dA``, ``dD``,
``ddelta_bias`` are per-batch partials accumulated by their program and summed afterwards.  ``du``, ``ddelta``,
``dz`` are written in the inputs' dtypes.  On a GPU the softplus uses ``lg2.approx`` (``FAST``).  More than
``BWD_STATES`` (16) states: inside each block of steps the program runs over tiles of 16 states one after the
other, each as at dstate 16 (64 states at once spilled registers), the tile's adjoint carried in ``lamc`` like
the others; ``du``, ``ddelta``, ``dz`` (sums over the states) are summed over the tiles in float32 in a
scratch of the program's ``(BT steps, channels)`` (``(batch, dim, 3, BT)``, reused by every block: no per-step
buffer) and written once, in the inputs' dtypes, by the last tile; the terms in ``D`` and ``dD`` from the first
tile, ``ddelta_bias`` from the last (fixed order, deterministic, one writer an element).

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
BWD_CHANNELS = 64  # channels of one backward program (dB / dC reduced over them in the program)
BWD_STATES = 16  # states of one backward pass over a block (more states: the program runs over state tiles)


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
def _log2_fast(x, FAST: tl.constexpr):
    """log2 in float32: lg2.approx on a GPU (FAST), tl.log2 (a polynomial) otherwise; the interpreter cannot
    run inline assembly."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _softplus_fast(x, FAST: tl.constexpr):
    """log(1 + e^x) (x itself past 20) from exp2 and log2."""
    sp = 0.6931471805599453 * _log2_fast(1.0 + tl.exp2(tl.minimum(x, 20.0) * 1.4426950408889634), FAST)
    return tl.where(x <= 20.0, sp, x)


@triton.jit
def _sigmoid_fast(x):
    return 1.0 / (1.0 + tl.exp2(-1.4426950408889634 * x))


@triton.jit
def _delta_f(delta_ptr, offs, mask, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, FAST: tl.constexpr):
    """As :func:`_delta`, the softplus from :func:`_softplus_fast`."""
    raw = tl.load(delta_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw = raw + bias[None, :]
    if SOFTPLUS:
        dt = _softplus_fast(raw, FAST)
    else:
        dt = raw
    return raw, dt


@triton.jit
def _scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, seq_ptr,
    dout_ptr, dlast_ptr, ckpt_ptr, lamc_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dD_ptr, dbias_ptr, dBp_ptr, dCp_ptr, acc_ptr,
    L, DIM, N, H, NPROG,
    s_ub, s_ud, s_ul, s_tb, s_td, s_tl, s_zb, s_zd, s_zl, s_gb, s_gd, s_gl,
    s_Bb, s_Bg, s_Bn, s_Bl,
    s_Cb, s_Cg, s_Cn, s_Cl,
    T: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr, NP: tl.constexpr, NL: tl.constexpr,
    NSUB: tl.constexpr, NT: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    GATE: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DLAST: tl.constexpr, FAST: tl.constexpr,
):
    # tiles (BT, NP, BLOCK_D, NL): state n = k * NP * NL + p * NL + l of the state tile k; steps and the NP
    # states of a lane in one thread
    pid_b = tl.program_id(0).to(tl.int64)
    nb = tl.num_programs(0)
    pid_p = tl.program_id(1)
    R: tl.constexpr = T // BT  # backward steps per forward checkpoint interval
    offs_t = tl.arange(0, BT)
    first = (offs_t == 0)[:, None, None, None]
    lastt = (offs_t == BT - 1)[:, None, None, None]
    offs_n0 = tl.arange(0, NP)[:, None] * NL + tl.arange(0, NL)[None, :]  # (NP, NL)
    g = ((pid_p * NSUB * BLOCK_D) // H).to(tl.int64)  # a program never straddles two groups
    Bp = B_ptr + pid_b * s_Bb + g * s_Bg  # scalar bases; per-state offsets are built in the loop
    Cp = C_ptr + pid_b * s_Cb + g * s_Cg
    dBp = dBp_ptr + (pid_b * NPROG + pid_p) * N * L  # rows of the dB / dC partials
    dCp = dCp_ptr + (pid_b * NPROG + pid_p) * N * L
    acc_p = acc_ptr + (pid_b * DIM + pid_p * NSUB * BLOCK_D) * (3 * BT)  # the program's tile sums (NT > 1)
    nck = tl.cdiv(L, BT)
    for cr in range(0, nck):
        cb = nck - 1 - cr
        c = cb // R  # the forward chunk
        t = cb * BT + offs_t
        mask_t = t < L
        t64 = t.to(tl.int64)
        keep1 = (t + 1) < L
        if HAS_RESET:
            sq = tl.load(seq_ptr + t, mask=mask_t, other=-1)
            sq_prev = tl.load(seq_ptr + t - 1, mask=mask_t & (t > 0), other=-1)
            sq_next = tl.load(seq_ptr + t + 1, mask=keep1, other=-1)
            keep1 = keep1 & (sq_next == sq)
        for k in range(0, NT):  # the state tiles, one after the other (NT == 1: no loop)
            offs_n = k * (NP * NL) + offs_n0
            mask_n = offs_n < N
            m_nt = mask_t[:, None, None] & mask_n[None, :, :]
            n64 = offs_n.to(tl.int64)[None, :, :]
            B4 = tl.load(Bp + n64 * s_Bn + t64[:, None, None] * s_Bl, mask=m_nt, other=0.0)
            B4 = B4.to(tl.float32)[:, :, None, :]
            C4 = tl.load(Cp + n64 * s_Cn + t64[:, None, None] * s_Cl, mask=m_nt, other=0.0)
            C4 = C4.to(tl.float32)[:, :, None, :]
            dB_acc = tl.zeros((BT, NP, BLOCK_D, NL), dtype=tl.float32)
            dC_acc = tl.zeros((BT, NP, BLOCK_D, NL), dtype=tl.float32)
            for sub in range(0, NSUB):
                offs_d = (pid_p * NSUB + sub) * BLOCK_D + tl.arange(0, BLOCK_D)
                mask_d = offs_d < DIM
                d64 = offs_d.to(tl.int64)
                dn = d64[None, :, None] * N + offs_n[:, None, :]  # (NP, BLOCK_D, NL)
                mask_dn = mask_d[None, :, None] & mask_n[:, None, :]
                A4 = tl.load(A_ptr + dn, mask=mask_dn, other=0.0).to(tl.float32)[None]
                A2 = A4 * 1.4426950408889634
                Dv = tl.load(D_ptr + offs_d, mask=mask_d & HAS_D & (k == 0), other=0.0).to(tl.float32)
                bias = tl.load(bias_ptr + offs_d, mask=mask_d & HAS_BIAS, other=0.0).to(tl.float32)
                u_row = u_ptr + pid_b * s_ub + d64 * s_ud
                t_row = delta_ptr + pid_b * s_tb + d64 * s_td
                o_row = pid_b * DIM * L + d64 * L  # du, ddelta, dz: (batch, dim, L) contiguous
                m_dt = mask_t[:, None] & mask_d[None, :]
                uu = tl.load(u_row[None, :] + t64[:, None] * s_ul, mask=m_dt, other=0.0).to(tl.float32)
                raw, dt = _delta_f(t_row[None, :] + t64[:, None] * s_tl, 0, m_dt, bias, HAS_BIAS, SOFTPLUS, FAST)
                dt = tl.where(m_dt, dt, 0.0)  # past the end: a = 1, b = 0
                raw1, dt1 = _delta_f(t_row[None, :] + (t64[:, None] + 1) * s_tl, 0, keep1[:, None] & mask_d[None, :],
                                     bias, HAS_BIAS, SOFTPLUS, FAST)
                dt1 = tl.where(keep1[:, None], dt1, 0.0)  # a_{t+1} = 1 past the end (carries dlast in)
                dout = tl.load(dout_ptr + pid_b * s_gb + d64[None, :] * s_gd + t64[:, None] * s_gl, mask=m_dt,
                               other=0.0).to(tl.float32)
                if c > 0:
                    h0 = tl.load(ckpt_ptr + ((c - 1) * nb + pid_b) * DIM * N + dn, mask=mask_dn, other=0.0)
                else:
                    h0 = tl.zeros((NP, BLOCK_D, NL), dtype=tl.float32)
                for w in tl.static_range(R - 1):  # the state at this block's start: scan the earlier blocks of c
                    if w < cb % R:
                        tw64 = (c * T + w * BT + offs_t).to(tl.int64)
                        uw = tl.load(u_row[None, :] + tw64[:, None] * s_ul, mask=mask_d[None, :], other=0.0)
                        raw_w, dtw = _delta_f(t_row[None, :] + tw64[:, None] * s_tl, 0, mask_d[None, :], bias,
                                              HAS_BIAS, SOFTPLUS, FAST)
                        Bw = tl.load(Bp + n64 * s_Bn + tw64[:, None, None] * s_Bl, mask=mask_n[None, :, :], other=0.0)
                        aw = tl.exp2(dtw[:, None, :, None] * A2)
                        if HAS_RESET:
                            sw = tl.load(seq_ptr + tw64)
                            sw_prev = tl.load(seq_ptr + tw64 - 1, mask=tw64 > 0, other=-1)
                            aw = tl.where((sw == sw_prev)[:, None, None, None], aw, 0.0)
                        bw = (dtw * uw.to(tl.float32))[:, None, :, None] * Bw.to(tl.float32)[:, :, None, :]
                        aw_c, hw = tl.associative_scan((aw, bw + tl.where(first, aw * h0[None], -0.0)), 0, _affine)
                        h0 = tl.sum(tl.where(lastt, hw, -0.0), axis=0)
                dt4 = dt[:, None, :, None]
                dtu = dt * uu
                dtu4 = dtu[:, None, :, None]
                a = tl.exp2(dt4 * A2)
                if HAS_RESET:
                    a = tl.where((sq == sq_prev)[:, None, None, None], a, 0.0)
                # h_t = a_t h_{t-1} + b_t, the chunk's entering state folded into its first step
                ac, hs = tl.associative_scan((a, dtu4 * B4 + tl.where(first, a * h0[None], -0.0)), 0, _affine)
                if HAS_Z:
                    zz = tl.load(z_ptr + pid_b * s_zb + d64[None, :] * s_zd + t64[:, None] * s_zl, mask=m_dt,
                                 other=0.0).to(tl.float32)
                    sz = _sigmoid_fast(zz)
                    if GATE == 1:
                        gz = zz * sz
                        gp = sz * (1.0 + zz * (1.0 - sz))
                    else:
                        gz = sz
                        gp = sz * (1.0 - sz)
                    y = tl.sum(tl.sum(hs * C4, axis=1), axis=2)
                    if HAS_D:
                        y = y + Dv[None, :] * uu
                    dzt = dout * y * gp
                    dy = dout * gz
                else:
                    dy = dout
                dy4 = dy[:, None, :, None]
                dC_acc += hs * dy4
                # lam_t = C_t dy_t + a_{t+1} lam_{t+1}, the later block's adjoint folded into the last step
                gin = dy4 * C4
                a1 = tl.exp2(dt1[:, None, :, None] * A2)
                if HAS_RESET:
                    a1 = tl.where(keep1[:, None, None, None], a1, 0.0)
                    if HAS_DLAST:
                        ends = mask_t & (sq_next != sq)
                        lp = dlast_ptr + sq.to(tl.int64)[:, None, None, None] * DIM * N + dn[None]
                        gin += tl.load(lp, mask=mask_dn[None] & ends[:, None, None, None], other=0.0).to(tl.float32)
                if cr > 0:
                    lam_in = tl.load(lamc_ptr + pid_b * DIM * N + dn, mask=mask_dn, other=0.0)
                elif HAS_DLAST and not HAS_RESET:
                    lam_in = tl.load(dlast_ptr + pid_b * DIM * N + dn, mask=mask_dn, other=0.0).to(tl.float32)
                else:
                    lam_in = tl.zeros((NP, BLOCK_D, NL), dtype=tl.float32)
                # a forward scan of the time-flipped block (a flip within a thread costs nothing; reverse=True
                # reverses the lanes with shuffles)
                gin = gin + tl.where(lastt, a1 * lam_in[None], -0.0)
                lc, lam = tl.associative_scan((tl.flip(a1, 0), tl.flip(gin, 0)), 0, _affine)
                lam = tl.flip(lam, 0)
                tl.store(lamc_ptr + pid_b * DIM * N + dn, tl.sum(tl.where(first, lam, -0.0), axis=0), mask=mask_dn)
                dB_acc += lam * dtu4
                dlog = lam * tl.fma(-dtu4, B4, hs)  # lam_t a_t h_{t-1}
                ddtu = tl.sum(tl.sum(lam * B4, axis=1), axis=2)  # (BT, BLOCK_D)
                ddt = tl.sum(tl.sum(dlog * A4, axis=1), axis=2) + ddtu * uu
                _accumulate(dA_ptr + pid_b * DIM * N + dn, tl.sum(dlog * dt4, axis=0), mask_dn, cr > 0)
                du = ddtu * dt
                if HAS_D:
                    du += dy * Dv[None, :]
                    _accumulate(dD_ptr + pid_b * DIM + offs_d, tl.sum(dy * uu, axis=0), mask_d & (k == 0), cr > 0)
                if SOFTPLUS:
                    ddt = ddt * _sigmoid_fast(raw)
                ddt = tl.where(m_dt, ddt, 0.0)
                if NT > 1:
                    # the sums of the tiles before, in the program's (3, BT steps x channels) scratch
                    sp = acc_p + (sub * BLOCK_D + tl.arange(0, BLOCK_D))[None, :] * (3 * BT) + offs_t[:, None]
                    if k > 0:
                        du += tl.load(sp)
                        ddt += tl.load(sp + BT)
                        if HAS_Z:
                            dzt += tl.load(sp + 2 * BT)
                    if k < NT - 1:
                        tl.store(sp, du)
                        tl.store(sp + BT, ddt)
                        if HAS_Z:
                            tl.store(sp + 2 * BT, dzt)
                last = k == NT - 1  # the last tile writes the sums over the states
                if HAS_BIAS:
                    _accumulate(dbias_ptr + pid_b * DIM + offs_d, tl.sum(ddt, axis=0), mask_d & last, cr > 0)
                m_out = m_dt & last
                if HAS_Z:
                    tl.store(dz_ptr + o_row[None, :] + t64[:, None], dzt.to(dz_ptr.dtype.element_ty), mask=m_out)
                tl.store(du_ptr + o_row[None, :] + t64[:, None], du.to(du_ptr.dtype.element_ty), mask=m_out)
                tl.store(ddelta_ptr + o_row[None, :] + t64[:, None], ddt.to(ddelta_ptr.dtype.element_ty), mask=m_out)
            tl.store(dCp + n64 * L + t64[:, None, None], tl.sum(dC_acc, axis=2), mask=m_nt)
            tl.store(dBp + n64 * L + t64[:, None, None], tl.sum(dB_acc, axis=2), mask=m_nt)
            # the adjoint carry, dA / dD / ddelta_bias and the tiles' sums are read back next tile or block
            tl.debug_barrier()


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


def bwd_config(H: int, N: int, chunk: int) -> dict:
    """Constexprs and ``num_warps`` of the backward for ``H`` channels a group, ``N`` states, forward chunk
    ``chunk``.  Tiles ``(BT, NP, BLOCK_D, NL)``: the state n = p * NL + l, NL states on lanes, NP states and BT
    steps in a thread, BLOCK_D channels on the other lanes and the warps (the per-channel tiles ``(BT, BLOCK_D)``
    then hold one element a thread, which keeps their math out of the broadcast layout): 8 steps, up to 8 state
    lanes, 2 warps.  ``NSUB`` blocks make one program's ``BWD_CHANNELS`` channels (dB / dC summed over them in
    registers).  dstate > ``BWD_STATES``: the program runs over ``NT`` tiles of ``BWD_STATES`` states one
    after the other (its registers then hold no more than at dstate 16; 64 states at once spilled)."""
    BN = triton.next_power_of_2(N)
    NT = triton.cdiv(N, BWD_STATES) if BN > BWD_STATES else 1
    NL = min(BN, 8)
    BD = _block_d(H, max(1, 64 // NL))
    per_prog = _block_d(H, max(BD, BWD_CHANNELS))
    return dict(BT=min(8, chunk), BLOCK_D=BD, NP=min(BN, BWD_STATES) // NL, NL=NL, NSUB=per_prog // BD, NT=NT,
                num_warps=2)


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
    cfg = bwd_config(H, N, chunk)
    warps = cfg.pop("num_warps")
    nprog = dim // (cfg["BLOCK_D"] * cfg["NSUB"])
    dev = u.device
    f32 = dict(device=dev, dtype=torch.float32)
    # every element below is written by the kernel (when L > 0)
    new = torch.empty if L > 0 else torch.zeros
    lamc = torch.empty((batch, dim, N), **f32)  # the adjoint carried from one chunk to the one before
    du = torch.empty((batch, dim, L), device=dev, dtype=u.dtype)
    ddelta = torch.empty((batch, dim, L), device=dev, dtype=delta.dtype)
    dz = torch.empty((batch, dim, L), device=dev, dtype=z.dtype) if z is not None else None
    # more than one state tile: the sums over the states of a block of steps, carried from one tile to the next
    # (du, ddelta, y: BT steps x the program's channels, reused by every block)
    acc = torch.empty((batch, dim, 3, cfg["BT"]), **f32) if cfg["NT"] > 1 else None
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
                du, ddelta, _opt(dz, du), dA, dD, dbias, dBp, dCp, _opt(acc, dA),
                L, dim, N, H, nprog,
                *u.stride(), *delta.stride(), *_s3(z), *dout.stride(), *B.stride(), *C.stride(),
                T=chunk, **cfg,
                HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
                SOFTPLUS=delta_softplus, GATE=_GATES[gate], HAS_RESET=seq is not None, HAS_DLAST=dlast is not None,
                FAST=dev.type == "cuda", num_warps=warps,
            )
    dB = dBp.view(batch, G, nprog // G, N, L).sum(2)
    dC = dCp.view(batch, G, nprog // G, N, L).sum(2)
    return (
        du, ddelta, dA.sum(0), dB, dC,
        dD.sum(0) if D is not None else None, dz, dbias.sum(0) if delta_bias is not None else None,
    )

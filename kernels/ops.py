"""torch custom ops ``certblocks::selective_scan`` (+ its backward) and ``certblocks::selective_state_update``.

Registered with ``torch.library.custom_op`` together with fake (meta) kernels and an autograd
formula, so ``torch.compile(fullgraph=True)`` traces through them without a graph break.

``certblocks::selective_scan`` mirrors :func:`certblocks.kernels.selective_scan` argument for argument
(``u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, return_last_state, cu_seqlens, backend``)
and returns three tensors: ``out`` (u's shape and dtype), ``last_state`` (float32,
``(batch, dim, dstate)``, or ``(nseq, dim, dstate)`` with ``cu_seqlens``; always computed) and
``checkpoints`` (float32 ``(ceil(L / K), batch, dim, dstate)``: the state after every K steps, used by
the backward; K = :func:`checkpoint_stride`).  ``backend`` is ``"torch"`` or ``"triton"``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import torch_scan
from ._checks import check_scan_args

TRITON_CHUNK = 32


def checkpoint_stride(backend: str) -> int:
    """Number of time steps between two saved states for ``backend``."""
    return torch_scan.CHUNK if backend == "torch" else TRITON_CHUNK


def _canon(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens):
    return check_scan_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens)


@torch.library.custom_op("certblocks::selective_scan", mutates_args=())
def selective_scan_op(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    delta_bias: Optional[Tensor],
    delta_softplus: bool,
    gate: Optional[str],
    return_last_state: bool,
    cu_seqlens: Optional[Tensor],
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    a = _canon(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens)
    if backend == "torch":
        return torch_scan.scan_fwd(
            a.u, a.delta, a.A, a.B, a.C, a.D, a.z, a.delta_bias, a.delta_softplus, a.gate, a.cu_seqlens
        )
    if backend == "triton":
        from . import triton_scan

        return triton_scan.scan_fwd(
            a.u, a.delta, a.A, a.B, a.C, a.D, a.z, a.delta_bias, a.delta_softplus, a.gate, a.cu_seqlens,
            chunk=TRITON_CHUNK,
        )
    raise ValueError(f"backend={backend!r} is not supported by the custom op; allowed: 'torch', 'triton'")


@selective_scan_op.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, return_last_state, cu_seqlens, backend):
    batch, dim, L = u.shape
    N = A.shape[1]
    nlast = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    K = checkpoint_stride(backend)
    nck = (L + K - 1) // K
    f32 = torch.float32
    return u.new_empty(u.shape), u.new_empty((nlast, dim, N), dtype=f32), u.new_empty((nck, batch, dim, N), dtype=f32)


def _empty_like_none(x: Optional[Tensor], ref: Tensor) -> Tensor:
    return ref.new_empty((0,)) if x is None else x


@torch.library.custom_op("certblocks::selective_scan_bwd", mutates_args=())
def selective_scan_bwd_op(
    dout: Tensor,
    dlast: Optional[Tensor],
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    delta_bias: Optional[Tensor],
    checkpoints: Tensor,
    delta_softplus: bool,
    gate: Optional[str],
    cu_seqlens: Optional[Tensor],
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias) in the inputs' dtypes and shapes
    (an absent optional input gets an empty tensor)."""
    a = _canon(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens)
    if backend == "torch":
        grads = torch_scan.scan_bwd(
            dout, dlast, a.u, a.delta, a.A, a.B, a.C, a.D, a.z, a.delta_bias, a.delta_softplus, a.gate,
            a.cu_seqlens, checkpoints,
        )
    elif backend == "triton":
        from . import triton_scan

        grads = triton_scan.scan_bwd(
            dout, dlast, a.u, a.delta, a.A, a.B, a.C, a.D, a.z, a.delta_bias, a.delta_softplus, a.gate,
            a.cu_seqlens, checkpoints, chunk=TRITON_CHUNK,
        )
    else:
        raise ValueError(f"backend={backend!r} is not supported by the custom op; allowed: 'torch', 'triton'")
    du, ddelta, dA, dB, dC, dD, dz, ddb = grads
    if B.dim() == 3:
        dB = dB[:, 0]
    if C.dim() == 3:
        dC = dC[:, 0]
    outs = []
    for g, x in ((du, u), (ddelta, delta), (dA, A), (dB, B), (dC, C), (dD, D), (dz, z), (ddb, delta_bias)):
        outs.append(u.new_empty((0,)) if x is None else g.to(x.dtype).contiguous())
    return tuple(outs)  # type: ignore[return-value]  # eight entries, one per input


@selective_scan_bwd_op.register_fake
def _(dout, dlast, u, delta, A, B, C, D, z, delta_bias, checkpoints, delta_softplus, gate, cu_seqlens, backend):
    return tuple(
        u.new_empty((0,)) if x is None else torch.empty_like(x, memory_format=torch.contiguous_format)
        for x in (u, delta, A, B, C, D, z, delta_bias)
    )


def _setup_context(ctx, inputs, output):
    (u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, return_last_state, cu_seqlens, backend) = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, cu_seqlens, output[2])
    ctx.delta_softplus, ctx.gate, ctx.backend = delta_softplus, gate, backend


def _backward(ctx, dout, dlast, dckpt):
    u, delta, A, B, C, D, z, delta_bias, cu_seqlens, ckpt = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(u)
    grads = torch.ops.certblocks.selective_scan_bwd(
        dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, ctx.delta_softplus, ctx.gate, cu_seqlens,
        ctx.backend,
    )
    du, ddelta, dA, dB, dC, dD, dz, ddb = grads
    return (
        du, ddelta, dA, dB, dC,
        dD if D is not None else None,
        dz if z is not None else None,
        ddb if delta_bias is not None else None,
        None, None, None, None, None,
    )


torch.library.register_autograd("certblocks::selective_scan", _backward, setup_context=_setup_context)


@torch.library.custom_op("certblocks::selective_state_update", mutates_args=("state",))
def selective_state_update_op(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    dt_bias: Optional[Tensor],
    dt_softplus: bool,
    gate: Optional[str],
    backend: str,
) -> Tensor:
    if backend == "triton":
        from . import triton_decode

        return triton_decode.state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate)
    if backend in ("torch", "reference"):
        from .reference import selective_state_update_reference

        return selective_state_update_reference(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate)
    raise ValueError(f"backend={backend!r} is not supported by the custom op; allowed: 'torch', 'triton'")


@selective_state_update_op.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate, backend):
    return x.new_empty(x.shape)

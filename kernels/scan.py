"""Public entry points: :func:`selective_scan` and :func:`selective_state_update`."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional, Tuple, Union

import torch

from ._checks import check_backend, check_scan_args
from .decode import check_decode_args


def triton_usable(device: torch.device) -> bool:
    """True if the Triton kernels can run on ``device`` (CUDA, or CPU with ``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``backend`` (``"auto"``, ``"reference"``, ``"torch"``, ``"triton"``) into the one that runs."""
    backend = check_backend(backend)
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if backend == "triton" and not triton_usable(device):
        raise ValueError(
            f"backend='triton' cannot run on device {device}: it needs the triton package and a CUDA device, "
            "or a CPU tensor with the environment variable TRITON_INTERPRET=1 set before triton is imported; "
            "allowed alternatives: 'auto', 'torch', 'reference'"
        )
    return backend


def selective_scan(
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
    backend: str = "auto",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Selective scan (Mamba's S6 recurrence) with mamba-ssm's ``selective_scan_fn`` semantics.

    For every batch ``b``, channel ``d`` and state index ``n``::

        dt_t  = softplus(delta_t + delta_bias)  (or delta_t + delta_bias without delta_softplus)
        h_t   = exp(dt_t * A[d, n]) * h_{t-1} + dt_t * u_t * B_t[n]        (h_{-1} = 0)
        y_t   = sum_n C_t[n] * h_t[n] + D[d] * u_t
        out_t = y_t * gate(z_t)                                           (when z is given)

    Arithmetic is float32 whatever the input dtypes; ``out`` has u's dtype, ``last_state`` is float32.

    Args:
        u: input, (batch, dim, seqlen).
        delta: step sizes, (batch, dim, seqlen).
        A: state matrix (real, normally negative), (dim, dstate).
        B: input projection, (batch, dstate, seqlen) or grouped (batch, ngroups, dstate, seqlen); channel
            ``d`` reads group ``d // (dim // ngroups)``.
        C: output projection, same shapes as B.
        D: skip connection, (dim,), or None.
        z: gate input, (batch, dim, seqlen), or None (no gating).
        delta_bias: added to delta before softplus, (dim,), or None.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        gate: ``"silu"`` (mamba-ssm), ``"sigmoid"`` (linear-growth Mamba) or ``None`` (then z must be None).
        return_last_state: also return the final state.
        cu_seqlens: packed variable-length batch. With ``batch == 1``, an int32/int64 tensor of shape
            ``(nseq + 1,)``, ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == seqlen``: sequence
            ``i`` occupies time steps ``cu_seqlens[i]:cu_seqlens[i+1]`` and starts from a zero state (the
            result equals running each sequence separately).  ``last_state`` then has shape
            ``(nseq, dim, dstate)``: the state at the end of each sequence (zeros for an empty one).
        backend: ``"auto"`` (triton on CUDA, torch otherwise), ``"reference"`` (plain per-step loop),
            ``"torch"`` (fast blocked CPU path, hand-written backward) or ``"triton"`` (CUDA, or CPU under
            ``TRITON_INTERPRET=1``).

    Returns:
        ``out`` (batch, dim, seqlen), or ``(out, last_state)`` if ``return_last_state``.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: a shape, gate, backend or cu_seqlens is not allowed.
    """
    backend = check_backend(backend)
    check_scan_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, cu_seqlens)
    if not isinstance(return_last_state, bool):
        raise TypeError(f"return_last_state must be a bool, got {type(return_last_state).__name__}")
    backend = resolve_backend(backend, u.device)
    if backend == "reference":
        from .reference import selective_scan_reference

        return selective_scan_reference(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, return_last_state, cu_seqlens
        )
    from . import ops  # noqa: F401  (registers the custom ops)

    out, last, _ = torch.ops.certblocks.selective_scan(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, gate, return_last_state, cu_seqlens, backend
    )
    return (out, last) if return_last_state else out


def selective_state_update(
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
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of the selective scan; ``state`` is updated in place (like mamba-ssm).

    ``state <- exp(dt * A) * state + dt * x * B``; ``out = (sum_n C * state + D * x) * gate(z)``, with
    ``dt = softplus(dt + dt_bias)`` if ``dt_softplus``.  Arithmetic in float32; ``out`` in x's dtype.

    Args:
        state: (batch, dim, dstate), updated in place (any float dtype; float32 recommended).
        x: (batch, dim).
        dt: (batch, dim).
        A: (dim, dstate).
        B: (batch, dstate) or grouped (batch, ngroups, dstate).
        C: same shapes as B.
        D: (dim,) or None.
        z: (batch, dim) or None.
        dt_bias: (dim,) or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        gate: ``"silu"``, ``"sigmoid"`` or ``None`` (then z must be None).
        backend: ``"auto"`` (triton on CUDA, torch otherwise), ``"reference"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``out`` (batch, dim) in x's dtype.
    """
    backend = check_backend(backend)
    check_decode_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate)
    backend = resolve_backend(backend, state.device)
    if backend == "reference":
        from .reference import selective_state_update_reference

        return selective_state_update_reference(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate)
    from . import ops  # noqa: F401

    return torch.ops.certblocks.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, gate, backend)

"""Argument validation and canonical shapes shared by every selective-scan backend.

Canonical (internal) layout, whatever the caller passed:

* ``u``, ``delta``, ``z``: ``(batch, dim, seqlen)``
* ``A``: ``(dim, dstate)``
* ``B``, ``C``: ``(batch, ngroups, dstate, seqlen)`` -- a 3-D ``(batch, dstate, seqlen)`` input is
  viewed as ``ngroups = 1``.  Channel ``d`` reads group ``d // (dim // ngroups)`` (mamba-ssm's
  ``"B G N L -> B (G H) N L"`` repeat).
* ``D``, ``delta_bias``: ``(dim,)``
* ``cu_seqlens``: int64 ``(nseq + 1,)``, only with ``batch == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GATES = ("silu", "sigmoid", None)
BACKENDS = ("auto", "reference", "torch", "triton")


@dataclass
class ScanArgs:
    """Validated, canonically shaped arguments of one selective scan."""

    u: torch.Tensor
    delta: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: Optional[torch.Tensor]
    z: Optional[torch.Tensor]
    delta_bias: Optional[torch.Tensor]
    delta_softplus: bool
    gate: Optional[str]
    cu_seqlens: Optional[torch.Tensor]
    B_was_3d: bool
    C_was_3d: bool


def _need_tensor(name: str, x: object, optional: bool = False) -> None:
    if x is None and optional:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(x).__name__}")


def _need_float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; allowed: torch.float32, torch.float16, torch.bfloat16")


def check_gate(gate: object) -> Optional[str]:
    """Validate ``gate`` (one of ``"silu"``, ``"sigmoid"``, ``None``)."""
    if gate is not None and not isinstance(gate, str):
        raise TypeError(f"gate must be a str or None, got {type(gate).__name__}; allowed: 'silu', 'sigmoid', None")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not supported; allowed: 'silu', 'sigmoid', None")
    return gate


def check_backend(backend: object) -> str:
    """Validate ``backend`` (one of ``"auto"``, ``"reference"``, ``"torch"``, ``"triton"``)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {', '.join(repr(b) for b in BACKENDS)}")
    return backend


def _canon_bc(name: str, x: torch.Tensor, batch: int, dim: int, dstate: int, seqlen: int) -> torch.Tensor:
    if x.dim() == 3:
        if tuple(x.shape) != (batch, dstate, seqlen):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected (batch, dstate, seqlen) = {(batch, dstate, seqlen)} "
                f"or grouped (batch, ngroups, dstate, seqlen)"
            )
        return x.unsqueeze(1)
    if x.dim() == 4:
        b, g, n, seq = x.shape
        if (b, n, seq) != (batch, dstate, seqlen) or g < 1 or dim % g != 0:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected grouped (batch, ngroups, dstate, seqlen) with "
                f"batch={batch}, dstate={dstate}, seqlen={seqlen} and ngroups dividing dim={dim}"
            )
        return x
    raise ValueError(
        f"{name} has {x.dim()} dimensions (shape {tuple(x.shape)}); allowed: (batch, dstate, seqlen) or "
        f"(batch, ngroups, dstate, seqlen)"
    )


def check_cu_seqlens(cu_seqlens: Optional[torch.Tensor], batch: int, seqlen: int) -> Optional[torch.Tensor]:
    """Validate the packed-batch offsets ``cu_seqlens`` (see :func:`certblocks.kernels.selective_scan`)."""
    if cu_seqlens is None:
        return None
    _need_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; allowed: torch.int32, torch.int64")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens has shape {tuple(cu_seqlens.shape)}; expected (nseq + 1,) with nseq >= 1")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of size 1, got batch={batch}")
    capturing = cu_seqlens.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not torch.compiler.is_compiling() and cu_seqlens.device.type != "meta" and not capturing:
        # one host read of the offsets; skipped while a CUDA graph is captured (the kernels never read them on the host)
        c = cu_seqlens.detach().cpu()
        if int(c[0]) != 0 or int(c[-1]) != seqlen or bool((c[1:] < c[:-1]).any()):
            raise ValueError(
                f"cu_seqlens={c.tolist()} must start at 0, be non-decreasing and end at seqlen={seqlen}"
            )
    return cu_seqlens.to(torch.int64)


def check_scan_args(
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
    cu_seqlens: Optional[torch.Tensor] = None,
) -> ScanArgs:
    """Validate the arguments of a selective scan and return them in canonical shapes (views, no copies)."""
    for name, x, opt in (
        ("u", u, False), ("delta", delta, False), ("A", A, False), ("B", B, False), ("C", C, False),
        ("D", D, True), ("z", z, True), ("delta_bias", delta_bias, True),
    ):
        _need_tensor(name, x, opt)
        if x is not None:
            _need_float(name, x)
    if A.is_complex():
        raise TypeError("A is complex; only real A is supported")
    if not isinstance(delta_softplus, bool):
        raise TypeError(f"delta_softplus must be a bool, got {type(delta_softplus).__name__}")
    gate = check_gate(gate)
    if u.dim() != 3:
        raise ValueError(f"u has shape {tuple(u.shape)}; expected (batch, dim, seqlen)")
    batch, dim, seqlen = u.shape
    if tuple(delta.shape) != tuple(u.shape):
        raise ValueError(f"delta has shape {tuple(delta.shape)}; expected the shape of u, {tuple(u.shape)}")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A has shape {tuple(A.shape)}; expected (dim, dstate) with dim={dim}")
    dstate = A.shape[1]
    Bc = _canon_bc("B", B, batch, dim, dstate, seqlen)
    Cc = _canon_bc("C", C, batch, dim, dstate, seqlen)
    for name, x in (("D", D), ("delta_bias", delta_bias)):
        if x is not None and tuple(x.shape) != (dim,):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected (dim,) = ({dim},)")
    if z is not None:
        if gate is None:
            raise ValueError("z was given but gate=None (no gating); pass gate='silu' or 'sigmoid', or z=None")
        if tuple(z.shape) != tuple(u.shape):
            raise ValueError(f"z has shape {tuple(z.shape)}; expected the shape of u, {tuple(u.shape)}")
    devs = {x.device for x in (u, delta, A, B, C, D, z, delta_bias) if x is not None}
    if len(devs) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devs)}")
    cu = check_cu_seqlens(cu_seqlens, batch, seqlen)
    return ScanArgs(u, delta, A, Bc, Cc, D, z, delta_bias, delta_softplus, gate, cu, B.dim() == 3, C.dim() == 3)

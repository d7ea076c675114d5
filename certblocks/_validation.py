"""Argument and weight checks shared by the blocks, the stack and the zoo.

Each check raises ``TypeError`` / ``ValueError`` naming the argument, the value received and what is
allowed, and returns the validated value.  :func:`check_finite` turns a non-finite weight into
:class:`NonFiniteWeightError` naming the parameter, instead of a certificate computed from NaN.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

__all__ = [
    "NonFiniteWeightError",
    "check_bool",
    "check_cert_args",
    "check_choice",
    "check_finite",
    "check_input",
    "check_int",
    "check_prob",
    "check_real",
]


class NonFiniteWeightError(ValueError):
    """A weight or buffer a certificate reads holds NaN or infinite entries.

    Attributes:
        names: ``(parameter path, number of non-finite entries)`` for each offending tensor.
    """

    def __init__(self, names: Sequence[Tuple[str, int]]) -> None:
        self.names = tuple(names)
        parts = [f"{name} has {n} non-finite {'entry' if n == 1 else 'entries'}" for name, n in self.names]
        super().__init__("; ".join(parts) + " (a certificate needs finite weights: the training diverged or the "
                         "checkpoint is corrupt)")


def check_finite(module: nn.Module, prefix: str = "") -> None:
    """Raise :class:`NonFiniteWeightError` naming every parameter or floating buffer of ``module`` that is not finite.

    Args:
        module: the module whose tensors are checked.
        prefix: prepended to the parameter names (``"blocks.3."``), so the message names the tensor in the model.
    """
    bad = []
    for kind in ("parameters", "buffers"):
        for name, t in getattr(module, f"named_{kind}")(remove_duplicate=True):
            if not t.is_floating_point() and not t.is_complex():
                continue
            t = t.detach()
            if t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=torch.float64))):
                continue  # a NaN or an inf entry makes the float64 sum non-finite: one pass, no allocation
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad.append((prefix + name, n))
    if bad:
        raise NonFiniteWeightError(bad)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_real(name: str, value: Any, *, positive: bool = False, nonnegative: bool = False) -> float:
    """``value`` as a finite float (optionally ``> 0`` or ``>= 0``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and v <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if nonnegative and v < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return v


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_prob(name: str, value: Any) -> float:
    """``value`` as a probability in ``[0, 1)`` (a dropout rate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, allowed: Tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_cert_args(seq_len: Optional[int], r0: Optional[float], *, block: str = "",
                    needs_seq_len: bool = False) -> Tuple[Optional[int], Optional[float]]:
    """Validate ``certificate(seq_len=..., r0=...)`` arguments.

    Args:
        seq_len: ``None`` or an int ``>= 1``.
        r0: ``None`` or a finite number ``>= 0``.
        block: the block's name, for the message.
        needs_seq_len: the block's bound depends on the sequence length: ``None`` is refused.
    """
    if seq_len is None:
        if needs_seq_len:
            raise ValueError(f"{block + '.' if block else ''}certificate() needs seq_len: its bound sums over the "
                             "sequence (pass the longest sequence the block will see, e.g. seq_len=1024)")
    else:
        check_int("seq_len", seq_len)
    if r0 is not None:
        if isinstance(r0, bool) or not isinstance(r0, (int, float)) or not r0 >= 0 or not math.isfinite(r0):
            raise ValueError(f"r0 must be a finite number >= 0 or None, got {r0!r}")
        r0 = float(r0)
    return seq_len, r0


def check_input(x: torch.Tensor, dim: int, weight: torch.Tensor, name: str = "x", ndim: Optional[int] = None) -> None:
    """Raise a clear error when ``x`` has the wrong type, shape or dtype for a block of width ``dim``.

    A symbolic value (``torch.fx`` tracing: timm's and torchvision's feature extraction) is not checked: its shape
    and dtype are known only when the traced graph runs.  TorchScript does not compile this check: a block calls it
    under ``if not torch.jit.is_scripting()``.
    """
    if isinstance(x, torch.fx.Proxy):
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have shape (batch, seq_len, {dim}), got {tuple(x.shape)}")
    if x.ndim < 1 or x.shape[-1] != dim:
        raise ValueError(f"{name} must have last dimension {dim} (the block's dim), got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{name}.dtype {x.dtype} differs from the block's parameters ({weight.dtype}); "
                        f"cast the block with .to({x.dtype}) or run under torch.autocast")

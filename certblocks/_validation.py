"""The argument and weight checks of certblocks: one place for every validator.

Each check raises ``TypeError`` (a value of the wrong type) or ``ValueError`` (a value out of range) whose message
names the argument, the value received and what is allowed (``dt must be a finite number > 0, got 0.0``), and
returns the validated value.  :func:`check_finite` turns a non-finite weight into :class:`NonFiniteWeightError`
naming the parameter, instead of a certificate computed from NaN.

Pure Python at import (torch is imported by the checks on tensors and modules only), so the pure-Python modules
(``certblocks.budget``, ``certblocks.exponents``) use it too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "NonFiniteWeightError",
    "check_bool",
    "check_callable",
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


def all_finite(t: Any) -> bool:
    """Every entry of the floating or complex tensor ``t`` is finite.

    One reduction, no copy: ``torch.aminmax`` propagates NaN, so its minimum and maximum are both finite exactly when
    every entry is (an inf is an extreme, a NaN makes both NaN).  An elementwise check allocates a bool per entry, and a
    float64 sum a float64 copy of the tensor; by chunks, the chunks were kept by the C allocator between a checkpoint's
    reads (0.9 GiB of anonymous memory over a 1B Llama's layers, benchmarks/results/checkpoint.md).
    """
    import torch

    if t.numel() == 0:
        return True
    if t.is_complex():
        t = torch.view_as_real(t)
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def check_finite(module: nn.Module, prefix: str = "") -> None:
    """Raise :class:`NonFiniteWeightError` naming every parameter or floating buffer of ``module`` that is not finite.

    Args:
        module: the module whose tensors are checked.
        prefix: prepended to the parameter names (``"blocks.3."``), so the message names the tensor in the model.
    """
    import torch

    bad = []
    for kind in ("parameters", "buffers"):
        for name, t in getattr(module, f"named_{kind}")(remove_duplicate=True):
            if not t.is_floating_point() and not t.is_complex():
                continue
            t = t.detach()
            if all_finite(t):
                continue
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad.append((prefix + name, n))
    if bad:
        raise NonFiniteWeightError(bad)


def check_int(name: str, value: Any, minimum: int = 1, *, optional: bool = False, note: str = "") -> Any:
    """``value`` as an int ``>= minimum`` (bools are refused); ``None`` passes when ``optional``.

    Args:
        name: the argument's name, for the message.
        value: what was passed.
        minimum: the smallest value allowed.
        optional: ``None`` is allowed (and returned).
        note: what the argument is, added to the message in parentheses.
    """
    if value is None and optional:
        return None
    allowed = f"an int >= {minimum}{' or None' if optional else ''}{f' ({note})' if note else ''}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def _bounds_text(gt: Optional[float], ge: Optional[float], lt: Optional[float], le: Optional[float]) -> str:
    low = (f"({gt:g}", gt) if gt is not None else (f"[{ge:g}", ge) if ge is not None else None
    high = (f"{lt:g})", lt) if lt is not None else (f"{le:g}]", le) if le is not None else None
    if low is not None and high is not None:
        return f" in {low[0]}, {high[0]}"
    if low is not None:
        return f" {'>' if gt is not None else '>='} {low[1]:g}"
    if high is not None:
        return f" {'<' if lt is not None else '<='} {high[1]:g}"
    return ""


def check_real(name: str, value: Any, *, positive: bool = False, nonnegative: bool = False,
               gt: Optional[float] = None, ge: Optional[float] = None, lt: Optional[float] = None,
               le: Optional[float] = None, optional: bool = False, note: str = "") -> Any:
    """``value`` as a finite float within the given bounds; ``None`` passes when ``optional``.

    Args:
        name: the argument's name, for the message.
        value: what was passed (an int or a float; bools are refused).
        positive: ``> 0`` (the same as ``gt=0``).
        nonnegative: ``>= 0`` (the same as ``ge=0``).
        gt, ge, lt, le: the bounds (``>``, ``>=``, ``<``, ``<=``), any that apply.
        optional: ``None`` is allowed (and returned).
        note: what the argument is, added to the message in parentheses (``"a margin"``).

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: it is not finite or out of the bounds; the message says ``must be a finite number > 0``.
    """
    if value is None and optional:
        return None
    if positive:
        gt = 0.0 if gt is None else max(gt, 0.0)
    if nonnegative and gt is None:
        ge = 0.0 if ge is None else max(ge, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number{_allowed(gt, ge, lt, le, optional, note)}, got {value!r} "
                        f"({type(value).__name__})")
    v = float(value)
    if not (math.isfinite(v) and (gt is None or v > gt) and (ge is None or v >= ge) and (lt is None or v < lt)
            and (le is None or v <= le)):
        raise ValueError(f"{name} must be a finite number{_allowed(gt, ge, lt, le, optional, note)}, got {value!r}")
    return v


def _allowed(gt: Optional[float], ge: Optional[float], lt: Optional[float], le: Optional[float], optional: bool,
             note: str) -> str:
    """What a number may be, for a message (written only when a check fails)."""
    return _bounds_text(gt, ge, lt, le) + (" or None" if optional else "") + (f" ({note})" if note else "")


def check_bool(name: str, value: Any, *, optional: bool = False) -> Any:
    """``value`` if it is a bool (``None`` too when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r} "
                        f"({type(value).__name__})")
    return value


def check_prob(name: str, value: Any) -> float:
    """``value`` as a probability in ``[0, 1)`` (a dropout rate)."""
    return check_real(name, value, ge=0.0, lt=1.0, note="a probability")


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    """``value`` if it is one of ``allowed``."""
    if not any(type(value) is type(a) and value == a for a in allowed):  # True is not 1, "1" is not 1
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_callable(name: str, value: Any, signature: str = "", *, optional: bool = False) -> Any:
    """``value`` if it is callable (``None`` too when ``optional``); ``signature`` says how it is called, for the
    message (``"callable(alert)"``)."""
    if value is None and optional:
        return None
    if not callable(value):
        what = signature or "callable"
        raise TypeError(f"{name} must be {what}{' or None' if optional else ''}, got {type(value).__name__}")
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
    return seq_len, check_real("r0", r0, ge=0.0, optional=True)


def check_input(x: torch.Tensor, dim: int, weight: torch.Tensor, name: str = "x", ndim: Optional[int] = None) -> None:
    """Raise a clear error when ``x`` has the wrong type, shape or dtype for a block of width ``dim``.

    A symbolic value (``torch.fx`` tracing: timm's and torchvision's feature extraction) is not checked: its shape
    and dtype are known only when the traced graph runs.  TorchScript does not compile this check: a block calls it
    under ``if not torch.jit.is_scripting()``.
    """
    import torch
    import torch.fx

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

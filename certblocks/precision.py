"""Precision policies: which dtype each tensor of a run is held in (docs/theory.md section 7).

A certificate for one dtype assumes every tensor in that dtype.  Training runs keep different tensors in different
dtypes: autocast with fp32 parameters and stream (AMP), FSDP's mixed precision (parameters and stream in bf16,
gradient reductions in fp32), fp8 matmuls with per-tensor scales.  A :class:`Precision` states such a run, and
:func:`as_precision` reads one from every spelling a dtype is accepted in today plus the named policies:

=============  ==========  ========  ============  ==========  ================================================
name           parameters  stream    autocast      reductions  notes
=============  ==========  ========  ============  ==========  ================================================
``fp16`` ...   the dtype   the dtype off           the dtype   pure (``fp16``, ``bf16``, ``fp32``, ``fp64``,
                                                               ``fp8_e4m3``, ``fp8_e5m2``): every tensor in it
``amp-fp16``   fp32        fp32      fp16          fp32        a GradScaler starting at 65536
``amp-bf16``   fp32        fp32      bf16          fp32
``fsdp-bf16``  bf16        bf16      off           fp32        FSDP2 ``MixedPrecisionPolicy(bf16, fp32)``
``fp8-e4m3``   fp32        fp32      bf16          fp32        Linear inputs and weights e4m3 with per-tensor
                                                               scales, their gradients e5m2
=============  ==========  ========  ============  ==========  ================================================

Which op runs in which dtype is **not** listed here: torch's autocast lists differ between devices (under CPU
autocast in torch 2.14 ``linear`` and ``scaled_dot_product_attention`` run in the low dtype while ``layer_norm`` keeps
an fp32 input in fp32), so the tracer
captures the model under the policy (:func:`certblocks.trace.capture.capture` with ``precision=``) and reads each
node's dtype from the captured graph's concrete values (:func:`certblocks.trace.capture.held_dtype`).

fp8 with *dynamic* per-tensor scales (the scale of a tensor is its current ``amax / M_fp8``) cannot saturate by
construction: the forward side of an fp8 run is its base dtypes' (bf16 autocast here), and the fp8 casts cost
resolution, not range.  Static scales are checked against certified peaks (``s >= peak / M_fp8``).

This module is pure Python (no torch import): the CLI's ``--dtype`` parses policies without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from .budget import DTYPE_MAX, dtype_name

__all__ = ["Fp8Recipe", "Precision", "POLICIES", "PURE_DTYPES", "as_precision", "is_mixed", "allowed_precisions"]

#: The pure dtypes (every tensor in one dtype), by canonical name.
PURE_DTYPES: Tuple[str, ...] = tuple(DTYPE_MAX)


def _dtype(what: str, value: Any) -> str:
    """A canonical dtype name for the field ``what`` (the error names the field)."""
    try:
        return dtype_name(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


@dataclass(frozen=True)
class Fp8Recipe:
    """Which ops compute in fp8, and how (per-tensor scaling).

    Attributes:
        ops: the aten ops whose floating inputs (activation and weight) are cast to :attr:`forward` with a per-tensor
            scale (``("aten.linear",)``: every ``nn.Linear``).
        forward: the fp8 format of those inputs (``"fp8_e4m3"``).
        backward: the fp8 format of their gradients (``"fp8_e5m2"``).
        scaling: ``"dynamic"`` (each tensor's scale from its current ``amax``: no saturation by construction) or
            ``"static"`` (fixed scales, e.g. from certified peaks: saturation is ruled out when
            ``scale >= peak / M_fp8``).
    """

    ops: Tuple[str, ...] = ("aten.linear",)
    forward: str = "fp8_e4m3"
    backward: str = "fp8_e5m2"
    scaling: str = "dynamic"

    def __post_init__(self) -> None:
        if isinstance(self.ops, str) or not all(isinstance(o, str) and o for o in self.ops):
            raise TypeError(f"ops must be a tuple of aten op names such as ('aten.linear',), got {self.ops!r}")
        object.__setattr__(self, "ops", tuple(self.ops))
        for name in ("forward", "backward"):
            value = _dtype(name, getattr(self, name))
            if not value.startswith("fp8"):
                raise ValueError(f"{name} must be an fp8 format (fp8_e4m3, fp8_e5m2, ...), got {value!r}")
            object.__setattr__(self, name, value)
        if self.scaling not in ("dynamic", "static"):
            raise ValueError(f"scaling must be 'dynamic' or 'static', got {self.scaling!r}")


@dataclass(frozen=True)
class Precision:
    """A precision policy: the dtype each kind of tensor of a training run is held in.

    Attributes:
        name: the policy's name (a pure policy's is its dtype's canonical name: ``"fp16"``).
        param_dtype: the dtype of the parameters as the forward reads them (after any FSDP cast).
        stream_dtype: the dtype of the residual stream outside autocast (the model input's and the parameters'
            dtype; the graph captured under the policy says where the stream really is).
        autocast_dtype: the low dtype of ``torch.autocast`` (``None``: autocast off).
        reduce_dtype: the dtype gradients are reduced (all-reduced, reduce-scattered) in.
        fp8: the fp8 recipe (``None``: no fp8).
        loss_scale: the initial scale of a ``GradScaler`` where the run uses one (``None``: no loss scaling); the
            backward side compares it with the largest safe static scale.

    Every dtype field takes a torch dtype or any name :func:`certblocks.budget.dtype_name` accepts, and holds the
    canonical name.
    """

    name: str
    param_dtype: str = "fp32"
    stream_dtype: str = "fp32"
    autocast_dtype: Optional[str] = None
    reduce_dtype: str = "fp32"
    fp8: Optional[Fp8Recipe] = None
    loss_scale: Optional[float] = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        for what in ("param_dtype", "stream_dtype", "reduce_dtype"):
            object.__setattr__(self, what, _dtype(what, getattr(self, what)))
        if self.autocast_dtype is not None:
            object.__setattr__(self, "autocast_dtype", _dtype("autocast_dtype", self.autocast_dtype))
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
            raise TypeError(f"fp8 must be an Fp8Recipe or None, got {type(self.fp8).__name__}")
        if self.loss_scale is not None:
            s = self.loss_scale
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"loss_scale must be a finite number > 0 or None, got {s!r}")
            object.__setattr__(self, "loss_scale", float(s))

    # -- what it holds ---------------------------------------------------------------------------------------
    @property
    def pure(self) -> bool:
        """Every tensor in one dtype: no autocast, no fp8, parameters, stream and reductions alike (today's
        certificates: every value against that dtype's ``M``, the graph not captured under the policy)."""
        return (self.autocast_dtype is None and self.fp8 is None
                and self.param_dtype == self.stream_dtype == self.reduce_dtype)

    @property
    def dtypes(self) -> Tuple[str, ...]:
        """The dtypes the policy holds values in without a scale (parameters, stream, autocast), narrowest first.
        fp8 values carry a per-tensor scale and are not among them (their range is the scale's business)."""
        found = {self.param_dtype, self.stream_dtype} | ({self.autocast_dtype} if self.autocast_dtype else set())
        return tuple(sorted(found, key=lambda d: DTYPE_MAX[d]))

    @property
    def narrowest(self) -> str:
        """The narrowest dtype the policy holds intermediates in: what a block whose intermediates' dtypes are not
        known (a certified block's own certificate) is bounded against (sound: every other dtype is wider)."""
        return self.dtypes[0]

    @property
    def grad_dtype(self) -> str:
        """The narrowest dtype a gradient is held in without a loss scale: the autocast dtype (the gradient of an
        fp16 branch output is fp16), else the parameters' or the stream's (fp8 gradients carry their own scale)."""
        return self.narrowest

    @property
    def max_value(self) -> float:
        """``M`` of :attr:`stream_dtype`."""
        return DTYPE_MAX[self.stream_dtype]

    def describe(self) -> str:
        """One line: the policy and the dtype of each kind of tensor."""
        if self.pure:
            return f"{self.name}: every tensor in {self.stream_dtype}"
        parts = [f"parameters {self.param_dtype}", f"stream {self.stream_dtype}",
                 f"autocast {self.autocast_dtype}" if self.autocast_dtype else "autocast off",
                 f"reductions {self.reduce_dtype}"]
        if self.fp8 is not None:
            parts.append(f"fp8 {'/'.join(o.replace('aten.', '') for o in self.fp8.ops)} inputs and weights "
                         f"{self.fp8.forward}, gradients {self.fp8.backward} ({self.fp8.scaling} per-tensor scales)")
        if self.loss_scale is not None:
            parts.append(f"GradScaler from {self.loss_scale:g}")
        return f"{self.name}: " + ", ".join(parts)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "param_dtype": self.param_dtype, "stream_dtype": self.stream_dtype,
                "autocast_dtype": self.autocast_dtype, "reduce_dtype": self.reduce_dtype,
                "fp8": None if self.fp8 is None else {"ops": list(self.fp8.ops), "forward": self.fp8.forward,
                                                      "backward": self.fp8.backward, "scaling": self.fp8.scaling},
                "loss_scale": self.loss_scale}

    def __str__(self) -> str:
        return self.name


def _pure(name: str) -> Precision:
    return Precision(name, param_dtype=name, stream_dtype=name, reduce_dtype=name)


#: The named mixed policies (docs/theory.md section 7).
POLICIES: Dict[str, Precision] = {
    "amp-fp16": Precision("amp-fp16", autocast_dtype="fp16", loss_scale=65536.0),
    "amp-bf16": Precision("amp-bf16", autocast_dtype="bf16"),
    "fsdp-bf16": Precision("fsdp-bf16", param_dtype="bf16", stream_dtype="bf16", reduce_dtype="fp32"),
    "fp8-e4m3": Precision("fp8-e4m3", autocast_dtype="bf16", fp8=Fp8Recipe()),
}


def allowed_precisions() -> str:
    """The accepted values, in words (error messages, ``--help``)."""
    return (f"{', '.join(sorted(PURE_DTYPES))} or the matching torch dtypes (aliases such as 'float16'), a precision "
            f"policy ({', '.join(POLICIES)}) or a certblocks.precision.Precision")


def as_precision(x: Any) -> Precision:
    """The :class:`Precision` named by ``x``.

    Args:
        x: a :class:`Precision` (returned as it is, and remembered by its name: a certificate names its policy, and
            ``certificate.dtype`` reads back to it); a policy name (``"amp-fp16"``, ``"amp-bf16"``, ``"fsdp-bf16"``,
            ``"fp8-e4m3"``, or the name of a :class:`Precision` given before); or a dtype as accepted today -- a name
            or alias (``"fp16"``, ``"float16"``, ``"half"``, ``"bf16"``, ...) or a torch dtype (``torch.float16``)
            -- which gives the pure policy of that dtype.

    Raises:
        TypeError: ``x`` is not a str, a torch dtype or a :class:`Precision`.
        ValueError: an unknown name (the message lists the allowed values), or a :class:`Precision` whose name is
            a named policy's or a dtype's but which differs from it.
    """
    if isinstance(x, Precision):
        return _remember(x)
    if isinstance(x, str):
        key = x.strip().lower()
        if key in POLICIES:
            return POLICIES[key]
        if x.strip() in _CUSTOM:
            return _CUSTOM[x.strip()]
        try:
            return _PURE[dtype_name(key)]
        except ValueError:
            raise ValueError(f"dtype {x!r} is not supported; allowed: {allowed_precisions()}") from None
    if str(x).startswith("torch."):
        try:
            return _PURE[dtype_name(x)]
        except ValueError:
            raise ValueError(f"dtype {x!r} is not supported; allowed: {allowed_precisions()}") from None
    raise TypeError(f"dtype must be a dtype name, a torch dtype, a policy name or a Precision, got {x!r}")


def _remember(p: Precision) -> Precision:
    """``p``, remembered by its name; a name of a built-in policy or dtype must name that policy."""
    key = p.name.strip().lower()
    builtin = POLICIES.get(key)
    if builtin is None:
        try:
            builtin = _PURE[dtype_name(key)]
        except ValueError:
            builtin = None
    if builtin is not None and builtin != p:
        raise ValueError(f"precision name {p.name!r} is {builtin.describe()!r}; give the custom policy {p!r} "
                         "another name")
    if builtin is None:
        _CUSTOM[p.name.strip()] = p
    return p


def is_mixed(x: Any) -> bool:
    """Whether ``x`` (anything :func:`as_precision` accepts) holds tensors in more than one dtype."""
    return not as_precision(x).pure


_PURE: Dict[str, Precision] = {name: _pure(name) for name in PURE_DTYPES}
_CUSTOM: Dict[str, Precision] = {}  # the custom policies given so far, by name (as_precision)


#: Names of :mod:`certblocks.fp8` (it imports torch) reachable from here without importing it at module load.
_FP8_NAMES = ("Fp8Scale", "Fp8Stats", "fp8_scales", "fp8_emulation", "quantize")


def __getattr__(name: str) -> Any:
    """``certblocks.precision.fp8_scales`` and the other fp8 names, loaded from :mod:`certblocks.fp8` on first use
    (this module stays importable without torch, for the command line)."""
    if name in _FP8_NAMES:
        from . import fp8

        return getattr(fp8, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

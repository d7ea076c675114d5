"""The certified envelope: what a certificate assumed (dtype, sequence length, input radius) and the widest run
seen since.

A certificate is for a dtype, a sequence length and an input radius; a forward outside
them is outside the certificate.  :class:`Envelope` records what a certificate assumed and checks each forward of
the model (a :class:`~certblocks.CertifiedStack` in its ``forward``, a zoo model in its call, a converted model by a
forward pre-hook on its first update that :meth:`certblocks.model.CertifiedModel.certificate` installs): a longer
sequence, an input whose per-token norm exceeds a stated ``r0``, or a narrower compute dtype warns once per quantity
with :class:`EnvelopeWarning` (a :class:`CertificateWarning`), or raises :class:`~certblocks.CertificationError` when
``strict``; the model's ``certificate()`` is then computed at the envelope actually used (the longest sequence, the
largest radius, the narrowest dtype seen), so ``ok`` is never reported for a run the certificate did not cover.
The check compares shapes and dtypes; the norm is computed only where ``r0`` is a stated bound, once per forward;
nothing is checked while ``torch.compile`` / ``torch.export`` / ``torch.jit`` / ``torch.fx`` trace the model, nor
inside :func:`envelope_paused` (certblocks' own analysis calls).
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ._validation import check_int
from .budget import DTYPE_MAX, dtype_name
from .precision import as_precision

__all__ = ["CertificateWarning", "EnvelopeWarning", "Envelope", "envelope_paused", "compute_dtype"]


class CertificateWarning(UserWarning):
    """A certificate's margin ran low (:class:`~certblocks.CertificateMonitor`), or a run left what the certificate
    assumed (:class:`EnvelopeWarning`); the message names the update or model and the quantity."""


class EnvelopeWarning(CertificateWarning):
    """A forward ran outside the certified envelope: a longer sequence, a larger input norm or a narrower dtype
    than the certificate assumed (:class:`Envelope`)."""


_PAUSE = threading.local()


@contextlib.contextmanager
def envelope_paused() -> Iterator[None]:
    """No envelope check inside (certblocks' own calls of a model: the trajectory, the monitor's checks)."""
    _PAUSE.depth = getattr(_PAUSE, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSE.depth -= 1


def _tracing(x: Any) -> bool:
    """A graph is being captured (compile, export, jit, fx) or the tensor is a transform's wrapper: no check."""
    if getattr(_PAUSE, "depth", 0) or torch.compiler.is_compiling() or torch.compiler.is_exporting() \
            or torch.jit.is_tracing():
        return True
    if not isinstance(x, Tensor) or isinstance(x, torch.fx.Proxy):
        return True
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(wrapped is not None and wrapped(x))


_NAMES: Dict[torch.dtype, Optional[str]] = {}


def _name(dtype: torch.dtype) -> Optional[str]:
    """The canonical name of a floating dtype, cached (``None``: one certblocks has no range for)."""
    if dtype not in _NAMES:
        try:
            _NAMES[dtype] = dtype_name(dtype)
        except (TypeError, ValueError):
            _NAMES[dtype] = None
    return _NAMES[dtype]


def compute_dtype(x: Tensor, fallback: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype a forward on ``x`` computes in: the autocast dtype of ``x``'s device when autocast is on, else
    ``x``'s dtype (``fallback`` for an integer input, e.g. token ids: the parameters' dtype)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    if x.is_floating_point() or fallback is None:
        return x.dtype
    return fallback


class Envelope:
    """What a certificate assumed (dtype, sequence length, input radius) and the widest run seen since.

    Args:
        owner: the model's name, for the messages.
        dtype: the dtype the certificate is for, or its precision policy (:func:`certblocks.precision.as_precision`:
            a forward is inside it when it computes in the policy's narrowest dtype or a wider one).
        seq_len: the sequence length it was computed at (``None``: the certificate does not depend on it, or the
            model refuses longer inputs itself).
        r0: the bound on the input's per-token norm it assumes when that bound is *stated* (given by the user,
            checked with one norm per forward); ``None`` when ``r0`` is derived from the weights (a zoo model's
            embedding bound holds for every input) and is not checked.
        strict: raise :class:`~certblocks.CertificationError` at a forward outside the envelope instead of warning.
        quiet: record without warning (a model built with ``certify=False`` claims no certificate; its
            ``certificate()`` is still computed at the envelope used).  ``strict`` raises all the same.

    Attributes:
        dtype: the narrowest dtype the certified policy computes in (the dtype itself for a pure one).
        policy: the certified policy's name (a pure dtype's canonical name).
        seen_dtype, seen_seq_len, seen_r0: the narrowest dtype, the longest sequence and the largest input norm of
            the forwards outside the envelope (``None``: none so far).
    """

    def __init__(self, owner: str, dtype: Any, seq_len: Optional[int] = None, r0: Optional[float] = None, *,
                 strict: bool = False, quiet: bool = False) -> None:
        self.owner = owner
        self.strict = strict
        self.quiet = quiet
        self.warned: set = set()
        self.seen_dtype: Optional[str] = None
        self.seen_seq_len: Optional[int] = None
        self.seen_r0: Optional[float] = None
        self.record(dtype, seq_len, r0)

    def record(self, dtype: Any, seq_len: Optional[int], r0: Optional[float]) -> None:
        """Set what the certificate assumes (a new certification); what was seen outside the old one is kept only
        where it is still outside the new one."""
        prec = as_precision(dtype)
        self.dtype = prec.narrowest
        self.policy = prec.name
        self.seq_len = None if seq_len is None else check_int("seq_len", seq_len)
        self.r0 = None if r0 is None else float(r0)
        self._ok_dtypes: set = set()  # torch dtypes checked inside the envelope: one set lookup per forward
        if self.seen_dtype is not None and DTYPE_MAX[self.seen_dtype] >= DTYPE_MAX[self.dtype]:
            self.seen_dtype = None
        if self.seen_seq_len is not None and (self.seq_len is None or self.seen_seq_len <= self.seq_len):
            self.seen_seq_len = None
        if self.seen_r0 is not None and (self.r0 is None or self.seen_r0 <= self.r0):
            self.seen_r0 = None

    @property
    def exceeded(self) -> bool:
        """A forward ran outside the envelope since it was recorded."""
        return self.seen_dtype is not None or self.seen_seq_len is not None or self.seen_r0 is not None

    def used(self) -> Tuple[str, Optional[int], Optional[float]]:
        """``(dtype, seq_len, r0)`` of the runs so far: the certified ones widened by what was seen (``dtype``: the
        certified policy's name, or the narrower dtype a forward ran in)."""
        dtype = self.seen_dtype or self.policy
        seq_len = self.seq_len if self.seen_seq_len is None else self.seen_seq_len
        r0 = self.r0 if self.seen_r0 is None else self.seen_r0
        return dtype, seq_len, r0

    def check(self, x: Any, *, dtype: Optional[torch.dtype] = None, state: bool = True, stacklevel: int = 6) -> None:
        """Check one forward: ``x`` the residual-stream state entering the first update (``state``: its
        second-to-last dimension is the sequence, its last the width) or any model input (``state=False``: the
        dtype only); ``dtype``: the compute dtype when ``x`` does not carry it (integer token ids)."""
        if _tracing(x):
            return
        run = compute_dtype(x, dtype)
        found: List[str] = []
        if run not in self._ok_dtypes:
            name = _name(run)
            if name is None or DTYPE_MAX[name] >= DTYPE_MAX[self.dtype]:
                self._ok_dtypes.add(run)
            else:
                if self.seen_dtype is None or DTYPE_MAX[name] < DTYPE_MAX[self.seen_dtype]:
                    self.seen_dtype = name
                found.append(f"dtype {name} is narrower than the certified {self.dtype}")
        if state and self.seq_len is not None:
            n = int(x.shape[-2]) if x.ndim >= 3 else 1
            if n > self.seq_len:
                self.seen_seq_len = max(n, self.seen_seq_len or 0)
                found.append(f"sequence length {n} > the certified seq_len {self.seq_len}")
        if state and self.r0 is not None and x.numel():
            # the per-token norm (docs/theory.md section 3: r0 bounds max_i ||x_i||), once per forward
            r = float(torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float32).max())
            if not r <= self.r0:  # NaN counts as outside
                r = math.inf if math.isnan(r) else r
                self.seen_r0 = max(r, self.seen_r0 or 0.0)
                found.append(f"input per-token norm {r:.4g} > the certified r0 {self.r0:.4g}")
        if found:
            self._report(found, stacklevel)

    def _report(self, found: List[str], stacklevel: int) -> None:
        key = frozenset(f.split(" ", 1)[0] for f in found)
        msg = (f"{self.owner} ran outside its certified envelope: {'; '.join(found)}. Its certificate() is now "
               f"computed at the envelope used ({self._used_text()}); certify it for that run, or keep the inputs "
               "inside the envelope")
        if self.strict:
            from .stack import CertificationError

            raise CertificationError(msg)
        if not self.quiet and not key <= self.warned:
            self.warned |= key
            warnings.warn(msg, EnvelopeWarning, stacklevel=stacklevel)

    def _used_text(self) -> str:
        dtype, seq_len, r0 = self.used()
        parts = [dtype] + ([f"seq_len {seq_len}"] if seq_len is not None else []) + (
            [f"r0 {r0:.4g}"] if r0 is not None else [])
        return ", ".join(parts)

    def __repr__(self) -> str:
        return (f"Envelope({self.owner}: dtype={self.dtype}, seq_len={self.seq_len}, r0={self.r0}, "
                f"strict={self.strict}, used={self._used_text()})")

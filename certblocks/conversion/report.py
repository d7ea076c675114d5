"""What :func:`certblocks.conversion.convert` reports: the swaps, the certificates before and after, the depth per
dtype, and how to undo it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from .._format import render_table
from ..certificate import StackCertificate
from ..exponents import Exponents
from ..fixes import Fix

__all__ = ["Swap", "ConversionWarning", "ConversionError", "DepthChange", "ConversionReport", "ABSENT", "max_q"]


@dataclass(frozen=True)
class Swap:
    """One module replaced by :func:`convert`.

    Attributes:
        path: module path in the model.
        before: class name of the source module.
        after: class name of the replacement.
        exponents_before: the source's exponents ``(q, sigma)`` (of the normalization, for a norm removal).
        exponents_after: the replacement's exponents (``Identity``: (1, 0)).
    """

    path: str
    before: str
    after: str
    exponents_before: Exponents
    exponents_after: Exponents

    def __str__(self) -> str:
        return f"{self.path}: {self.before} {self.exponents_before} -> {self.after} {self.exponents_after}"


class ConversionWarning(UserWarning):
    """A conversion lowered the model's certified depth in some dtype (the message has the table and the fixes)."""


class ConversionError(ValueError):
    """:func:`convert` refused: a swap lowers the certified depth (``strict=True``), or ``remove_norms=True`` would
    leave a residual branch above (1, 1).  The model is left as it was."""


@dataclass(frozen=True)
class DepthChange:
    """The certified depth of a model in one dtype before and after :func:`convert` (traced).

    Attributes:
        dtype: the dtype.
        before, after: the certified residual updates.
        depth_before, depth_after: the residual updates (the same unless a swap changed the structure).
        reason: when the depth drops, the update whose log factor grew most, with its culprit.
        fixes: when the depth drops, the value of each lever that certifies again the updates certified before
            (each certified again: :func:`certblocks.fixes.compute_fixes`).
    """

    dtype: str
    before: int
    after: int
    depth_before: int
    depth_after: int
    reason: str = ""
    fixes: Tuple[Fix, ...] = ()

    @property
    def lowered(self) -> bool:
        """The conversion certifies fewer updates than before."""
        return self.after < self.before

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.dtype} {self.before}/{self.depth_before} -> {self.after}/{self.depth_after}{why}"

    def to_dict(self) -> Dict[str, Any]:
        return {"dtype": self.dtype, "before": self.before, "after": self.after, "depth_before": self.depth_before,
                "depth_after": self.depth_after, "reason": self.reason, "fixes": [f.to_dict() for f in self.fixes]}


@dataclass
class ConversionReport:
    """What :func:`convert` did.

    Attributes:
        model: the converted model (the input itself when ``inplace=True``, else a deep copy).
        swaps: every swap, in module order.
        certificate_before, certificate_after: the model's stack certificates (tracer) for ``dtype``,
            or ``None`` when no ``example_input`` was given or the tracer failed.
        trace_error_before, trace_error_after: why a certificate is missing (empty when present).
        dtype: the dtype of the certificates.
        notes: other changes made to the model (e.g. an HF ``config.use_cache`` set to False).
        depths: the certified depth per dtype before and after (:class:`DepthChange`; empty without both
            certificates).
    """

    model: nn.Module
    swaps: List[Swap] = field(default_factory=list)
    certificate_before: Optional[StackCertificate] = None
    certificate_after: Optional[StackCertificate] = None
    trace_error_before: str = ""
    trace_error_after: str = ""
    dtype: str = "bf16"
    notes: List[str] = field(default_factory=list)
    depths: List[DepthChange] = field(default_factory=list)
    _undo: List[Tuple[Any, str, Any]] = field(default_factory=list, repr=False)

    @property
    def lowered(self) -> List[DepthChange]:
        """The dtypes in which the conversion certifies fewer updates than before."""
        return [d for d in self.depths if d.lowered]

    def table(self, *, markdown: bool = False) -> str:
        """Certified depth per dtype before and after, and for a drop its reason and fixes."""
        if not self.depths:
            why = self.trace_error_before or self.trace_error_after or "no example_input given"
            return f"certified depths not available: {why.splitlines()[0]}"
        rows = []
        for d in self.depths:
            note = "" if not d.lowered else d.reason + (
                ("; fixes: " + ", ".join(f.text for f in d.fixes)) if d.fixes else "")
            rows.append([d.dtype, f"{d.before}/{d.depth_before}", f"{d.after}/{d.depth_after}",
                         f"{d.after - d.before:+d}", note])
        return render_table(["dtype", "before", "after", "change", "reason and fix"], rows, markdown=markdown)

    @property
    def max_q_after(self) -> Optional[float]:
        """Largest ``q`` over the residual updates after conversion (tracer), ``None`` if unknown."""
        return max_q(self.certificate_after)

    @property
    def max_q_before(self) -> Optional[float]:
        """Largest ``q`` over the residual updates before conversion (tracer), ``None`` if unknown."""
        return max_q(self.certificate_before)

    def revert(self) -> nn.Module:
        """Put the original modules (and changed settings) back into :attr:`model` and return it."""
        for parent, name, old in reversed(self._undo):
            if old is ABSENT:
                delattr(parent, name)
            else:
                setattr(parent, name, old)
        self._undo.clear()
        self.swaps = []
        self.notes = []
        self.depths = []
        return self.model

    def explain(self) -> str:
        """The swaps, then the certificates before and after."""
        out = [f"{len(self.swaps)} swaps"]
        out += [f"  {s}" for s in self.swaps]
        for tag, cert, err in (("before", self.certificate_before, self.trace_error_before),
                               ("after", self.certificate_after, self.trace_error_after)):
            out.append(f"certificate {tag}:")
            out.append(cert.explain() if cert is not None else f"  not available: {err}")
        if self.depths:
            out += ["certified depth before and after:", self.table()]
        return "\n".join(out)

    def __str__(self) -> str:
        def short(c: Optional[StackCertificate], err: str) -> str:
            if c is None:
                return f"n/a ({err.splitlines()[0][:80] if err else 'no example_input'})"
            return f"{c.certified_depth}/{c.depth} certified in {c.dtype}, max q {max_q(c)}"

        before = short(self.certificate_before, self.trace_error_before)
        after = short(self.certificate_after, self.trace_error_after)
        return f"ConversionReport({len(self.swaps)} swaps; before: {before}; after: {after})"


ABSENT = object()  # an attribute convert() added (revert deletes it)


def max_q(cert: Optional[StackCertificate]) -> Optional[float]:
    if cert is None or not cert.updates:
        return None
    qs = [u.q for u in cert.updates]
    return None if any(q is None for q in qs) else max(qs)  # type: ignore[type-var]


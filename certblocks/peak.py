"""The bound on the largest value a block computes on the way: :class:`Peak` (re-exported by
:mod:`certblocks.certificate`, whose :class:`~certblocks.certificate.BlockCertificate` carries one)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

from . import budget as _budget
from ._format import fmt_num as _fmt_num

__all__ = ["Peak"]


@dataclass(frozen=True)
class Peak:
    """Bound on the largest intermediate value of a block: ``c ||x||^q + b``.

    The state bound alone does not make a forward pass finite: a block can compute
    values far larger than its output on the way (attention's query-key logits grow
    like ``kappa ||x||^2`` while the block's output grows like ``||x||``; a SwiGLU's
    gated product like ``||x||^2`` before a small down-projection).  A block that
    carries a peak promises that every entry of every tensor it computes from ``x``
    (its output included) is at most ``c ||x||^q + b`` in absolute value, so the
    forward depth also requires ``c R_k^q + b < M`` at each update's input radius.

    A peak whose bound was not derived (a node of a traced graph without a finite bound, a value the
    chain reads at its example, an output of the model it does not bound) is :meth:`unbounded`: its
    bound is the largest float, so it reaches every dtype's ``M`` and a chain holding it is not
    certified, the failure naming ``what``.  Unknown is never zero (docs/theory.md section 6).

    Args:
        q: exponent (``q = 2`` for query-key logits and bilinear gates).
        c: coefficient.
        b: offset.
        what: the intermediate that attains the bound, for reports
            (``"query-key logits"``); for an unbounded peak, the value not bounded and why.
        lever: what lowers this bound, in words, when it is known (a peak of the values held in one dtype under a
            precision policy: "keep blocks.3.mlp.fc2 in fp32 ..."); ``""``: the failure's generic fix.
        parts: the values the peak folds, each ``(terms, what, lever)`` with ``terms`` its bound as
            ``((power, coefficient), ...)`` (``()``: not kept); :meth:`named_at` names the largest at a radius.
    """

    q: float
    c: float
    b: float = 0.0
    what: str = ""
    lever: str = ""
    parts: Tuple[Tuple[Tuple[Tuple[float, float], ...], str, str], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def unbounded(cls, what: str) -> Peak:
        """A peak that is not derived: ``what`` names the value and the reason (reports and the failure)."""
        return cls(0.0, sys.float_info.max, 0.0, what)

    @property
    def derived(self) -> bool:
        """False for an :meth:`unbounded` peak (a coefficient at the largest float)."""
        return self.c < sys.float_info.max and self.b < sys.float_info.max

    def __post_init__(self) -> None:
        for name in ("q", "c", "b"):
            object.__setattr__(self, name, _budget._real(f"peak {name}", getattr(self, name)))
        for name in ("what", "lever"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")

    def bound(self, radius: float) -> float:
        """``c * radius^q + b`` (``inf`` past the float range)."""
        if self.q == 0.0:
            return self.c + self.b
        try:
            return self.c * float(radius) ** self.q + self.b
        except OverflowError:
            return math.inf

    def named_at(self, radius: float) -> Tuple[str, str]:
        """``(what, lever)`` of the value with the largest bound at input radius ``radius`` among :attr:`parts` (the
        first in graph order on a tie); ``(what, lever)`` of the peak without parts."""
        best, out = -1.0, (self.what, self.lever)
        for terms, what, lever in self.parts:
            try:
                v = math.fsum(coef * (float(radius) ** p if p else 1.0) for p, coef in terms)
            except OverflowError:
                v = math.inf
            if v > best:
                best, out = v, (what, lever)
        return out

    def to_dict(self) -> Dict[str, Any]:
        out = {"q": self.q, "c": self.c, "b": self.b, "what": self.what}
        if self.lever:
            out["lever"] = self.lever
        return out

    def __str__(self) -> str:
        what = f" ({self.what})" if self.what else ""
        if not self.derived:
            return f"peak not derived{what}"
        return f"peak <= {_fmt_num(self.c)} ||x||^{_fmt_num(self.q)} + {_fmt_num(self.b)}{what}"

"""The results of the backward bound (docs/theory.md section 7): a gradient's bound (:class:`GradBound`), one per
tensor of a model (:class:`NodeGradient`, :class:`SegmentGradients`, :class:`ModelGradients`) and the largest safe
static loss scale (:class:`LossScale`), with the constants the loss scale is read with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

#: Relative margin on ``S*`` for the roundings of the backward's low-precision arithmetic (the bounds are exact).
ROUNDING_MARGIN = 2.0 ** -8
#: ``torch.amp.GradScaler``'s default initial scale.
GRAD_SCALER_INIT = 65536.0


# ---------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class GradBound:
    """A bound of one gradient tensor ``g`` (``inf``: not bounded; ``why`` names what stops the bound).

    Attributes:
        total: ``N*(g)``, the sum over its rows of their Euclidean norms (the costate norm of the chain).
        rows: the largest Euclidean norm of a row (``<= total``).
        entry: every ``|g_i|`` (``<= rows`` for an activation; a parameter's may be bounded directly).
        why: why a bound is ``inf`` (the op or segment that stops it), ``""`` when finite.
    """

    total: float
    rows: float
    entry: float
    why: str = ""

    @classmethod
    def of(cls, total: float, rows: Optional[float] = None, why: str = "") -> GradBound:
        """The bound of a gradient with ``N* <= total`` and rows ``<= rows`` (default ``total``)."""
        r = total if rows is None else min(rows, total)
        return cls(total, r, r, why if not math.isfinite(r) else "")

    @property
    def known(self) -> bool:
        return math.isfinite(self.entry)


ZERO = GradBound(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class NodeGradient:
    """The bound of one gradient tensor of a model's backward.

    Attributes:
        name: the node (``"u:a"`` for a hidden cast: the argument ``a`` cast inside the op ``u``).
        op: the node's op (``"placeholder"`` for a parameter).
        module: the module path of the node (a parameter: its name).
        segment: the segment it belongs to (``""``: the parameter side, shared by segments).
        dtype: the dtype the gradient is held in (the tensor's; a hidden cast: the op's).
        bound: its :class:`GradBound`.
        kind: ``"activation"``, ``"parameter"`` (a parameter or a tensor computed from parameters alone) or
            ``"hidden"`` (an autocast cast inside an op).
    """

    name: str
    op: str
    module: str
    segment: str
    dtype: Optional[torch.dtype]
    bound: GradBound
    kind: str = "activation"

    @property
    def entry(self) -> float:
        return self.bound.entry


@dataclass
class SegmentGradients:
    """The gradient bounds of one segment (:func:`segment_gradients`).

    Attributes:
        bounds: node name -> :class:`GradBound` for every node of the segment that carries a gradient (an op with
            several outputs: ``"name#k"`` per output).
        parameters: node name -> entry bound of the gradient reaching each parameter-side argument from this
            segment (summed over its uses here), with why when ``inf``.
        hidden: ``(op node, argument node, dtype, entry bound, why)`` for every argument cast inside an op to a
            dtype other than its own.
        radius: the radius at which the forward bounds were read.
    """

    bounds: Dict[str, GradBound] = field(default_factory=dict)
    parameters: Dict[str, Tuple[float, str]] = field(default_factory=dict)
    hidden: List[Tuple[str, str, Optional[torch.dtype], float, str]] = field(default_factory=list)
    radius: float = 0.0


@dataclass
class ModelGradients:
    """Every gradient bound of a model (:func:`model_gradient_bounds`): a :class:`NodeGradient` per tensor."""

    gradients: List[NodeGradient]
    costates: List[float]
    notes: List[str] = field(default_factory=list)

    def by_name(self) -> Dict[str, NodeGradient]:
        return {ng.name: ng for ng in self.gradients}


@dataclass(frozen=True)
class LossScale:
    """The largest static loss scale with which no gradient held in ``dtype`` can overflow (docs/theory.md section 7).

    Attributes:
        value: ``S* = min M / (entry bound)`` over the gradients held in ``dtype`` (divided by ``1 + ROUNDING_MARGIN``);
            ``inf`` when no gradient is held in it; ``0.0`` when one of them is not bounded (no scale is certified).
        node: the gradient that sets it (or the first one not bounded).
        module: that node's module path.
        dtype: the low-precision dtype checked (fp16).
        certified: every gradient held in ``dtype`` is bounded.
        safe_unscaled: ``value >= 1``: a step without a loss scale cannot overflow.
        grad_scaler_above: a GradScaler's initial scale (:data:`GRAD_SCALER_INIT`) is above ``value``: it skips steps
            until it has come down.
        reason: one line that says it.
        gradients: every bound (all dtypes), for reports.
        entry: the entry bound of ``node``'s gradient.
    """

    value: float
    node: str
    module: str
    dtype: torch.dtype
    certified: bool
    safe_unscaled: bool
    grad_scaler_above: bool
    reason: str
    gradients: Tuple[NodeGradient, ...] = ()
    entry: float = math.nan

    def __str__(self) -> str:
        return self.reason


def _sum(items: Iterable[Tuple[str, float, float, str]]) -> GradBound:
    total = rows = 0.0
    why = ""
    for _, t, r, w in items:
        total += t
        rows += r
        if w and not why:
            why = w
    return GradBound.of(total, rows, why)

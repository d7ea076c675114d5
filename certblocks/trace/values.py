"""Abstract values: what the tracer knows about one tensor of a velocity's graph.

For a velocity ``v`` with input ``x`` (per-token norm ``||x||``, docs/theory.md section 1), every
intermediate tensor ``t`` gets an :class:`AValue`.  Its bounds are
:class:`~certblocks.bounds.poly.Poly` in the radius ``r = ||x||``:

==================  ==========================================================================
field               meaning
==================  ==========================================================================
``exps``            growth exponents ``(q, sigma)`` of ``x -> t`` by the rules of docs/theory.md section 2
``shape``           the tensor's shape
``growth``          ``N(t) <= growth(||x||)``: bound of the row norm (``None``: not derived)
``max_abs``         ``max_i |t_i| <= max_abs(||x||)``: bound of every entry (``None``: not derived)
``jacobian``        ``||dt/dx|| <= jacobian(R)`` on the ball ``||x|| <= R`` (``None``: not derived)
``sign``            ``"+"`` (every entry >= 0), ``"-"`` (every entry <= 0), ``"0"`` or ``None`` (unknown)
``const``           the tensor does not depend on ``x``
``value``           the concrete tensor of a constant (``None`` otherwise)
``stochastic_dim``  the (negative) dimension along which ``t`` is row-stochastic (entries >= 0, sum 1)
``row_sum``         with ``stochastic_dim``: the sums along it are at most this (1; ``1 + u`` after a rounding cast)
``rule``            the rule that produced the value (reports)
``deps``            names of the input-dependent nodes it was computed from
``bad``             why this node is outside the certified class (only on the node responsible)
==================  ==========================================================================

``N(t)`` is the *row norm*: the largest Euclidean norm of ``t`` along its last dimension
(over all leading indices).  For the velocity's input and output of shape
``(..., tokens, features)`` it is the per-token norm of the certificate; the Jacobian norms are
operator norms induced by the row norms of input and output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ..bounds.poly import Poly
from ..exponents import CONSTANT, Exponents

__all__ = ["AValue", "ConstAValue", "row_norm", "max_abs", "sign_of"]


def row_norm(t: torch.Tensor) -> float:
    """Largest Euclidean norm along the last dimension (``|t|`` for a 0-d tensor), in float64."""
    t = t.detach()
    if t.is_complex():
        t = t.abs()
    t = t.double()
    if t.dim() == 0:
        return float(t.abs())
    if t.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(t, dim=-1).max())


def max_abs(t: torch.Tensor) -> float:
    """Largest absolute entry (``0`` for an empty tensor)."""
    t = t.detach()
    if t.numel() == 0:
        return 0.0
    return float(t.abs().max().double())


def sign_of(t: torch.Tensor) -> Optional[str]:
    """``"+"``, ``"-"``, ``"0"`` when every entry is >= 0, <= 0 or 0; ``None`` otherwise (or with a NaN)."""
    t = t.detach()
    if t.is_complex() or t.numel() == 0:
        return None if t.numel() else "0"
    if t.dtype == torch.bool:
        return "+"
    if not t.is_floating_point():
        t = t.double()
    lo, hi = map(float, torch.aminmax(t))
    if lo != lo or hi != hi:  # NaN
        return None
    if lo == 0 and hi == 0:
        return "0"
    if lo >= 0:
        return "+"
    if hi <= 0:
        return "-"
    return None


@dataclass(kw_only=True)
class AValue:
    """Abstract value of one tensor (the fields are tabled in the module docstring)."""

    exps: Exponents
    shape: Tuple[int, ...]
    growth: Optional[Poly] = None
    max_abs: Optional[Poly] = None
    jacobian: Optional[Poly] = None
    sign: Optional[str] = None
    const: bool = False
    value: Optional[torch.Tensor] = None
    stochastic_dim: Optional[int] = None
    row_sum: float = 1.0
    rule: str = ""
    deps: Tuple[str, ...] = field(default_factory=tuple)
    bad: str = ""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def constant(cls, value: Any, rule: str = "constant") -> AValue:
        """A value that does not depend on the input; norms and sign are computed on first use."""
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        return ConstAValue(value.detach(), rule)

    @classmethod
    def unknown(cls, shape: Tuple[int, ...], rule: str, bad: str = "", deps: Tuple[str, ...] = ()) -> AValue:
        """A value with unknown exponents and no bound (``bad`` says why, on the node responsible)."""
        return cls(exps=Exponents(None, None), shape=tuple(shape), rule=rule, deps=tuple(deps), bad=bad)

    def entry_bound(self) -> Optional[Poly]:
        """A bound of every entry: :attr:`max_abs` when derived, else :attr:`growth` (a row norm bounds its entries)."""
        return self.max_abs if self.max_abs is not None else self.growth


class ConstAValue(AValue):
    """An :class:`AValue` of a constant, with lazily computed row norm, max-abs and sign."""

    def __init__(self, value: torch.Tensor, rule: str = "constant") -> None:
        self.exps = CONSTANT
        self.jacobian = Poly.ZERO
        self.shape = tuple(value.shape)
        self.const = True
        self.value = value
        self.stochastic_dim = None
        self.row_sum = 1.0
        self.rule = rule
        self.deps = ()
        self.bad = ""
        self._cache: Dict[str, Any] = {}

    def _get(self, key: str) -> Any:
        if key not in self._cache:
            v = self.value
            assert v is not None  # derived lazily only from a concrete value (otherwise set when made)
            if key == "growth":
                self._cache[key] = Poly.const(row_norm(v if (v.is_floating_point() or v.is_complex())
                                                       else v.double()))
            elif key == "max_abs":
                self._cache[key] = Poly.const(max_abs(v.double() if v.dtype == torch.bool else v))
            else:
                self._cache[key] = sign_of(v)
        return self._cache[key]

    growth = property(lambda self: self._get("growth"),
                      lambda self, v: self._cache.__setitem__("growth", v))
    max_abs = property(lambda self: self._get("max_abs"),
                       lambda self, v: self._cache.__setitem__("max_abs", v))
    sign = property(lambda self: self._get("sign"),
                    lambda self, v: self._cache.__setitem__("sign", v))

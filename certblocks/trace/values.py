"""Abstract values: what the tracer knows about one tensor of a velocity's graph.

For a velocity ``v`` with input ``x`` (per-token norm ``||x||``, THEORY.md section 1), every
intermediate tensor ``t`` gets an :class:`AValue`:

* ``exps`` -- the growth exponents ``(q, sigma)`` of ``x -> t`` by the rules of THEORY.md section 2;
* ``G`` -- a :class:`~certblocks.trace.poly.Poly` with ``N(t) <= G(||x||)``;
* ``M`` -- a Poly with ``max |t_i| <= M(||x||)``;
* ``J`` -- a Poly with ``||dt/dx|| <= J(R)`` on the ball ``||x|| <= R``;
* ``sign`` -- ``"+"`` (every entry >= 0), ``"-"`` (every entry <= 0), ``"0"`` or ``None`` (unknown).

``N(t)`` is the *row norm*: the largest Euclidean norm of ``t`` along its last dimension
(over all leading indices).  For the velocity's input and output of shape
``(..., tokens, features)`` it is the per-token norm of the certificate; the Jacobian norms are
operator norms induced by the row norms of input and output.  ``G``, ``M`` or ``J`` is ``None``
when no bound was derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ..exponents import CONSTANT, Exponents
from ..bounds.poly import Poly

__all__ = ["AValue", "row_norm", "max_abs", "sign_of"]


def row_norm(t: torch.Tensor) -> float:
    """Largest Euclidean norm along the last dimension (``|t|`` for a 0-d tensor)."""
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
    t = t.detach()
    if t.numel() == 0:
        return 0.0
    return float(t.abs().max().double())


def sign_of(t: torch.Tensor) -> Optional[str]:
    t = t.detach()
    if t.is_complex() or t.numel() == 0:
        return None if t.numel() else "0"
    if t.dtype == torch.bool:
        return "+"
    if not t.is_floating_point():
        t = t.double()
    lo, hi = torch.aminmax(t)
    lo, hi = float(lo), float(hi)
    if lo != lo or hi != hi:  # NaN
        return None
    if lo == 0 and hi == 0:
        return "0"
    if lo >= 0:
        return "+"
    if hi <= 0:
        return "-"
    return None


@dataclass
class AValue:
    """Abstract value of one tensor (see the module docstring)."""

    exps: Exponents
    G: Optional[Poly]
    M: Optional[Poly]
    J: Optional[Poly]
    shape: Tuple[int, ...]
    sign: Optional[str] = None
    const: bool = False
    value: Optional[torch.Tensor] = None
    stoch: Optional[int] = None  # row-stochastic (entries >= 0, sum 1) along this dim
    rule: str = ""
    deps: Tuple[str, ...] = field(default_factory=tuple)
    bad: str = ""  # why this node is outside the class (only on the node responsible)

    @property
    def last(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def constant(cls, value: torch.Tensor, rule: str = "constant") -> AValue:
        """A value that does not depend on the input; norms and sign are computed on first use."""
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        return ConstAValue(value.detach(), rule)

    @classmethod
    def unknown(cls, shape: Tuple[int, ...], rule: str, bad: str = "", deps: Tuple[str, ...] = ()) -> AValue:
        return cls(Exponents(None, None), None, None, None, tuple(shape), None, False, None, None, rule, deps, bad)

    def M_or_G(self) -> Optional[Poly]:
        return self.M if self.M is not None else self.G

    def describe_bounds(self) -> str:
        return f"N<={self.G!r}, J<={self.J!r}"

    def finite(self) -> bool:
        return all(p is None or p.is_finite() for p in (self.G, self.J))


def _is_finite_number(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class ConstAValue(AValue):
    """An :class:`AValue` of a constant, with lazily computed row norm, max-abs and sign."""

    def __init__(self, value: torch.Tensor, rule: str = "constant") -> None:
        self.exps = CONSTANT
        self.J = Poly.ZERO
        self.shape = tuple(value.shape)
        self.const = True
        self.value = value
        self.stoch = None
        self.rule = rule
        self.deps = ()
        self.bad = ""
        self._cache: dict = {}

    def _get(self, key: str):
        if key not in self._cache:
            v = self.value
            if key == "G":
                self._cache[key] = Poly.const(row_norm(v if (v.is_floating_point() or v.is_complex())
                                                       else v.double()))
            elif key == "M":
                self._cache[key] = Poly.const(max_abs(v.double() if v.dtype == torch.bool else v))
            else:
                self._cache[key] = sign_of(v)
        return self._cache[key]

    G = property(lambda self: self._get("G"), lambda self, v: self._cache.__setitem__("G", v))  # type: ignore
    M = property(lambda self: self._get("M"), lambda self, v: self._cache.__setitem__("M", v))  # type: ignore
    sign = property(lambda self: self._get("sign"), lambda self, v: self._cache.__setitem__("sign", v))  # type: ignore

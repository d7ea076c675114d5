"""The arithmetic of growth exponents (docs/theory.md section 2).

Every residual velocity ``v`` carries two exponents:

* ``q``, the forward growth exponent: ``||v(x)|| <= c ||x||^q + b``;
* ``sigma``, the Jacobian growth exponent: ``sup_{||x|| <= R} ||dv(x)|| <= l1 R^sigma + l0``.

They propagate through a computation graph by four rules (composition, sum,
product, residual wrap) plus normalization as a primitive.  The rules give
upper bounds: an exponent derived here is never smaller than the true one.

An exponent may be ``None``: *not derived* (the primitive is outside the class the
rules cover).  ``None`` propagates: any rule with an unknown operand yields an
unknown result, except where the result does not depend on it (a bounded outer
map, ``q1 = 0``, bounds the composition whatever the inner map does).

This module is pure Python; it does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Optional, Tuple

from ._validation import check_real

__all__ = [
    "Exponents",
    "compose",
    "add",
    "product",
    "residual",
    "normalize",
    "power",
    "exp_of_nonpositive",
    "CONSTANT",
    "IDENTITY",
    "AFFINE",
    "LINEAR",
    "LIPSCHITZ",
    "SATURATING",
    "SOFTMAX",
    "NORM",
    "QK_LOGITS",
    "ATTENTION",
    "QK_NORM_ATTENTION",
    "MAMBA_SSM",
    "LINEAR_GROWTH_MAMBA",
    "UNKNOWN",
]

Exp = Optional[float]


def _check_exponent(name: str, value: object) -> Exp:
    return check_real(name, value, ge=0.0, optional=True, note="None: not derived")


def _fmt(value: Exp) -> str:
    return "?" if value is None else f"{value:g}"


@dataclass(frozen=True)
class Exponents:
    """A pair of growth exponents ``(q, sigma)``.

    Args:
        q: forward growth exponent, ``>= 0``, or ``None`` when not derived.
        sigma: Jacobian growth exponent, ``>= 0``, or ``None`` when not derived.

    ``Exponents`` is an immutable value: it compares, hashes and unpacks like a
    pair (``q, sigma = x``).  ``x <= y`` is the componentwise order (``y`` is at
    least as bad as ``x``); it is ``False`` when either side has an unknown
    exponent.
    """

    q: Exp
    sigma: Exp = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "q", _check_exponent("q", self.q))
        object.__setattr__(self, "sigma", _check_exponent("sigma", self.sigma))

    @property
    def known(self) -> bool:
        """True when both exponents are derived."""
        return self.q is not None and self.sigma is not None

    def matrix(self) -> Tuple[Tuple[float, float], Tuple[float, float]]:
        """The 2x2 matrix ``[[q, sigma], [0, 1]]``.

        Composition is the matrix product: ``compose(outer, inner).matrix()`` equals
        ``inner.matrix() @ outer.matrix()``.
        """
        if not self.known:
            raise ValueError(f"matrix() needs both exponents derived, got {self}")
        assert self.q is not None and self.sigma is not None  # for type checkers
        return ((self.q, self.sigma), (0.0, 1.0))

    def __iter__(self):
        yield self.q
        yield self.sigma

    def __le__(self, other: Exponents) -> bool:
        if not isinstance(other, Exponents):
            return NotImplemented
        if not (self.known and other.known):
            return False
        return self.q <= other.q and self.sigma <= other.sigma  # type: ignore[operator]

    def __ge__(self, other: Exponents) -> bool:
        if not isinstance(other, Exponents):
            return NotImplemented
        return other <= self

    def __str__(self) -> str:
        return f"(q={_fmt(self.q)}, sigma={_fmt(self.sigma)})"

    def __repr__(self) -> str:
        return f"Exponents(q={_fmt(self.q)}, sigma={_fmt(self.sigma)})"

    def to_dict(self) -> dict:
        return {"q": self.q, "sigma": self.sigma}


def _as_exponents(x: object, name: str) -> Exponents:
    if isinstance(x, Exponents):
        return x
    if isinstance(x, tuple) and len(x) == 2:
        return Exponents(*x)
    raise TypeError(f"{name} must be an Exponents or a (q, sigma) pair, got {x!r}")


def _mul(a: Exp, b: Exp) -> Exp:
    return None if a is None or b is None else a * b


def _add(a: Exp, b: Exp) -> Exp:
    return None if a is None or b is None else a + b


def _max(a: Exp, b: Exp) -> Exp:
    return None if a is None or b is None else max(a, b)


def compose(outer: Exponents, inner: Exponents) -> Exponents:
    """Exponents of ``outer o inner`` (``outer`` applied after ``inner``).

    ``q = q_outer * q_inner`` and ``sigma = sigma_outer * q_inner + sigma_inner``:
    the product ``inner.matrix() @ outer.matrix()`` of the matrices ``[[q, sigma], [0, 1]]``.  A bounded outer map
    (``q_outer = 0``) gives ``q = 0`` even when ``q_inner`` is unknown.
    """
    o = _as_exponents(outer, "outer")
    i = _as_exponents(inner, "inner")
    q = 0.0 if o.q == 0.0 else _mul(o.q, i.q)
    sigma = _add(_mul(o.sigma, i.q), i.sigma)
    return Exponents(q, sigma)


def add(*xs: Exponents) -> Exponents:
    """Exponents of a sum ``B1 + B2 + ...``: the componentwise maximum."""
    if not xs:
        raise ValueError("add() needs at least one operand")
    es = [_as_exponents(x, f"xs[{k}]") for k, x in enumerate(xs)]
    return reduce(lambda a, b: Exponents(_max(a.q, b.q), _max(a.sigma, b.sigma)), es)


def _product2(a: Exponents, b: Exponents) -> Exponents:
    q = _add(a.q, b.q)
    sigma = _max(_add(a.sigma, b.q), _add(a.q, b.sigma))
    return Exponents(q, sigma)


def product(*xs: Exponents) -> Exponents:
    """Exponents of a bilinear product (Hadamard, matmul) of the operands.

    For two operands ``q = q1 + q2`` and ``sigma = max(sigma1 + q2, q1 + sigma2)``;
    more operands fold left (the rule is associative and commutative).
    """
    if not xs:
        raise ValueError("product() needs at least one operand")
    es = [_as_exponents(x, f"xs[{k}]") for k, x in enumerate(xs)]
    return reduce(_product2, es)


def residual(x: Exponents) -> Exponents:
    """Exponents of the residual update ``I + dt * B``: ``(max(1, q), sigma)``."""
    e = _as_exponents(x, "x")
    return Exponents(None if e.q is None else max(1.0, e.q), e.sigma)


def normalize(x: Exponents) -> Exponents:
    """Exponents of ``N o B`` for a normalization ``N``: ``(0, sigma_B)``.

    The output of a normalization is bounded whatever its input, so ``q = 0``
    even when ``q_B`` is unknown.
    """
    return compose(NORM, x)


def power(p: float) -> Exponents:
    """Entrywise power ``x ** p`` for a real ``p >= 1``: ``(p, p - 1)``."""
    p = check_real("power(p): p", p, ge=1.0, note="below 1 the Jacobian of x ** p is unbounded at 0")
    return Exponents(p, p - 1.0)


def exp_of_nonpositive(argument: Exponents) -> Exponents:
    """``exp(g)`` where ``g <= 0`` is proven: bounded by 1, so ``(0, sigma_g)``."""
    g = _as_exponents(argument, "argument")
    return Exponents(0.0, g.sigma)


#: A constant (no dependence on the state).
CONSTANT = Exponents(0, 0)
#: The identity map.
IDENTITY = Exponents(1, 0)
#: An affine map ``W x + b``.
AFFINE = Exponents(1, 0)
LINEAR = AFFINE
#: A globally Lipschitz activation (ReLU, GELU, SiLU, softplus, ELU, leaky ReLU).
LIPSCHITZ = Exponents(1, 0)
#: A saturating activation (tanh, sigmoid, hardtanh, ReLU6, DyT).
SATURATING = Exponents(0, 0)
#: A row-stochastic softmax.
SOFTMAX = Exponents(0, 0)
#: A normalization (LayerNorm with eps > 0, RMSNorm, ScaleNorm, x / ||x||).
NORM = Exponents(0, 0)
#: Query-key logits ``s X^T Wq^T Wk X``.
QK_LOGITS = Exponents(2, 1)
#: Self-attention ``softmax(s Q K^T) V`` without normalization.
ATTENTION = Exponents(1, 2)
#: Self-attention with normalized queries and keys (QK-norm).
QK_NORM_ATTENTION = Exponents(1, 1)
#: The Mamba block without normalization (sigma <= 5 by the rules, >= 4 by the lower-bound lemma).
MAMBA_SSM = Exponents(5, 5)
#: The linear-growth Mamba block.
LINEAR_GROWTH_MAMBA = Exponents(1, 1)
#: Nothing derived.
UNKNOWN = Exponents(None, None)

"""Upper-bound polynomials ``P(r) = sum_k a_k r^{e_k}`` (``a_k >= 0``, real ``e_k >= 0``) and the peak algebra.

The tracer propagates, for every node of a velocity's graph, two such bounds in the
radius ``r`` of the velocity's input (per-token norm):

* ``G(r)``: the node's value has norm ``<= G(||x||)`` (for every ``x``);
* ``J(R)``: the node's Jacobian with respect to the input has norm ``<= J(R)`` on the
  ball ``||x|| <= R``.

Nonnegative coefficients make every bound nondecreasing in ``r``, so bounds compose by
substitution.  The degrees follow the exponent algebra of :mod:`certblocks.exponents`
exactly (product adds degrees, composition multiplies them), and :meth:`Poly.collapse_growth`
/ :meth:`Poly.collapse_jacobian` turn a polynomial into the two-term form
``c r^q + b`` / ``l1 max(R, 1)^sigma + l0`` of a :class:`~certblocks.certificate.BlockCertificate`.
The blocks write their hand-derived bounds with the same class.

Peaks (:class:`~certblocks.certificate.Peak`, a bound ``c R^q + b`` on every intermediate value of a
block) are folded from such polynomials by :func:`fold_peak`; :func:`normalized_peak` is the peak of a
branch between normalizations.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

from ..certificate import Peak
from .norms import rounded_up

__all__ = ["Poly", "psum", "fold_peak", "peak_poly", "power_terms", "normalized_peak"]

_TOL = 1e-9


def _key(e: float) -> float:
    return round(float(e), 9)


class Poly:
    """An upper-bound polynomial with nonnegative coefficients and real exponents (immutable)."""

    __slots__ = ("terms",)

    def __init__(self, terms: Optional[Dict[float, float]] = None) -> None:
        clean: Dict[float, float] = {}
        for e, a in (terms or {}).items():
            if a is None or (isinstance(a, float) and math.isnan(a)):
                raise ValueError(f"Poly coefficient for exponent {e} is {a!r}")
            if a < 0:
                raise ValueError(f"Poly coefficients must be >= 0, got {a} for exponent {e}")
            if e < -_TOL:
                raise ValueError(f"Poly exponents must be >= 0, got {e}")
            if a == 0:
                continue
            k = _key(max(e, 0.0))
            clean[k] = clean.get(k, 0.0) + float(a)
        self.terms = clean

    # constructors -------------------------------------------------------------------------
    @classmethod
    def const(cls, a: float) -> Poly:
        return cls({0.0: float(a)})

    @classmethod
    def mono(cls, a: float, e: float) -> Poly:
        return cls({float(e): float(a)})

    ZERO: Poly

    # queries -------------------------------------------------------------------------------
    @property
    def degree(self) -> float:
        """Largest exponent with a nonzero coefficient (0 for the zero polynomial)."""
        return max(self.terms, default=0.0)

    def __call__(self, r: float) -> float:
        return math.fsum(a * (r**e if e else 1.0) for e, a in self.terms.items())

    def total(self) -> float:
        """``P(1)``: the sum of the coefficients."""
        return math.fsum(self.terms.values())

    def is_finite(self) -> bool:
        return all(math.isfinite(a) for a in self.terms.values())

    # arithmetic ----------------------------------------------------------------------------
    def __add__(self, other: Poly) -> Poly:
        t = dict(self.terms)
        for e, a in other.terms.items():
            t[e] = t.get(e, 0.0) + a
        return Poly(t)

    def scale(self, s: float) -> Poly:
        if s < 0:
            raise ValueError(f"scale must be >= 0, got {s}")
        if s == 0:
            return Poly()
        return Poly({e: a * s for e, a in self.terms.items()})

    def __mul__(self, other: Poly) -> Poly:
        if isinstance(other, (int, float)):
            return self.scale(float(other))
        t: Dict[float, float] = {}
        for e1, a1 in self.terms.items():
            for e2, a2 in other.terms.items():
                k = _key(e1 + e2)
                t[k] = t.get(k, 0.0) + a1 * a2
        return Poly(t)

    __rmul__ = __mul__

    def power(self, p: float) -> Poly:
        """An upper bound of ``P(r)^p`` for ``p >= 0`` (exact for one term or a small integer ``p``)."""
        if p < 0:
            raise ValueError(f"power needs p >= 0, got {p}")
        if p == 0:
            return Poly.const(1.0)
        items = list(self.terms.items())
        if not items:
            return Poly()
        if len(items) == 1:
            e, a = items[0]
            return Poly({e * p: a**p})
        if float(p).is_integer() and p <= 4:
            out = Poly.const(1.0)
            for _ in range(int(p)):
                out = out * self
            return out
        m = len(items)
        # power mean: (sum_i t_i)^p <= m^(p-1) sum_i t_i^p for p >= 1; subadditivity for p < 1.
        f = m ** (p - 1) if p >= 1 else 1.0
        return Poly({e * p: f * a**p for e, a in items})

    def compose(self, inner: Poly) -> Poly:
        """An upper bound of ``self(inner(r))``."""
        out = Poly()
        for e, a in self.terms.items():
            out = out + inner.power(e).scale(a)
        return out

    # collapse to certificate form ----------------------------------------------------------
    def collapse_growth(self, q: float, t: float = 1.0) -> Tuple[float, float]:
        """``(c, b)`` with ``P(r) <= c r^q + b`` for every ``r >= 0``.

        Terms with ``0 < e < q`` are split by Young's inequality at the scale ``t > 0``,
        ``r^e <= (e/q) t^(e-q) r^q + (1 - e/q) t^e`` (equality at ``r = t``): sound for every ``r``,
        tightest near ``r = t``.  Raises ``ValueError`` when the degree exceeds ``q``.
        """
        if not t > 0:
            raise ValueError(f"the folding scale t must be > 0, got {t!r}")
        c = b = 0.0
        for e, a in self.terms.items():
            if e > q + _TOL:
                raise ValueError(f"bound of degree {e} cannot be written with exponent q={q}")
            if e == 0:
                b += a
            elif abs(e - q) <= _TOL:
                c += a
            else:
                c += a * (e / q) * t ** (e - q)
                b += a * (1 - e / q) * t**e
        return rounded_up(c, len(self.terms)), rounded_up(b, len(self.terms))

    def collapse_jacobian(self, sigma: float) -> Tuple[float, float]:
        """``(l1, l0)`` with ``P(R) <= l1 max(R, 1)^sigma + l0`` for every ``R >= 0``."""
        l1 = l0 = 0.0
        for e, a in self.terms.items():
            if e > sigma + _TOL:
                raise ValueError(f"bound of degree {e} cannot be written with exponent sigma={sigma}")
            if e == 0:
                l0 += a
            else:
                l1 += a
        return rounded_up(l1, len(self.terms)), l0

    def __repr__(self) -> str:
        if not self.terms:
            return "0"
        return " + ".join(f"{a:.4g}" + (f" r^{e:g}" if e else "") for e, a in sorted(self.terms.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Poly) and self.terms == other.terms

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.terms.items())))


Poly.ZERO = Poly()


def psum(polys: Iterable[Optional[Poly]]) -> Optional[Poly]:
    """Sum of bounds; ``None`` (unknown) if any is unknown."""
    out = Poly()
    for p in polys:
        if p is None:
            return None
        out = out + p
    return out


def fold_peak(polys: Sequence[Union[Poly, Mapping[float, float]]], what: str) -> Peak:
    """One :class:`~certblocks.certificate.Peak` bounding several polynomial bounds in ``R = ||x||``.

    Each polynomial (a :class:`Poly` or a mapping ``{power: coefficient}``, non-negative) bounds one
    intermediate; the peak is their coefficient-wise maximum, with the middle powers folded into the top
    one and the constant by ``R^p <= R^top + 1`` (``0 < p < top``, any ``R >= 0``), so it stays a sound
    bound for every ``R``.

    Args:
        polys: the intermediates' bounds.
        what: the intermediate that dominates at large ``R`` (reports).
    """
    merged: Dict[float, float] = {}
    for poly in polys:
        items = poly.terms.items() if isinstance(poly, Poly) else poly.items()
        for p, coef in items:
            if p < 0 or coef < 0 or not math.isfinite(coef):
                raise ValueError(f"peak polynomial terms must be finite and non-negative, got {p}: {coef}")
            merged[float(p)] = max(merged.get(float(p), 0.0), float(coef))
    top = max((p for p, coef in merged.items() if coef > 0), default=0.0)
    middle = math.fsum(coef for p, coef in merged.items() if 0.0 < p < top)
    c = merged.get(top, 0.0) + middle if top > 0 else 0.0
    b = merged.get(0.0, 0.0) + middle if top > 0 else merged.get(0.0, 0.0)
    n = len(merged)
    return Peak(top, rounded_up(c, n), rounded_up(b, n), what=what)


def power_terms(q: float, c: float, b: float) -> Dict[float, float]:
    """``c R^q + b`` as ``{power: coefficient}``; ``q = 0`` is one constant ``c + b`` (rounded up), never a dict
    literal ``{q: c, 0.0: b}`` whose second key would overwrite the first."""
    if q == 0.0:
        return {0.0: math.nextafter(c + b, math.inf)}
    return {q: c, 0.0: b}


def peak_poly(peak: Optional[Peak], q: Optional[float] = None, c: float = 0.0, b: float = 0.0) -> Dict[float, float]:
    """``{power: coefficient}`` of a block's peak, or of its growth bound ``c R^q + b`` when it has none."""
    if peak is not None:
        return power_terms(peak.q, peak.c, peak.b)
    if q is None:
        raise ValueError("a block without exponents has no intermediate bound")
    return power_terms(q, c, b)


def normalized_peak(branch_peak: Optional[Peak], branch_q: Optional[float], branch_c: float, branch_b: float,
                    a_in: float, c_out: float, what: str) -> Peak:
    """Peak of a normalized update ``N_out(F(N_in(x)))``: every intermediate is a constant.

    ``N_in(x)`` is at most ``a_in``; the branch's intermediates at most its peak (or growth bound) at
    radius ``a_in``; the output at most ``c_out``.  The normalization itself is a primitive: its sum
    of squares runs in float32 or wider (torch's kernels, certblocks' norms), and should it overflow
    (past ``||x|| ~ 1.8e19``) the normalized value becomes 0, not inf or NaN.
    """
    poly = peak_poly(branch_peak, branch_q, branch_c, branch_b)
    inner = math.fsum(coef * (a_in ** p if p != 0.0 else 1.0) for p, coef in poly.items())
    return Peak(0.0, 0.0, rounded_up(max(a_in, inner, c_out), len(poly)), what=what)

"""Depth budgets: from growth exponents and coefficients to overflow depths.

docs/theory.md section 3.  A residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` stays
finite in a floating-point format with largest finite value ``M`` while

* the forward radius ``R_0 = r0, R_{k+1} = R_k + dt * (c_k R_k^{q_k} + b_k)``
  stays below ``M`` (it bounds ``||X_k||``; the aligned block attains it), and
* the layerwise backward bound
  ``log Lip(G) + sum_{k<D} log(1 + dt * L_k(R_k))``, with
  ``L_k(R) = l1_k max(R, 1)^sigma_k + l0_k``, stays below ``log M``.

A whole model also has *maps* between its updates (docs/theory.md section 6: a stem,
patch merging, a downsampling block, a scaling): ``X' = m(X)`` with
``R' = c_m R^{q_m} + b_m`` and backward factor ``log L_m(R)`` (no ``1 +``, no
``dt``).  A map's factor can be below 1, so the costate bound at every segment
boundary is checked, not only at the input: the backward bound of the first
``D`` segments is ``log Lip(G) + max_{j <= D} sum_{j <= k < D} log F_k``.

The *overflow depth* of a bound is the first depth ``D`` at which it reaches
``M``; the certified depth is one less.

Exactness.  Depth boundaries are decided exactly: the recursions run in
floating point with outward rounding (a rigorous enclosure of the exact value),
and whenever the enclosure straddles ``M`` the computation is redone in
arbitrary precision (mpmath).  Where a closed form is exact (``q = 0``,
``q = 1``, a bounded Jacobian) it is evaluated with enough precision for the
depth, which is a Python ``int`` of any size (fp64 depths exceed ``1e300``).
When a homogeneous recursion would run for more than :data:`MAX_STEPS` steps,
the remaining steps are bounded by the closed forms; the depth is then a sound
lower bound of the exact one, and the result says so (``exact=False``).

This module is pure Python plus mpmath; it does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterable, List, Sequence, Tuple, Union

import mpmath

from ._validation import check_bool, check_int, check_real

__all__ = [
    "DTYPE_MAX",
    "MAX_STEPS",
    "float_max",
    "dtype_name",
    "jacobian_budget",
    "forward_radii",
    "radius_closed_form",
    "backward_log_factors",
    "Overflow",
    "forward_overflow_depth",
    "backward_overflow_depth",
    "UpdateCoefficients",
    "StackScan",
    "scan_stack",
]

Depth = Union[int, float]  # an int, or math.inf when the bound never reaches M

#: Largest finite value of each supported format (exact binary values).
DTYPE_MAX = {
    "fp16": 65504.0,  # (2 - 2^-10) * 2^15
    "bf16": math.ldexp(2 - 2.0**-7, 127),
    "fp32": math.ldexp(2 - 2.0**-23, 127),
    "fp64": 1.7976931348623157e308,  # (2 - 2^-52) * 2^1023
    "fp8_e4m3": 448.0,
    "fp8_e5m2": 57344.0,
    "fp8_e4m3fnuz": 240.0,
    "fp8_e5m2fnuz": 57344.0,
}

_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "fp64": "fp64", "float64": "fp64", "double": "fp64", "f64": "fp64",
    "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
    "fp8_e4m3fnuz": "fp8_e4m3fnuz", "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "fp8_e5m2fnuz": "fp8_e5m2fnuz", "float8_e5m2fnuz": "fp8_e5m2fnuz",
}

#: Steps a homogeneous recursion runs before the closed forms take over.
MAX_STEPS = 20_000

_PREC = 256  # bits for the arbitrary-precision fallback


def dtype_name(dtype: object) -> str:
    """Canonical name (``"fp16"``, ``"bf16"``, ...) of a torch dtype or a name."""
    if isinstance(dtype, str):
        key = dtype.strip().lower()
    else:
        text = str(dtype)  # torch.float16 prints as "torch.float16"; no torch import needed
        if not text.startswith("torch."):
            raise TypeError(f"dtype must be a torch floating dtype or a name, got {dtype!r}")
        key = text[len("torch."):]
    if key.startswith("torch."):
        key = key[len("torch."):]
    try:
        return _ALIASES[key]
    except KeyError:
        allowed = ", ".join(sorted(DTYPE_MAX))
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {allowed} or the matching torch dtypes") from None


def float_max(dtype: object) -> float:
    """Largest finite value ``M`` of a floating-point format (exact).

    Args:
        dtype: a torch floating dtype (``torch.float16``, ``torch.bfloat16``,
            ``torch.float32``, ``torch.float64``, ``torch.float8_e4m3fn``,
            ``torch.float8_e5m2``) or one of the names ``"fp16"``, ``"bf16"``,
            ``"fp32"``, ``"fp64"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` (aliases such
            as ``"float16"`` and ``"bfloat16"`` are accepted).
    """
    return DTYPE_MAX[dtype_name(dtype)]


# ----------------------------------------------------------------------------- validation

def _real(name: str, value: object, *, minimum: float = 0.0, strict: bool = False) -> float:
    """A finite number ``>= minimum`` (``> minimum`` when ``strict``): :func:`certblocks._validation.check_real`."""
    return check_real(name, value, gt=minimum) if strict else check_real(name, value, ge=minimum)


def _depth_arg(depth: object) -> int:
    return check_int("depth", depth)


def _check_run(M: float, dt: float, r0: float, lip_g: float) -> Tuple[float, float, float]:
    dt = _real("dt", dt, strict=True)
    r0 = _real("r0", r0)
    lip_g = _real("lip_g", lip_g, strict=True)
    if r0 >= M:
        raise ValueError(f"r0 must be below the dtype's largest finite value {M:g}, got {r0:g}")
    if lip_g >= M:
        raise ValueError(f"lip_g must be below the dtype's largest finite value {M:g}, got {lip_g:g}")
    return dt, r0, lip_g


# ----------------------------------------------------------------------------- the uniform budget

def jacobian_budget(depth: int, dtype: object, dt: float = 1.0, lip_g: float = 1.0) -> float:
    """The uniform Jacobian budget ``((M / Lip(G))^(1/D) - 1) / dt`` (docs/theory.md section 3).

    A stack of ``depth`` blocks is backward-certified when the Jacobian bound on
    the reachable ball stays strictly below this budget.  With ``Lip(G) = 1``,
    fp32 and ``dt = 1`` it is 39.3 at ``D = 24`` and 1.52 at ``D = 96``.
    """
    depth = _depth_arg(depth)
    M = float_max(dtype)
    dt = _real("dt", dt, strict=True)
    lip_g = _real("lip_g", lip_g, strict=True)
    if lip_g >= M:
        raise ValueError(f"lip_g must be below the dtype's largest finite value {M:g}, got {lip_g:g}")
    return math.expm1(math.log(M / lip_g) / depth) / dt


# ----------------------------------------------------------------------------- outward-rounded floats

_INF = math.inf
_up = lambda x: math.nextafter(x, _INF)  # one ulp up: bounds a correctly rounded op
_dn = lambda x: math.nextafter(x, -_INF)


def _pow(x: float, p: float) -> float:
    if p == 1.0:
        return x
    if p == 0.0:
        return 1.0
    try:
        return x**p
    except OverflowError:
        return _INF


def _pow_up(x: float, p: float) -> float:
    if p == 0.0 or p == 1.0:
        return _pow(x, p)
    return _up(_up(_pow(x, p)))  # libm pow is within one ulp; two ulps is a safe margin


def _pow_dn(x: float, p: float) -> float:
    x = max(x, 0.0)  # a radius rounded down from 0 is -0 or the negative subnormal: its power is 0
    if p == 0.0 or p == 1.0:
        return _pow(x, p)
    return max(0.0, _dn(_dn(_pow(x, p))))


def _log1p_up(x: float) -> float:
    return _up(_up(math.log1p(x))) if x != _INF else _INF


def _log1p_dn(x: float) -> float:
    return max(0.0, _dn(_dn(math.log1p(x)))) if x != _INF else _INF


def _log_up(x: float) -> float:
    return _up(_up(math.log(x))) if x != _INF else _INF


def _log_dn(x: float) -> float:
    return _dn(_dn(math.log(x))) if x != _INF else _INF


@dataclass(frozen=True)
class UpdateCoefficients:
    """The numbers of one residual update that the budgets need.

    ``sigma`` (and ``q``) may be ``None`` when not derived; the scans then stop
    certifying at that update.  ``pq, pc, pb`` bound the update's largest
    intermediate value, ``pc R^pq + pb`` at input radius ``R`` (``pq = None``: no
    intermediate bound, only the state is checked).  ``residual=False`` makes it a
    map: ``R' = c R^q + b`` and backward factor ``log L(R)`` (``dt`` does not apply).
    """

    q: float | None
    sigma: float | None
    c: float = 1.0
    b: float = 0.0
    l1: float = 0.0
    l0: float = 1.0
    pq: float | None = None
    pc: float = 0.0
    pb: float = 0.0
    residual: bool = True

    def __post_init__(self) -> None:
        check_bool("residual", self.residual)
        for name in ("q", "sigma", "pq"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, _real(name, v))
        for name in ("c", "b", "l1", "l0", "pc", "pb"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))


def _step_hi(R: float, u: UpdateCoefficients, dt: float) -> float:
    growth = _up(_up(u.c * _pow_up(R, u.q)) + u.b)  # type: ignore[arg-type]
    return _up(R + _up(dt * growth)) if u.residual else growth


def _step_lo(R: float, u: UpdateCoefficients, dt: float) -> float:
    growth = _dn(_dn(u.c * _pow_dn(R, u.q)) + u.b)  # type: ignore[arg-type]
    return _dn(R + max(0.0, _dn(dt * max(0.0, growth)))) if u.residual else max(0.0, growth)


def _peak_hi(R: float, u: UpdateCoefficients) -> float:
    return _up(_up(u.pc * _pow_up(R, u.pq)) + u.pb)  # type: ignore[arg-type]


def _peak_lo(R: float, u: UpdateCoefficients) -> float:
    return _dn(_dn(u.pc * _pow_dn(R, u.pq)) + u.pb)  # type: ignore[arg-type]


#: A map's Jacobian bound below this is raised to it before the logarithm (a map with ``L = 0`` is constant:
#: its factor would be ``-inf``; the floor keeps the sums finite and only weakens the bound).
_TINY = 2.0**-1000
_LOG_TINY = -1000 * math.log(2.0)


def _factor_hi(R: float, u: UpdateCoefficients, dt: float) -> float:
    L = _up(_up(u.l1 * _pow_up(max(R, 1.0), u.sigma)) + u.l0)  # type: ignore[arg-type]
    if u.residual:
        return _log1p_up(_up(dt * L))
    return _log_up(max(L, _TINY))


def _factor_lo(R: float, u: UpdateCoefficients, dt: float) -> float:
    L = _dn(_dn(u.l1 * _pow_dn(max(R, 1.0), u.sigma)) + u.l0)  # type: ignore[arg-type]
    if u.residual:
        return _log1p_dn(max(0.0, _dn(dt * max(0.0, L))))
    return _log_dn(max(L, _TINY))


# ----------------------------------------------------------------------------- arbitrary precision twins

def _mp(x: float) -> mpmath.mpf:
    return mpmath.mpf(x)


def _step_mp(R, u: UpdateCoefficients, dt):
    Rq = R ** _mp(u.q) if u.q not in (0.0, 1.0) else (R if u.q == 1.0 else mpmath.mpf(1))  # type: ignore[arg-type]
    growth = _mp(u.c) * Rq + _mp(u.b)
    return R + _mp(dt) * growth if u.residual else growth


def _peak_mp(R, u: UpdateCoefficients):
    Rq = R ** _mp(u.pq) if u.pq not in (0.0, 1.0) else (R if u.pq == 1.0 else mpmath.mpf(1))  # type: ignore[arg-type]
    return _mp(u.pc) * Rq + _mp(u.pb)


def _factor_mp(R, u: UpdateCoefficients, dt):
    Rb = max(R, mpmath.mpf(1))
    Rs = Rb ** _mp(u.sigma) if u.sigma != 0.0 else mpmath.mpf(1)  # type: ignore[arg-type]
    L = _mp(u.l1) * Rs + _mp(u.l0)
    if u.residual:
        return mpmath.log1p(_mp(dt) * L)
    return mpmath.log(max(L, _mp(_TINY)))


# ----------------------------------------------------------------------------- finite heterogeneous stacks

@dataclass(frozen=True)
class StackScan:
    """Result of :func:`scan_stack` for a finite stack of ``n`` updates.

    Attributes:
        radii: ``R_0 .. R_n`` (upper bounds in float, ``inf`` past the float range).
        log_factors: ``log(1 + dt * L_k(R_k))`` per update (upper bounds; ``nan``
            where ``sigma`` is not derived).
        forward_overflow: first ``D <= n`` at which the state (``R_D >= M``) or an
            intermediate of update ``D - 1`` (``P(R_{D-1}) >= M``) reaches ``M``, or ``None``.
        backward_overflow: first ``D <= n`` at which the backward bound reaches
            ``M``, or ``None``.
        unknown: index of the first update whose ``q`` or ``sigma`` is not derived, or ``None``.
        forward_intermediate: ``True`` when the forward overflow is an intermediate's.
        output_bound: the head's output bound at ``R_n`` (upper bound; ``nan`` without a head or when a
            segment before it is not derived). ``forward_overflow == n + 1`` when the head's output or
            intermediates reach ``M``.
    """

    radii: Tuple[float, ...]
    log_factors: Tuple[float, ...]
    forward_overflow: int | None
    backward_overflow: int | None
    unknown_q: int | None
    unknown_sigma: int | None
    forward_intermediate: bool = False
    output_bound: float = math.nan


def _log_budget(M: float, lip_g: float) -> Tuple[float, float]:
    """Enclosure of ``log(M / Lip(G))``."""
    x = math.log(M) - math.log(lip_g)
    return _dn(_dn(_dn(x))), _up(_up(_up(x)))


def scan_stack(updates: Sequence[UpdateCoefficients], M: float, *, dt: float = 1.0, r0: float = 1.0,
               lip_g: float = 1.0, head: UpdateCoefficients | None = None) -> StackScan:
    """Run the forward recursion and the layerwise backward sum over a finite chain of segments.

    Crossings of ``M`` are decided exactly (outward-rounded floats, with an
    arbitrary-precision rerun when the enclosure straddles the boundary).

    Args:
        updates: the segments in order (residual updates and maps, see :class:`UpdateCoefficients`).
        M: the dtype's largest finite value.
        dt: the residual step (residual updates only).
        r0: the bound on the first segment's input.
        lip_g: ``Lip(G)``, the bound on the costate at the chain's output.
        head: a map applied to the last state whose output and intermediates must stay below ``M``
            (forward only: its Jacobian is the caller's ``lip_g``).
    """
    if head is not None and head.residual:
        raise ValueError("head must be a map (residual=False)")
    dt, r0, lip_g = _check_run(M, dt, r0, lip_g)
    n = len(updates)
    unknown_q = next((k for k, u in enumerate(updates) if u.q is None), None)
    unknown_sigma = next((k for k, u in enumerate(updates) if u.sigma is None or u.q is None), None)
    b_lo, b_hi = _log_budget(M, lip_g)

    radii: List[float] = [r0]
    factors: List[float] = []
    lo = hi = r0
    s_lo = s_hi = 0.0  # enclosure of sum(log factors)
    m_lo = m_hi = 0.0  # enclosure of the smallest prefix sum (0 unless a factor is below 1)
    fwd: int | None = None
    bwd: int | None = None
    inter = False
    ambiguous = False
    for k, u in enumerate(updates):
        if u.q is None:
            break
        if fwd is None and u.pq is not None:  # the update's intermediates, computed from X_k
            if _peak_lo(lo, u) >= M:
                fwd, inter = k + 1, True
            elif _peak_hi(hi, u) >= M:
                ambiguous = True
                break
        if u.sigma is not None:
            f_hi = _factor_hi(hi, u, dt)
            f_lo = _factor_lo(lo, u, dt)
            factors.append(f_hi)
            s_hi, s_lo = _up(s_hi + f_hi), _dn(s_lo + f_lo)
            m_hi, m_lo = min(m_hi, s_hi), min(m_lo, s_lo)
            if bwd is None and (unknown_sigma is None or k < unknown_sigma):
                # the largest costate bound over the boundaries j <= k + 1: sum of the factors from j to k
                if _dn(s_lo - m_hi) >= b_hi:
                    bwd = k + 1
                elif _up(s_hi - m_lo) >= b_lo:
                    ambiguous = True
        else:
            factors.append(math.nan)
        hi, lo = _step_hi(hi, u, dt), _step_lo(lo, u, dt)
        radii.append(hi)
        if fwd is None:
            if lo >= M:
                fwd = k + 1
            elif hi >= M:
                ambiguous = True
        if ambiguous:
            break
    out_hi = math.nan
    if head is not None and not ambiguous and unknown_q is None and head.q is not None:
        out_hi = _step_hi(hi, head, dt)
        if fwd is None:
            if head.pq is not None and _peak_lo(lo, head) >= M:
                fwd, inter = n + 1, True
            elif _step_lo(lo, head, dt) >= M:
                fwd = n + 1
            elif out_hi >= M or (head.pq is not None and _peak_hi(hi, head) >= M):
                ambiguous = True
    if ambiguous:
        return _scan_stack_mp(updates, M, dt=dt, r0=r0, lip_g=lip_g, unknown_q=unknown_q,
                              unknown_sigma=unknown_sigma, head=head)
    # radii/factors past an unknown q stay undefined
    factors.extend([math.nan] * (n - len(factors)))
    radii.extend([math.inf] * (n + 1 - len(radii)))
    return StackScan(tuple(radii), tuple(factors), fwd, bwd, unknown_q, unknown_sigma, inter, out_hi)


def _scan_stack_mp(updates, M, *, dt, r0, lip_g, unknown_q, unknown_sigma, head=None) -> StackScan:
    n = len(updates)
    with mpmath.workprec(_PREC):
        Mm = _mp(M)
        budget = mpmath.log(Mm) - mpmath.log(_mp(lip_g))
        R = _mp(r0)
        S = mpmath.mpf(0)
        S_min = mpmath.mpf(0)
        radii: List[float] = [r0]
        factors: List[float] = []
        fwd = bwd = None
        inter = False
        for k, u in enumerate(updates):
            if u.q is None:
                break
            if fwd is None and u.pq is not None and _peak_mp(R, u) >= Mm:
                fwd, inter = k + 1, True
            if u.sigma is not None:
                f = _factor_mp(R, u, dt)
                factors.append(_to_float_up(f))
                S += f
                S_min = min(S_min, S)
                if bwd is None and (unknown_sigma is None or k < unknown_sigma) and S - S_min >= budget:
                    bwd = k + 1
            else:
                factors.append(math.nan)
            R = _step_mp(R, u, dt)
            radii.append(_to_float_up(R))
            if fwd is None and R >= Mm:
                fwd = k + 1
        out = math.nan
        if head is not None and unknown_q is None and head.q is not None:
            Y = _step_mp(R, head, dt)
            out = _to_float_up(Y)
            if fwd is None and head.pq is not None and _peak_mp(R, head) >= Mm:
                fwd, inter = n + 1, True
            elif fwd is None and Y >= Mm:
                fwd = n + 1
    factors.extend([math.nan] * (n - len(factors)))
    radii.extend([math.inf] * (n + 1 - len(radii)))
    return StackScan(tuple(radii), tuple(factors), fwd, bwd, unknown_q, unknown_sigma, inter, out)


def _to_float_up(x) -> float:
    try:
        f = float(x)
    except OverflowError:
        return math.inf
    return f if f >= x else _up(f)


def forward_radii(updates: Iterable[Tuple[float, float, float]], *, dt: float = 1.0, r0: float = 1.0) -> List[float]:
    """The forward radius recursion ``R_{k+1} = R_k + dt (c_k R_k^{q_k} + b_k)``.

    Args:
        updates: ``(q, c, b)`` per update, in depth order.
        dt: residual step size.
        r0: radius of the input, ``||X_0|| <= r0``.

    Returns:
        ``[R_0, ..., R_n]`` as floats rounded upward (``inf`` past the float range),
        so each is a rigorous upper bound of the exact recursion.
    """
    dt = _real("dt", dt, strict=True)
    r0 = _real("r0", r0)
    out = [r0]
    R = r0
    for k, (q, c, b) in enumerate(updates):
        u = UpdateCoefficients(q=_real(f"updates[{k}].q", q), sigma=0.0, c=c, b=b)
        R = _step_hi(R, u, dt)
        out.append(R)
    return out


def backward_log_factors(updates: Iterable[Tuple[float, float, float]], radii: Sequence[float], *,
                         dt: float = 1.0) -> List[float]:
    """Layerwise backward factors ``log(1 + dt * (l1 max(R_k, 1)^sigma + l0))``.

    Args:
        updates: ``(sigma, l1, l0)`` per update, in depth order.
        radii: ``R_k`` per update (at least as many as updates).
        dt: residual step size.

    Returns:
        The factors, rounded upward; their sum bounds ``log(||p_0|| / Lip(G))``.
    """
    dt = _real("dt", dt, strict=True)
    out = []
    for k, (sigma, l1, l0) in enumerate(updates):
        u = UpdateCoefficients(q=0.0, sigma=_real(f"updates[{k}].sigma", sigma), l1=l1, l0=l0)
        out.append(_factor_hi(float(radii[k]), u, dt))
    return out


# ----------------------------------------------------------------------------- homogeneous stacks

@dataclass(frozen=True)
class Overflow:
    """An overflow depth: the first depth at which a bound reaches ``M``.

    Attributes:
        depth: the depth (a Python ``int`` of any size), or ``math.inf`` when the
            bound never reaches ``M``.
        exact: ``True`` when ``depth`` is the exact first crossing of the bound;
            ``False`` when closed forms bounded the tail of a very long
            recursion, in which case ``depth`` is a sound lower bound of it.
    """

    depth: Depth
    exact: bool = True


def radius_closed_form(q: float, c: float, b: float, depth: float, *, dt: float = 1.0, r0: float = 1.0) -> float:
    """Closed-form upper bound of ``R_D`` for a homogeneous stack (docs/theory.md section 3).

    * ``q < 1``: ``(rbar0^(1-q) + (1-q)(c+b) D dt)^(1/(1-q))``, ``rbar0 = max(r0, 1)``;
    * ``q = 1``: ``(1 + c dt)^D (r0 + b/c) - b/c`` (exact);
    * ``q > 1``: ``rho exp(C_q q^D)``, ``rho = (c dt)^(-1/(q-1))``,
      ``C_q = log(2^(1/(q-1)) (1 + r0/rho))``; with ``b > 0``, ``c + b`` and ``rbar0``.

    Returns a float (``inf`` past the float range).
    """
    q = _real("q", q)
    c = _real("c", c)
    b = _real("b", b)
    depth = _real("depth", depth)
    dt = _real("dt", dt, strict=True)
    r0 = _real("r0", r0)
    with mpmath.workprec(_PREC):
        val = _closed_form_mp(q, c, b, mpmath.mpf(depth), dt, r0)
        return _to_float_up(val)


def _closed_form_mp(q, c, b, D, dt, r0):
    """Upper bound of R after D steps from radius r0 (mpmath), valid for any q."""
    q, c, b, dt, r0 = (_mp(v) for v in (q, c, b, dt, r0))
    if q == 1:
        if c == 0:
            return r0 + D * dt * b
        y0 = r0 + b / c
        return mpmath.exp(D * mpmath.log1p(c * dt)) * y0 - b / c
    if q == 0:
        return r0 + D * dt * (c + b)
    C = c + b if b > 0 else c
    rb = max(r0, mpmath.mpf(1)) if b > 0 else r0
    if C == 0:
        return rb
    if q < 1:
        rb = max(r0, mpmath.mpf(1))
        C = c + b
        return (rb ** (1 - q) + (1 - q) * C * D * dt) ** (1 / (1 - q))
    # q > 1: the smaller of the paper's form (iii) and the comparison ODE r' = C dt r^q.
    rho = (C * dt) ** (-1 / (q - 1))
    Cq = mpmath.log(mpmath.mpf(2) ** (1 / (q - 1)) * (1 + rb / rho))
    form3 = rho * mpmath.exp(Cq * q**D)
    if rb == 0:
        return form3
    rest = rb ** (1 - q) - (q - 1) * C * dt * D
    if rest <= 0:
        return form3
    return min(form3, rest ** (-1 / (q - 1)))


def _tail_steps_mp(q, c, b, R, dt, M) -> int:
    """Sound lower bound on the number of further steps before R reaches M (closed forms)."""
    with mpmath.workprec(_PREC):
        q, c, b, R, dt, M = (_mp(v) for v in (q, c, b, R, dt, M))
        if q == 1 or q == 0:
            raise AssertionError("exact forms handle q in {0, 1}")
        if q < 1:
            rb = max(R, mpmath.mpf(1))
            x = (M ** (1 - q) - rb ** (1 - q)) / ((1 - q) * (c + b) * dt)
            return max(1, int(mpmath.ceil(x)))
        C = c + b if b > 0 else c
        rb = max(R, mpmath.mpf(1)) if b > 0 else R
        best = 1
        rho = (C * dt) ** (-1 / (q - 1))
        Cq = mpmath.log(mpmath.mpf(2) ** (1 / (q - 1)) * (1 + rb / rho))
        if M > rho and Cq > 0:
            best = max(best, int(mpmath.ceil(mpmath.log(mpmath.log(M / rho) / Cq) / mpmath.log(q))))
        if rb > 0:
            x = (rb ** (1 - q) - M ** (1 - q)) / ((q - 1) * C * dt)
            best = max(best, int(mpmath.ceil(x)))
        return best


def _exact_linear_crossing(start: Fraction, step: Fraction, target: Fraction) -> Depth:
    """First D >= 0 with start + D * step >= target."""
    if start >= target:
        return 0
    if step <= 0:
        return math.inf
    return math.ceil((target - start) / step)


def _exact_geometric_crossing(terms: Callable[[], Tuple[mpmath.mpf, mpmath.mpf, mpmath.mpf]]) -> Depth:
    """First D >= 0 with ``y0 * exp(D * rate) >= target``, decided exactly.

    ``terms()`` returns ``(y0, rate, target)`` evaluated at the current mpmath
    precision; it is re-evaluated with enough bits for the depth before the
    neighbours of the estimate are checked.
    """
    with mpmath.workprec(_PREC):
        y0, rate, target = terms()
        if y0 >= target:
            return 0
        if rate <= 0 or y0 <= 0:
            return math.inf
        guess = int(mpmath.ceil(mpmath.log(target / y0) / rate))
    with mpmath.workprec(_PREC + max(guess, 1).bit_length()):
        y0, rate, target = terms()
        D = max(1, int(mpmath.ceil(mpmath.log(target / y0) / rate)))  # now with bits to spare

        def reaches(D: int) -> bool:
            return y0 * mpmath.exp(D * rate) >= target

        for _ in range(64):  # the estimate is off by at most one: settle it on the exact comparison
            if D > 1 and reaches(D - 1):
                D -= 1
            elif not reaches(D):
                D += 1
            else:
                return D
    raise RuntimeError("geometric crossing did not settle; please report this")


def forward_overflow_depth(q: float, c: float, b: float, dtype: object, *, dt: float = 1.0,
                           r0: float = 1.0, peak: Tuple[float, float, float] | None = None) -> Overflow:
    """First depth at which the forward pass of a homogeneous stack can reach ``M``.

    The stack repeats one block with ``||v(x)|| <= c ||x||^q + b`` without end.
    Without ``peak`` this is the first ``D`` with ``R_D >= M`` (the state).  With
    ``peak = (pq, pc, pb)``, a bound ``pc ||x||^pq + pb`` on every intermediate value
    the block computes from its input ``x``, it is the first ``D`` at which the
    state ``R_D`` or an intermediate of update ``D``, ``P(R_{D-1})``, reaches ``M``.

    Exact for ``q`` in ``{0, 1}`` (closed forms) and whenever the crossing comes
    within :data:`MAX_STEPS` steps; otherwise a sound lower bound (see :class:`Overflow`).
    """
    q = _real("q", q)
    c = _real("c", c)
    b = _real("b", b)
    M = float_max(dtype)
    dt, r0, _ = _check_run(M, dt, r0, 1.0)
    pq = pc = pb = None
    if peak is not None:
        if not isinstance(peak, (tuple, list)) or len(peak) != 3:
            raise TypeError(f"peak must be a tuple (pq, pc, pb) or None, got {peak!r}")
        pq, pc, pb = _real("peak q", peak[0]), _real("peak c", peak[1]), _real("peak b", peak[2])
    u = UpdateCoefficients(q=q, sigma=0.0, c=c, b=b, pq=pq, pc=pc or 0.0, pb=pb or 0.0)
    if q == 0.0 or c == 0.0:  # R_D = r0 + D dt (c [q = 0] + b): linear in D
        inc = Fraction(c if q == 0.0 else 0.0) + Fraction(b)
        state = Overflow(_exact_linear_crossing(Fraction(r0), Fraction(dt) * inc, Fraction(M)))
        radius = _linear_radius(Fraction(r0), Fraction(dt) * inc)
    elif q == 1.0:
        def terms():
            shift = _mp(b) / _mp(c)
            return _mp(r0) + shift, mpmath.log1p(_mp(c) * _mp(dt)), _mp(M) + shift

        state = Overflow(_exact_geometric_crossing(terms))
        radius = _geometric_radius(c, b, dt, r0)
    else:
        return _iterated_forward(u, M, dt, r0)
    if u.pq is None:
        return state
    return _first_overflow(state, _peak_crossing(u, M, radius, state.depth))


def _iterated_forward(u: UpdateCoefficients, M: float, dt: float, r0: float) -> Overflow:
    """:func:`forward_overflow_depth` for ``q`` outside ``{0, 1}``: outward-rounded steps, then closed forms."""
    if u.c == 0.0 and u.b == 0.0 or r0 == 0.0 and u.b == 0.0:  # the state never moves
        if u.pq is None:
            return Overflow(math.inf)
        return Overflow(1 if _peak_reaches(u, M, lambda j: Fraction(r0), 0) else math.inf)
    hi = lo = r0
    for k in range(MAX_STEPS):
        if u.pq is not None:
            if _peak_lo(lo, u) >= M:
                return Overflow(k + 1)
            if _peak_hi(hi, u) >= M:
                return Overflow(_homogeneous_forward_mp(u, M, dt, r0))
        hi, lo = _step_hi(hi, u, dt), _step_lo(lo, u, dt)
        if lo >= M:
            return Overflow(k + 1)
        if hi >= M:
            return Overflow(_homogeneous_forward_mp(u, M, dt, r0))
    tail = _tail_steps_mp(u.q, u.c, u.b, hi, dt, M)
    if u.pq is not None:
        tail = min(tail, _tail_steps_to_peak(u, hi, dt, M) + 1)
    return Overflow(MAX_STEPS + tail, exact=False)


def _peak_threshold_lo(u: UpdateCoefficients, M: float):
    """A lower bound (mpmath) of the radius ``T`` at which ``pc T^pq + pb = M``."""
    with mpmath.workprec(_PREC):
        rest = _mp(M) - _mp(u.pb)
        if rest <= 0:
            return mpmath.mpf(0)
        if u.pc == 0.0 or u.pq == 0.0:
            return mpmath.inf if _mp(u.pc) < rest else mpmath.mpf(0)
        return (rest / _mp(u.pc)) ** (1 / _mp(u.pq)) * (1 - mpmath.mpf(2) ** -200)  # type: ignore[arg-type]


def _tail_steps_to_peak(u: UpdateCoefficients, R: float, dt: float, M: float) -> int:
    """Sound lower bound on the further steps before the radius reaches the peak threshold (0 if unsure)."""
    T = _peak_threshold_lo(u, M)
    if T == mpmath.inf:
        return 2**64  # the intermediates never reach M: any bound past the state's tail will do
    if _mp(R) >= T:
        return 0
    return _tail_steps_mp(u.q, u.c, u.b, R, dt, T)


def _first_overflow(a: Overflow, b: Overflow) -> Overflow:
    """The earlier of two overflows (a lower bound stays a lower bound)."""
    if a.depth < b.depth:
        return a
    if b.depth < a.depth:
        return b
    return Overflow(a.depth, a.exact or b.exact)


def _linear_radius(start: Fraction, step: Fraction) -> Callable[[int], Fraction]:
    return lambda j: start + j * step


def _geometric_radius(c: float, b: float, dt: float, r0: float) -> Callable[[int], mpmath.mpf]:
    """``R_j = (r0 + b/c)(1 + c dt)^j - b/c`` in mpmath at the current precision."""
    def radius(j: int):
        shift = _mp(b) / _mp(c)
        return (_mp(r0) + shift) * mpmath.exp(j * mpmath.log1p(_mp(c) * _mp(dt))) - shift
    return radius


def _peak_reaches(u: UpdateCoefficients, M: float, radius: Callable, j: int) -> bool:
    """Whether ``P(R_j) >= M``: exact in rationals when possible, else with bits to spare for ``j``."""
    with mpmath.workprec(_PREC + max(j, 1).bit_length()):
        R = radius(j)
        if isinstance(R, Fraction) and float(u.pq).is_integer():  # type: ignore[arg-type]
            return Fraction(u.pc) * R ** int(u.pq) + Fraction(u.pb) >= Fraction(M)  # type: ignore[arg-type]
        if isinstance(R, Fraction):
            R = mpmath.mpf(R.numerator) / R.denominator
        return _peak_mp(R, u) >= _mp(M)


def _peak_crossing(u: UpdateCoefficients, M: float, radius: Callable, state_depth: Depth) -> Overflow:
    """First ``D`` with ``P(R_{D-1}) >= M`` when it comes no later than ``state_depth`` (else ``inf``).

    ``P(R_j)`` grows with ``j``, so the first crossing is found by bisection over
    ``j < state_depth`` with the exact comparison of :func:`_peak_reaches`.
    """
    if state_depth == math.inf:  # the radius is constant (r0 = b = 0, or no growth)
        return Overflow(1 if _peak_reaches(u, M, radius, 0) else math.inf)
    hi = int(state_depth) - 1
    if not _peak_reaches(u, M, radius, hi):
        return Overflow(math.inf)
    lo = -1  # invariant: P(R_lo) < M (lo = -1: none yet), P(R_hi) >= M
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _peak_reaches(u, M, radius, mid):
            hi = mid
        else:
            lo = mid
    return Overflow(hi + 1)


def _homogeneous_forward_mp(u: UpdateCoefficients, M: float, dt: float, r0: float) -> int:
    with mpmath.workprec(_PREC):
        R, Mm = _mp(r0), _mp(M)
        for k in range(MAX_STEPS + 1):
            if u.pq is not None and _peak_mp(R, u) >= Mm:
                return k + 1
            R = _step_mp(R, u, dt)
            if R >= Mm:
                return k + 1
    raise RuntimeError("arbitrary-precision rerun did not cross M; please report this")


def backward_overflow_depth(q: float | None, sigma: float | None, c: float, b: float, l1: float, l0: float,
                            dtype: object, *, dt: float = 1.0, r0: float = 1.0, lip_g: float = 1.0) -> Overflow:
    """First depth at which the layerwise backward bound of a homogeneous stack reaches ``M``.

    The bound is ``Lip(G) * prod_{k<D} (1 + dt * L(R_k))`` with
    ``L(R) = l1 max(R, 1)^sigma + l0`` and ``R_k`` the forward radius.  With a
    bounded Jacobian (``sigma = 0`` or ``l1 = 0``) this is
    ``ceil(log(M / Lip(G)) / log(1 + dt L))``, computed exactly.
    """
    M = float_max(dtype)
    q = _real("q", q)
    sigma = _real("sigma", sigma)
    u = UpdateCoefficients(q=q, sigma=sigma, c=c, b=b, l1=l1, l0=l0)
    dt, r0, lip_g = _check_run(M, dt, r0, lip_g)
    if sigma == 0.0 or l1 == 0.0:
        L = (l1 if sigma == 0.0 else 0.0) + l0
        if L == 0.0:
            return Overflow(math.inf)
        def terms():
            return _mp(lip_g), mpmath.log1p(_mp(dt) * _mp(L)), _mp(M)

        return Overflow(_exact_geometric_crossing(terms))
    b_lo, b_hi = _log_budget(M, lip_g)
    hi = lo = r0
    s_hi = s_lo = 0.0
    for k in range(MAX_STEPS):
        s_hi = _up(s_hi + _factor_hi(hi, u, dt))
        s_lo = _dn(s_lo + _factor_lo(lo, u, dt))
        if s_lo >= b_hi:
            return Overflow(k + 1)
        if s_hi >= b_lo:
            return Overflow(_homogeneous_backward_mp(u, M, dt, r0, lip_g))
        hi, lo = _step_hi(hi, u, dt), _step_lo(lo, u, dt)
    return Overflow(_backward_tail(u, hi, s_hi, b_lo, dt), exact=False)


def _homogeneous_backward_mp(u: UpdateCoefficients, M: float, dt: float, r0: float, lip_g: float) -> int:
    with mpmath.workprec(_PREC):
        R = _mp(r0)
        S = mpmath.mpf(0)
        budget = mpmath.log(_mp(M)) - mpmath.log(_mp(lip_g))
        for k in range(MAX_STEPS + 1):
            S += _factor_mp(R, u, dt)
            if S >= budget:
                return k + 1
            R = _step_mp(R, u, dt)
    raise RuntimeError("arbitrary-precision rerun did not cross M; please report this")


_MAX_ROUNDS = 4096


def _backward_tail(u: UpdateCoefficients, R: float, S: float, budget: float, dt: float) -> Depth:
    """Sound lower bound on the backward overflow depth past MAX_STEPS (galloping over closed forms).

    From depth K with radius bound R and log-sum bound S, a block of m further
    updates adds at most m * log(1 + dt L(F(R, m-1))), F the closed-form radius
    bound; take the longest block that keeps the sum below the budget, and repeat.
    """
    K = MAX_STEPS
    with mpmath.workprec(_PREC):
        Rm, Sm, B = _mp(R), _mp(S), _mp(budget)

        def factor(r):
            return _factor_mp(r, u, dt) * (1 + mpmath.mpf(2) ** -200)

        def block(m: int):
            return Sm + m * factor(_closed_form_mp(u.q, u.c, u.b, mpmath.mpf(m - 1), dt, Rm))

        for _ in range(_MAX_ROUNDS):
            if block(1) >= B:
                return K + 1
            m = 1
            while m < 2**4000 and block(2 * m) < B:
                m *= 2
            lo_m, hi_m = m, 2 * m  # block(lo_m) < B <= block(hi_m)
            while hi_m - lo_m > 1:
                mid = (lo_m + hi_m) // 2
                if block(mid) < B:
                    lo_m = mid
                else:
                    hi_m = mid
            Sm = block(lo_m)
            Rm = _closed_form_mp(u.q, u.c, u.b, mpmath.mpf(lo_m), dt, Rm)
            K += lo_m
        return K + 1

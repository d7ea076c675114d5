"""Computed fixes: for a refused chain, the value of each lever that certifies it, verified by recomputing.

A refusal says which segment fails (:class:`~certblocks.failures.Failure`); :func:`compute_fixes` says what
to change, with numbers.  Each :class:`Fix` is one lever at one value, and every value is checked by
certifying the changed chain again with :func:`~certblocks.certify_stack` (same dtype, ``r0``, head and loss
gradient) before it is reported:

* ``depth``: the largest number of residual updates that is certified (the chain cut after that update);
* ``dt``: the largest residual step (the ``"update"`` segments' velocities scaled by ``dt``);
* a block lever (:class:`Lever`), applied to every segment that has it: ``init_values`` (a branch gain
  ``max |gamma|``: every coefficient scales with it, :mod:`certblocks.blocks.gain`) and ``qk_norm_eps`` (the
  QK-norm's ``eps``: the attention's ``l1`` scales like ``1/sqrt(eps)``, :mod:`certblocks.blocks.attention`);
* ``dtype``: the narrowest wider dtype, reported only when it certifies more updates than the chosen one;
* ``enforce``: the cap factor of :func:`certblocks.enforce` (computed by the caller that holds the model).

A continuous lever is solved by bisection on a log scale (the verdict is monotone in each of them: every
bound grows with ``dt``, the gains and ``1/sqrt(eps)``), stopped as soon as the value rounded to two significant
digits in the safe direction is the same at both ends of the bracket, and certified again at the rounded value.
The depth is found by bisection too where the chain is made of residual updates only (:func:`_depth_fix` says
why the verdict is monotone in the length there).  A lever that cannot certify the whole chain (a map or
the head fails whatever its value) is not reported.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from . import budget as _budget
from ._format import fmt_num
from .certificate import BlockCertificate, StackCertificate, certify_stack

__all__ = ["Fix", "Lever", "LEVERS", "compute_fixes", "recertify", "format_fixes"]

#: The levers, in the order fixes are reported.
LEVERS = ("init_values", "dt", "qk_norm_eps", "depth", "enforce", "dtype")

# dtypes by range, narrowest first (a "wider" dtype has a larger largest finite value)
_BY_RANGE = ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "fp32", "fp64")


@dataclass(frozen=True)
class Fix:
    """One lever at one value, and what the chain certifies with it (recomputed).

    Attributes:
        lever: one of :data:`LEVERS`.
        value: the lever's value (an int for ``depth``, a dtype name for ``dtype``, else a float).
        certified_depth: the updates certified with it; ``depth``: the chain's updates with it.
        ok: the changed chain is certified as a whole (head included).
        text: the change in words (``"dt <= 0.043"``).
    """

    lever: str
    value: Any
    certified_depth: int
    depth: int
    ok: bool
    text: str

    def __str__(self) -> str:
        return f"{self.text} (certifies {self.certified_depth}/{self.depth})"

    def to_dict(self) -> Dict[str, Any]:
        return {"lever": self.lever, "value": self.value, "certified_depth": self.certified_depth,
                "depth": self.depth, "ok": self.ok, "text": self.text}


@dataclass(frozen=True)
class Lever:
    """A parameter of a block that its certificate depends on in a known way.

    Attributes:
        name: ``"init_values"`` or ``"qk_norm_eps"``.
        current: the value the block's certificate was computed at.
        larger_certifies: ``True`` when a larger value lowers the bounds (``eps``), ``False`` when a smaller
            one does (a gain).
        apply: ``(certificate at current, value) -> certificate at value``, from the block's own bound formula.
    """

    name: str
    current: float
    larger_certifies: bool
    apply: Callable[[BlockCertificate, float], BlockCertificate]


def recertify(cert: StackCertificate, segments: Optional[Sequence[BlockCertificate]] = None, *,
              dtype: Optional[str] = None, dt: Optional[float] = None) -> StackCertificate:
    """``cert``'s chain certified again, with other segments, dtype or ``dt`` (same ``r0``, head, loss gradient)."""
    segs = cert.updates if segments is None else tuple(segments)
    kw: Dict[str, Any] = dict(dt=cert.dt if dt is None else dt, r0=cert.r0)
    if cert.head is not None:
        return certify_stack(segs, dtype or cert.dtype, head=cert.head, loss_grad=cert.loss_grad, **kw)
    return certify_stack(segs, dtype or cert.dtype, lip_g=cert.lip_g, **kw)


def _round(value: float, down: bool) -> float:
    """``value`` to two significant digits, rounded down (``down``) or up."""
    if value <= 0 or not math.isfinite(value):
        return value
    e = math.floor(math.log10(value)) - 1
    scaled = value / 10.0**e
    r = (math.floor(scaled) if down else math.ceil(scaled)) * 10.0**e
    return float(f"{r:.2g}") if r > 0 else value


def _solve(check: Callable[[float], StackCertificate], current: float, larger: bool, span: float = 1e12
           ) -> Optional[tuple]:
    """The value nearest ``current`` (on the certifying side) whose chain is certified: ``(value, cert)``."""
    far = current * span if larger else current / span
    if not check(far).ok:
        return None
    lo, hi = math.log(current), math.log(far)  # lo fails, hi passes
    for _ in range(64):
        if _round(math.exp(hi), down=not larger) == _round(math.exp(lo), down=not larger):
            break  # the reported (rounded) value is the same wherever the boundary lies in [lo, hi]: decided
        mid = 0.5 * (lo + hi)
        if check(math.exp(mid)).ok:
            hi = mid
        else:
            lo = mid
        if abs(hi - lo) < 1e-9:
            break
    exact = math.exp(hi)
    for value in (_round(exact, down=not larger), exact, math.exp(hi) * (1.0 + 1e-6 if larger else 1.0 - 1e-6)):
        got = check(value)
        if got.ok:
            return value, got
    return None


def _lever_fix(cert: StackCertificate, name: str, levers: Mapping[int, Sequence[Lever]]) -> Optional[Fix]:
    """The value of the block lever ``name`` (the same for every segment that has it) that certifies the chain."""
    own = {k: lv for k, ls in levers.items() for lv in ls if lv.name == name}
    if not own:
        return None
    larger = next(iter(own.values())).larger_certifies
    # a common value: start from the current value least favourable to certification
    currents = [lv.current for lv in own.values()]
    current = min(currents) if larger else max(currents)

    def check(value: float) -> StackCertificate:
        segs = [own[k].apply(u, value) if k in own else u for k, u in enumerate(cert.updates)]
        return recertify(cert, segs)

    found = _solve(check, current, larger)
    if found is None:
        return None
    value, got = found
    text = f"{name} {'>=' if larger else '<='} {fmt_num(value)}"
    return Fix(name, value, got.certified_depth, got.depth, got.ok, text)


def _dt_fix(cert: StackCertificate) -> Optional[Fix]:
    if not any(u.kind == "update" for u in cert.updates):
        return None
    found = _solve(lambda dt: recertify(cert, dt=dt), cert.dt, larger=False)
    if found is None:
        return None
    value, got = found
    return Fix("dt", value, got.certified_depth, got.depth, got.ok, f"dt <= {fmt_num(value)}")


def _depth_fix(cert: StackCertificate) -> Optional[Fix]:
    """The largest number of updates whose chain (cut after that update, head kept) is certified.

    In a chain of residual updates only (kind ``"update"``) the verdict of a prefix is monotone in its length: each
    update keeps or raises the radius (``R_{k+1} = R_k + dt (c R_k^q + b) >= R_k``, docs/theory.md section 6), so a
    longer prefix has the same first radii and forward checks, a head checked at a larger ``R_n`` (its bounds
    grow with the radius), and a backward sum with more factors ``log(1 + dt L_k) >= 0`` and a larger ``Lip(G)``:
    if ``n`` updates are certified, so are ``n - 1``.  The longest certified prefix is then found by bisection
    (``log2 D`` certifications, where the search from the top was ``D``).  A map or a non-identity block can shrink
    the radius or have a factor below 0, so a chain holding one is searched from the top.
    """
    ends = [k for k, u in enumerate(cert.updates) if u.is_update]

    def cut(n: int) -> StackCertificate:
        return recertify(cert, cert.updates[: ends[n - 1] + 1])

    def fix(n: int, got: StackCertificate) -> Fix:
        return Fix("depth", n, got.certified_depth, got.depth, True,
                   f"at most {n} residual update{'s' if n > 1 else ''}")

    if any(u.kind != "update" for u in cert.updates):
        for n in range(len(ends) - 1, 0, -1):
            got = cut(n)
            if got.ok:
                return fix(n, got)
        return None
    if len(ends) < 2:
        return None
    first = cut(1)
    if not first.ok:
        return None
    lo, hi, best = 1, len(ends), first  # cut(lo) is certified; the whole chain (hi updates) is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = cut(mid)
        if got.ok:
            lo, best = mid, got
        else:
            hi = mid
    return fix(lo, best)


def _dtype_fix(cert: StackCertificate) -> Optional[Fix]:
    """The narrowest wider dtype that certifies the chain, else the one that certifies the most updates, and
    only when it certifies more than ``cert``'s dtype."""
    if cert.dtype not in _BY_RANGE:
        return None
    best: Optional[StackCertificate] = None
    for name in _BY_RANGE[_BY_RANGE.index(cert.dtype) + 1:]:
        if _budget.float_max(name) <= cert.max_value:
            continue
        got = recertify(cert, dtype=name)
        if got.ok:
            best = got
            break
        if got.certified_depth > (cert.certified_depth if best is None else best.certified_depth):
            best = got
    if best is None:
        return None
    return Fix("dtype", best.dtype, best.certified_depth, best.depth, best.ok, f"dtype {best.dtype}")


def compute_fixes(cert: StackCertificate, *, levers: Optional[Mapping[int, Sequence[Lever]]] = None,
                  extra: Sequence[Fix] = (), dt: bool = True) -> List[Fix]:
    """The fixes of a refused chain, one per lever that can certify it (empty when ``cert.ok``).

    Args:
        cert: the refused chain.
        levers: block levers per segment index (from the blocks' ``levers()``).
        extra: fixes computed by the caller (``enforce``), kept in :data:`LEVERS` order.
        dt: report the ``dt`` lever (a caller whose model has no step, only gains, turns it off).
    """
    if cert.ok:
        return []
    fixes: List[Optional[Fix]] = []
    levers = levers or {}
    names = sorted({lv.name for ls in levers.values() for lv in ls}, key=lambda n: LEVERS.index(n)
                   if n in LEVERS else len(LEVERS))
    fixes += [_lever_fix(cert, n, levers) for n in names]
    if dt:
        fixes.append(_dt_fix(cert))
    fixes += [_depth_fix(cert), *extra, _dtype_fix(cert)]
    out = [f for f in fixes if f is not None]
    return sorted(out, key=lambda f: LEVERS.index(f.lever) if f.lever in LEVERS else len(LEVERS))


def format_fixes(fixes: Sequence[Fix]) -> str:
    """One line: ``"fixes (each certified again): dt <= 0.043 (certifies 24/24); ..."``, or ``""``."""
    if not fixes:
        return ""
    return "fixes (each certified again): " + "; ".join(str(f) for f in fixes)


def scale_l1(cert: BlockCertificate, factor: float) -> BlockCertificate:
    """``cert`` with ``l1`` times ``factor`` (rounded up)."""
    return dataclasses.replace(cert, l1=cert.l1 * factor * (1.0 + 2.0**-50))

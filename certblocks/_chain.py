"""Certifying a chain: :func:`certify_stack` walks a model's segments (residual updates, maps, its head) through the
forward radius recursion and the layerwise backward bound, and returns the
:class:`~certblocks.certificate.StackCertificate` (docs/theory.md section 6; the classes are in
:mod:`certblocks.certificate`, which re-exports the function).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import mpmath

from . import budget as _budget
from ._format import fmt_num as _fmt_num
from .certificate import BlockCertificate, StackCertificate
from .failures import Failure, head_gradient_failure, locate_failure, suggest_fix
from .peak import Peak
from .precision import Precision, as_precision

__all__ = ["certify_stack"]


def certify_stack(certs: Sequence[BlockCertificate], dtype: object, *, dt: float = 1.0, r0: float = 1.0,
                  lip_g: float | None = None, head: BlockCertificate | None = None,
                  loss_grad: float = 1.0) -> StackCertificate:
    """Certify a finite chain of segments: residual updates, and for a whole model its maps and head.

    Runs the forward radius recursion (``R_{k+1} = R_k + dt (c_k R_k^{q_k} + b_k)`` for an update,
    ``c_k R_k^{q_k} + b_k`` for a map) and the layerwise backward bound over the segments in order
    (docs/theory.md section 6); boundaries are decided exactly (see :mod:`certblocks.budget`).

    Under a mixed precision policy (``"amp-fp16"``, ...; docs/theory.md section 7) each value is checked against the
    ``M`` of the dtype it is held in: a segment's :attr:`BlockCertificate.peaks` each against its dtype, a segment
    whose intermediates' dtypes are not known (a certified block's own certificate) against the policy's narrowest
    dtype with its input counted among them (autocast may cast it), each state against the dtype the segment's
    output is held in (:attr:`BlockCertificate.state_dtype`, else the policy's stream), the head's output likewise;
    the backward bound of the stream's costates against the ``M`` of the policy's gradient dtype.  These crossings
    are decided with outward rounding and an arbitrary-precision rerun where the enclosure straddles ``M``, the
    backward one with its budget rescaled to the widest dtype (a bound within a few ulps of ``M`` is refused).

    Args:
        certs: one :class:`BlockCertificate` per segment, in order (kind ``"update"``, ``"map"`` or
            ``"block"``).
        dtype: a torch dtype, a dtype name or a precision policy (:func:`certblocks.precision.as_precision`:
            ``"amp-fp16"``, ``"amp-bf16"``, ``"fsdp-bf16"``, ``"fp8-e4m3"`` or a
            :class:`~certblocks.precision.Precision`).
        dt: residual step size (scales the velocities of the ``"update"`` segments only).
        r0: bound on the first segment's input (the per-token norm).
        lip_g: the Lipschitz constant of the loss head in the state (default 1); not with ``head``.
        head: the head ``G`` as a map certificate: its output and peak at ``R_n`` must stay below ``M``
            and ``Lip(G)`` is its Jacobian bound at ``R_n`` times ``loss_grad``.
        loss_grad: bound on the loss gradient in the head's output (:data:`cross_entropy_gradient` for
            cross-entropy with mean reduction); only with ``head``.

    Raises:
        TypeError: a segment or the head is not a :class:`BlockCertificate`.
        ValueError: ``lip_g`` given with ``head``, the head is not a map, or an argument is out of range.
    """
    certs = tuple(certs)
    for k, cert in enumerate(certs):
        if not isinstance(cert, BlockCertificate):
            raise TypeError(f"certs[{k}] must be a BlockCertificate, got {type(cert).__name__}")
    prec = as_precision(dtype)
    mixed = not prec.pure
    name = prec.name if mixed else prec.stream_dtype
    M = _budget.float_max(prec.grad_dtype)  # the backward budget's (a pure dtype's M)
    checks = [_peak_checks(c, prec) for c in certs] if mixed else []
    # mixed: the scans run against the widest dtype (its radii, factors and output bound); each value's own M below
    M_scan = max([M, prec.max_value] + [_budget.float_max(ch.state) for ch in checks]) if mixed else M
    coefficients = [c._coefficients() for c in certs]
    loss_grad = _budget._real("loss_grad", loss_grad, strict=True)
    head_u = None
    if head is not None:
        if not isinstance(head, BlockCertificate):
            raise TypeError(f"head must be a BlockCertificate, got {type(head).__name__}")
        if head.kind != "map":
            raise ValueError(f"head must be a map certificate (kind='map'), got kind={head.kind!r}")
        if lip_g is not None:
            raise ValueError("pass lip_g or head, not both: with a head, Lip(G) is its Jacobian bound times loss_grad")
        head_u = head._coefficients()
        if mixed:
            head_u = dataclasses.replace(head_u, pq=None)
        radius = _budget.scan_stack(coefficients, M_scan, dt=dt, r0=r0).radii[-1]
        lip_g = _head_lipschitz(head, radius, loss_grad)
    elif lip_g is None:
        lip_g = loss_grad
    elif loss_grad != 1.0:
        raise ValueError("loss_grad needs a head; without one, pass the whole bound as lip_g")
    # A head whose Lip(G) reaches M overflows the gradient at the output itself, at any depth.
    head_backward = head is not None and lip_g >= M
    scan_lip = 1.0 if head_backward else lip_g
    if mixed:
        if scan_lip >= M:  # the message of a pure dtype's check, with the gradient dtype's M
            raise ValueError(f"lip_g must be below the largest finite value {M:g} of the policy's gradient dtype "
                             f"{prec.grad_dtype}, got {scan_lip:g}")
        scan_lip = _up(_up(scan_lip * (M_scan / M)))  # log(M_scan / scan_lip) <= log(M / lip_g): the same budget
        coefficients = [dataclasses.replace(u, pq=None) for u in coefficients]
    scan = _budget.scan_stack(coefficients, M_scan, dt=dt, r0=r0, lip_g=scan_lip, head=head_u)
    n = len(certs)
    crossing = None
    if mixed:
        head_checks = _peak_checks(head, prec, head=True) if head is not None else None
        crossing = _held_forward(coefficients, checks, head_u, head_checks, dt, r0)
        forward_overflow = None if crossing is None else crossing.segment + 1
    else:
        forward_overflow = scan.forward_overflow
    fwd_seg = n if forward_overflow is None else min(n, forward_overflow - 1)
    bwd_seg = 0 if head_backward else n if scan.backward_overflow is None else scan.backward_overflow - 1
    unknown = scan.unknown_sigma  # first segment with q or sigma not derived
    if unknown is not None:
        bwd_seg = min(bwd_seg, unknown)
        if scan.unknown_q is not None:
            fwd_seg = min(fwd_seg, scan.unknown_q)
    blind = next((k for k, c in enumerate(certs) if c.peak is not None and not c.peak.derived), None)
    if blind is not None:  # an intermediate not bounded: the forward pass is not certified from there on
        fwd_seg = min(fwd_seg, blind)
    cert_seg = min(fwd_seg, bwd_seg)
    head_fails = forward_overflow == n + 1
    head_why = _head_unknown(head)
    backward_scan = dataclasses.replace(scan, forward_overflow=None, forward_intermediate=False) if mixed else scan

    def at(k: int, bwd: int) -> Failure:
        """The failure at segment ``k < n`` (``n``: the head's forward), an unbounded peak named as such."""
        if k < n and k == blind and k != unknown:
            return _unbounded_failure(certs[k], k)
        if crossing is not None and k == crossing.segment and k == fwd_seg and fwd_seg <= bwd and not (
                unknown is not None and k == unknown):
            return _held_failure(crossing, certs, head, prec, dt)
        if mixed:  # what is left is a backward or unknown failure: against the gradient dtype's M
            return locate_failure(certs, prec.grad_dtype, k, backward_scan, unknown, n + 1 if k == bwd else fwd_seg,
                                  bwd, head)
        return locate_failure(certs, name, k, scan, unknown, fwd_seg, bwd, head)

    failure = None
    if head_why is not None:  # a failure before the head comes first; else the head's unknown bound
        if fwd_seg < n:
            failure = at(fwd_seg, n)
        elif not head_backward and bwd_seg < n:
            failure = at(bwd_seg, bwd_seg)
        else:
            assert head is not None
            fix = suggest_fix(head, "unknown") if head.q is None or head.sigma is None else _BOUND_IT
            failure = Failure(n, head.name, "unknown", f"the head '{head.name or 'head'}': {head_why}", fix, "head")
    elif head_backward and (fwd_seg < n or head_fails):  # a forward failure comes first
        failure = at(fwd_seg, n)
    elif head_backward:
        failure = head_gradient_failure(head, n, lip_g, loss_grad, scan.radii[-1], M)  # type: ignore[arg-type]
    elif cert_seg < n or head_fails:
        failure = at(cert_seg, bwd_seg)

    def updates_before(seg: int) -> int:
        return sum(1 for c in certs[:seg] if c.is_update)

    notes = _precision_notes(certs, head, prec) if mixed else ()
    return StackCertificate(certs, name, M, float(dt), float(r0), float(lip_g), scan.radii, scan.log_factors,
                            updates_before(fwd_seg), updates_before(bwd_seg), updates_before(cert_seg), failure,
                            head, loss_grad, scan.output_bound, precision=prec, notes=notes)


# ----------------------------------------------------------------------------- each value against its own dtype

_up = _budget._up
_dn = _budget._dn


def _ratio(bound: float, dtype: str) -> float:
    return bound / _budget.float_max(dtype)


def _with_input(peak: Peak) -> Peak:
    """``max(peak(R), R)`` as one peak, rounded up: a block whose intermediates' dtypes are not known, with its input
    among them (autocast may cast the block's input to the low dtype)."""
    if not peak.derived:
        return peak
    q, c, b = peak.q, peak.c, peak.b
    if q >= 1.0:  # R <= R^q + 1 (q > 1); max(c R + b, R) <= max(c, 1) R + b (q = 1)
        c2, b2, q2 = max(c, 1.0), (b if q == 1.0 else _up(max(b, 1.0))), q
    else:  # R^q <= R + 1 for 0 <= q < 1: c R^q + b <= c R + (c + b)
        c2, b2, q2 = max(c, 1.0), _up(c + b), 1.0
    what = f"{peak.what}, or the segment's input" if peak.what else "the segment's input or an intermediate"
    return Peak(q2, c2, b2, what, peak.lever)


class _Checks(NamedTuple):
    """What a segment holds under a mixed policy: ``(dtype, peak)`` of each group of its values, and the dtype of its
    output state (the head: of its output)."""

    peaks: List[Tuple[str, Peak]]
    state: str
    known: bool  # the dtypes were read under the policy (else: the narrowest dtype stands for every value)


def _peak_checks(cert: BlockCertificate, prec: Precision, *, head: bool = False) -> _Checks:
    """A segment's :class:`_Checks` under a mixed policy: its :attr:`~BlockCertificate.peaks` read under ``prec``, else
    its peak (with its input) against the policy's narrowest dtype; no peak without one.  Its output state in the
    dtype read under ``prec`` (:attr:`~BlockCertificate.state_dtype`), else in the stream's (the head's output: the
    narrowest, it may be a low-dtype matmul's)."""
    read = cert.precision == prec.name and bool(cert.state_dtype)
    state = cert.state_dtype if read else (prec.narrowest if head else prec.stream_dtype)
    held = cert.held_peaks(prec.name)
    if held is not None:
        return _Checks(sorted(held.items(), key=lambda dp: _budget.DTYPE_MAX[dp[0]]), state, True)
    peaks = [] if cert.peak is None else [(prec.narrowest, _with_input(cert.peak))]
    return _Checks(peaks, state, False)


class _Crossing(NamedTuple):
    """The first value that reaches the ``M`` of its dtype (:func:`_held_forward`)."""

    segment: int  # the segment's index (``n``: the head)
    kind: str  # "intermediate", "state" or "output"
    dtype: str
    peak: Optional[Peak]
    bound: float  # the value's bound there (an upper bound)
    radius: float  # the input radius of the segment (an upper bound)


def _held_forward(coefficients: Sequence[_budget.UpdateCoefficients], checks: Sequence[_Checks],
                  head_u: Optional[_budget.UpdateCoefficients], head_checks: Optional[_Checks],
                  dt: float, r0: float) -> Optional[_Crossing]:
    """The first segment at which a value reaches the ``M`` of the dtype it is held in: its intermediates (each dtype's
    peak at the input radius), then its output state; after the last segment the head's intermediates and output.

    Radii are enclosed in outward-rounded floats; where an enclosure straddles ``M`` the radius is recomputed in
    arbitrary precision (mpmath) and the comparison decided there.
    """
    lo = hi = float(r0)

    def exact(j: int) -> Any:
        R = mpmath.mpf(r0)
        for u in coefficients[:j]:
            R = _budget._step_mp(R, u, dt)
        return R

    def reaches(value_lo: float, value_hi: float, M: float, value_mp: Callable[[], Any]) -> bool:
        if value_lo >= M:
            return True
        if value_hi < M:
            return False
        with mpmath.workprec(_budget._PREC):
            return bool(value_mp() >= mpmath.mpf(M))

    def peak_mp(k: int, u: _budget.UpdateCoefficients) -> Any:
        return _budget._peak_mp(exact(k), u)

    def peak_crossing(k: int, group: List[Tuple[str, Peak]]) -> Optional[_Crossing]:
        for d, p in group:
            u = _budget.UpdateCoefficients(0.0, 0.0, pq=p.q, pc=p.c, pb=p.b)
            if reaches(_budget._peak_lo(lo, u), _budget._peak_hi(hi, u), _budget.float_max(d),
                       functools.partial(peak_mp, k, u)):
                return _Crossing(k, "intermediate", d, p, _budget._peak_hi(hi, u), hi)
        return None

    for k, u in enumerate(coefficients):
        if u.q is None:
            return None
        found = peak_crossing(k, checks[k].peaks)
        if found is not None:
            return found
        radius = hi
        hi, lo = _budget._step_hi(hi, u, dt), _budget._step_lo(lo, u, dt)
        d = checks[k].state
        if reaches(lo, hi, _budget.float_max(d), functools.partial(exact, k + 1)):
            return _Crossing(k, "state", d, None, hi, radius)
    n = len(coefficients)
    if head_u is None or head_checks is None or head_u.q is None:
        return None
    found = peak_crossing(n, head_checks.peaks)
    if found is not None:
        return found
    d = head_checks.state
    if reaches(_budget._step_lo(lo, head_u, dt), _budget._step_hi(hi, head_u, dt), _budget.float_max(d),
               lambda: _budget._step_mp(exact(n), head_u, dt)):
        return _Crossing(n, "output", d, None, _budget._step_hi(hi, head_u, dt), hi)
    return None


def _segment_label(k: int, cert: BlockCertificate) -> str:
    what = {"update": "update", "map": "map", "block": "residual block"}[cert.kind]
    return f"{what} {k} ({cert.name or 'unnamed'})"


def _held_failure(c: _Crossing, certs: Sequence[BlockCertificate], head: Optional[BlockCertificate],
                  prec: Precision, dt: float) -> Failure:
    """The failure of a value that reaches the ``M`` of the dtype it is held in under ``prec``: the value (node,
    module, dtype) and a lever."""
    n = len(certs)
    M = _budget.float_max(c.dtype)
    cert = head if c.segment == n else certs[c.segment]
    assert cert is not None
    seg = "head" if c.segment == n else cert.kind
    label = f"the head '{cert.name or 'head'}'" if c.segment == n else _segment_label(c.segment, cert)
    if c.segment == n:
        at = f"at the last state's radius R_{n} = {_fmt_num(c.radius)}: the head is not certified at any depth"
    elif cert.is_update:
        at = (f"at depth {sum(1 for u in certs[:c.segment + 1] if u.is_update)} (input radius R_{c.segment} = "
              f"{_fmt_num(c.radius)})")
    else:
        at = f"at its input radius R_{c.segment} = {_fmt_num(c.radius)} (a map is not certified at any depth)"
    if c.kind == "intermediate":
        assert c.peak is not None
        what, lever = c.peak.named_at(c.radius)
        what = what or f"an intermediate value held in {c.dtype}"
        reason = (f"{what}, in {label}, can reach {c.dtype}'s M = {M:.4g} under {prec.name} {at}: the bound of "
                  f"the {c.dtype} values there is {_fmt_num(c.bound)}")
        fix = lever or (f"keep the ops of {cert.name or 'this segment'} that run in {c.dtype} in a wider dtype "
                               f"(outside autocast), or lower their bound: {suggest_fix(cert, 'intermediate')}")
        return Failure(c.segment, cert.name, "forward", reason, fix, seg)
    if c.kind == "output":
        reason = (f"the output of {label}, held in {c.dtype} under {prec.name}, has the bound {_fmt_num(c.bound)}: it "
                  f"can reach {c.dtype}'s M = {M:.4g} {at}")
        return Failure(c.segment, cert.name, "forward", reason,
                       f"keep the head's last matmul in fp32 (outside autocast), or lower its output bound: "
                       f"{suggest_fix(cert, 'forward')}", seg)
    reason = (f"the state after {label}, held in {c.dtype} (the residual stream under {prec.name}), can reach "
              f"{c.dtype}'s M = {M:.4g} {at}: its bound {_fmt_num(c.bound)}")
    return Failure(c.segment, cert.name, "forward", reason, suggest_fix(cert, "forward"), seg)


def _precision_notes(certs: Sequence[BlockCertificate], head: Optional[BlockCertificate],
                     prec: Precision) -> Tuple[str, ...]:
    """What a mixed-policy certificate assumed: the segments whose intermediates' dtypes are not known."""
    blind = [c.name or f"segment {k}" for k, c in enumerate(certs) if c.peak is not None and not
             _peak_checks(c, prec).known]
    if head is not None and head.peak is not None and not _peak_checks(head, prec, head=True).known:
        blind.append(head.name or "head")
    if not blind:
        return ()
    which = ", ".join(blind[:4]) + (f", ... ({len(blind)} in all)" if len(blind) > 4 else "")
    return (f"{len(blind)} segment(s) ({which}) carry no per-dtype bounds read under {prec.name} (a certified "
            f"block's own certificate, or a graph captured without the policy): their intermediates and their input "
            f"are bounded against {prec.narrowest}'s M = {_budget.float_max(prec.narrowest):.4g}, the narrowest "
            f"dtype the policy holds values in (sound), their output states against the stream's "
            f"{prec.stream_dtype}",)


def _head_unknown(head: BlockCertificate | None) -> str | None:
    """Why the head's bounds are not known (exponents or peak not derived), or ``None``."""
    if head is None:
        return None
    if head.q is None or head.sigma is None:
        missing = "q and sigma" if head.q is None and head.sigma is None else ("q" if head.q is None else "sigma")
        culprit = f", culprit: {head.culprit}" if head.culprit else ""
        return f"{head.exponents}{culprit} has {missing} not derived: its output bound and Lip(G) are unknown"
    if head.peak is not None and not head.peak.derived:
        return f"its intermediates are not bounded: {head.peak.what or 'peak not derived'}"
    return None


def _unbounded_failure(cert: BlockCertificate, k: int) -> Failure:
    """Segment ``k`` states an :meth:`~Peak.unbounded` peak: the failure names the value it does not bound."""
    assert cert.peak is not None
    what = {"update": "update", "map": "map", "block": "residual block"}[cert.kind]
    reason = (f"{what} {k} ({cert.name or 'unnamed'}) with {cert.exponents} leaves a value unbounded: "
              f"{cert.peak.what or 'peak not derived'}")
    return Failure(k, cert.name, "unknown", reason, _BOUND_IT, cert.kind)


_BOUND_IT = ("bound that value: a rule or an atom for the op that makes it, or a model that does not compute or "
             "read it (the model certificate's notes say where it comes from)")


def _head_lipschitz(head: BlockCertificate, radius: float, loss_grad: float) -> float:
    """``Lip(G)``: the head's Jacobian bound at ``radius`` times ``loss_grad``, rounded up; clamped into the
    positive floats (a constant head has a zero bound; an unbounded one the largest float)."""
    j = head.jacobian_bound(radius) if math.isfinite(radius) else math.inf
    v = j * loss_grad
    v = math.nextafter(v, math.inf) if math.isfinite(v) else sys.float_info.max
    return min(max(v, sys.float_info.min), sys.float_info.max)

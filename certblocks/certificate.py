"""Certificates: a block's exponents and coefficients, and the depths they certify.

* :class:`BlockCertificate` -- one residual velocity ``v``: exponents ``(q, sigma)``
  and coefficients with ``||v(x)|| <= c ||x||^q + b`` and
  ``sup_{||x|| <= R} ||dv(x)|| <= l1 max(R, 1)^sigma + l0``; optionally a
  :class:`Peak`, the bound on the largest value the block computes on the way.
* :class:`Depths` -- the certified depths of a homogeneous stack of one block.
* :class:`StackCertificate` -- a finite chain of segments, residual updates and
  maps, from a model's input to its head (:func:`certify_stack`, which walks the chain: in
  :mod:`certblocks._chain`, re-exported here).

All three render as text (``str``/``explain``) and JSON (``to_dict``/``to_json``).  Where a chain
fails and the fix in words live in :mod:`certblocks.failures` (re-exported here).

A chain is certified for a dtype or a precision policy (:mod:`certblocks.precision`, docs/theory.md section 7):
under a mixed policy each value is checked against the ``M`` of the dtype it is held in
(:attr:`BlockCertificate.peaks`, read from the graph captured under the policy).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import budget as _budget
from ._format import fmt_num as _fmt_num
from ._format import render_table
from ._validation import check_choice

if TYPE_CHECKING:
    from .fixes import Fix
from ._format import json_number
from .exponents import Exponents
from .failures import Failure, suggest_fix
from .peak import Peak
from .precision import Precision

__all__ = ["BlockCertificate", "Depths", "Failure", "KINDS", "Peak", "StackCertificate", "certify_stack",
           "cross_entropy_gradient", "json_number", "suggest_fix"]

#: Segment kinds of a chain (docs/theory.md section 6): ``"update"`` is ``X' = X + dt v(X)``; ``"map"`` is
#: ``X' = m(X)`` (a stem, patch merging, a scaling: not counted in the depth, ``dt`` does not apply);
#: ``"block"`` is a residual block whose shortcut is not the identity (a projection shortcut ``P x + f(x)``,
#: parallel branches ``x + f(x) + g(x)``), certified as one map of its input and counted as an update.
KINDS = ("update", "map", "block")

#: Bound on the gradient of the cross-entropy loss in the logits (mean reduction): ``softmax(z) - e_t`` has
#: Euclidean norm at most ``sqrt(2)`` per token, and the mean over ``n`` tokens divides it by ``n``.
cross_entropy_gradient = math.sqrt(2.0)

Depth = Union[int, float]


@dataclass(frozen=True)
class BlockCertificate:
    """The certificate of one residual velocity ``v`` (one update of a stack), or of a map.

    Args:
        q: forward growth exponent, or ``None`` when not derived.
        sigma: Jacobian growth exponent, or ``None`` when not derived.
        c: growth coefficient, ``||v(x)|| <= c ||x||^q + b`` for every ``x``.
        b: growth offset.
        l1: Jacobian coefficient, ``sup_{||x||<=R} ||dv(x)||_2 <= l1 max(R,1)^sigma + l0``.
        l0: Jacobian offset.
        name: a label (module path or block name) used in reports.
        culprit: the primitive responsible for the exponents, when known (reports).
        fix: a suggestion in words for lowering the exponents (reports); when
            empty, :func:`suggest_fix` writes one from the exponents.
        peak: bound on the largest intermediate value (:class:`Peak`), or ``None``
            when the block states none: then only the state is checked, and a
            :class:`StackCertificate` lists the segment under ``unchecked``
            (every shipped block and every traced certificate states one; a
            :class:`~certblocks.trace.ModelCertificate` refuses a segment without).
            :meth:`Peak.unbounded` when a bound is not derived: the chain is
            not certified.
        kind: ``"update"`` (default; ``X' = X + dt v(X)``), ``"map"`` (``X' = v(X)``: the growth and
            Jacobian bounds are the map's own, its backward factor is ``L(R)`` without ``1 +``) or
            ``"block"`` (a residual block with a non-identity shortcut certified as one map, counted
            as an update); see :data:`KINDS`.
        peaks: the peak of the values held in each dtype (``{"fp16": Peak, "fp32": Peak}``: each the fold over the
            values held in that dtype, naming the one that sets it) under the policy :attr:`precision`, read from the
            graph captured under it (docs/theory.md section 7); ``None``: the dtypes of the intermediates are not
            known (a certified block's own certificate).  :attr:`peak` stays the bound over all of them.  They hold
            for the :attr:`peak` they were derived with: a copy whose ``peak`` was replaced (a gain, a cap) drops
            them (:meth:`held_peaks` gives ``None``) and is bounded as a block of unknown dtypes.
        precision: the name of the policy :attr:`peaks` and :attr:`state_dtype` were read under (``""``: none).
        state_dtype: the dtype the segment's output state (for an update: ``x + dt v(x)``; for the head: its output)
            is held in under :attr:`precision` (``""``: not known: the policy's stream dtype is taken).

    All coefficients are sound upper bounds in the per-token norm (docs/theory.md section 1).
    """

    q: float | None
    sigma: float | None
    c: float = 1.0
    b: float = 0.0
    l1: float = 0.0
    l0: float = 1.0
    name: str = ""
    culprit: str = ""
    fix: str = ""
    peak: Peak | None = None
    kind: str = "update"
    peaks: Optional[Mapping[str, Peak]] = field(default=None, hash=False)
    precision: str = ""
    state_dtype: str = ""
    peaks_of: Peak | None = field(default=None, repr=False, compare=False, hash=False)  # the peak `peaks` go with

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, KINDS)
        if self.peak is not None and not isinstance(self.peak, Peak):
            raise TypeError(f"peak must be a Peak or None, got {type(self.peak).__name__}")
        if self.peaks is not None:
            if not isinstance(self.peaks, Mapping):
                raise TypeError(f"peaks must be a mapping dtype -> Peak or None, got {type(self.peaks).__name__}")
            held: Dict[str, Peak] = {}
            for d, p in self.peaks.items():
                if not isinstance(p, Peak):
                    raise TypeError(f"peaks[{d!r}] must be a Peak, got {type(p).__name__}")
                held[_budget.dtype_name(d)] = p
            object.__setattr__(self, "peaks", held)  # a copy (a plain dict: certificates are pickled and copied)
            if self.peaks_of is None:
                object.__setattr__(self, "peaks_of", self.peak)
        if self.state_dtype:
            object.__setattr__(self, "state_dtype", _budget.dtype_name(self.state_dtype))
        e = Exponents(self.q, self.sigma)  # validates q and sigma
        object.__setattr__(self, "q", e.q)
        object.__setattr__(self, "sigma", e.sigma)
        for name in ("c", "b", "l1", "l0"):
            object.__setattr__(self, name, _budget._real(name, getattr(self, name)))
        for name in ("name", "culprit", "fix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")

    @property
    def exponents(self) -> Exponents:
        """The pair ``(q, sigma)``."""
        return Exponents(self.q, self.sigma)

    @property
    def is_update(self) -> bool:
        """True for a residual update or block (counted in a stack's depth), False for a map."""
        return self.kind != "map"

    def growth_bound(self, radius: float) -> float:
        """``c * radius^q + b``: the bound on ``||v(x)||`` for ``||x|| = radius``."""
        if self.q is None:
            return math.inf
        return self.c * radius**self.q + self.b

    def jacobian_bound(self, radius: float) -> float:
        """``l1 * max(radius, 1)^sigma + l0``: the bound on the Jacobian over the ball."""
        if self.sigma is None:
            return math.inf
        return self.l1 * max(radius, 1.0) ** self.sigma + self.l0

    def peak_bound(self, radius: float) -> float | None:
        """The bound on the block's largest intermediate at input radius ``radius`` (``None``: no peak)."""
        return None if self.peak is None else self.peak.bound(radius)

    def held_peaks(self, precision: str) -> Optional[Dict[str, Peak]]:
        """:attr:`peaks` when they were read under the policy named ``precision`` and still go with :attr:`peak`,
        else ``None`` (the dtypes of the intermediates are not known for that policy)."""
        if self.peaks is None or self.precision != precision or self.peak != self.peaks_of:
            return None
        return dict(self.peaks)

    def with_output_scaled(self, factor: float, scale: Callable[[float], float], name: str = "") -> BlockCertificate:
        """The certificate of ``s * v`` for ``v`` certified here and ``|s| <= factor`` entrywise: ``c, b, l1, l0``
        mapped by ``scale`` (``x -> factor * x`` rounded up); for ``factor > 1`` the peak, and each dtype's peak of
        :attr:`peaks` when they go with it, also bounds the scaled output ``factor (c R^q + b)`` (which dtype holds
        that product is not known here: it is folded into every one).  ``factor <= 1``: the peaks already bound it.
        """
        from .bounds.poly import fold_peak, power_terms

        peak, held = self.peak, self.held_peaks(self.precision) if self.peaks is not None else None
        extra: Dict[str, Any] = {}
        if peak is not None and factor > 1.0:
            if self.q is None:  # the scaled output's bound has no exponent to fold with
                peak = Peak.unbounded(f"{peak.what}, scaled by {factor:g}: the certificate's exponent is not derived")
                out = None
            else:
                out = power_terms(self.q, scale(self.c), scale(self.b))

            def fold(p: Peak) -> Peak:
                if out is None or not p.derived:
                    return p if not p.derived else Peak.unbounded(f"{p.what}, scaled by {factor:g}")
                return dataclasses.replace(fold_peak([power_terms(p.q, p.c, p.b), out], p.what), lever=p.lever)

            if out is not None:
                peak = fold(peak)
            if held is not None:
                extra = {"peaks": {d: fold(p) for d, p in held.items()}, "peaks_of": peak}
        return dataclasses.replace(self, c=scale(self.c), b=scale(self.b), l1=scale(self.l1), l0=scale(self.l0),
                                   peak=peak, name=name or self.name, **extra)

    def _coefficients(self) -> _budget.UpdateCoefficients:
        p = self.peak
        return _budget.UpdateCoefficients(self.q, self.sigma, self.c, self.b, self.l1, self.l0,
                                          None if p is None else p.q, 0.0 if p is None else p.c,
                                          0.0 if p is None else p.b, residual=self.kind == "update")

    def depths(self, dtype: object, *, dt: float = 1.0, r0: float = 1.0, lip_g: float = 1.0) -> Depths:
        """Certified depths of a stack repeating this block without end.

        Args:
            dtype: torch dtype or name (``"fp16"``, ``"bf16"``, ``"fp32"``, ...).
            dt: residual step size.
            r0: bound on the input's norm, ``||X_0|| <= r0``.
            lip_g: Lipschitz constant of the loss head in the state.

        Raises:
            ValueError: the certificate is a map or a block (a chain of them is certified by
                :func:`certify_stack`, not repeated without end).
        """
        if self.kind != "update":
            raise ValueError(f"depths() repeats a residual update without end; {self.name or 'this'} is a "
                             f"{self.kind}: certify the model's chain with certify_stack")
        name = _budget.dtype_name(dtype)
        M = _budget.float_max(name)
        fwd = bwd = None
        if self.q is not None:
            peak = None if self.peak is None else (self.peak.q, self.peak.c, self.peak.b)
            fwd = _budget.forward_overflow_depth(self.q, self.c, self.b, name, dt=dt, r0=r0, peak=peak)
            if self.sigma is not None:
                bwd = _budget.backward_overflow_depth(self.q, self.sigma, self.c, self.b, self.l1, self.l0, name,
                                                      dt=dt, r0=r0, lip_g=lip_g)
        else:
            _budget._check_run(M, dt, r0, lip_g)
        return Depths.from_overflow(name, M, fwd, bwd)

    def to_dict(self) -> Dict[str, Any]:
        out = {"name": self.name, "kind": self.kind, "q": self.q, "sigma": self.sigma, "c": self.c, "b": self.b,
               "l1": self.l1, "l0": self.l0, "culprit": self.culprit, "fix": self.fix,
               "peak": None if self.peak is None else self.peak.to_dict()}
        if self.peaks is not None:
            out.update(peaks={d: p.to_dict() for d, p in self.peaks.items()}, precision=self.precision,
                       state_dtype=self.state_dtype)
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        label = (f"{self.name}: " if self.name else "") + ("" if self.kind == "update" else f"{self.kind} ")
        growth = f"||v(x)|| <= {_fmt_num(self.c)} ||x||^{_fmt_num(self.q)} + {_fmt_num(self.b)}"
        peak = "" if self.peak is None else f", {self.peak}"
        return (f"{label}{self.exponents}, {growth}, "
                f"L(R) <= {_fmt_num(self.l1)} R^{_fmt_num(self.sigma)} + {_fmt_num(self.l0)}{peak}")


@dataclass(frozen=True)
class Depths:
    """Certified depths of a homogeneous stack for one dtype.

    Attributes:
        dtype: canonical dtype name.
        max_value: the dtype's largest finite value ``M``.
        forward: ``D_F``, the largest depth whose forward bound (the state and, for a
            block with a :class:`Peak`, its intermediates) stays below ``M``.
        backward: ``D_grad``, the largest depth whose backward bound stays below ``M``.
        certified: ``min(D_F, D_grad)``.
        forward_overflow: ``D_F + 1``, the first depth at which the forward bound reaches ``M``.
        backward_overflow: ``D_grad + 1``.
        exact: ``False`` when a depth is a sound lower bound obtained from closed
            forms (very long recursions) rather than the exact crossing.

    Depths are Python ints of any size, ``math.inf`` when a bound never reaches
    ``M``, and ``None`` when an exponent is not derived.
    """

    dtype: str
    max_value: float
    forward: Depth | None
    backward: Depth | None
    certified: Depth | None
    forward_overflow: Depth | None
    backward_overflow: Depth | None
    exact: bool = True

    @classmethod
    def from_overflow(cls, dtype: str, M: float, fwd: _budget.Overflow | None,
                      bwd: _budget.Overflow | None) -> Depths:
        f = None if fwd is None else fwd.depth - 1
        g = None if bwd is None else bwd.depth - 1
        cert = None if f is None or g is None else min(f, g)
        exact = all(o.exact for o in (fwd, bwd) if o is not None)
        return cls(dtype, M, f, g, cert, None if fwd is None else fwd.depth, None if bwd is None else bwd.depth, exact)

    def to_dict(self) -> Dict[str, Any]:
        return {k: json_number(getattr(self, k)) for k in
                ("dtype", "max_value", "forward", "backward", "certified", "forward_overflow", "backward_overflow",
                 "exact")}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        tag = "" if self.exact else " (lower bounds)"
        return (f"{self.dtype}: D_F={_fmt_num(self.forward)}, D_grad={_fmt_num(self.backward)}, "
                f"D_cert={_fmt_num(self.certified)}{tag}")

@dataclass(frozen=True)
class StackCertificate:
    """Certificate of a finite chain of segments (:func:`certify_stack`).

    A plain stack is a chain of residual updates; a whole model adds maps (its stem, patch merging,
    downsampling) and a head (docs/theory.md section 6).

    Attributes:
        updates: the segments' certificates in order (residual updates, blocks and maps).
        dtype: canonical dtype name; ``max_value`` its ``M``.
        dt: the residual step; ``r0`` the bound on the first segment's input.
        lip_g: ``Lip(G)``, the bound on the costate at the last state: the given number, or with a
            ``head`` its Jacobian bound at ``R_n`` times ``loss_grad``.
        radii: ``R_0 .. R_n`` (upper bounds), one per segment boundary.
        log_factors: the backward factor per segment (upper bounds): ``log(1 + dt L_k(R_k))`` for an
            update, ``log L_k(R_k)`` for a map or block.
        forward_depth: the number of residual updates (kinds ``"update"`` and ``"block"``) before the
            first segment at which the forward bound (state or intermediates) reaches ``M``.
        backward_depth: likewise for the backward bound.
        certified_depth: ``min(forward_depth, backward_depth)``, also stopping at a segment whose
            exponents are not derived.
        first_failure: where certification fails, or ``None`` when ``ok``.
        head: the head's certificate (a map), or ``None``.
        loss_grad: the bound on the loss gradient in the head's output (1 without a loss).
        output_bound: the head's output bound at ``R_n`` (``nan`` without a head).
        scope: what the chain does not cover, in words (``""``: nothing; e.g. a converted model certified without
            a batch: its blocks as velocities of their own inputs, not the modules around them).
        precision: the :class:`~certblocks.precision.Precision` the chain is certified for (``dtype`` is its name;
            for a pure policy, the dtype's canonical name).  Under a mixed policy (docs/theory.md section 7) every
            value is checked against the ``M`` of the dtype it is held in (a segment's :attr:`BlockCertificate.peaks`,
            else the policy's narrowest dtype), each state against its dtype's (the stream's), and the backward
            bound of the stream's costates against the ``M`` of the policy's gradient dtype (``max_value``): an
            unscaled step, a safe loss scale ``>= 1`` for them.
        max_loss_scale: the largest static loss scale with which no gradient held in fp16 can overflow, for a
            chain read from its graph (:meth:`certblocks.trace.ModelCertificate.stack` under pure fp16 or amp-fp16:
            every gradient of the graph bounded, :mod:`certblocks.trace.backward`); certified then means
            forward-safe and ``max_loss_scale >= 1``.  ``None``: not computed (a chain of blocks' own certificates,
            whose intermediates' gradients are not bounded: only the stream's costates are checked).
        notes: what the certificate assumed under its policy, in words (segments whose intermediates' dtypes are
            not known and were bounded against the narrowest dtype).
    """

    updates: Tuple[BlockCertificate, ...]
    dtype: str
    max_value: float
    dt: float
    r0: float
    lip_g: float
    radii: Tuple[float, ...]
    log_factors: Tuple[float, ...]
    forward_depth: int
    backward_depth: int
    certified_depth: int
    first_failure: Failure | None = field(default=None)
    head: BlockCertificate | None = None
    loss_grad: float = 1.0
    output_bound: float = math.nan
    scope: str = ""
    precision: Optional[Precision] = None
    max_loss_scale: Optional[float] = None
    notes: Tuple[str, ...] = ()

    @property
    def depth(self) -> int:
        """The number of residual updates in the chain (maps are not counted)."""
        return sum(1 for u in self.updates if u.is_update)

    @property
    def state_max_value(self) -> float:
        """``M`` of the residual stream's dtype (the policy's; ``max_value`` for a pure dtype)."""
        return self.max_value if self.precision is None else _budget.float_max(self.precision.stream_dtype)

    @property
    def ok(self) -> bool:
        """True when the whole chain (head included) is certified for its dtype."""
        return self.first_failure is None

    @property
    def log_gradient_bound(self) -> float:
        """Upper bound of ``log(||p_0|| / Lip(G))``: the sum of the segments' factors (``inf`` when a factor is not
        derived: an unknown factor is not 0)."""
        if any(math.isnan(f) for f in self.log_factors):
            return math.inf
        return math.fsum(self.log_factors)

    @property
    def unchecked(self) -> List[int]:
        """The segments that state no peak (``peak=None``, certificates built by hand): only their state is
        bounded, not the intermediates they compute.  ``len(updates)`` stands for the head."""
        out = [k for k, u in enumerate(self.updates) if u.peak is None]
        return out + ([len(self.updates)] if self.head is not None and self.head.peak is None else [])

    def in_dtype(self, dtype: object) -> StackCertificate:
        """The same chain (segments, head, loss gradient, ``dt``, ``r0``) certified for another dtype or precision
        policy (:func:`certblocks.precision.as_precision`)."""
        if self.head is not None:
            return certify_stack(self.updates, dtype, dt=self.dt, r0=self.r0, head=self.head,
                                 loss_grad=self.loss_grad)
        return certify_stack(self.updates, dtype, dt=self.dt, r0=self.r0, lip_g=self.lip_g)

    def fixes(self) -> List[Fix]:
        """For a refused chain, the value of each generic lever that certifies it, each certified again: the
        largest depth, the largest ``dt`` and a wider dtype when it certifies more (:mod:`certblocks.fixes`;
        a model adds its blocks' levers: ``ZooModel.fixes()``, ``CertifiedStack.fixes()``).  Empty when ``ok``.

        Computed on the first call and kept: the certificate is frozen, so its fixes never change (a new list each
        call)."""
        cached = self.__dict__.get("_fixes")
        if cached is None:
            from .fixes import compute_fixes

            cached = tuple(compute_fixes(self))
            self.__dict__["_fixes"] = cached  # frozen dataclass: the cache bypasses __setattr__, not the fields
        return list(cached)

    def _fixes_of(self, fixes: Union[bool, Sequence[Fix]]) -> List[Fix]:
        """The fixes an ``explain`` / ``to_dict`` was asked for: none, this chain's own, or the given ones."""
        if isinstance(fixes, bool):
            return self.fixes() if fixes and not self.ok else []
        if isinstance(fixes, (str, bytes)) or not isinstance(fixes, Sequence):
            raise TypeError(f"fixes must be a bool or a sequence of Fix, got {type(fixes).__name__}")
        return list(fixes)

    def to_dict(self, *, fixes: Union[bool, Sequence[Fix]] = False) -> Dict[str, Any]:
        """The certificate as JSON-ready data.

        Args:
            fixes: ``True`` adds the chain's computed fixes under ``"fixes"`` (:meth:`fixes`: each a certification
                again, computed once); a sequence of :class:`~certblocks.fixes.Fix` adds those (a model's own:
                ``as_certified(model).fixes(dtype)``); ``False`` (default) leaves the key out, computing nothing.
        """
        out = {
            "dtype": self.dtype, "max_value": self.max_value, "dt": self.dt, "r0": self.r0, "lip_g": self.lip_g,
            "depth": self.depth, "ok": self.ok, "forward_depth": self.forward_depth,
            "backward_depth": self.backward_depth, "certified_depth": self.certified_depth,
            "first_failure": None if self.first_failure is None else self.first_failure.to_dict(),
            "updates": [
                {**u.to_dict(), "radius_in": json_number(self.radii[k]), "log_factor": json_number(self.log_factors[k])}
                for k, u in enumerate(self.updates)
            ],
            "radius_out": json_number(self.radii[-1]),
            "head": None if self.head is None else self.head.to_dict(),
            "loss_grad": self.loss_grad, "output_bound": json_number(self.output_bound),
            "unchecked": self.unchecked, "scope": self.scope,
        }
        if self.precision is not None and not self.precision.pure:
            out.update(precision=self.precision.to_dict(), max_loss_scale=json_number(self.max_loss_scale),
                       state_max_value=self.state_max_value, notes=list(self.notes))
        if fixes is not False:
            out["fixes"] = [f.to_dict() for f in self._fixes_of(fixes)]
        return out

    def to_json(self, *, fixes: Union[bool, Sequence[Fix]] = False, **kwargs: Any) -> str:
        """:meth:`to_dict` as a JSON string (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(fixes=fixes), **kwargs)

    def explain(self, *, fixes: Union[bool, Sequence[Fix]] = False) -> str:
        """A readable table: one row per segment, then the head and the verdict.

        Args:
            fixes: ``True`` adds, for a refused chain, the line of computed fixes (:meth:`fixes`: each lever's value
                certified again); a sequence of :class:`~certblocks.fixes.Fix` adds those (a model's own:
                ``as_certified(model).fixes(dtype)``, which knows its blocks' levers); ``False`` (default) computes
                none and says how to get them.
        """
        log_budget = math.log(self.max_value) - math.log(self.lip_g)
        maps = len(self.updates) - self.depth
        what = f"{self.depth} updates" + (f" and {maps} maps" if maps else "")
        kind = "stack" if not maps and self.head is None else "chain"
        mixed = self.precision is not None and not self.precision.pure
        held = (f"{self.dtype} (stream {self.precision.stream_dtype}, M = {self.state_max_value:.4g}; gradients "
                f"{self.precision.grad_dtype}, M = {self.max_value:.4g})" if mixed and self.precision is not None
                else f"{self.dtype} (M = {self.max_value:.4g})")
        head = (f"{kind} of {what}, {held}, dt = {self.dt:g}, "
                f"r0 = {self.r0:g}, Lip(G) = {self.lip_g:.4g}; backward budget log(M/Lip G) = {log_budget:.4g}")
        cols = ("k", "segment", "kind", "(q, sigma)", "c", "b", "l1", "l0", "R_k", "peak P_k(R_k)", "log factor",
                "cum. log")
        rows = []
        cum = 0.0
        for k, u in enumerate(self.updates):
            f = self.log_factors[k]
            cum = cum + f if not math.isnan(f) else math.nan
            rows.append((str(k), u.name or "-", u.kind, f"({_fmt_num(u.q)}, {_fmt_num(u.sigma)})", _fmt_num(u.c),
                         _fmt_num(u.b), _fmt_num(u.l1), _fmt_num(u.l0), _fmt_num(self.radii[k]),
                         self._peak_cell(u, self.radii[k]), _fmt_num(f), _fmt_num(cum)))
        if self.head is not None:
            h = self.head
            rows.append(("G", h.name or "head", "head", f"({_fmt_num(h.q)}, {_fmt_num(h.sigma)})", _fmt_num(h.c),
                         _fmt_num(h.b), _fmt_num(h.l1), _fmt_num(h.l0), _fmt_num(self.radii[-1]),
                         self._peak_cell(h, self.radii[-1]), _fmt_num(math.log(self.lip_g)), "-"))
        out = [head, render_table(cols, rows, align="rll" + "r" * (len(cols) - 3))]  # names and kinds left
        out.append(f"R_{len(self.updates)} = {_fmt_num(self.radii[-1])}"
                   + ("" if self.head is None else f", head output <= {_fmt_num(self.output_bound)}"))
        if self.unchecked:
            names = ["G" if k == len(self.updates) else str(k) for k in self.unchecked]
            which = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            out.append(f"not checked: segment(s) {which} state no peak: only their state is bounded, not their "
                       "intermediates")
        if self.scope:
            out.append(f"scope: {self.scope}")
        if mixed and self.precision is not None:
            out.append(f"precision: {self.precision.describe()}")
            out += [f"note: {note}" for note in self.notes]
            if self.max_loss_scale is None:
                out.append(f"loss scale: not computed in this version (the stream's costates are checked against "
                           f"{self.precision.grad_dtype}'s M: a safe scale >= 1 for them)")
            else:
                scaler = self.precision.loss_scale
                above = (f"; the GradScaler's initial scale {scaler:g} is above it: it skips steps until it comes "
                         "down" if scaler is not None and scaler > self.max_loss_scale else "")
                out.append(f"largest safe static loss scale: {self.max_loss_scale:.4g}{above}")
        elif self.max_loss_scale is not None:
            out.append(f"largest safe static loss scale: {self.max_loss_scale:.4g} (the gradients held in fp16)")
        if self.ok:
            out.append(f"certified: all {self.depth} updates (D_F >= {self.forward_depth}, "
                       f"D_grad >= {self.backward_depth}) in {self.dtype}")
        else:
            first = self.first_failure
            assert first is not None
            out.append(f"NOT certified: {first.reason}")
            out.append(f"culprit's fix: {first.fix}")
            if fixes is False:
                out.append("computed fixes (each lever's value certified again): explain(fixes=True) or .fixes()")
            else:
                from .fixes import format_fixes

                line = format_fixes(self._fixes_of(fixes))
                if line:
                    out.append(line)
        return "\n".join(out)

    def _peak_cell(self, u: BlockCertificate, radius: float) -> str:
        """The peak column of :meth:`explain`: the bound at ``radius``; under a mixed policy the one nearest its
        dtype's ``M``, with the dtype."""
        if u.peak is None:
            return "-"
        prec = self.precision
        if prec is None or prec.pure:
            return _fmt_num(u.peak_bound(radius))
        checks = _peak_checks(u, prec, head=u is self.head).peaks
        if not checks:
            return "-"
        d, p = max(checks, key=lambda dp: _ratio(dp[1].bound(radius), dp[0]))
        return f"{_fmt_num(p.bound(radius))} {d}"

    def __str__(self) -> str:
        verdict = "certified" if self.ok else f"not certified past update {self.certified_depth}"
        return (f"StackCertificate({self.depth} updates, {self.dtype}: {verdict}; "
                f"forward {self.forward_depth}, backward {self.backward_depth})")


# At the end, not the top: certblocks._chain builds the classes above (an import cycle resolved by order). Re-exported
# here: certify_stack is part of this module's API; the two helpers serve StackCertificate's methods.
from ._chain import _peak_checks, _ratio, certify_stack  # noqa: E402

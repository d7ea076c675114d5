"""The counterexample search: random draws at each radius, then Adam ascents on the ratio value / bound.

:func:`search` runs every check a certificate states and returns the :class:`~certblocks.testing.SoundnessReport`;
:func:`assert_sound` raises on a counterexample; :func:`search_growth`, :func:`search_jacobian` and
:func:`search_peak` run one check with its own settings.  :func:`search_held` runs the velocity under a precision
policy (autocast on the CPU too) and checks every value against the bound of the dtype it is held in and that
dtype's ``M``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_real
from ..certificate import BlockCertificate
from ._constants import _DEFAULT_COUNT, CHECKS, DEFAULT_RADII, DEFAULT_RTOL, FAMILIES, Device, Example, Velocity
from .inputs import _check_count, _check_radius, _check_shape, _on_sphere, _unit_tokens, random_inputs, token_norm
from .jacobian import EXACT_JVP, _jacobian_lower, _jvp, _resolve_jvp
from .record import _record, held_intermediates
from .results import CheckResult, SoundnessReport, _Best


def _ratio(value: Tensor, bound: float) -> Tensor:
    """``value / bound`` in float64; ``x / 0`` is ``inf`` for ``x > 0``, NaN reads as ``inf``."""
    value = value.detach().to(torch.float64)
    r = value / bound if bound > 0 else torch.where(value > 0, math.inf, 0.0).to(torch.float64)
    return torch.nan_to_num(r, nan=math.inf, posinf=math.inf)


@dataclass
class _Settings:
    """One check's search: its budget, and the function, sample shape and inputs' dtype/device it runs on."""

    radii: Tuple[float, ...]
    count: int
    restarts: int
    from_best: int
    steps: int
    lr: float
    power_iters: int
    seed: int
    families: Tuple[str, ...]
    jvp: str
    rtol: float
    f: Optional[Velocity] = None
    shape: Tuple[int, ...] = ()
    dtype: torch.dtype = torch.float64
    device: torch.device = torch.device("cpu")
    example: Optional[Tensor] = None


def _prepare(v: Velocity, example: Example, dtype: torch.dtype, cast: bool, device: Device, **kw: Any) -> _Settings:
    """Validate, cast a module (a copy) to ``dtype``, check that ``v`` maps samples independently."""
    if not callable(v):
        raise TypeError(f"v must be a module or a callable, got {type(v).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(example, Tensor):
        if example.dim() < 2 or not example.is_floating_point():
            raise ValueError(f"example must be a floating batch (B, ..., features), got {tuple(example.shape)}")
        shape = tuple(example.shape[1:])
    else:
        shape = _check_shape(example)
    s = _Settings(**kw)
    s.radii = tuple(_check_radius(r) for r in s.radii)
    if not s.radii:
        raise ValueError("radii must name at least one radius")
    for name in ("count", "restarts", "from_best", "steps", "power_iters", "seed"):
        _check_count(name, getattr(s, name))
    for name in ("lr", "rtol"):
        check_real(name, getattr(s, name), ge=0.0)
    random_inputs(shape, 1.0, 0, families=s.families)  # validates the families
    tensors = list(v.parameters()) + list(v.buffers()) if isinstance(v, nn.Module) else []
    s.device = torch.device(device) if device is not None else tensors[0].device if tensors else torch.device("cpu")
    s.f, s.shape, s.dtype = v, shape, dtype
    if cast and isinstance(v, nn.Module) and any(t.is_floating_point() and t.dtype != dtype for t in tensors):
        s.f = copy.deepcopy(v).to(dtype).requires_grad_(False)
    s.example = example.detach().to(s.device, dtype) if isinstance(example, Tensor) else None
    x = random_inputs(shape, 1.0, 2, generator=torch.Generator().manual_seed(12345), dtype=dtype).to(s.device)
    with torch.no_grad():
        both = s.f(x)
        if not isinstance(both, Tensor) or both.dim() < 2 or both.shape[0] != 2:
            raise ValueError(f"v must map a batch (B, *{shape}) to a tensor (B, ..., features); a batch of 2 gave "
                             f"{getattr(both, 'shape', type(both).__name__)}")
        apart = torch.cat([s.f(x[:1]), s.f(x[1:])]).to(torch.float64)
    scale = float(apart.abs().max().nan_to_num(0.0)) if apart.numel() else 0.0
    if not torch.allclose(both.to(torch.float64), apart, rtol=1e-5, atol=1e-6 * scale + 1e-12, equal_nan=True):
        raise ValueError("v mixes the samples of a batch or is not deterministic (dropout, batch statistics?): "
                         "a certificate is a property of one sample; call .eval() on the module")
    return s


def _draws(s: _Settings, radius: float, n: int, gen: torch.Generator) -> Tensor:
    return random_inputs(s.shape, radius, n, generator=gen, dtype=s.dtype, families=s.families).to(s.device)


def _top(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest finite scores."""
    r = torch.nan_to_num(scores.detach(), nan=-math.inf, posinf=-math.inf)
    return r.argsort(descending=True)[:min(k, r.numel())]


def _ascend(params: List[Tensor], step: Callable[[], Tuple[Tensor, bool]], steps: int, lr: float) -> None:
    """Adam on ``params`` maximizing ``step()[0].sum()``; ``step`` records each point (the last one too) and
    says whether to go on (False once a non-finite value was found)."""
    opt = torch.optim.Adam(params, lr=lr)
    for k in range(steps + 1):
        with torch.enable_grad():
            objective, go_on = step()
            if not go_on or k == steps or not objective.requires_grad:  # a constant score has nothing to ascend
                return
            grads = torch.autograd.grad(-objective.sum(), params, allow_unused=True)
        for p, g in zip(params, grads):
            p.grad = None if g is None else torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
        opt.step()


class _Search:
    """The search of one check at every radius: random draws, then ascents (see :func:`search`)."""

    def __init__(self, check: str, s: _Settings, cert: BlockCertificate) -> None:
        self.check, self.s = check, s
        self.gen = torch.Generator().manual_seed(s.seed)
        self.best = _Best(check, s.rtol)
        self.bound_at = {"growth": cert.growth_bound, "jacobian": cert.jacobian_bound, "peak": cert.peak_bound}[check]
        self.mode = _resolve_jvp(s.f, _draws(s, 1.0, 1, self.gen), s.jvp) if check == "jacobian" else ""
        self.worst: Dict[str, Any] = {"ratio": -math.inf}  # peak: the worst batch; its sample is found at the end

    def run(self) -> CheckResult:
        s = self.s
        for r in s.radii:
            bound = self.bound_at(r)
            x = _draws(s, r, s.count, self.gen)
            if s.example is not None:
                x = torch.cat([x, _on_sphere(s.example, r)])
            rank, tan, finite = self.score_draws(x, r, bound)
            if finite and (r > 0.0 or self.check == "jacobian"):
                pick = _top(rank, s.from_best)
                z = torch.cat([_draws(s, 1.0, s.restarts, self.gen), x[pick]])
                w = None
                if tan is not None:
                    w0 = torch.randn(s.restarts, *s.shape, generator=self.gen, dtype=torch.float64)
                    w = torch.cat([w0.to(s.device, s.dtype), tan[pick]])
                if z.shape[0]:
                    self.ascend(r, bound, z, w)
        if "x" in self.worst:  # the sample of the worst batch that attains its value, evaluated alone
            xb, w = self.worst["x"], self.worst
            own = torch.stack([_record(s.f, xb[k:k + 1])[0].detach() for k in range(xb.shape[0])])
            k = int(torch.nan_to_num(own, nan=math.inf, posinf=math.inf).argmax())
            self.best.update(_ratio(w["total"], w["bound"]), w["total"], w["bound"], w["r"], xb[k:k + 1],
                             counted=False)
        return self.best.result()

    def score_batch(self, x: Tensor, total: Tensor, bound: float, r: float) -> bool:
        """Peak: the batch's largest entry against the bound; False when it is not finite."""
        rr = _ratio(total.reshape(1), bound)
        self.best.evaluations += x.shape[0]
        if x.shape[0] and float(rr) > self.worst["ratio"]:
            self.worst.update(ratio=float(rr), total=total.detach().reshape(1), bound=bound, r=r, x=x.detach().clone())
        return bool(torch.isfinite(rr).all())

    def score_draws(self, x: Tensor, r: float, bound: float) -> Tuple[Tensor, Optional[Tensor], bool]:
        """Score the random draws: per-draw ranks, the Jacobian's tangents, whether every value is finite."""
        s, tan = self.s, None
        if self.check == "peak":
            total, rank = _record(s.f, x)
            return rank, None, self.score_batch(x, total, bound, r)
        if self.check == "growth":
            with torch.no_grad():
                rank = token_norm(s.f(x))
        else:
            rank, tan = _jacobian_lower(s.f, x, s.power_iters, self.gen, self.mode)
        self.best.update(_ratio(rank, bound), rank, bound, r, x, tan)
        return rank, tan, bool(torch.isfinite(rank).all())

    def ascend(self, r: float, bound: float, z0: Tensor, w0: Optional[Tensor]) -> None:
        """Adam ascents from the states ``z0`` (and the tangents ``w0``) projected on the sphere of radius ``r``."""
        s, best, mode = self.s, self.best, self.mode
        denom = bound if bound > 0 else 1.0
        z = _on_sphere(z0, math.sqrt(s.shape[-1])).detach().requires_grad_(True)  # entries of order 1
        w = None if w0 is None else w0.detach().clone().requires_grad_(True)
        top = {"ratio": torch.full((z.shape[0],), -math.inf, dtype=torch.float64, device=s.device),
               "x": torch.zeros_like(z)}

        def step() -> Tuple[Tensor, bool]:
            xs = _on_sphere(z, r)
            if self.check == "peak":
                total, per = _record(s.f, xs)
                return torch.cat([total.reshape(1), per]) / denom, self.score_batch(xs, total, bound, r)
            if w is None:
                val = token_norm(s.f(xs))
                rr = _ratio(val, bound)
                best.update(rr, val, bound, r, xs)
                return val / denom, bool(torch.isfinite(rr).all())
            ws = _unit_tokens(w)
            val = token_norm(_jvp(s.f, xs, ws, mode))
            rr = _ratio(val, bound)
            better = rr > top["ratio"]
            top["ratio"] = torch.where(better, rr, top["ratio"])
            top["x"][better] = xs.detach()[better]
            if mode in EXACT_JVP:  # autograd's J w: counts; central differences only steer
                best.update(rr, val, bound, r, xs, ws)
            return val / denom, mode not in EXACT_JVP or bool(torch.isfinite(rr).all())

        _ascend([z] if w is None else [z, w], step, s.steps, s.lr)
        if w is not None:  # the end points and each ascent's best point, scored exactly
            ends = torch.cat([_on_sphere(z.detach(), r), top["x"]])
            val, tan = _jacobian_lower(s.f, ends, s.power_iters, self.gen, mode)
            best.update(_ratio(val, bound), val, bound, r, ends, tan)


def _one(check: str, v: Velocity, cert: BlockCertificate, example: Example, dtype: torch.dtype, cast: bool,
         device: Device, **kw: Any) -> CheckResult:
    if not isinstance(cert, BlockCertificate):
        raise TypeError(f"certificate must be a BlockCertificate, got {type(cert).__name__}")
    if {"growth": cert.q, "jacobian": cert.sigma, "peak": cert.peak}[check] is None:
        raise ValueError(f"the certificate {cert.name!r} states no {check} bound")
    return _Search(check, _prepare(v, example, dtype, cast, device, **kw), cert).run()


def search_growth(v: Velocity, certificate: BlockCertificate, example: Example, *,
                  radii: Iterable[float] = DEFAULT_RADII, count: int = 64, restarts: int = 4, from_best: int = 2,
                  steps: int = 30, lr: float = 0.1, seed: int = 0, dtype: torch.dtype = torch.float64,
                  cast: bool = True, device: Device = None, families: Sequence[str] = FAMILIES,
                  rtol: float = DEFAULT_RTOL) -> CheckResult:
    """Search for ``x`` with ``||v(x)|| > c ||x||^q + b`` (the arguments are :func:`search`'s)."""
    return _one("growth", v, certificate, example, dtype, cast, device, radii=tuple(radii), count=count,
                restarts=restarts, from_best=from_best, steps=steps, lr=lr, power_iters=0, seed=seed,
                families=tuple(families), jvp="auto", rtol=rtol)


def search_jacobian(v: Velocity, certificate: BlockCertificate, example: Example, *,
                    radii: Iterable[float] = DEFAULT_RADII, count: int = 16, restarts: int = 4, from_best: int = 2,
                    steps: int = 30, lr: float = 0.1, power_iters: int = 25, seed: int = 0,
                    dtype: torch.dtype = torch.float64, cast: bool = True, device: Device = None,
                    families: Sequence[str] = FAMILIES, jvp: str = "auto", rtol: float = DEFAULT_RTOL) -> CheckResult:
    """Search for ``x`` with ``||dv(x)|| > l1 max(||x||, 1)^sigma + l0`` (the arguments are :func:`search`'s).

    The bound at ``R`` covers the ball ``||x|| <= R`` and grows with ``R``: a state on the sphere of radius
    ``r`` is compared with the bound at ``r``, the strictest.  ``direction`` of the result is the tangent.
    """
    return _one("jacobian", v, certificate, example, dtype, cast, device, radii=tuple(radii), count=count,
                restarts=restarts, from_best=from_best, steps=steps, lr=lr, power_iters=power_iters, seed=seed,
                families=tuple(families), jvp=jvp, rtol=rtol)


def search_peak(v: Velocity, certificate: BlockCertificate, example: Example, *,
                radii: Iterable[float] = DEFAULT_RADII, count: int = 32, restarts: int = 3, from_best: int = 1,
                steps: int = 20, lr: float = 0.1, seed: int = 0, dtype: torch.dtype = torch.float64,
                cast: bool = True, device: Device = None, families: Sequence[str] = FAMILIES,
                rtol: float = DEFAULT_RTOL) -> CheckResult:
    """Search for ``x`` at which an intermediate of ``v`` exceeds the peak (the arguments are :func:`search`'s).

    The draws of a radius are recorded as one batch (all have that radius); the ascent maximizes the
    batch's largest entry plus each sample's own (read from the intermediates whose first dimension is the
    batch).  The reported input is the sample of the worst batch that attains its value.
    """
    return _one("peak", v, certificate, example, dtype, cast, device, radii=tuple(radii), count=count,
                restarts=restarts, from_best=from_best, steps=steps, lr=lr, power_iters=0, seed=seed,
                families=tuple(families), jvp="auto", rtol=rtol)


def search(v: Velocity, certificate: BlockCertificate, example: Example, *, radii: Iterable[float] = DEFAULT_RADII,
           checks: Optional[Iterable[str]] = None, count: Optional[int] = None, restarts: int = 4, from_best: int = 2,
           steps: int = 30, lr: float = 0.1, power_iters: int = 25, seed: int = 0, dtype: torch.dtype = torch.float64,
           cast: bool = True, device: Device = None, families: Sequence[str] = FAMILIES, jvp: str = "auto",
           rtol: float = DEFAULT_RTOL) -> SoundnessReport:
    """Search for counterexamples to every bound a certificate states.

    At each radius: ``count`` random draws (and the example's samples, rescaled), scored; then
    ``restarts`` Adam ascents from fresh draws and ``from_best`` from the best-scored draws, ``steps``
    steps each on the ratio value / bound, the state projected on the sphere of the radius.  The Jacobian
    scores draws with :func:`jacobian_norm_lower`; its ascent moves the state and a tangent of per-token
    norm 1 jointly through Jacobian-vector products, and its end points are scored again exactly.

    Args:
        v: the velocity: a module (searched as a copy cast to ``dtype`` when ``cast``) or a callable, mapping
            ``(B, *shape)`` to ``(B, ..., features)`` sample by sample.
        certificate: the certificate to test.
        example: one sample's shape ``(..., tokens, features)``, or an example batch ``(B, *shape)`` whose
            samples join the draws.
        radii: the radii ``||x||`` searched.
        checks: the checks to run, among :data:`CHECKS` (default: every bound the certificate states).
        count: random draws per radius (default 64 for growth, 16 for the Jacobian, 32 for the peak).
        restarts: ascents per radius from fresh draws (the families cycled, Gaussian first).
        from_best: ascents per radius from the best draws (for the Jacobian, with their best tangents).
        steps: Adam steps per ascent.
        lr: Adam's learning rate (the ascent moves a direction whose entries are of order 1).
        power_iters: iterations of :func:`jacobian_norm_lower`.
        seed: seed of every random draw; the search is deterministic.
        dtype: floating dtype of the inputs (and of a cast module).
        cast: cast a module that is not in ``dtype`` (on a copy; the module is left unchanged).
        device: where the inputs live (default: the module's device, else the CPU).
        families: the direction families of the draws (:data:`FAMILIES`).
        jvp: Jacobian-vector products by ``"forward"``-mode AD, the transpose of a ``"double"`` backward,
            ``"central"`` differences (for modules with neither; they only steer, scores stay exact: never a
            difference quotient across a jump of a piecewise map) or ``"auto"`` (forward, else central).
        rtol: the rounding allowance: a ratio above ``1 + rtol`` is a counterexample.

    Returns:
        The :class:`SoundnessReport`.

    Raises:
        ValueError: a check names a bound the certificate does not state, or an argument is invalid.
    """
    if not isinstance(certificate, BlockCertificate):
        raise TypeError(f"certificate must be a BlockCertificate, got {type(certificate).__name__}")
    stated = {"growth": certificate.q, "jacobian": certificate.sigma, "peak": certificate.peak}
    wanted = [c for c in CHECKS if stated[c] is not None] if checks is None else list(checks)
    if any(c not in CHECKS for c in wanted):
        raise ValueError(f"checks must be among {CHECKS}, got {wanted!r}")
    if count is not None:
        _check_count("count", count)
    kw: Dict[str, Any] = dict(radii=tuple(radii), restarts=restarts, from_best=from_best, steps=steps, lr=lr,
                              seed=seed, dtype=dtype, cast=cast, device=device, families=tuple(families),
                              jvp=jvp, rtol=rtol)
    found = {c: _one(c, v, certificate, example, count=_DEFAULT_COUNT[c] if count is None else count,
                     power_iters=power_iters if c == "jacobian" else 0, **kw) for c in wanted}
    return SoundnessReport(certificate.name or "v", **found)


def assert_sound(v: Velocity, certificate: BlockCertificate, example: Example, **kwargs: Any) -> SoundnessReport:
    """:func:`search` (same arguments), raising ``AssertionError`` when it finds a counterexample.

    Returns:
        The :class:`SoundnessReport` when no counterexample was found.

    Raises:
        AssertionError: naming each failing check with its ratio, radius, value and bound; the report is
            the exception's ``report`` attribute.
    """
    report = search(v, certificate, example, **kwargs)
    if not report.ok:
        lines = [f"certificate of {report.name} is not sound: {certificate}"]
        lines += [f"  {r.check} bound exceeded by a factor {r.ratio:.6g} at radius {r.radius:.4g} "
                  f"(value {r.value:.6g} > bound {r.bound:.6g})" for r in report.failures]
        err = AssertionError("\n".join(lines))
        err.report = report  # type: ignore[attr-defined]
        raise err
    return report


#: The rounding allowance of :func:`search_held`: the bounds are exact-arithmetic bounds and a value held in a low
#: dtype is rounded at every op (bf16 keeps 8 significant bits: up to ``2^-8`` of a value per rounding).
HELD_RTOL: float = 2.0**-5


def search_held(v: Velocity, certificate: BlockCertificate, example: Example, precision: Any, *,
                radii: Iterable[float] = DEFAULT_RADII, count: int = 32, restarts: int = 3, from_best: int = 1,
                steps: int = 20, lr: float = 0.1, seed: int = 0, device: Device = None,
                families: Sequence[str] = FAMILIES, rtol: float = HELD_RTOL) -> CheckResult:
    """Search for ``x`` at which a value ``v`` computes, run under a precision policy, exceeds the bound of the dtype
    it is held in, or overflows that dtype (docs/theory.md section 7).

    ``v`` runs as the policy runs it: a module's floating parameters cast to the policy's parameter dtype (on a
    copy), the inputs in its stream dtype, under ``torch.autocast(device_type, dtype)`` when the policy has autocast.
    Every tensor it computes from ``x``, and every input autocast casts into a narrower dtype, is recorded with its
    dtype (:func:`~certblocks.testing.record.held_intermediates`) and compared with the certificate's peak of that
    dtype at ``||x||`` (:attr:`~certblocks.certificate.BlockCertificate.peaks` read under the policy; a certificate
    without them, or a dtype it did not see: its :attr:`~certblocks.certificate.BlockCertificate.peak`, the bound of
    every value).  A value that is not finite (an overflow) is a ratio ``inf``.  Random draws at each radius, then
    Adam ascents on the largest ratio, as :func:`search_peak`.

    Args:
        v: the velocity (a module, or a callable that applies the policy's casts itself).
        certificate: its certificate, traced under the policy for its per-dtype peaks
            (``certblocks.certify(v, x, residual=None, precision=...)``).
        example: one sample's shape, or an example batch.
        precision: the policy (:func:`certblocks.precision.as_precision`).
        rtol: the rounding allowance (:data:`HELD_RTOL`): the bounds hold in exact arithmetic.
        radii, count, restarts, from_best, steps, lr, seed, device, families: as :func:`search`.

    Returns:
        The worst case (check ``"held"``; ``where`` names the dtype).
    """
    from ..precision import as_precision
    from ..trace.capture import torch_dtype

    if not isinstance(certificate, BlockCertificate):
        raise TypeError(f"certificate must be a BlockCertificate, got {type(certificate).__name__}")
    if certificate.peak is None:
        raise ValueError(f"the certificate {certificate.name!r} states no peak")
    prec = as_precision(precision)
    stream, param = torch_dtype(prec.stream_dtype), torch_dtype(prec.param_dtype)
    held = certificate.held_peaks(prec.name) or {}
    module = v
    if isinstance(module, nn.Module) and any(p.is_floating_point() and p.dtype != param for p in module.parameters()):
        module = copy.deepcopy(module).requires_grad_(False)
        for p in module.parameters():
            if p.is_floating_point():
                p.data = p.data.to(param)

    def run(x: Tensor) -> Tensor:
        if prec.autocast_dtype is None:
            return module(x)
        with torch.autocast(x.device.type, dtype=torch_dtype(prec.autocast_dtype)):
            return module(x)

    s = _prepare(run, example, stream, False, device, radii=tuple(radii), count=count, restarts=restarts,
                 from_best=from_best, steps=steps, lr=lr, power_iters=0, seed=seed, families=tuple(families),
                 jvp="auto", rtol=rtol)

    gen = torch.Generator().manual_seed(seed)
    best = _Best("held", rtol)
    where = {"dtype": ""}

    def score(x: Tensor, r: float) -> Tuple[Tensor, bool]:
        """Per-sample largest ratio over the dtypes (differentiable); records the worst; False on a non-finite."""
        rec = held_intermediates(run, x)
        per_sample, finite = [], True
        for dt, (total, each) in rec.items():
            name = _dtype_label(dt)
            peak = held.get(name, certificate.peak) if name else certificate.peak
            if peak is None:
                raise ValueError(f"certificate {certificate.name!r} has no peak for the {name or 'held'} values: "
                                 "a held-dtype search needs the certificate's per-dtype peaks")
            bound = peak.bound(r)
            rr = _ratio(each.detach(), bound)
            rt = _ratio(total.detach().reshape(1), bound)  # tensors without the batch dimension too (the batch's)
            if max(float(rr.max()), float(rt)) > best.ratio:
                where["dtype"] = name or str(dt)
            best.update(rr, each, bound, r, x)
            best.update(rt, total.reshape(1), bound, r, x[:1], counted=False)
            finite = finite and bool(torch.isfinite(rr).all()) and bool(torch.isfinite(rt).all())
            per_sample.append(each / (bound if bound > 0 else 1.0))
        if not per_sample:
            return torch.zeros(x.shape[0], dtype=torch.float64, device=x.device), True
        return torch.stack(per_sample).amax(dim=0), finite

    for r in s.radii:
        x = _draws(s, r, s.count, gen)
        if s.example is not None:
            x = torch.cat([x, _on_sphere(s.example, r)])
        ranks, finite = score(x, r)
        if not finite or r == 0.0:
            continue
        z0 = torch.cat([_draws(s, 1.0, s.restarts, gen), x[_top(ranks, s.from_best)]])
        if not z0.shape[0]:
            continue
        z = _on_sphere(z0, math.sqrt(s.shape[-1])).detach().requires_grad_(True)
        _ascend([z], lambda r=r, z=z: score(_on_sphere(z, r), r), s.steps, s.lr)
    out = best.result()
    return CheckResult(out.check, out.ratio, out.value, out.bound, out.radius, out.input, None, out.evaluations,
                       rtol, where["dtype"])


def _dtype_label(dt: torch.dtype) -> str:
    from ..budget import dtype_name

    try:
        return dtype_name(dt)
    except (TypeError, ValueError):
        return ""

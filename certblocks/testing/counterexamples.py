"""Counterexample search against a certificate: the soundness harness of certblocks.

A :class:`~certblocks.certificate.BlockCertificate` makes three promises about a velocity ``v``, for
every state ``x`` (THEORY.md sections 1 and 6):

* **growth**: ``||v(x)|| <= c ||x||^q + b``;
* **Jacobian**: ``||dv(x)|| <= l1 max(R, 1)^sigma + l0`` whenever ``||x|| <= R``;
* **peak**: every entry of every tensor ``v`` computes from ``x`` (its output included) is at most
  ``peak_bound(||x||)`` in absolute value.

``||.||`` is the per-token norm (the largest Euclidean norm of a token's feature vector; the last
dimension holds the features, every other dimension but the batch indexes tokens) and ``||dv(x)||``
the operator norm it induces.  This module tries hard to break a promise, in float64 by default:
random states at several radii, drawn from direction families that reach the bounds of the shipped
blocks (:data:`FAMILIES`: one dominant token, all tokens equal so that every attention logit row
ties, near-constant features, ...), then gradient ascent (Adam) on the ratio of the value to its
bound with the state projected on the sphere of the radius.  The Jacobian's norm is estimated from
below by an alternating (power-iteration) maximization with Jacobian-vector and vector-Jacobian
products (:func:`jacobian_norm_lower`); intermediates are recorded by a ``TorchFunctionMode``
(:func:`largest_intermediate`).  A search is deterministic for a given ``seed``::

    import certblocks.testing

    certblocks.testing.assert_sound(block, block.certificate(seq_len=8), (8, 64))

:func:`assert_sound` raises ``AssertionError`` naming the check, the ratio and the radius of a
counterexample; :func:`search` returns the :class:`SoundnessReport` without raising;
:func:`search_growth`, :func:`search_jacobian` and :func:`search_peak` run one check with its own
settings.  Finding nothing is evidence, not proof; the harness's own tests plant wrong certificates
and check that it finds them.  ``v`` must map a batch ``(B, *shape)`` to ``(B, ..., features)``
sample by sample (a module in eval mode): this is checked.  ``import certblocks`` does not import
this module.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..certificate import BlockCertificate

__all__ = ["CHECKS", "DEFAULT_RADII", "DEFAULT_RTOL", "FAMILIES", "CheckResult", "SoundnessReport", "as_atom",
           "assert_sound", "jacobian_norm_lower", "largest_intermediate", "random_inputs", "search", "search_growth",
           "search_jacobian", "search_peak", "token_norm"]

#: The promises of a certificate, in the order they are searched.
CHECKS: Tuple[str, ...] = ("growth", "jacobian", "peak")
#: Radii searched by default: tiny, below 1, about 1, large and very large.
DEFAULT_RADII: Tuple[float, ...] = (1e-3, 0.1, 1.0, 10.0, 1e3)
#: Rounding allowance: a ratio above ``1 + rtol`` is a counterexample (float64 arithmetic).
DEFAULT_RTOL: float = 1e-7
#: Direction families of the random draws (draw ``i`` comes from family ``i mod len(families)``).
FAMILIES: Tuple[str, ...] = ("gaussian", "dominant_token", "equal_tokens", "constant_features", "sparse_tokens",
                             "quiet_last", "axis")
_DEFAULT_COUNT: Dict[str, int] = {"growth": 64, "jacobian": 16, "peak": 32}

Velocity = Callable[[Tensor], Tensor]
Example = Union[Tensor, Sequence[int]]
Device = Optional[Union[str, torch.device]]


# --------------------------------------------------------------------------------------------- norms, inputs


def token_norm(x: Tensor) -> Tensor:
    """The per-token norm of each sample of a batch ``(B, ..., features)``, in float64.

    Returns:
        ``(B,)``: the largest Euclidean norm of a token's feature vector (``(B, features)``: one token).
    """
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor (B, ..., features), got {getattr(x, 'shape', type(x).__name__)}")
    return _tokens(x.to(torch.float64)).norm(dim=-1).amax(dim=-1)


def _tokens(x: Tensor) -> Tensor:
    """``(B, ..., d)`` as ``(B, T, d)``."""
    return x.flatten(1, -2) if x.dim() > 2 else x[:, None, :]


def _per_sample(s: Tensor, like: Tensor) -> Tensor:
    return s.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def _on_sphere(z: Tensor, radius: float) -> Tensor:
    """``z`` rescaled sample by sample to per-token norm ``radius``."""
    return z * _per_sample(radius / token_norm(z).clamp_min(1e-300), z)


def _unit_tokens(w: Tensor) -> Tensor:
    """Every token scaled to norm 1: an extreme point of the per-token unit ball."""
    return w / w.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def _ratio(value: Tensor, bound: float) -> Tensor:
    """``value / bound`` in float64; ``x / 0`` is ``inf`` for ``x > 0``, NaN reads as ``inf``."""
    value = value.detach().to(torch.float64)
    r = value / bound if bound > 0 else torch.where(value > 0, math.inf, 0.0).to(torch.float64)
    return torch.nan_to_num(r, nan=math.inf, posinf=math.inf)


def random_inputs(shape: Sequence[int], radius: float, count: int, *, generator: Optional[torch.Generator] = None,
                  dtype: torch.dtype = torch.float64, families: Sequence[str] = FAMILIES,
                  offset: int = 0) -> Tensor:
    """Random states of per-token norm exactly ``radius``; draw ``i`` from ``families[(i + offset) % F]``.

    Families: ``gaussian`` (i.i.d. normal); ``dominant_token`` (one token, cycling from the first,
    carries the norm, the others are 1e-3 smaller); ``equal_tokens`` (every token equal: each attention
    logit row ties, at every scale); ``constant_features`` (``1 + 1e-3 g``, where normalization
    Jacobians peak); ``sparse_tokens`` (every other token 1e-4 smaller); ``quiet_last`` (the last token
    1e-4 smaller: a quiet token after a large history); ``axis`` (every token along one coordinate axis).

    Args:
        shape: one sample's shape, ``(..., tokens, features)`` or ``(features,)``.
        radius: the per-token norm of every draw (``>= 0``).
        count: the number of draws.
        generator: the CPU random generator (default: seeded with 0).
        dtype: the floating dtype of the result.
        families: the families cycled through (names from :data:`FAMILIES`).
        offset: the family index of draw 0.

    Returns:
        ``(count, *shape)`` on the CPU.
    """
    shape, radius, count = _check_shape(shape), _check_radius(radius), _check_count("count", count)
    fams = tuple(families)
    if not fams or any(f not in FAMILIES for f in fams):
        raise ValueError(f"families must be a non-empty selection of {FAMILIES}, got {fams!r}")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    T, d = math.prod(shape[:-1]), shape[-1]
    g = torch.randn(count, T, d, generator=gen, dtype=torch.float64)
    for i in range(count):
        fam, k = fams[(i + offset) % len(fams)], (i + offset) // len(fams)
        if fam == "dominant_token":
            g[i, torch.arange(T) != k % T] *= 1e-3
        elif fam == "equal_tokens":
            g[i] = g[i, :1].expand(T, d)
        elif fam == "constant_features":
            g[i] = 1.0 + 1e-3 * g[i]
        elif fam == "sparse_tokens":
            g[i, k % 2::2] *= 1e-4
        elif fam == "quiet_last":
            g[i, -1] *= 1e-4
        elif fam == "axis":
            mag = g[i, :, 0].abs() + 1e-3
            g[i] = 0.0
            g[i, :, k % d] = mag
    g = g * 0.0 if radius == 0.0 else _on_sphere(g, radius)
    return g.reshape(count, *shape).to(dtype)


# --------------------------------------------------------------------------------------------- Jacobian


def _jvp(f: Velocity, x: Tensor, v: Tensor, mode: str) -> Tensor:
    """``J(x) v`` in float64: forward-mode AD, or central differences with a step relative to ``||x||``."""
    if mode == "forward":
        return torch.func.jvp(f, (x,), (v,))[1].to(torch.float64)
    h = 1e-6 * token_norm(x).clamp_min(1e-3)
    diff = f(x + _per_sample(h, x) * v).to(torch.float64) - f(x - _per_sample(h, x) * v).to(torch.float64)
    return diff / _per_sample(2 * h, diff)


def _resolve_jvp(f: Velocity, x: Tensor, mode: str) -> str:
    """``"auto"``: ``"forward"`` when ``f`` supports forward-mode AD, else ``"central"``."""
    if mode not in ("auto", "forward", "central"):
        raise ValueError(f"jvp must be 'auto', 'forward' or 'central', got {mode!r}")
    if mode != "auto":
        return mode
    try:
        torch.func.jvp(f, (x,), (torch.ones_like(x),))
    except (RuntimeError, NotImplementedError, TypeError):
        return "central"
    return "forward"


def _jacobian_lower(f: Velocity, x: Tensor, iters: int, gen: torch.Generator, mode: str) -> Tuple[Tensor, Tensor]:
    """Per-sample lower bounds of ``||dv(x)||`` and the tangents (per-token norm 1) attaining them.

    For an output token ``i`` and a unit vector ``u``, ``sum_j ||J_ij^T u||`` equals ``<u, (J w)_i>`` for
    the tangent ``w_j = normalize(J_ij^T u)``, so it and ``||(J w)_i||`` are at most the norm.  Alternating
    ``w <- normalize(J_i.^T u)``, ``u <- normalize((J w)_i)`` raises both (power iteration for one token).
    Each output token of each sample is one row of a batch; the vector-Jacobian products reuse one graph.
    Jacobian-vector products only choose ``u``, and count as scores only when exact (``mode="forward"``).
    """
    B, x = x.shape[0], x.detach()
    with torch.no_grad():
        out_shape = f(x[:1]).shape[1:]
    T, d_out = math.prod(out_shape[:-1]), out_shape[-1]
    X = x.repeat_interleave(T, dim=0).requires_grad_(True)  # row k reads output token k % T
    rows = torch.arange(B * T, device=x.device)
    tok = rows % T
    with torch.enable_grad():
        out = f(X)
    u = torch.randn(B * T, d_out, generator=gen, dtype=torch.float64).to(x.device)
    best = torch.zeros(B * T, dtype=torch.float64, device=x.device)
    best_w = torch.zeros_like(X)
    for it in range(iters + 1):
        u_out = u.to(out.dtype)
        cot = torch.zeros(B * T, T, d_out, dtype=out.dtype, device=x.device)
        cot[rows, tok] = u_out
        g = _tokens(torch.autograd.grad(out, X, cot.reshape(out.shape), retain_graph=True)[0].to(torch.float64))
        score = g.norm(dim=-1).sum(-1) / u_out.to(torch.float64).norm(dim=-1).clamp_min(1e-300)
        w = _unit_tokens(g).reshape(X.shape).to(x.dtype)
        better = score > best
        best, best_w[better] = torch.where(better, score, best), w[better]
        if it == iters:
            break
        with torch.no_grad():
            jw = _tokens(_jvp(f, X.detach(), w, mode))[rows, tok]
        jn = jw.norm(dim=-1)
        if mode == "forward":
            better = jn > best
            best, best_w[better] = torch.where(better, jn, best), w[better]
        fresh = torch.randn(B * T, d_out, generator=gen, dtype=torch.float64).to(x.device)
        u = torch.where(((jn > 0) & torch.isfinite(jn))[:, None], jw, fresh)
        u = u / u.norm(dim=-1, keepdim=True)
    best = best.reshape(B, T)
    idx = best.argmax(dim=1)
    return best.gather(1, idx[:, None])[:, 0], best_w.reshape(B, T, *x.shape[1:])[torch.arange(B), idx].detach()


def jacobian_norm_lower(f: Velocity, x: Tensor, *, iters: int = 25, seed: int = 0, jvp: str = "auto") -> Tensor:
    """A lower bound of ``||dv(x)||`` (induced per-token operator norm) at each sample of ``x``.

    An alternating maximization over the output token, the output direction and a tangent of
    per-token norm 1 (power iteration with Jacobian-vector and vector-Jacobian products).  Every value
    is attained by a tangent, so it never exceeds the norm (up to rounding); for a linear map it
    converges to the norm.

    Args:
        f: the velocity, acting on each sample independently.
        x: the states ``(B, *shape)``.
        iters: alternating iterations.
        seed: seed of the starting directions.
        jvp: ``"forward"`` (``torch.func.jvp``), ``"central"`` (central differences: they only choose
            directions, the scores stay exact) or ``"auto"`` (forward when ``f`` supports it).

    Returns:
        ``(B,)`` float64 lower bounds.
    """
    _check_count("iters", iters)
    return _jacobian_lower(f, x, iters, torch.Generator().manual_seed(seed), _resolve_jvp(f, x[:1].detach(), jvp))[0]


# --------------------------------------------------------------------------------------------- intermediates


class _Recorder(TorchFunctionMode):
    """Records ``max |entry|`` of every floating tensor a torch function returns that autograd reaches ``x`` from.

    Masked attention logits carry a large negative sentinel (their exponential is 0): entries at or below
    ``finfo.min / 4`` are not counted.
    """

    active: List[_Recorder] = []  # the recording modes, innermost last

    def __init__(self, x: Tensor) -> None:
        super().__init__()
        self.x, self.batch, self.paused = x, x.shape[0], 0
        self.reach: Dict[Any, bool] = {}  # autograd node -> whether it reaches x
        self.values: List[Tensor] = []  # one scalar per recorded tensor
        self.samples: List[Tensor] = []  # (B,) per recorded tensor whose first dimension is the batch

    def __enter__(self) -> _Recorder:
        _Recorder.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _Recorder.active.pop()
        super().__exit__(*exc)

    def depends(self, t: Tensor) -> bool:
        """Whether ``t`` is ``x`` or autograd reaches ``x`` from it (memoized graph search)."""
        root = t.grad_fn
        if t is self.x or root is None:
            return t is self.x
        if root not in self.reach:
            seen, stack, found = {root}, [root], False
            while stack and not found:
                node = stack.pop()
                found = (node is self.x.grad_fn or getattr(node, "variable", None) is self.x
                         or self.reach.get(node, False))
                for child, _ in node.next_functions:
                    if child is not None and child not in seen and self.reach.get(child) is not False:
                        seen.add(child)
                        stack.append(child)
            if found:
                self.reach[root] = True
            else:  # every node seen was explored to its leaves
                self.reach.update(dict.fromkeys(seen, False))
        return self.reach[root]

    def record(self, out: Any) -> None:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor) and t.is_floating_point() and t.numel() and self.depends(t):
                a = t.masked_fill(t <= torch.finfo(t.dtype).min / 4, 0.0).abs().to(torch.float64)
                if t.dim() and t.shape[0] == self.batch:
                    self.samples.append(a.reshape(self.batch, -1).amax(dim=1))
                    self.values.append(self.samples[-1].amax())
                else:
                    self.values.append(a.amax())

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.record(out)
        return out


def as_atom(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` seen as one primitive by the intermediate recorder: its output counts, its internals do not.

    For a function the certificate treats as one primitive although it is written in several torch
    calls, e.g. a normalization whose sum of squares runs in float32 (an overflow there maps the token to
    0, not to inf or NaN), as the recorder treats ``layer_norm``.  Patch the wrapper where the module looks
    ``fn`` up; outside a recording it only calls ``fn``.
    """
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mode = _Recorder.active[-1] if _Recorder.active else None
        if mode is None:
            return fn(*args, **kwargs)
        mode.paused += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            mode.paused -= 1
        mode.record(out)
        return out
    wrapped.__wrapped__, wrapped.__name__, wrapped.__doc__ = fn, getattr(fn, "__name__", "atom"), fn.__doc__
    return wrapped


def _record(f: Velocity, x: Tensor) -> Tuple[Tensor, Tensor]:
    """The largest ``|entry|`` computed from ``x`` (scalar) and a per-sample estimate ``(B,)`` that reads the
    recorded tensors whose first dimension is the batch (it ranks the draws and drives every ascent)."""
    if not x.requires_grad:
        x = x.detach().requires_grad_(True)
    with torch.enable_grad(), _Recorder(x) as mode:
        mode.record(f(x))
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    total = torch.stack(mode.values).amax() if mode.values else zero
    return total, torch.stack(mode.samples).amax(dim=0) if mode.samples else zero.expand(x.shape[0])


def largest_intermediate(f: Velocity, x: Tensor) -> Tensor:
    """The largest ``|entry|`` of every tensor ``f`` computes from ``x``, output included.

    Every torch function call is seen, not its internals (``layer_norm``'s statistics, a fused attention's
    logits: search a twin that writes them out); :func:`as_atom` makes a Python function one call.  A
    tensor counts when autograd reaches ``x`` from it: tensors of the parameters alone never count, tensors
    computed under ``torch.no_grad`` are not seen.

    Returns:
        A float64 scalar, differentiable with respect to ``x`` when ``x`` requires grad.
    """
    return _record(f, x)[0]


# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class CheckResult:
    """The worst case one check found.

    Attributes:
        check: ``"growth"``, ``"jacobian"`` or ``"peak"``.
        ratio: the largest value / bound found (``inf`` for a non-finite value).
        value: the value there (``||v(x)||``, the Jacobian's lower estimate, the largest intermediate).
        bound: the certificate's bound at that radius.
        radius: ``||x||`` there.
        input: that ``x``, ``(1, *shape)`` float64 on the CPU.
        direction: for the Jacobian, the tangent (per-token norm 1) attaining ``value``.
        evaluations: the number of inputs scored (random draws and ascent iterates).
        rtol: the rounding allowance: the check passes when ``ratio <= 1 + rtol``.
    """

    check: str
    ratio: float
    value: float
    bound: float
    radius: float
    input: Optional[Tensor]
    direction: Optional[Tensor] = None
    evaluations: int = 0
    rtol: float = DEFAULT_RTOL

    @property
    def ok(self) -> bool:
        """No counterexample: the worst ratio is at most ``1 + rtol``."""
        return self.ratio <= 1.0 + self.rtol

    def describe(self) -> str:
        """One line: the check, the worst ratio, its radius, value against bound, the effort, the verdict."""
        what = {"growth": "||v(x)||", "jacobian": "||dv(x)|| >=", "peak": "largest intermediate"}[self.check]
        return (f"{self.check}: worst ratio {self.ratio:.6g} at radius {self.radius:.4g} ({what} {self.value:.6g}, "
                f"bound {self.bound:.6g}; {self.evaluations} inputs) {'ok' if self.ok else 'COUNTEREXAMPLE'}")


@dataclass(frozen=True)
class SoundnessReport:
    """What :func:`search` found, check by check (``None``: not run).

    Attributes:
        name: the certificate's name.
        growth: the growth check's worst case.
        jacobian: the Jacobian check's worst case.
        peak: the peak check's worst case.
    """

    name: str
    growth: Optional[CheckResult] = None
    jacobian: Optional[CheckResult] = None
    peak: Optional[CheckResult] = None

    @property
    def results(self) -> List[CheckResult]:
        """The checks that ran, in :data:`CHECKS` order."""
        return [r for r in (self.growth, self.jacobian, self.peak) if r is not None]

    @property
    def failures(self) -> List[CheckResult]:
        """The checks that found a counterexample."""
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        """No check found a counterexample."""
        return not self.failures

    def __str__(self) -> str:
        head = f"soundness search for {self.name}: {'no counterexample' if self.ok else 'COUNTEREXAMPLE'}"
        return "\n".join([head] + ["  " + r.describe() for r in self.results])


@dataclass
class _Best:
    """The running worst case of one check."""

    check: str
    rtol: float
    ratio: float = -math.inf
    value: float = 0.0
    bound: float = math.nan
    radius: float = 0.0
    input: Optional[Tensor] = None
    direction: Optional[Tensor] = None
    evaluations: int = 0

    def update(self, ratios: Tensor, values: Tensor, bound: float, radius: float, xs: Tensor,
               dirs: Optional[Tensor] = None, counted: bool = True) -> None:
        """Keep the worst of ``ratios`` (one per sample of ``xs``)."""
        self.evaluations += int(ratios.numel()) if counted else 0
        if not ratios.numel():
            return
        k = int(ratios.argmax())
        if float(ratios[k]) > self.ratio:
            self.ratio, self.value = float(ratios[k]), float(values.detach().reshape(-1)[k])
            self.bound, self.radius = bound, radius
            self.input = xs[k:k + 1].detach().to("cpu", torch.float64).clone()
            self.direction = None if dirs is None else dirs[k:k + 1].detach().to("cpu", torch.float64).clone()

    def result(self) -> CheckResult:
        return CheckResult(self.check, max(self.ratio, 0.0), self.value, self.bound, self.radius, self.input,
                           self.direction, self.evaluations, self.rtol)


# --------------------------------------------------------------------------------------------- set-up


def _check_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    try:
        out = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if not out or any(s <= 0 for s in out):
        raise ValueError(f"shape must be one sample's shape (..., tokens, features), positive sizes; got {shape!r}")
    return out


def _check_radius(r: float) -> float:
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
        raise ValueError(f"a radius must be a finite number >= 0, got {r!r}")
    return float(r)


def _check_count(name: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return n


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
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
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


# --------------------------------------------------------------------------------------------- the search


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
            if not go_on or k == steps:
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
            if mode == "forward":  # exact: counts; central differences only steer
                best.update(rr, val, bound, r, xs, ws)
            return val / denom, mode != "forward" or bool(torch.isfinite(rr).all())

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
        jvp: Jacobian-vector products by ``"forward"``-mode AD, ``"central"`` differences (for modules
            without forward-mode AD; they only steer, scores stay exact) or ``"auto"``.
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

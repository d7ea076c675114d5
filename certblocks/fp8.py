"""fp8 scales from certificates: static per-tensor scales that never saturate (docs/theory.md section 7).

fp8 training casts each Linear's input and weight to e4m3 with a per-tensor scale ``s``: ``q = fp8(x / s) * s``.
The cast saturates when ``|x| / s`` exceeds the format's largest value (448 for e4m3) and flushes to zero the
values below ``s`` times half its smallest subnormal (``2^-9`` for e4m3).  The common recipe, *dynamic amax
scaling*, measures ``amax(x)`` at every call and takes ``s = amax / 448``.  A certificate bounds every entry of every
tensor of the model for every input in its ball (its peak), so

    s >= (certified peak of x) / 448

is a *static* scale that never saturates, by construction, for any input the certificate covers.  What a static
scale costs is resolution: when the certified peak is far above the values a batch actually holds, small values
flush to zero; that is measured (:func:`fp8_emulation` counts it), not bounded.  The weights' scales are exact:
``max |w| / 448``.

* :func:`fp8_scales` -- a :class:`Fp8Scale` per ``nn.Linear`` (by module path): its input's certified peak (read
  from the model's chain of segments at each segment's certified radius, docs/theory.md section 6.1), the static
  input scale, the weight's ``amax`` and scale, and why a Linear has no finite certified peak;
* :func:`quantize` -- the emulation of one cast (``x / s`` to ``torch.float8_e4m3fn`` and back, times ``s``), with
  the counts of saturated and flushed values;
* :func:`fp8_emulation` -- a context in which every ``nn.Linear`` of a model computes with fp8-cast inputs and
  weights, with static scales (a mapping from :func:`fp8_scales`) or dynamic amax scales (``"dynamic"``), and
  records per-Linear statistics (:class:`Fp8Stats`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Fp8Scale", "Fp8Stats", "fp8_scales", "quantize", "fp8_emulation", "E4M3_MAX", "E4M3_MIN_SUBNORMAL",
           "format_limits"]

#: The largest finite value of ``torch.float8_e4m3fn``.
E4M3_MAX = 448.0
#: The smallest positive subnormal of ``torch.float8_e4m3fn``.
E4M3_MIN_SUBNORMAL = 2.0 ** -9


def format_limits(fmt: torch.dtype) -> Tuple[float, float]:
    """``(largest finite value, smallest positive subnormal)`` of an fp8 dtype.

    Raises:
        TypeError: ``fmt`` is not one of torch's fp8 dtypes.
    """
    fp8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
           if hasattr(torch, n)]
    if fmt not in fp8:
        raise TypeError(f"fmt must be one of torch's fp8 dtypes {fp8}, got {fmt!r}")
    fi = torch.finfo(fmt)
    return float(fi.max), float(fi.smallest_normal) * float(fi.eps)


@dataclass(frozen=True)
class Fp8Scale:
    """The static fp8 scales of one ``nn.Linear``.

    Attributes:
        module: the Linear's module path.
        input_peak: the certified bound of every entry of its input (``inf``: none; the largest over its calls).
        input_scale: ``input_peak / M_fp8`` rounded up (``inf`` when the peak is not finite: no static scale).
        weight_amax: ``max |w|`` (exact).
        weight_scale: ``weight_amax / M_fp8`` rounded up (1 for a zero weight).
        calls: how many calls of the Linear the graph holds.
        why: why the input has no finite certified peak (``""`` when it has one).
    """

    module: str
    input_peak: float
    input_scale: float
    weight_amax: float
    weight_scale: float
    calls: int = 1
    why: str = ""

    @property
    def certified(self) -> bool:
        """The input's scale is static and never saturates (its peak is finite)."""
        return math.isfinite(self.input_scale)


@dataclass
class Fp8Stats:
    """Counts of one tensor's fp8 casts (summed over the calls in an :func:`fp8_emulation`).

    Attributes:
        values: entries cast.
        nonzero: entries that were not zero before the cast.
        saturated: entries with ``|x / s| > M_fp8`` (clamped to ``M_fp8``).
        flushed: nonzero entries that the cast made zero.
        amax: the largest ``|x|`` seen.
        scales: the smallest and largest scale used.
    """

    values: int = 0
    nonzero: int = 0
    saturated: int = 0
    flushed: int = 0
    amax: float = 0.0
    scales: Tuple[float, float] = (math.inf, 0.0)

    def add(self, other: Fp8Stats) -> None:
        self.values += other.values
        self.nonzero += other.nonzero
        self.saturated += other.saturated
        self.flushed += other.flushed
        self.amax = max(self.amax, other.amax)
        self.scales = (min(self.scales[0], other.scales[0]), max(self.scales[1], other.scales[1]))

    @property
    def saturated_fraction(self) -> float:
        return self.saturated / self.values if self.values else 0.0

    @property
    def flushed_fraction(self) -> float:
        """Flushed over nonzero entries."""
        return self.flushed / self.nonzero if self.nonzero else 0.0


def _scale_up(v: float) -> float:
    """A scale rounded up by a few float32 ulps: ``x / s`` computed in float32 stays within the format's range."""
    return v * (1.0 + 2.0 ** -20) if v > 0 else 1.0


def quantize(x: torch.Tensor, scale: Union[float, torch.Tensor], fmt: torch.dtype = torch.float8_e4m3fn
             ) -> Tuple[torch.Tensor, Fp8Stats]:
    """Emulate one fp8 cast: ``fp8(x / scale) * scale`` in ``x``'s dtype, the quotient clamped to the format's range.

    Args:
        x: the tensor.
        scale: the per-tensor scale (``> 0``).
        fmt: the fp8 dtype (default e4m3).

    Returns:
        ``(the cast tensor, its Fp8Stats)``.

    Raises:
        ValueError: ``scale`` not positive and finite.
    """
    s = float(scale)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    top, _ = format_limits(fmt)
    xf = x.detach().float()
    y = xf / s
    sat = int((y.abs() > top).sum())
    q = y.clamp(-top, top).to(fmt).float()
    nz = xf != 0
    st = Fp8Stats(values=x.numel(), nonzero=int(nz.sum()), saturated=sat, flushed=int((nz & (q == 0)).sum()),
                  amax=float(xf.abs().max()) if x.numel() else 0.0, scales=(s, s))
    out = (q * s).to(x.dtype)
    if x.requires_grad:  # a straight-through cast: the gradient of the high-precision tensor
        out = x + (out - x).detach()
    return out, st


def fp8_scales(model: nn.Module, example_input: Any, *, r0: Optional[float] = None,
               fmt: torch.dtype = torch.float8_e4m3fn, kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Fp8Scale]:
    """Static fp8 scales for every ``nn.Linear`` of ``model`` from its certificate.

    The model is captured on ``example_input`` (the bounds hold for inputs of its shapes), cut into its chain of
    segments and certified (docs/theory.md section 6.1); each segment's nodes are bounded at the segment's certified
    input radius, and each Linear's input scale is its input's entry bound over ``M_fp8`` (e4m3: 448).  A model that
    is not one chain is bounded as one map of its input at ``r0``.

    Args:
        model: the model (eval mode).
        example_input: a batch (tensor, tuple of positional arguments, or dict of keyword arguments).
        r0: the bound on the input's per-token norm, the Euclidean norm along its last dimension (not needed for token
            ids; a zoo model's ``input_radius()`` is the bound after its stem, not this one).
        fmt: the fp8 dtype.
        kwargs: extra keyword arguments for the forward.

    Returns:
        module path -> :class:`Fp8Scale`, for every ``nn.Linear`` the graph calls.

    Raises:
        ValueError: a float input without ``r0``.
    """
    from .model import as_args
    from .trace.api import _certify_chain
    from .trace.backward import _SegmentPass
    from .trace.capture import capture
    from .trace.chain import model_chain
    from .trace.nodes import bind_args, op_name
    from .trace.residual import find_residual_updates

    top, _ = format_limits(fmt)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    args, kw = as_args(example_input)
    kw.update(kwargs or {})
    g = capture(model, args, kw)
    chain = model_chain(g, find_residual_updates(g))
    floating = [n for n in g.user_inputs if isinstance(g.env.get(n.name), torch.Tensor)
                and g.env[n.name].is_floating_point()]
    if r0 is None:
        if floating:
            raise ValueError(f"r0 is needed for {type(model).__name__}: a bound on its input's per-token norm (the "
                             "Euclidean norm along the input's last dimension; token ids need none)")
        r0 = 1.0
    segments = []
    if chain is not None and chain.segments:
        mc = _certify_chain(g, chain, type(model).__name__)
        stack = mc.stack("fp32", r0=r0)
        body = [s for s in chain.segments if s.kind != "head"]
        for j, s in enumerate(chain.segments):
            radius = stack.radii[j] if s.kind != "head" else stack.radii[len(body)]
            segments.append((s.start, s.end, float(radius), f"{s.kind} {j}"))
    else:
        start = (floating or g.user_inputs)[0]
        outs = [o for o in g.outputs if isinstance(g.env.get(o.name), torch.Tensor)]
        segments.append((start, outs[0], float(r0), "the whole model (not one chain)"))
    found: Dict[str, Tuple[float, int, str]] = {}
    for start, end, radius, label in segments:
        sp = _SegmentPass(g, start, end, radius, set())
        for n in sp.order:
            if n.op != "call_function" or op_name(n.target) != "aten.linear":
                continue
            path = g.module_path(n)
            if not isinstance(g.get_module(path), nn.Linear):
                continue
            x = (bind_args(n) or {}).get("input")
            peak = sp.entry_of(x) if math.isfinite(radius) else None
            why = "" if peak is not None else (
                f"{label}: its certified radius is not finite" if not math.isfinite(radius) else
                f"{label}: the entries of its input {getattr(x, 'name', x)} are not bounded "
                f"({_why(sp, x)})")
            p = peak if peak is not None else math.inf
            old = found.get(path)
            found[path] = (max(p, old[0]) if old else p, (old[1] + 1) if old else 1, (old[2] if old else "") or why)
    out: Dict[str, Fp8Scale] = {}
    for path, (peak, calls, why) in found.items():
        mod = g.get_module(path)
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"fp8_scales: {path!r} is not an nn.Linear in the captured graph ({type(mod).__name__})")
        w = mod.weight.detach()
        wmax = float(w.abs().max()) if w.numel() else 0.0
        out[path] = Fp8Scale(path, peak, _scale_up(peak / top) if math.isfinite(peak) else math.inf, wmax,
                             _scale_up(wmax / top), calls, why if not math.isfinite(peak) else "")
    return out


def _why(sp: Any, x: Any) -> str:
    v = sp.values.get(getattr(x, "name", ""))
    return getattr(v, "bad", "") or getattr(v, "rule", "") or "no value"


@contextlib.contextmanager
def fp8_emulation(model: nn.Module, scales: Union[str, Mapping[str, Fp8Scale]] = "dynamic", *,
                  fmt: torch.dtype = torch.float8_e4m3fn, stats: Optional[Dict[str, Dict[str, Fp8Stats]]] = None,
                  fallback: str = "dynamic") -> Iterator[Dict[str, Dict[str, Fp8Stats]]]:
    """Inside the block every ``nn.Linear`` of ``model`` computes ``F.linear(q(x), q(W), b)`` in float32 with fp8-cast
    input and weight (:func:`quantize`).

    Args:
        model: the model.
        scales: ``"dynamic"`` (``s = amax / M_fp8`` per call and tensor, the common recipe) or a mapping from
            :func:`fp8_scales` (static scales; a Linear without a finite certified scale, or not in the mapping,
            uses ``fallback``).
        fmt: the fp8 dtype.
        stats: a dict to fill (module path -> ``{"input": Fp8Stats, "weight": Fp8Stats}``); a new one by default.
        fallback: ``"dynamic"`` or ``"none"`` (keep the Linear in high precision) for the Linears without a static
            scale.

    Yields:
        The statistics dict, filled as the model runs.

    Raises:
        ValueError: ``scales`` or ``fallback`` not one of the values allowed.
    """
    if not (scales == "dynamic" or isinstance(scales, Mapping)):
        raise ValueError(f"scales must be 'dynamic' or a mapping from fp8_scales, got {scales!r}")
    if fallback not in ("dynamic", "none"):
        raise ValueError(f"fallback must be 'dynamic' or 'none', got {fallback!r}")
    top, _ = format_limits(fmt)
    stats = {} if stats is None else stats
    patched = []

    def amax_scale(t: torch.Tensor) -> float:
        a = float(t.detach().abs().max()) if t.numel() else 0.0
        return _scale_up(a / top) if a > 0 and math.isfinite(a) else 1.0

    for path, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        static = scales.get(path) if isinstance(scales, Mapping) else None
        if isinstance(scales, Mapping) and (static is None or not static.certified) and fallback == "none":
            continue

        def forward(x: torch.Tensor, mod: nn.Linear = mod, path: str = path,
                    static: Optional[Fp8Scale] = static) -> torch.Tensor:
            sx = static.input_scale if static is not None and static.certified else amax_scale(x)
            sw = static.weight_scale if static is not None and static.certified else amax_scale(mod.weight)
            qx, st_x = quantize(x.float(), sx, fmt)
            qw, st_w = quantize(mod.weight.float(), sw, fmt)
            rec = stats.setdefault(path, {"input": Fp8Stats(), "weight": Fp8Stats()})
            rec["input"].add(st_x)
            rec["weight"].add(st_w)
            with torch.autocast(x.device.type, enabled=False):
                b = None if mod.bias is None else mod.bias.float()
                return F.linear(qx, qw, b)

        mod.forward = forward  # type: ignore[method-assign,assignment]  # an instance attribute: removed on exit
        patched.append(mod)
    try:
        yield stats
    finally:
        for mod in patched:
            del mod.forward


"""The intermediate recorder: the largest entry of every tensor a velocity computes from its input.

A ``TorchFunctionMode`` sees every torch function call (:func:`largest_intermediate`); :func:`as_atom` makes a
Python function one call.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._constants import Velocity


class _Recorder(TorchFunctionMode):
    """Records ``max |entry|`` of every floating tensor a torch function returns that autograd reaches ``x`` from.

    Masked attention logits carry a large negative sentinel (their exponential is 0): entries at or below
    ``finfo.min / 4`` are not counted.
    """

    active: List[_Recorder] = []  # the recording modes, innermost last

    def __init__(self, x: Tensor, differentiable: bool = True, casts: bool = False) -> None:
        super().__init__()
        self.x, self.batch, self.paused = x, x.shape[0], 0
        self.differentiable = differentiable  # False: the recorded maxima carry no graph (no float64 copy kept)
        self.casts = casts  # also the casts autocast makes of a call's inputs (:func:`held_intermediates`)
        self.reach: Dict[Any, bool] = {}  # autograd node -> whether it reaches x
        self.values: List[Tensor] = []  # one scalar per recorded tensor
        self.samples: List[Tensor] = []  # (B,) per recorded tensor whose first dimension is the batch
        self.dtypes: List[torch.dtype] = []  # the dtype of each recorded tensor (aligned with values)
        self.sample_dtypes: List[torch.dtype] = []  # the dtype of each per-sample record (aligned with samples)

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
        self.paused += 1  # the recorder's own torch calls (the maxima below) are not intermediates of the function
        try:
            with contextlib.nullcontext() if self.differentiable else torch.no_grad():
                self._record(out)
        finally:
            self.paused -= 1

    def _record(self, out: Any) -> None:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor) and t.is_floating_point() and t.numel() and self.depends(t):
                self._add(t)

    def _add(self, t: Tensor) -> None:
        a = t.masked_fill(t <= torch.finfo(t.dtype).min / 4, 0.0).abs()
        if self.differentiable:  # the searches ascend these maxima: their gradients in float64
            a = a.to(torch.float64)
        # else the maxima in the tensor's own dtype (exact: a maximum rounds nothing), then one float64 copy of each
        if t.dim() and t.shape[0] == self.batch:
            self.samples.append(a.reshape(self.batch, -1).amax(dim=1).to(torch.float64))
            self.sample_dtypes.append(t.dtype)
            self.values.append(self.samples[-1].amax())
        else:
            self.values.append(a.amax().to(torch.float64))
        self.dtypes.append(t.dtype)

    def record_casts(self, args: Any, kwargs: Any, out: Any) -> None:
        """The inputs of a call that autocast cast into its narrower output dtype (docs/theory.md section 7: a cast of
        an fp32 value to fp16 overflows at 65504): each such input as cast, recorded in that dtype."""
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]
        if not outs or not torch.is_autocast_enabled(outs[0].device.type):
            return
        low = min((t.dtype for t in outs), key=lambda d: torch.finfo(d).max)
        self.paused += 1  # the casts made here are the recorder's, not the function's
        try:
            with contextlib.nullcontext() if self.differentiable else torch.no_grad():
                for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                    if (isinstance(t, Tensor) and t.is_floating_point() and t.numel()
                            and torch.finfo(t.dtype).max > torch.finfo(low).max and self.depends(t)):
                        self._add(t.to(low))
        finally:
            self.paused -= 1

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.record(out)
            if self.casts:
                self.record_casts(args, kwargs, out)
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
    wrapped.__wrapped__, wrapped.__name__, wrapped.__doc__ = fn, getattr(fn, "__name__", "atom"), fn.__doc__  # type: ignore[attr-defined]
    return wrapped


def _run(f: Velocity, x: Tensor, differentiable: bool = True, casts: bool = False) -> Tuple[_Recorder, Tensor, Any]:
    """``f(x)`` under a recorder (``x`` made to require grad so that dependence is seen): the recorder, ``x`` and
    the output (with its autograd graph); ``differentiable``: the recorded maxima too; ``casts``: autocast's casts
    of the calls' inputs too."""
    if not x.requires_grad:
        x = x.detach().requires_grad_(True)
    with torch.enable_grad(), _Recorder(x, differentiable, casts) as mode:
        out = f(x)
        mode.record(out)
    return mode, x, out


def _record(f: Velocity, x: Tensor) -> Tuple[Tensor, Tensor]:
    """The largest ``|entry|`` computed from ``x`` (scalar) and a per-sample estimate ``(B,)`` that reads the
    recorded tensors whose first dimension is the batch (it ranks the draws and drives every ascent)."""
    mode, x, _ = _run(f, x)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    total = torch.stack(mode.values).amax() if mode.values else zero
    return total, torch.stack(mode.samples).amax(dim=0) if mode.samples else zero.expand(x.shape[0])


def held_intermediates(f: Velocity, x: Tensor) -> Dict[torch.dtype, Tuple[Tensor, Tensor]]:
    """Every tensor ``f`` computes from ``x`` by the dtype it is held in, run as the caller runs it (under a policy's
    autocast: every call's output, and each input autocast casts into a narrower dtype, recorded as cast).

    Returns:
        ``{dtype: (largest |entry|, per-sample largest (B,))}``, float64 and differentiable with respect to ``x`` (NaN
        reads as ``inf``; a dtype with no per-sample tensor has the batch's value for every sample).
    """
    mode, x, _ = _run(f, x, casts=True)
    out: Dict[torch.dtype, Tuple[Tensor, Tensor]] = {}
    for dt in dict.fromkeys(mode.dtypes):
        vals = [v for v, d in zip(mode.values, mode.dtypes) if d == dt]
        total = torch.nan_to_num(torch.stack(vals).amax(), nan=math.inf, posinf=math.inf)
        per = [s for s, d in zip(mode.samples, mode.sample_dtypes) if d == dt]
        each = (torch.nan_to_num(torch.stack(per).amax(dim=0), nan=math.inf, posinf=math.inf) if per
                else total.expand(x.shape[0]))
        out[dt] = (total, each)
    return out


def intermediate_peaks(f: Velocity, x: Tensor) -> Tuple[float, Dict[torch.dtype, float]]:
    """:func:`largest_intermediate` as a float, and the largest ``|entry|`` per dtype of the recorded tensors (under
    autocast a float32 residual stream and float16 matmul outputs are told apart); NaN counts as ``inf``."""
    return _peaks_of(_run(f, x, differentiable=False)[0])


def recorded_call(f: Velocity, x: Tensor) -> Tuple[Any, float, Dict[torch.dtype, float]]:
    """``f(x)`` with its autograd graph kept (``x`` must require grad), and :func:`intermediate_peaks`'s figures of
    the same run: one forward serves the recorder and later products through the graph."""
    if not x.requires_grad:
        raise ValueError("recorded_call needs an x that requires grad (its graph is kept for the caller)")
    mode, _, out = _run(f, x, differentiable=False)
    return (out, *_peaks_of(mode))


def _peaks_of(mode: _Recorder) -> Tuple[float, Dict[torch.dtype, float]]:
    by_dtype: Dict[torch.dtype, float] = {}
    values = torch.stack(mode.values).detach().tolist() if mode.values else []  # one transfer, not one per tensor
    for val, dt in zip(values, mode.dtypes):
        val = math.inf if math.isnan(val) else val
        by_dtype[dt] = max(by_dtype.get(dt, 0.0), val)
    return max(by_dtype.values(), default=0.0), by_dtype


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

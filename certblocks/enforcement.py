"""``enforce``: parametrizations that keep a model's certificate true for every weight training can reach.

:func:`enforce` registers ``torch.nn.utils.parametrize`` parametrizations on the weights the
certificate reads, so that the *effective* weights always satisfy caps, whatever the underlying
parameters (the ones the optimizer updates) become:

* a matrix ``W`` (or each row block of a fused one: ``q``, ``k``, ``v`` of ``c_attn``/``qkv``; the value and
  gate halves of a gated MLP's ``fc1``) is used as ``W * min(1, a / ||W||_2)``: spectral norm at most ``a``;
* a bias ``b`` (or each part of a fused one) as ``b * min(1, beta / ||b||_2)``;
* a QK-norm scale ``g`` as ``clamp(g, -gamma, gamma)``; a QK-LayerNorm bias like a bias; a Mamba block's conv taps
  and ``D`` likewise (largest absolute entry);
* a Mamba block's ``delta`` bias ``b`` as ``clamp(b, -30, softplus^-1(d))``: ``softplus(b_i) <= d``.  The lower end
  is fixed (not scaled with the caps; ``softplus(-30) < 1e-13``): only the bound on the ``delta`` pre-activation
  (the peak) reads it.

``||W||_2`` is bounded above in float64 (largest eigenvalue of the smaller Gram matrix, with the
rounding of ``eigvalsh`` and of the Gram product added; no gradient flows through the scale), and the
target is ``a (1 - delta)`` with ``delta = 2 u (sqrt(min(m, n)) + 1)`` (``u`` the unit roundoff of the
parameter's dtype), which absorbs the rounding of the product ``W * scale``: the effective norm is
below ``a`` in any parameter dtype (bf16 parameters lose a few percent of room).  The parameters
stay leaf ``nn.Parameter`` s (``module.parametrizations.weight.original``), so optimizers,
``state_dict`` / ``load_state_dict`` between enforced models and ``.to()`` work as usual;
:func:`unenforce` replaces them by plain parameters holding the current effective values.
Cost: one symmetric eigenvalue problem of the smaller side per capped matrix per forward (use
``parametrize.cached()`` around a forward to share it); measured ~3x a plain forward+backward for
width 256 on a 2-core CPU, relatively less for wider models and on GPUs.  Gradients: the scale
``min(1, a / ||W||)`` is treated as a constant by autograd (the gradient reaching ``W`` is the
effective weight's gradient times the scale), as in norm-clipping methods.

**How the caps are chosen.**  Every enforceable block (:class:`certblocks.protocol.EnforceableBlock`) lists
the tensors its certificate reads (``cap_slots()``) and computes, with the one bound function its
``certificate()`` uses, the *worst-case certificate* that holds whenever each part is within its cap
(``certificate_from_caps()``: every norm replaced by its cap, the refinements that need the weights
themselves dropped).  For the shipped blocks: MLP ``c = a2 a1``, ``b = a2 beta1 + beta2``, ``l0 = Lip(phi) a2 a1``;
attention ``c = sqrt(H) a_o a_v``, ``b = a_o beta_v + beta_o``, plain
``l1 = s H a_o a_v (2 a_q a_k + a_k beta_q / 2)``, QK-norm ``l1 = s H a_o a_v (A_k G_q a_q + A_q G_k a_k)``
with ``A = gamma sqrt(d_k) + beta_n`` and ``G = gamma / sqrt(eps)``;
sigmoid-gated MLP ``c = a2 a_g``, ``l1 = a2 a_u a_g / 4``, ``l0 = c + a2 a_u beta_g / 4``; SwiGLU (``q = 2``) ``c =
a2 (a_g a_u + (a_g beta_u + beta_g a_u) / 2)``, ``l1 = (1 + Lip(SiLU)) a2 a_g a_u``: a stack of it is certified for
a finite depth only, and the caps are chosen for that depth. Mamba blocks (``LinearGrowthMamba`` and ``Mamba``):
``in_proj`` in its ``x`` and ``z`` halves, ``x_proj`` in its ``delta``, ``B``, ``C`` row blocks, ``dt_proj.weight``,
``out_proj`` and the biases are capped as above, the conv taps and ``D`` clamped, the ``delta`` bias capped in
``softplus``; the bound then reads ``a <= min(K, seq_len) w_conv a_x`` for the conv over ``in_proj``, ``||M_i|| <=
a_dtw a_dt`` for the ``delta`` projection, ``delta <= softplus(softplus^-1(d) + a_dtw a_dt)``, and every decay
``exp(delta A)`` at its bound 1: ``A_log`` is not capped (``A = -exp(A_log) < 0`` whatever it is; the forward keeps
``A`` finite: ``A_log`` above 88 reads as 88), so the worst case gives up the decay's help, which matters only for
sequences longer than the decay time. The Mamba bounds hold for sequences of at most ``seq_len`` tokens (the
model's, or ``enforce``'s argument).

Each cap is ``alpha * ref`` with ``ref = max(current value, 1)`` (the norm when ``enforce`` is called,
floored at 1 so that zero-initialized biases and projections may still grow), and one factor ``alpha``
for the whole model: the largest ``alpha`` (bisection on a log scale, then ``* 0.99``) for which the
worst-case stack, with the run's ``dt``, ``r0`` and ``lip_g``, is certified by
:func:`certblocks.certify_stack` (exact forward radius recursion and layerwise backward sum) at
``depth`` updates.  The budget is thus shared in proportion to the weights' current sizes, and the
certificate holds for every parameter value.  If ``alpha < 1`` the current weights are shrunk
(the model's function changes); ``enforce`` returns ``alpha`` in its report.

``depth`` larger than the number of updates plans for a deeper model made of the same updates: the
worst-case list is repeated cyclically up to ``depth`` updates.

Supported updates: every module that keeps the protocol -- :class:`~certblocks.MLP`,
:class:`~certblocks.GatedMLP` (sigmoid gate, and SwiGLU at a finite depth), :class:`~certblocks.Attention`,
:class:`~certblocks.QKNormAttention`, :class:`~certblocks.LinearGrowthMamba`, :class:`~certblocks.Mamba` (``q = 5``:
caps that certify a deep stack of it shrink its weights a lot; ``mamba_forecaster_free`` gets ``alpha ~ 0.02`` in
bf16), :class:`~certblocks.blocks.NormedUpdate` and ``PatchTSTUpdate`` (no norm, or LayerNorm / RMSNorm pre / peri:
the norms' scales are clamped and their biases capped too) around a supported branch, branch gains, and the zoo's
wrappers (Toto's axis attention): every zoo forecaster and ``toto_style``.  Others raise ``TypeError`` naming the
update: PatchTST's BatchNorm (its eval-mode map reads the running statistics, buffers that training overwrites and
no parameter cap bounds) and post-norm layers (not residual updates).  The guarantee is for inputs of per-token norm
at most ``r0``; a zoo model's ``r0`` comes from its embedding, which is not capped: pass ``r0`` to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import bounds
from ._validation import check_int, check_real
from .certificate import BlockCertificate, StackCertificate, certify_stack
from .model import CertifiedModel, as_certified, underlying
from .precision import as_precision
from .protocol import CapSlot, EnforceableBlock

__all__ = ["enforce", "unenforce", "cap_factor", "cap_ratios", "EnforceReport", "NormCap", "ScaleClamp",
           "SoftplusCeiling"]

_FLOOR = 1.0


def _safety(p: torch.Tensor) -> float:
    """Relative room left below a cap for the rounding of ``p * scale`` in ``p``'s dtype.

    Each entry is rounded with relative error ``u = eps / 2``, so the rounded matrix is ``P + P o E`` with
    ``|E| <= u`` entrywise and ``||P o E||_2 <= u ||P||_F <= u sqrt(min(m, n)) ||P||_2``; twice that, plus
    the rounding of the scale itself, is kept free.
    """
    u = torch.finfo(p.dtype).eps
    k = min(p.shape) if p.ndim == 2 else 1
    return 1e-9 + 2.0 * u * math.sqrt(max(k, 1)) + 2.0 * u


# ---------------------------------------------------------------------------------------- parametrizations
class _Float64Caps(nn.Module):
    """A parametrization whose caps are float64 buffers: saved in the ``state_dict`` (loading an enforced model's
    state restores its caps), moved with the model, never cast (casting must not round a cap up)."""

    def _apply(self, fn: Any, recurse: bool = True) -> _Float64Caps:
        exact = {k: b for k, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for k, b in exact.items():
            self._buffers[k] = b.to(self._buffers[k].device)  # type: ignore[union-attr]
        return self

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _round_toward(t64: torch.Tensor, dtype: torch.dtype, toward: float) -> torch.Tensor:
    """The float64 tensor ``t64`` in ``dtype``, one step toward ``toward`` where rounding crossed it the other way."""
    t = t64.to(dtype)
    crossed = (t.to(torch.float64) - t64) * (toward - t64) < 0
    return torch.where(crossed, torch.nextafter(t, torch.full_like(t, toward)), t)


class NormCap(_Float64Caps):
    """``x -> x * min(1, cap / ||x||)`` on each row block of a matrix (spectral norm) or part of a vector (l2).

    Args:
        sizes: the sizes of the row blocks (matrices) or parts (vectors) along dim 0, summing to ``x.shape[0]``.
        caps: one cap per block.
    """

    caps: torch.Tensor  # a buffer (float64)

    def __init__(self, sizes: Sequence[int], caps: Sequence[float]) -> None:
        super().__init__()
        if len(sizes) != len(caps):
            raise ValueError(f"sizes {list(sizes)} and caps {list(caps)} differ in length")
        self.sizes = [int(s) for s in sizes]
        self.register_buffer("caps", torch.tensor([float(c) for c in caps], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.sizes, dim=0)
        out = []
        for j, p in enumerate(parts):
            with torch.no_grad():  # the scale is a constant for autograd (no SVD backward)
                p64 = p.detach().to(torch.float64)
                n = bounds.op_norm_tensor(p64)
                target = self.caps[j].to(p64.device) * (1.0 - _safety(p))
                scale = torch.clamp(target / n.clamp_min(1e-300), max=1.0)
            out.append(p * scale.to(p.dtype))
        return out[0] if len(out) == 1 else torch.cat(out, dim=0)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, caps={[f'{c:.4g}' for c in self.caps.tolist()]}"


class ScaleClamp(_Float64Caps):
    """``g -> clamp(g, -cap, cap)``: ``||g||_inf <= cap`` (QK-norm and normalization scales, conv taps, ``D``)."""

    cap_value: torch.Tensor  # a buffer (float64)

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.register_buffer("cap_value", torch.tensor(float(cap), dtype=torch.float64))

    @property
    def cap(self) -> float:
        """The cap."""
        return float(self.cap_value)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        cap = _round_toward(self.cap_value.to(g.device), g.dtype, 0.0)
        return torch.minimum(torch.maximum(g, -cap), cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap:.4g}"


class SoftplusCeiling(_Float64Caps):
    """``x -> clamp(x, lower, softplus^-1(cap))``: every ``softplus(x_i) <= cap`` and ``x_i >= lower``.

    The upper end is :func:`certblocks.protocol.softplus_ceiling` (computed in float64 on ``x``'s device, then
    lowered by two float64 steps to stay at or below the value the certificates read) rounded down in ``x``'s
    dtype; the lower end (fixed, not a cap) rounded up.  When ``lower`` exceeds the upper end every entry is the
    upper end: the ceiling always holds.
    """

    cap_value: torch.Tensor  # a buffer (float64)

    def __init__(self, cap: float, lower: float) -> None:
        super().__init__()
        self.register_buffer("cap_value", torch.tensor(float(cap), dtype=torch.float64))
        self.lower = float(lower)

    @property
    def cap(self) -> float:
        """The cap on ``softplus`` of an entry."""
        return float(self.cap_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cap_value.to(x.device)
        hi = c + torch.log(-torch.expm1(-c))
        for _ in range(2):
            hi = torch.nextafter(hi, torch.full_like(hi, -math.inf))
        hi = _round_toward(hi, x.dtype, -math.inf)
        lo = _round_toward(x.new_full((), self.lower, dtype=torch.float64), x.dtype, math.inf)
        return torch.minimum(torch.maximum(x, lo), hi)

    def extra_repr(self) -> str:
        return f"cap={self.cap:.4g}, lower={self.lower:g}"


# ---------------------------------------------------------------------------------------- per-update plans
@dataclass
class _Plan:
    """An update to cap: its block, the tensors its certificate reads, and their reference norms."""

    name: str
    block: EnforceableBlock
    slots: List[CapSlot]
    refs: List[List[float]]  # per slot, one reference value per part (current norm, floored at 1)

    def worst(self, alpha: float, seq_len: Optional[int]) -> BlockCertificate:
        """The certificate at caps ``alpha * ref``, from the block's own bound (``certificate_from_caps``)."""
        caps = {key: alpha * ref for sl, refs in zip(self.slots, self.refs) for key, ref in zip(sl.keys, refs)}
        try:
            cert = self.block.certificate_from_caps(caps, seq_len=seq_len)
        except ValueError as exc:
            if seq_len is None and "seq_len" in str(exc):
                raise ValueError(f"update {self.name!r} needs a sequence length: pass enforce(..., seq_len=N), the "
                                 f"longest sequence the guarantee is for ({exc})") from None
            raise
        return dataclasses.replace(cert, name=self.name)


def _reference(slot: CapSlot) -> List[float]:
    """The current norm of each part of a slot's tensor (floored at 1: a zero bias may still grow)."""
    t = getattr(slot.module, slot.name)
    out = []
    for part in torch.split(t.detach(), list(slot.sizes), dim=0):
        if part.numel() == 0:
            v = 0.0
        elif slot.kind == "matrix":
            v = bounds.op_norm(part)
        elif slot.kind == "vector":
            v = bounds.vec_norm(part)
        elif slot.kind == "softplus":
            v = float(torch.nn.functional.softplus(part.to(torch.float64).max()))
        else:
            v = bounds.vec_inf_norm(part)
        out.append(max(v, _FLOOR))
    return out


def _plan(name: str, m: nn.Module) -> _Plan:
    """The plan of one update, or a ``TypeError`` naming it when its block is not enforceable."""
    if not isinstance(m, EnforceableBlock):
        raise TypeError(f"enforce does not support update {name!r} ({type(m).__name__}): its block has no "
                        "cap_slots() / certificate_from_caps() (certblocks.protocol.EnforceableBlock); supported: MLP, "
                        "GatedMLP, Attention, QKNormAttention, LinearGrowthMamba, Mamba, NormedUpdate, ScaledBranch "
                        "and PatchTSTUpdate (no norm, or pre/peri LayerNorm/RMSNorm)")
    try:
        slots = m.cap_slots()
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    return _Plan(name, m, slots, [_reference(sl) for sl in slots])


# ---------------------------------------------------------------------------------------- enforce / unenforce
@dataclass
class EnforceReport:
    """What :func:`enforce` did.

    Attributes:
        alpha: the common factor of the caps (``cap = alpha * max(norm at enforce time, 1)``).
        caps: ``{"<update>.<module>.<tensor>": [cap per part]}``.
        worst_case: the worst-case stack certificate at the caps (certified).
        dtype, depth: what the caps were chosen for.
    """

    alpha: float
    caps: Dict[str, List[float]]
    worst_case: StackCertificate
    dtype: str
    depth: int
    modules: List[Tuple[nn.Module, str]] = field(default_factory=list, repr=False)


def _is_enforced(module: nn.Module, name: str) -> bool:
    return parametrize.is_parametrized(module, name) and any(
        isinstance(p, (NormCap, ScaleClamp, SoftplusCeiling))
        for p in cast(Dict[str, nn.ModuleList], module.parametrizations)[name])


def _worst_stack(plans: List[_Plan], alpha: float, depth: int, ups: CertifiedModel, dtype: str) -> StackCertificate:
    certs = [p.worst(alpha, ups.seq_len) for p in plans]
    full = [certs[k % len(certs)] for k in range(depth)]
    return certify_stack(full, dtype, dt=ups.dt, r0=ups.radius(), lip_g=ups.lip_g)


def _prepare(model: Any, dtype: Union[str, torch.dtype], depth: Optional[int], r0: Optional[float],
             lip_g: Optional[float], seq_len: Optional[int]) -> Tuple[str, CertifiedModel, List[_Plan], int]:
    dt_name = as_precision(dtype).name
    ups = as_certified(model, r0=r0, seq_len=seq_len)
    if not ups.modules:
        raise TypeError(f"{type(ups.module).__name__} has no certified block (no submodule with certificate() and "
                        "exponents) for enforce to cap; convert it with certblocks.convert first, or pass (name, "
                        "module) pairs")
    ups = dataclasses.replace(ups)  # r0 and lip_g are set below for this search only
    if r0 is None and callable(ups.r0):
        ups.r0 = float(ups.r0())  # freeze: the guarantee is for this radius
    if lip_g is not None:
        ups.lip_g = check_real("lip_g", lip_g, gt=0.0, optional=True)
    n = len(ups.modules)
    depth = n if depth is None else check_int("depth", depth, n, optional=True, note="the number of residual updates")
    return dt_name, ups, [_plan(name, m) for name, m in zip(ups.names, ups.modules)], depth


def _search_alpha(plans: List[_Plan], depth: int, ups: CertifiedModel, dt_name: str) -> Tuple[float, StackCertificate]:
    """The largest common factor (bisection on a log scale, then ``* 0.99``) whose worst case is certified."""
    lo, hi = math.log(1e-8), math.log(1e8)
    if not _worst_stack(plans, math.exp(lo), depth, ups, dt_name).ok:
        raise ValueError(f"no caps certify this model in {dt_name} at depth {depth}: even with every norm at "
                         f"1e-8 of its reference the stack is not certified (r0 = {ups.radius():g}, dt = {ups.dt:g})")
    if _worst_stack(plans, math.exp(hi), depth, ups, dt_name).ok:
        lo = hi
    else:
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if _worst_stack(plans, math.exp(mid), depth, ups, dt_name).ok:
                lo = mid
            else:
                hi = mid
    alpha = math.exp(lo) * 0.99
    worst = _worst_stack(plans, alpha, depth, ups, dt_name)
    assert worst.ok
    return alpha, worst


def cap_factor(model: Any, dtype: Union[str, torch.dtype], depth: Optional[int] = None, *,
               r0: Optional[float] = None, lip_g: Optional[float] = None,
               seq_len: Optional[int] = None) -> Tuple[float, StackCertificate]:
    """The cap factor ``alpha`` :func:`enforce` would choose, and its worst-case certificate; registers nothing.

    Same arguments as :func:`enforce`.  ``alpha >= 1`` keeps the current weights; ``alpha < 1`` shrinks them.
    """
    dt_name, ups, plans, depth = _prepare(model, dtype, depth, r0, lip_g, seq_len)
    return _search_alpha(plans, depth, ups, dt_name)


def enforce(model: Any, dtype: Union[str, torch.dtype], depth: Optional[int] = None, *,
            r0: Optional[float] = None, lip_g: Optional[float] = None,
            seq_len: Optional[int] = None) -> EnforceReport:
    """Cap the weights of ``model``'s residual updates so that its certificate holds for every parameter value.

    See the module docstring for the parametrizations and how the caps are chosen.

    Args:
        model: a :class:`~certblocks.CertifiedStack`, a zoo model, a converted model or ``(name, module)``
            pairs (as for :class:`~certblocks.CertificateMonitor`).
        dtype: the dtype the certificate is for, or its precision policy (:func:`certblocks.precision.as_precision`:
            under ``"amp-fp16"`` the capped blocks' intermediates are bounded against fp16, the stream against fp32).
        depth: the number of updates to certify (default: the model's; larger plans for added layers).
        r0: the input radius (default: the model's at this call).
        lip_g: ``Lip(G)`` of the head (default: the model's, 1 for a zoo model); the head is not capped, so a
            head's bound holds while its weights stay as they are.
        seq_len: the longest sequence the guarantee is for (default: the stack's or zoo model's); Mamba blocks
            need one (their bound sums over time), other blocks ignore it.

    Returns:
        An :class:`EnforceReport` (``alpha``, the caps, the worst-case certificate).

    Raises:
        TypeError: an update is not supported, or a tensor is already parametrized.
        ValueError: ``depth`` smaller than the number of updates, or no caps can certify the stack
            (e.g. ``r0`` alone overflows the dtype).
    """
    dt_name, ups, plans, depth = _prepare(model, dtype, depth, r0, lip_g, seq_len)
    for p in plans:
        for sl in p.slots:
            if parametrize.is_parametrized(sl.module, sl.name):
                raise TypeError(f"{p.name}: {type(sl.module).__name__}.{sl.name} is already parametrized; "
                                "call certblocks.unenforce first")
    alpha, worst = _search_alpha(plans, depth, ups, dt_name)
    caps: Dict[str, List[float]] = {}
    done: List[Tuple[nn.Module, str]] = []
    for p in plans:
        paths = {id(m): path for path, m in cast(nn.Module, p.block).named_modules()}
        for sl, refs in zip(p.slots, p.refs):
            values = [alpha * r for r in refs]
            par: nn.Module
            if sl.kind == "clamp":
                par = ScaleClamp(values[0])
            elif sl.kind == "softplus":
                assert sl.lower is not None
                par = SoftplusCeiling(values[0], sl.lower)
            else:
                par = NormCap(sl.sizes, values)
            parametrize.register_parametrization(sl.module, sl.name, par)
            done.append((sl.module, sl.name))
            path = paths.get(id(sl.module))
            caps[".".join(x for x in (p.name, path, sl.name) if x) if path is not None
                 else f"{p.name}:{type(sl.module).__name__}.{sl.name}"] = values
    # a stack's or zoo model's certificate() sees the new parametrizations (new caps buffers) and recomputes
    return EnforceReport(alpha, caps, worst, dt_name, depth, done)


def cap_ratios(model: nn.Module) -> Dict[str, float]:
    """How full each cap is: the effective value over its cap, for every part of every enforced tensor.

    Exact in float64: the spectral norm (SVD) of a capped matrix block, the Euclidean norm of a capped vector
    part, the largest absolute entry of a clamped tensor, the largest ``softplus`` of a ``"softplus"`` one.  A
    ratio is at most 1 whatever the parameters are.

    Returns:
        ``{"<module path>.<tensor>[<part>]": ratio}``.
    """
    out: Dict[str, float] = {}
    for path, m in model.named_modules():
        if not parametrize.is_parametrized(m):
            continue
        for name, plist in m.parametrizations.items():
            t = getattr(m, name).detach().to(torch.float64)
            key = ".".join(x for x in (path, name) if x)
            for par in plist:
                if isinstance(par, NormCap):
                    for j, (p, cap) in enumerate(zip(torch.split(t, par.sizes, dim=0), par.caps.tolist())):
                        n = torch.linalg.matrix_norm(p, ord=2) if p.ndim == 2 else torch.linalg.vector_norm(p)
                        out[f"{key}[{j}]"] = float(n) / cap
                elif isinstance(par, ScaleClamp):
                    out[f"{key}[0]"] = float(t.abs().max()) / par.cap
                elif isinstance(par, SoftplusCeiling):
                    out[f"{key}[0]"] = float(torch.nn.functional.softplus(t).max()) / par.cap
    return out


def unenforce(model: Any) -> int:
    """Remove :func:`enforce`'s parametrizations; each tensor becomes a plain parameter with its current
    effective (capped) value.

    Args:
        model: any ``nn.Module`` (every enforced tensor below it is restored), a wrapper of one, a
            ConversionReport, or ``(name, module)`` pairs.

    Returns:
        The number of tensors restored.
    """
    model = underlying(model)
    if isinstance(model, nn.Module):
        mods = list(model.modules())
    elif isinstance(model, (list, tuple)):
        mods = [m for item in model for m in item[1].modules()]
    else:
        raise TypeError(f"model must be an nn.Module or (name, module) pairs, got {type(model).__name__}")
    count = 0
    for m in mods:
        if not parametrize.is_parametrized(m):
            continue
        for name in list(cast(nn.ModuleDict, m.parametrizations).keys()):
            if _is_enforced(m, name):
                parametrize.remove_parametrizations(m, name, leave_parametrized=True)
                count += 1
    return count

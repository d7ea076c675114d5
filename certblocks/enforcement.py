"""``enforce``: parametrizations that keep a model's certificate true for every weight training can reach.

:func:`enforce` registers ``torch.nn.utils.parametrize`` parametrizations on the weights the
certificate reads, so that the *effective* weights always satisfy caps, whatever the underlying
parameters (the ones the optimizer updates) become:

* a matrix ``W`` (or each row block of a fused one: ``q``, ``k``, ``v`` of ``c_attn``/``qkv``; the value and
  gate halves of a gated MLP's ``fc1``) is used as ``W * min(1, a / ||W||_2)``: spectral norm at most ``a``;
* a bias ``b`` (or each part of a fused one) as ``b * min(1, beta / ||b||_2)``;
* a QK-norm scale ``g`` as ``clamp(g, -gamma, gamma)``; a QK-LayerNorm bias like a bias.

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

**How the caps are chosen.**  For each supported update the certificate's coefficients are
monotone in these norms, and a *worst-case certificate* bounds them from the caps alone (the same
formulas as the blocks' ``certificate()`` with every norm replaced by its cap, and the min/sandwich
refinements dropped): MLP ``c = a2 a1``, ``b = a2 beta1 + beta2``, ``l0 = Lip(phi) a2 a1``;
attention ``c = sqrt(H) a_o a_v``, ``b = a_o beta_v + beta_o``, plain
``l1 = s H a_o a_v (2 a_q a_k + a_k beta_q / 2)``, QK-norm ``l1 = s H a_o a_v (A_k G_q a_q + A_q G_k a_k)``
with ``A = gamma sqrt(d_k) + beta_n`` and ``G = gamma / sqrt(eps)``;
sigmoid-gated MLP ``c = a2 a_g``, ``l1 = a2 a_u a_g / 4``, ``l0 = c + a2 a_u beta_g / 4``.
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

Supported updates: :class:`~certblocks.MLP`, :class:`~certblocks.GatedMLP` (sigmoid gate),
:class:`~certblocks.Attention`, :class:`~certblocks.QKNormAttention` (and their converted adapters),
``PatchTSTUpdate`` (no norm, or LayerNorm / RMSNorm pre / peri: the norms' scales are clamped and
their biases capped too), the zoo's ``NormedUpdate`` around a supported branch, and wrappers with an
``attn`` child (Toto's axis attention).  Others (Mamba blocks, BatchNorm, post-norm) raise
``TypeError``.  The guarantee is for inputs of per-token norm at most ``r0``; a zoo model's ``r0``
comes from its embedding, which is not capped: pass ``r0`` to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from .budget import dtype_name
from .certificate import BlockCertificate, StackCertificate, certify_stack
from .monitor import ResidualUpdates, residual_updates

__all__ = ["enforce", "unenforce", "EnforceReport", "NormCap", "ScaleClamp"]

_FLOOR = 1.0


def _spectral_upper(w: torch.Tensor) -> torch.Tensor:
    """An upper bound of ``||W||_2`` (float64, a 0-d tensor): ``sqrt(lambda_max(G) (1 + rel))``, ``G`` the smaller Gram.

    ``eigvalsh`` is backward stable (error ``<= c n u ||G||``) and forming ``G`` adds at most ``m u ||W||_F^2
    <= m n u ||W||_2^2`` (``u = 2^-53``, ``n <= m`` the sides); ``rel = 1e-14 n + 4e-16 m n`` covers both with room.
    Computed on one thread: multi-threaded LAPACK on these sizes was measured 10-25x slower on a busy CPU.
    """
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=w.device)
    m, n = max(w.shape), min(w.shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
        lam = torch.linalg.eigvalsh(g)[-1].clamp_min(0.0)
    finally:
        torch.set_num_threads(threads)
    return torch.sqrt(lam * (1.0 + 1e-14 * n + 4e-16 * m * n))


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
class NormCap(nn.Module):
    """``x -> x * min(1, cap / ||x||)`` on each row block of a matrix (spectral norm) or part of a vector (l2).

    Args:
        sizes: the sizes of the row blocks (matrices) or parts (vectors) along dim 0, summing to ``x.shape[0]``.
        caps: one cap per block.
    """

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
                n = _spectral_upper(p64) if p.ndim == 2 else torch.linalg.vector_norm(p64) * (1.0 + 1e-15 * p.numel())
                target = self.caps[j].to(p64.device) * (1.0 - _safety(p))
                scale = torch.clamp(target / n.clamp_min(1e-300), max=1.0)
            out.append(p * scale.to(p.dtype))
        return out[0] if len(out) == 1 else torch.cat(out, dim=0)

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, caps={[f'{c:.4g}' for c in self.caps.tolist()]}"


class ScaleClamp(nn.Module):
    """``g -> clamp(g, -cap, cap)``: ``||g||_inf <= cap`` (QK-norm scales)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = float(cap)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        cap = torch.tensor(self.cap, dtype=torch.float64).to(g.dtype)
        if float(cap) > self.cap:  # the cap rounded up in g's dtype: take the next value below
            cap = torch.nextafter(cap, torch.zeros_like(cap))
        cap = cap.to(g.device)
        return torch.minimum(torch.maximum(g, -cap), cap)

    def right_inverse(self, g: torch.Tensor) -> torch.Tensor:
        return g

    def extra_repr(self) -> str:
        return f"cap={self.cap:.4g}"


# ---------------------------------------------------------------------------------------- per-block plans
@dataclass
class _Slot:
    """One capped tensor: ``module.name`` with parts ``sizes``; ``kind`` "matrix", "vector" or "clamp"."""

    module: nn.Module
    name: str
    kind: str
    sizes: List[int]
    refs: List[float]  # reference values (current norms, floored)
    keys: List[str]  # symbolic names used by the worst-case formula


@dataclass
class _Plan:
    name: str
    slots: List[_Slot]
    worst: Any  # callable(caps: Dict[str, float]) -> BlockCertificate


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _ref(parts: Sequence[torch.Tensor], kind: str) -> List[float]:
    out = []
    for p in parts:
        p = _f64(p)
        if kind == "matrix":
            v = float(torch.linalg.matrix_norm(p, ord=2)) if p.numel() else 0.0
        elif kind == "vector":
            v = float(p.norm())
        else:
            v = float(p.abs().max()) if p.numel() else 0.0
        out.append(max(v, _FLOOR))
    return out


def _slot(module: nn.Module, name: str, kind: str, sizes: List[int], keys: List[str]) -> Optional[_Slot]:
    t = getattr(module, name, None)
    if t is None:
        return None
    parts = torch.split(t, sizes, dim=0) if kind != "clamp" else [t]
    return _Slot(module, name, kind, sizes, _ref(parts, kind), keys)


def _linear_slots(lin: nn.Linear, sizes: List[int], wkeys: List[str], bkeys: List[str]) -> List[_Slot]:
    out = [_slot(lin, "weight", "matrix", sizes, wkeys), _slot(lin, "bias", "vector", sizes, bkeys)]
    return [s for s in out if s is not None]


def _plan_mlp(name: str, m: nn.Module) -> _Plan:
    from .blocks._coeffs import act_lipschitz, fold_peak

    slots = _linear_slots(m.fc1, [m.fc1.out_features], ["a1"], ["beta1"]) + \
        _linear_slots(m.fc2, [m.fc2.out_features], ["a2"], ["beta2"])
    lip = act_lipschitz(m.act)

    def worst(a: Dict[str, float]) -> BlockCertificate:
        c = a["a2"] * a["a1"]
        b = a["a2"] * a.get("beta1", 0.0) + a.get("beta2", 0.0)
        peak = fold_peak([{1.0: a["a1"], 0.0: a.get("beta1", 0.0)}, {1.0: c, 0.0: b}], "hidden pre-activation")
        return BlockCertificate(1, 0, c=c, b=b, l1=0.0, l0=lip * c, name=name, peak=peak)
    return _Plan(name, slots, worst)


def _plan_gated(name: str, m: nn.Module) -> _Plan:
    from .blocks._coeffs import fold_peak

    if m.gate != "sigmoid":
        raise TypeError(f"{name}: GatedMLP(gate={m.gate!r}) has q = 2 and cannot be certified in depth; "
                        "use gate='sigmoid'")
    h = m.hidden_dim
    slots = _linear_slots(m.fc1, [h, h], ["ag", "au"], ["betag", "betau"]) + \
        _linear_slots(m.fc2, [m.fc2.out_features], ["a2"], ["beta2"])

    def worst(a: Dict[str, float]) -> BlockCertificate:
        c = a["a2"] * a["ag"]
        b = a["a2"] * a.get("betag", 0.0) + a.get("beta2", 0.0)
        fc1 = {1.0: math.hypot(a["ag"], a["au"]), 0.0: math.hypot(a.get("betag", 0.0), a.get("betau", 0.0))}
        peak = fold_peak([fc1, {0.0: 1.0}, {1.0: c, 0.0: b}], "gate input W_g x, W_u x")
        return BlockCertificate(1, 1, c=c, b=b, l1=0.25 * a["a2"] * a["au"] * a["ag"],
                                l0=c + 0.25 * a["a2"] * a["au"] * a.get("betag", 0.0), name=name, peak=peak)
    return _Plan(name, slots, worst)


def _plan_attention(name: str, m: nn.Module) -> _Plan:
    from .blocks._coeffs import fold_peak

    D, H, s = m.dim, m.num_heads, m.scale
    slots = _linear_slots(m.in_proj, [D, D, D], ["aq", "ak", "av"], ["betaq", "betak", "betav"]) + \
        _linear_slots(m.out_proj, [D], ["ao"], ["betao"])
    qk = m.qk_norm
    if qk is not None:
        eps_q, eps_k, hd = m.q_norm.eps, m.k_norm.eps, m.head_dim
        for tag, norm in (("q", m.q_norm), ("k", m.k_norm)):
            slots.append(_Slot(norm, "weight", "clamp", [hd], _ref([norm.weight], "clamp"), [f"gamma{tag}"]))
            if getattr(norm, "bias", None) is not None:
                sl = _slot(norm, "bias", "vector", [hd], [f"betan{tag}"])
                assert sl is not None
                slots.append(sl)

    def worst(a: Dict[str, float]) -> BlockCertificate:
        mv = a["ao"] * a["av"]
        c = math.sqrt(H) * mv
        b = a["ao"] * a.get("betav", 0.0) + a.get("betao", 0.0)
        betas = [a.get(f"beta{t}", 0.0) for t in "qkv"]
        qkv = {1.0: math.sqrt(a["aq"] ** 2 + a["ak"] ** 2 + a["av"] ** 2), 0.0: math.sqrt(sum(x * x for x in betas))}
        polys = [qkv, {0.0: 1.0}, {1.0: c, 0.0: b}]  # q/k/v, the softmax, the output
        sc = max(1.0, s)
        if qk is None:
            bq = a["ak"] * a.get("betaq", 0.0)
            l1 = s * H * mv * (2.0 * a["aq"] * a["ak"] + 0.5 * bq)
            l0 = c + s * H * mv * 0.5 * bq
            polys.append({2.0: sc * a["aq"] * a["ak"], 1.0: sc * (a["aq"] * betas[1] + a["ak"] * betas[0]),
                          0.0: sc * betas[0] * betas[1]})
            return BlockCertificate(1, 2, c=c, b=b, l1=l1, l0=l0, name=name,
                                    peak=fold_peak(polys, "query-key logits"))

        def out_bound(tag: str) -> float:
            g = a[f"gamma{tag}"]
            return g if qk == "l2" else g * math.sqrt(hd) + a.get(f"betan{tag}", 0.0)

        A_q, A_k = out_bound("q"), out_bound("k")
        G_q, G_k = a["gammaq"] / math.sqrt(eps_q), a["gammak"] / math.sqrt(eps_k)
        l1 = s * H * mv * (A_k * G_q * a["aq"] + A_q * G_k * a["ak"])
        polys.append({0.0: sc * A_q * A_k})
        return BlockCertificate(1, 1, c=c, b=b, l1=l1, l0=c, name=name, peak=fold_peak(polys, "q/k/v projection"))
    return _Plan(name, slots, worst)


def _plan_normed(name: str, inner: _Plan, norm_in: nn.Module, norm_out: Optional[nn.Module]) -> _Plan:
    """A branch behind a LayerNorm / RMSNorm (pre), and optionally one after it (peri): exponents (0, 0).

    Worst case from the caps: ``A = gamma sqrt(d) + beta``, ``G = gamma / sqrt(eps)``; pre ``c = c_F A^q + b_F``,
    ``l0 = L_F(A) G_in``; peri ``c = A_out``, ``l0 = G_out L_F(A_in) G_in`` (the blocks' grid bound is below these).
    """
    from .blocks._coeffs import normalized_peak

    slots = list(inner.slots)
    norms = [("in", norm_in)] + ([("out", norm_out)] if norm_out is not None else [])
    info = {}
    for tag, norm in norms:
        if not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) or getattr(norm, "weight", None) is None:
            raise TypeError(f"{name}: enforce needs an affine nn.LayerNorm or nn.RMSNorm, got {type(norm).__name__}")
        d = norm.normalized_shape[-1]
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        info[tag] = (d, eps)
        slots.append(_Slot(norm, "weight", "clamp", [d], _ref([norm.weight], "clamp"), [f"gamma_{tag}"]))
        if getattr(norm, "bias", None) is not None:
            sl = _slot(norm, "bias", "vector", [d], [f"beta_{tag}"])
            assert sl is not None
            slots.append(sl)

    def worst(a: Dict[str, float]) -> BlockCertificate:
        def bounds(tag: str) -> Tuple[float, float]:
            d, eps = info[tag]
            g = a[f"gamma_{tag}"]
            return g * math.sqrt(d) + a.get(f"beta_{tag}", 0.0), g / math.sqrt(eps)

        branch = inner.worst(a)
        a_in, g_in = bounds("in")
        assert branch.q is not None
        what = "branch intermediates at the normalized radius"
        if norm_out is None:
            c = branch.growth_bound(a_in)
            return BlockCertificate(0, 0, c=c, b=0.0, l1=0.0, l0=branch.jacobian_bound(a_in) * g_in, name=name,
                                    peak=normalized_peak(branch.peak, branch.q, branch.c, branch.b, a_in, c, what))
        a_out, g_out = bounds("out")
        return BlockCertificate(0, 0, c=a_out, b=0.0, l1=0.0, l0=g_out * branch.jacobian_bound(a_in) * g_in,
                                name=name,
                                peak=normalized_peak(branch.peak, branch.q, branch.c, branch.b, a_in, a_out, what))
    return _Plan(name, slots, worst)


def _plan(name: str, m: nn.Module) -> _Plan:
    from .blocks.attention import _SelfAttention
    from .blocks.mlp import MLP, GatedMLP

    if isinstance(m, _SelfAttention):
        return _plan_attention(name, m)
    if isinstance(m, MLP):
        return _plan_mlp(name, m)
    if isinstance(m, GatedMLP):
        return _plan_gated(name, m)
    if type(m).__name__ == "PatchTSTUpdate":
        if m.norm is None:
            return _plan(name, m.branch)
        if m.norm not in ("layer", "rms") or m.placement not in ("pre", "peri"):
            raise TypeError(f"{name}: PatchTSTUpdate with norm={m.norm!r}, placement={m.placement!r} is not "
                            "supported by enforce (norm None, or 'layer'/'rms' with placement 'pre'/'peri')")
        return _plan_normed(name, _plan(name, m.branch), m.norm_in, m.norm_out if m.placement == "peri" else None)
    if type(m).__name__ == "NormedUpdate":
        return _plan_normed(name, _plan(name, m.branch), m.norm, m.norm_out if m.placement == "peri" else None)
    attn = getattr(m, "attn", None)
    if isinstance(attn, _SelfAttention) and len(list(m.children())) == 1:
        return _plan_attention(name, attn)
    raise TypeError(f"enforce does not support update {name!r} ({type(m).__name__}); supported: MLP, "
                    "GatedMLP(gate='sigmoid'), Attention, QKNormAttention, PatchTSTUpdate(norm=None)")


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
        isinstance(p, (NormCap, ScaleClamp)) for p in module.parametrizations[name])


def _worst_stack(plans: List[_Plan], alpha: float, depth: int, ups: ResidualUpdates, dtype: str) -> StackCertificate:
    certs = []
    for p in plans:
        caps: Dict[str, float] = {}
        for sl in p.slots:
            for key, ref in zip(sl.keys, sl.refs):
                caps[key] = alpha * ref
        certs.append(p.worst(caps))
    full = [certs[k % len(certs)] for k in range(depth)]
    return certify_stack(full, dtype, dt=ups.dt, r0=ups.radius(), lip_g=ups.lip_g)


def enforce(model: Any, dtype: Union[str, torch.dtype], depth: Optional[int] = None, *,
            r0: Optional[float] = None) -> EnforceReport:
    """Cap the weights of ``model``'s residual updates so that its certificate holds for every parameter value.

    See the module docstring for the parametrizations and how the caps are chosen.

    Args:
        model: a :class:`~certblocks.CertifiedStack`, a zoo model, a converted model or ``(name, module)``
            pairs (as for :class:`~certblocks.CertificateMonitor`).
        dtype: the dtype the certificate is for.
        depth: the number of updates to certify (default: the model's; larger plans for added layers).
        r0: the input radius (default: the model's at this call).

    Returns:
        An :class:`EnforceReport` (``alpha``, the caps, the worst-case certificate).

    Raises:
        TypeError: an update is not supported, or a tensor is already parametrized.
        ValueError: ``depth`` smaller than the number of updates, or no caps can certify the stack
            (e.g. ``r0`` alone overflows the dtype).
    """
    dt_name = dtype_name(dtype)
    ups = residual_updates(model, r0=r0)
    if r0 is None and callable(ups.r0):
        ups.r0 = float(ups.r0())  # freeze: the guarantee is for this radius
    n = len(ups.modules)
    if depth is None:
        depth = n
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise TypeError(f"depth must be an int >= {n} (the number of updates) or None, got {depth!r}")
    if depth < n:
        raise ValueError(f"depth must be >= the number of residual updates ({n}), got {depth}")
    plans = [_plan(name, m) for name, m in zip(ups.names, ups.modules)]
    for p in plans:
        for sl in p.slots:
            if parametrize.is_parametrized(sl.module, sl.name):
                raise TypeError(f"{p.name}: {type(sl.module).__name__}.{sl.name} is already parametrized; "
                                "call certblocks.unenforce first")
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
    caps: Dict[str, List[float]] = {}
    done: List[Tuple[nn.Module, str]] = []
    for p in plans:
        for sl in p.slots:
            values = [alpha * r for r in sl.refs]
            par: nn.Module = ScaleClamp(values[0]) if sl.kind == "clamp" else NormCap(sl.sizes, values)
            parametrize.register_parametrization(sl.module, sl.name, par)
            done.append((sl.module, sl.name))
            caps[f"{p.name}:{type(sl.module).__name__}.{sl.name}"] = values
    from .stack import CertifiedStack

    if isinstance(model, CertifiedStack):
        model.recertify()
    return EnforceReport(alpha, caps, worst, dt_name, depth, done)


def unenforce(model: Any) -> int:
    """Remove :func:`enforce`'s parametrizations; each tensor becomes a plain parameter with its current
    effective (capped) value.

    Args:
        model: any ``nn.Module`` (every enforced tensor below it is restored), a ConversionReport, or
            ``(name, module)`` pairs.

    Returns:
        The number of tensors restored.
    """
    if hasattr(model, "model") and hasattr(model, "swaps") and isinstance(model.model, nn.Module):
        model = model.model
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
        for name in list(m.parametrizations.keys()):
            if _is_enforced(m, name):
                parametrize.remove_parametrizations(m, name, leave_parametrized=True)
                count += 1
    return count

"""Saturating normalizers: :class:`DyT` (Dynamic Tanh), the pre-normalized update :class:`PreNormed`, the attention
:class:`QKDyTAttention` whose queries and keys pass through a DyT, and the head :func:`dyt_linear_head`.

``DyT(x) = gamma * phi(alpha * x) + beta`` entrywise over the last dimension, ``phi = tanh`` (Dynamic Tanh, Zhu et
al. 2025) or ``erf`` (Derf), ``alpha`` a learnable scalar or one per channel.  Unlike a LayerNorm or an RMSNorm it
has no ``eps``: it is bounded and Lipschitz everywhere (docs/theory.md section 7.2).  Per token, with ``d``
channels, whatever ``x``:

* output: ``|y_i| <= |gamma_i| + |beta_i|``, so ``||y||_2 <= B = || |gamma| + |beta| ||_2`` (at most
  ``||gamma||_inf sqrt(d) + ||beta||_2``);
* Jacobian: ``diag(gamma_i alpha_i phi'(alpha_i x_i))``, of norm at most ``G = max_i |alpha_i gamma_i| sup phi'``
  (``sup tanh' = 1``, ``sup erf' = 2 / sqrt(pi)``);
* intermediates: ``|alpha_i x_i| <= max |alpha| ||x||``, ``|phi| <= 1``, ``|gamma_i phi| <= |gamma_i|``.

So a DyT is ``(q, sigma) = (0, 0)`` with ``c = 0``, ``b = B``, ``l0 = G`` (docs/theory.md section 2.3, the DyT row).

A pre-normalized update ``X + g * f(DyT(X))`` (:class:`PreNormed`: a DyT, a certified branch ``f`` and an optional
:class:`~certblocks.blocks.LayerScale` gain ``g``) is ``(0, 0)`` whatever the branch: the branch sees inputs of norm
at most ``B``, so (docs/theory.md section 7.2)::

    ||v(x)|| <= g (c_f B^q_f + b_f),        ||dv(x)|| <= g L_f(B) G,        L_f(R) = l1_f max(R, 1)^sigma_f + l0_f

and its intermediates are the DyT's (``max |alpha| ||x||``, linear in the radius), the branch's at radius ``B`` and
the output.  The backward budget is then spent as ``sum_k log(1 + l0_k) + log Lip(G)``, independent of the radius.

:class:`QKDyTAttention` is GPT-2 / timm self-attention with a DyT on each head's queries and keys in place of the
RMS QK-norm: the derivation of the QK-norm bound (:mod:`certblocks.blocks.attention`) holds for any normalization
whose output is bounded by ``A`` and whose Jacobian is bounded by ``G``; a DyT over the head dimension has
``A = || |gamma| + |beta| ||_2`` and ``G = max |alpha gamma|``, with no ``1/sqrt(eps)``.

:func:`dyt_linear_head` is the head ``W DyT(x) + b`` (the final DyT and the classifier or LM head):
``Lip(G) = ||W|| max |alpha gamma|`` (times the loss's gradient bound, ``sqrt(2)`` for cross-entropy).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import bounds
from .._validation import check_bool, check_cert_args, check_choice, check_finite, check_int, check_real
from ..bounds.poly import power_terms
from ..certificate import BlockCertificate, Peak
from ..exponents import QK_NORM_ATTENTION, SATURATING, Exponents
from ..fixes import Lever
from ..protocol import CapSlot, EnforceableBlock
from .attention import AttentionNorms, _SelfAttention
from .attention_sources import read_source
from .gain import LayerScale, scaled_certificate

__all__ = ["DyT", "PreNormed", "QKDyTAttention", "DYT_KINDS", "ALPHA_INIT", "dyt_linear_head", "dyt_caps",
           "norm_head_bounds"]

#: The saturating functions ``phi`` of a :class:`DyT`.
DYT_KINDS = ("tanh", "erf")
#: The DyT paper's default initial ``alpha`` (a scalar).
ALPHA_INIT = 0.5


def _phi_constants(kind: str) -> Tuple[float, float]:
    """``(sup |phi|, sup phi')`` of the saturating function (:mod:`certblocks.bounds.activations`)."""
    act = bounds.activation(kind)
    assert act.saturation is not None
    return act.saturation, act.derivative[1]


def dyt_caps(alpha: float, gamma: float, beta: float, *, d: int, kind: str = "tanh") -> Tuple[float, float, float]:
    """``(B, G, E)`` of a DyT over ``d`` channels with ``max |alpha| <= alpha``, ``max |gamma| <= gamma`` and
    ``||beta||_2 <= beta``: output norm ``B = gamma sqrt(d) + beta``, Jacobian ``G = alpha gamma sup phi'`` and
    largest output entry ``E = gamma + beta`` (module docstring)."""
    sat, slope = _phi_constants(kind)
    b = bounds.rounded_up(gamma * sat * math.sqrt(d) + beta, 2)
    g = bounds.rounded_up(alpha * gamma * slope, 2)
    return b, g, bounds.rounded_up(gamma * sat + beta, 2)


class DyT(nn.Module):
    """Dynamic Tanh ``y = weight * tanh(alpha * x) + bias`` over the last dimension: exponents (0, 0), no ``eps``.

    Args:
        dim: number of channels (the last dimension).
        alpha_init: the initial value of ``alpha`` (finite, > 0; the DyT paper's default 0.5).
        per_channel: one ``alpha`` per channel (shape ``(dim,)``) instead of one scalar (shape ``(1,)``).
        kind: ``"tanh"`` (DyT) or ``"erf"`` (Derf's ``erf``, without its shift).
        bias: a learnable ``bias`` (``beta``, initialized to 0); ``weight`` (``gamma``) is initialized to 1.
        device, dtype: as for torch layers.

    Parameters are ``alpha``, ``weight`` and ``bias``, so a LayerNorm's ``weight`` / ``bias`` load into ``gamma`` /
    ``beta`` by name (:meth:`from_module`).
    """

    exponents: ClassVar[Exponents] = SATURATING

    def __init__(self, dim: int, alpha_init: float = ALPHA_INIT, *, per_channel: bool = False, kind: str = "tanh",
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.dim = check_int("dim", dim)
        self.alpha_init = check_real("alpha_init", alpha_init, gt=0.0, note="DyT's initial alpha")
        self.per_channel = check_bool("per_channel", per_channel)
        self.kind = check_choice("kind", kind, DYT_KINDS)
        check_bool("bias", bias)
        dd = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.full((dim if per_channel else 1,), self.alpha_init, **dd))
        self.weight = nn.Parameter(torch.ones(dim, **dd))
        if bias:
            self.bias = nn.Parameter(torch.zeros(dim, **dd))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim) -> (..., dim)``."""
        z = self.alpha * x
        y = self.weight * (torch.tanh(z) if self.kind == "tanh" else torch.erf(z))
        return y if self.bias is None else y + self.bias

    def reset_parameters(self) -> None:
        """``alpha = alpha_init``, ``weight = 1``, ``bias = 0``."""
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)
            self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def init_weights(self) -> None:
        """timm's hook (``VisionTransformer.init_weights`` calls it on every module that has it): the initial values."""
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"{self.dim}, alpha_init={self.alpha_init:g}, per_channel={self.per_channel}, kind={self.kind!r}, "
                f"bias={self.bias is not None}")

    # -- bounds ---------------------------------------------------------------------------------------------
    def _entries(self) -> torch.Tensor:
        """``|gamma_i| sup |phi| + |beta_i|`` per channel (float64)."""
        sat, _ = _phi_constants(self.kind)
        e = self.weight.detach().double().cpu().abs() * sat
        if self.bias is not None:
            e = e + self.bias.detach().double().cpu().abs()
        return e

    def output_bound(self) -> float:
        """``B``: an upper bound of the Euclidean norm of every output token, ``|| |gamma| + |beta| ||_2``."""
        return bounds.rounded_up(bounds.vec_norm(self._entries()), 2)

    def entry_bound(self) -> float:
        """``E``: an upper bound of every output entry, ``max_i |gamma_i| + |beta_i|``."""
        return bounds.rounded_up(float(self._entries().max()), 2)

    def jacobian_bound(self) -> float:
        """``G``: an upper bound of the Jacobian's spectral norm at every input, ``max |alpha_i gamma_i| sup phi'``."""
        _, slope = _phi_constants(self.kind)
        a = self.alpha.detach().double().cpu().abs()
        g = self.weight.detach().double().cpu().abs()
        return bounds.rounded_up(float((a * g).max()) * slope, 2)

    def alpha_bound(self) -> float:
        """``max |alpha|`` (exact): the slope of the intermediate ``alpha * x`` in ``||x||``."""
        return bounds.vec_inf_norm(self.alpha)

    def peak(self) -> Peak:
        """Every intermediate: ``|alpha x| <= max |alpha| ||x||``, ``|phi| <= 1``, the output ``<= E``."""
        sat, _ = _phi_constants(self.kind)
        return Peak(1.0, self.alpha_bound(), max(sat, bounds.vec_inf_norm(self.weight) * sat, self.entry_bound()),
                    "DyT input alpha * x")

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """``(0, 0)``: ``||DyT(x)|| <= B``, ``||dDyT(x)|| <= G`` (module docstring); token-wise, every radius."""
        check_cert_args(seq_len, r0)
        check_finite(self)
        return BlockCertificate(0.0, 0.0, c=0.0, b=self.output_bound(), l1=0.0, l0=self.jacobian_bound(),
                                name="DyT", culprit=f"DyT ({self.kind}): bounded, Jacobian max |alpha gamma|",
                                peak=self.peak())

    # -- enforce ----------------------------------------------------------------------------------------------
    def cap_slots(self, tag: str = "") -> List[CapSlot]:
        """``alpha`` and ``weight`` (``"clamp"``: keys ``alpha<tag>``, ``gamma<tag>``) and ``bias`` (``beta<tag>``)."""
        slots = [CapSlot(self, "alpha", "clamp", (self.alpha.shape[0],), (f"alpha{tag}",)),
                 CapSlot(self, "weight", "clamp", (self.dim,), (f"gamma{tag}",))]
        if self.bias is not None:
            slots.append(CapSlot(self, "bias", "vector", (self.dim,), (f"beta{tag}",)))
        return slots

    def caps_bounds(self, caps: Mapping[str, float], tag: str = "") -> Tuple[float, float, float]:
        """``(B, G, E)`` while ``alpha``, ``weight`` and ``bias`` are within the caps of :meth:`cap_slots`."""
        return dyt_caps(caps[f"alpha{tag}"], caps[f"gamma{tag}"], caps.get(f"beta{tag}", 0.0), d=self.dim,
                        kind=self.kind)

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while the parameters are within their caps."""
        b, g, e = self.caps_bounds(caps)
        sat, _ = _phi_constants(self.kind)
        return BlockCertificate(0.0, 0.0, c=0.0, b=b, l1=0.0, l0=g, name="DyT",
                                peak=Peak(1.0, caps["alpha"], max(sat, e), "DyT input alpha * x"))

    # -- conversion -------------------------------------------------------------------------------------------
    @classmethod
    def from_module(cls, src: nn.Module, *, alpha_init: float = ALPHA_INIT, per_channel: bool = False,
                    kind: str = "tanh") -> DyT:
        """A DyT in place of a LayerNorm / RMSNorm (torch's, timm's, HF's): ``gamma`` and ``beta`` copied from its
        ``weight`` and ``bias`` (1 and 0 when it has none), ``alpha`` at ``alpha_init``.

        The DyT computes another function than the norm (``tanh`` of the raw input instead of its normalization):
        the model needs fine-tuning, as after any conversion.

        Raises:
            TypeError: ``src`` is not a normalization over one last dimension with at most a weight and a bias.
        """
        if not isinstance(src, nn.Module):
            raise TypeError(f"src must be an nn.Module, got {type(src).__name__}")
        weight = getattr(src, "weight", None)
        shape = getattr(src, "normalized_shape", None)
        if isinstance(shape, int):
            shape = (shape,)
        if shape is None and isinstance(weight, torch.Tensor):
            shape = tuple(weight.shape)
        if shape is None:
            size = getattr(src, "hidden_size", None) or getattr(src, "dim", None)
            shape = (int(size),) if isinstance(size, int) else None
        if shape is None or len(tuple(shape)) != 1:
            raise TypeError(f"cannot convert {type(src).__name__} to DyT: need a normalization over one last dimension "
                            f"(normalized_shape or a 1-d weight), got {shape!r}")
        dim = int(tuple(shape)[0])
        bias = getattr(src, "bias", None)
        ref = weight if isinstance(weight, torch.Tensor) else next(iter(src.parameters()), None)
        dd = {"device": None if ref is None else ref.device, "dtype": None if ref is None else ref.dtype}
        out = cls(dim, alpha_init, per_channel=per_channel, kind=kind, bias=True, **dd)
        with torch.no_grad():
            if isinstance(weight, torch.Tensor):
                w = weight.detach()
                if type(src).__name__ == "GemmaRMSNorm":  # Gemma scales by (1 + weight)
                    w = 1.0 + w
                out.weight.copy_(w)
            if isinstance(bias, torch.Tensor):
                out.bias.copy_(bias.detach())
        out.train(src.training)
        return out


# ---------------------------------------------------------------------------------------------- pre-normalized update
def _pre_norm(norm_b: float, jac: float, norm_peak: Peak, branch: BlockCertificate, gain: float,
              name: str, culprit: str) -> BlockCertificate:
    """The ``(0, 0)`` certificate of ``g * f(N(x))`` from the normalization's output bound ``B`` and peak, the
    Jacobian bound ``jac >= sup_x ||J_f(N x)|| ||J_N(x)||``, the branch's certificate and the gain ``g`` (module
    docstring): ``b = g (c_f B^q_f + b_f)``, ``l0 = g jac``; the peak is the normalization's (with its ``R`` term),
    the branch's at radius ``B`` and the output (times ``g`` when ``g > 1``)."""
    if branch.q is None or branch.sigma is None:
        raise ValueError(f"the branch's exponents are not derived: {branch}")
    out = branch.growth_bound(norm_b)
    inner = bounds.peak_poly(branch.peak, branch.q, branch.c, branch.b)
    at_b = math.fsum(coef * (norm_b ** p if p != 0.0 else 1.0) for p, coef in inner.items())
    top = max(norm_peak.b, bounds.rounded_up(at_b, len(inner)), out, out * gain)
    return BlockCertificate(0.0, 0.0, c=0.0, b=bounds.rounded_up(out * gain, 2), l1=0.0,
                            l0=bounds.rounded_up(jac * gain, 2), name=name, culprit=culprit,
                            peak=Peak(norm_peak.q, norm_peak.c, bounds.rounded_up(top, 2), norm_peak.what))


#: The properties of a :class:`PreNormed` (its children take other names).
_VIEW_PROPERTIES = frozenset({"norm_module", "inner", "layer_scale"})
_NORMS = (DyT, nn.LayerNorm, nn.RMSNorm)


class PreNormed(nn.Module):
    """The velocity ``gain(branch(norm(x)))``: a normalization, a certified branch and an optional gain, ``(0, 0)``.

    The normalization is a :class:`DyT` (the certified case: no ``eps``) or an ``nn.LayerNorm`` / ``nn.RMSNorm`` (the
    Pre-LN baseline: its Jacobian bound carries ``1/sqrt(eps)``).

    Args:
        norm: the normalization on the branch's input.
        branch: a certified block (``certificate()``): an attention, an MLP, ...
        gain: a :class:`~certblocks.blocks.LayerScale` on its output, or ``None``.
        names: the three modules' attribute names (``("ln_1", "attn", "ls1")`` in a GPT-2 block, ``("norm1",
            "attn", "ls1")`` in a timm block; the third is unused without a gain): a model's ``residual_updates()``
            builds this velocity as a view of its block's children (not registered in the model, so it adds nothing
            to its ``state_dict``), and a parameter's path reads as in the model.

    Certificate (module docstring), ``B`` the normalization's output bound and ``g`` the gain's largest entry:
    ``b = g (c_f B^q_f + b_f)``, ``l0 = g L_f(B) max |alpha gamma|`` for a DyT; for a LayerNorm / RMSNorm
    ``l0 = g sup_x ||J_f(N x)|| ||J_N(x)||`` (:func:`certblocks.bounds.prenorm_jacobian`).
    """

    exponents: ClassVar[Exponents] = SATURATING

    def __init__(self, norm: nn.Module, branch: nn.Module, gain: Optional[LayerScale] = None,
                 names: Sequence[str] = ("norm", "fn", "ls")) -> None:
        super().__init__()
        if not isinstance(norm, _NORMS):
            raise TypeError(f"norm must be a DyT, nn.LayerNorm or nn.RMSNorm, got {type(norm).__name__}")
        if not callable(getattr(branch, "certificate", None)):
            raise TypeError(f"branch must be a certified block (with certificate()), got {type(branch).__name__}")
        if gain is not None and not isinstance(gain, LayerScale):
            raise TypeError(f"gain must be a LayerScale or None, got {type(gain).__name__}")
        if len(names) != 3 or len(set(map(str, names))) != 3 or set(map(str, names)) & _VIEW_PROPERTIES:
            raise ValueError(f"names must be three distinct attribute names other than {sorted(_VIEW_PROPERTIES)}, "
                             f"got {names!r}")
        self.names = tuple(str(n) for n in names)
        self.add_module(self.names[0], norm)
        self.add_module(self.names[1], branch)
        if gain is not None:
            self.add_module(self.names[2], gain)

    @property
    def norm_module(self) -> nn.Module:
        """The normalization on the branch's input."""
        return getattr(self, self.names[0])

    @property
    def inner(self) -> nn.Module:
        """The branch."""
        return getattr(self, self.names[1])

    @property
    def layer_scale(self) -> Optional[LayerScale]:
        """The gain, or ``None``."""
        return getattr(self, self.names[2], None)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = self.inner(self.norm_module(x), *args, **kwargs)
        return y if self.layer_scale is None else self.layer_scale(y)

    def gain_bound(self) -> float:
        """``max |gamma|`` of the gain (1 without one)."""
        return 1.0 if self.layer_scale is None else self.layer_scale.bound()

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """``(0, 0)`` from the normalization's bounds, the branch's certificate at radius ``B`` and the gain (class
        docstring)."""
        check_cert_args(seq_len, r0)
        check_finite(self)
        norm, branch = self.norm_module, self.inner.certificate(seq_len=seq_len)
        name = f"{type(norm).__name__}+{type(self.inner).__name__}"
        if isinstance(norm, DyT):
            b = norm.output_bound()
            return _pre_norm(b, branch.jacobian_bound(b) * norm.jacobian_bound(), norm.peak(), branch,
                             self.gain_bound(), name, f"pre-DyT branch: Jacobian L_f(B) max|alpha gamma|, B = {b:.4g}")
        b, _ = bounds.module_norm_bounds(norm)
        return _pre_norm(b, bounds.prenorm_jacobian(norm, branch.jacobian_bound), Peak(0.0, 0.0, b), branch,
                         self.gain_bound(), name, "pre-normalized branch: Jacobian ~ 1/sqrt(eps) of the norm")

    def velocity_io(self) -> Tuple[nn.Module, nn.Module]:
        """``(norm, gain or branch)``: the modules a model's forward calls for this update (a view is not called
        itself): the normalization receives the state ``X_k``, the last one returns ``v(X_k)``."""
        return self.norm_module, self.inner if self.layer_scale is None else self.layer_scale

    def levers(self) -> List[Lever]:
        """``init_values`` when there is a gain: the certificate at a gain ``v`` is this one scaled by
        ``v / max |gamma|`` (the gain multiplies every coefficient of the whole update)."""
        g = self.gain_bound()
        if self.layer_scale is None or not g > 0:
            return []
        return [Lever("init_values", g, False, lambda cert, v: _rescaled(cert, v / g))]

    def _enforceable(self) -> EnforceableBlock:
        branch = self.inner
        if not isinstance(self.norm_module, DyT) or not isinstance(branch, EnforceableBlock):
            raise TypeError(f"enforce supports a DyT before a branch with cap_slots() / certificate_from_caps(), got "
                            f"{type(self.norm_module).__name__} and {type(branch).__name__}")
        return branch

    def cap_slots(self) -> List[CapSlot]:
        """The DyT's slots (``alpha_in``, ``gamma_in``, ``beta_in``), the branch's and the gain's (``"gain"``)."""
        slots = self.norm_module.cap_slots("_in") + self._enforceable().cap_slots()
        if self.layer_scale is not None:
            slots.append(CapSlot(self.layer_scale, "gamma", "clamp", (self.layer_scale.gamma.shape[0],), ("gain",)))
        return slots

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while the DyT, the branch and the gain are within their caps."""
        branch = self._enforceable().certificate_from_caps(caps, seq_len=seq_len)
        norm = self.norm_module
        b, g, e = norm.caps_bounds(caps, "_in")
        sat, _ = _phi_constants(norm.kind)
        peak = Peak(1.0, caps["alpha_in"], max(sat, e), "DyT input alpha * x")
        return _pre_norm(b, branch.jacobian_bound(b) * g, peak, branch, caps["gain"] if self.layer_scale is not None
                         else 1.0, f"DyT+{type(self.inner).__name__}", "pre-DyT branch at its caps")


def _rescaled(cert: BlockCertificate, factor: float) -> BlockCertificate:
    """A ``(0, 0)`` pre-normalized certificate at a gain ``factor`` times the current one: ``b`` and ``l0`` scaled,
    the peak kept when the factor is at most 1 (its intermediates do not grow when the gain shrinks)."""
    if factor > 1.0:
        return scaled_certificate(cert, factor)
    return dataclasses.replace(cert, b=bounds.rounded_up(cert.b * factor), l0=bounds.rounded_up(cert.l0 * factor))


# ---------------------------------------------------------------------------------------------- DyT on queries and keys
class QKDyTAttention(_SelfAttention):
    """GPT-2 / timm self-attention with a :class:`DyT` on each head's queries and keys: exponents (1, 1), no ``eps``.

    ``q_norm`` and ``k_norm`` are DyTs over the head dimension (``alpha``, ``weight``, ``bias``); the block's input
    is not normalized (behind a :class:`PreNormed` it is).  The certificate is the QK-norm one
    (:mod:`certblocks.blocks.attention`) with the DyT's ``A = || |gamma| + |beta| ||`` and ``G = max |alpha gamma|``
    in place of the RMS norm's ``||g|| sqrt(d_k)`` and ``||g|| / sqrt(eps)``:
    ``L(R) <= c + s R sum_h ||M_h|| (A_k G_q ||W_Q^h|| + A_q G_k ||W_K^h||)``, every logit below ``s A_q A_k``.

    Args:
        dim: model width.
        num_heads: number of heads (must divide ``dim``).
        qk_alpha_init: the initial ``alpha`` of the query and key DyTs.
        causal, bias, qkv_bias, proj_bias, attn_dropout, resid_dropout, scale, naming, device, dtype: as for
            :class:`~certblocks.blocks.QKNormAttention`.
    """

    exponents: ClassVar[Exponents] = QK_NORM_ATTENTION

    def __init__(self, dim: int, num_heads: int, *, qk_alpha_init: float = 1.0, causal: bool = True,
                 bias: bool = True, qkv_bias: Optional[bool] = None, proj_bias: Optional[bool] = None,
                 attn_dropout: float = 0.0, resid_dropout: float = 0.0, scale: Optional[float] = None,
                 naming: str = "gpt2", device=None, dtype=None) -> None:
        super().__init__(dim, num_heads, causal=causal, bias=bias, qkv_bias=qkv_bias, proj_bias=proj_bias,
                         qk_norm=None, attn_dropout=attn_dropout, resid_dropout=resid_dropout, scale=scale,
                         naming=naming, device=device, dtype=dtype)
        dd = {"device": device, "dtype": dtype}
        self.qk_norm = "dyt"  # not "rms"/"l2": the fused RMS path is never taken, q_norm/k_norm are called
        self.q_norm = DyT(self.head_dim, qk_alpha_init, **dd)
        self.k_norm = DyT(self.head_dim, qk_alpha_init, **dd)
        self.fused_qk_norm = False

    def _certificate(self, n: AttentionNorms) -> BlockCertificate:
        return dataclasses.replace(
            super()._certificate(n), name=type(self).__name__,
            culprit="QK-DyT attention: Jacobian ~ R through the spread of the values (no 1/sqrt(eps))",
            fix="give the branch a small gain (init_values), a smaller dt, or a DyT on its input (PreNormed)")

    def levers(self) -> List[Lever]:
        """None: there is no ``eps`` (a branch gain is :class:`PreNormed`'s or ``ScaledBranch``'s)."""
        return []

    def cap_slots(self) -> List[CapSlot]:
        """The projections' slots (as :class:`~certblocks.blocks.QKNormAttention`) and the DyTs' (``alphaq``,
        ``gammaq``, ``betaq`` / ``...k``)."""
        slots = [s for s in super().cap_slots() if s.module not in (self.q_norm, self.k_norm)]
        return slots + self.q_norm.cap_slots("q") + self.k_norm.cap_slots("k")

    def _caps_norms(self, caps: Mapping[str, float]) -> AttentionNorms:
        """Every projection block at its cap (as the base class) and the DyTs' ``A``, ``G`` at theirs."""
        H = self.num_heads
        aq, ak, av, ao = caps["aq"], caps["ak"], caps["av"], caps["ao"]
        bq, bk, bv = (caps.get(f"beta{t}", 0.0) for t in "qkv")
        (a_q, g_q, _), (a_k, g_k, _) = (norm.caps_bounds(caps, t) for t, norm in (("q", self.q_norm),
                                                                                  ("k", self.k_norm)))
        return AttentionNorms(value=(ao * av,) * H, c=math.sqrt(H) * ao * av, b=ao * bv + caps.get("betao", 0.0),
                              w_in=math.sqrt(aq * aq + ak * ak + av * av), b_in=math.sqrt(bq * bq + bk * bk + bv * bv),
                              wq=(aq,) * H, wk=(ak,) * H, a_q=a_q, a_k=a_k, g_q=g_q, g_k=g_k)

    def _peak(self, n: AttentionNorms) -> Peak:
        """The base peak (q/k/v, logits ``s A_q A_k``, output) and the DyTs' inputs ``alpha W_Q x``."""
        base = super()._peak(n)
        slope = max(self.q_norm.alpha_bound() * max(n.wq), self.k_norm.alpha_bound() * max(n.wk))
        const = max(self.q_norm.alpha_bound(), self.k_norm.alpha_bound()) * n.b_in
        return bounds.fold_peak([power_terms(base.q, base.c, base.b), {1.0: slope, 0.0: const}, {0.0: 1.0}],
                                base.what)

    @classmethod
    def from_module(cls, src: nn.Module, *, qk_alpha_init: float = 1.0, **overrides: Any) -> QKDyTAttention:
        """Build from nanoGPT ``CausalSelfAttention``, HF ``GPT2Attention``, timm ``Attention`` or a certblocks
        attention: the projections are copied, the query and key DyTs start at ``alpha = qk_alpha_init``,
        ``gamma = 1``, ``beta = 0`` (a source's own QK-norm is not copied: it normalizes, a DyT saturates)."""
        _, cfg, sd = read_source(src)
        cfg.pop("qk_norm", None)
        cfg.pop("qk_norm_eps", None)
        cfg.update(overrides)
        block = cls(qk_alpha_init=qk_alpha_init, **cfg)
        own = block.state_dict()
        sd = {k: v for k, v in sd.items() if not k.startswith(("q_norm.", "k_norm."))}
        sd.update({k: v for k, v in own.items() if k.startswith(("q_norm.", "k_norm."))})
        block.load_state_dict(sd, strict=True)
        return block


# ---------------------------------------------------------------------------------------------- the head
def norm_head_bounds(norm: nn.Module) -> Tuple[float, float]:
    """``(A, G)`` of a head's normalization: a :class:`DyT` (``B``, ``max |alpha gamma|``) or a LayerNorm / RMSNorm
    (:func:`certblocks.bounds.module_norm_bounds`)."""
    if isinstance(norm, DyT):
        return norm.output_bound(), norm.jacobian_bound()
    return bounds.module_norm_bounds(norm)


def dyt_linear_head(norms: Sequence[nn.Module], linear: Optional[nn.Linear], name: str) -> BlockCertificate:
    """The map certificate of ``linear(norm_k(... norm_1(x)))``, the first normalization a :class:`DyT` (a LayerNorm
    or RMSNorm may follow): growth ``||W|| A_k + ||b||`` whatever ``x`` (q = 0), Jacobian ``||W|| prod G`` (sigma =
    0); every entry below the first DyT's ``max |alpha| ||x||`` (its input ``alpha * x``, linear in the radius), the
    normalizations' outputs and the logits (``max_i ||w_i|| A_k + max |b|``).  Token pooling between the
    normalizations (the class token, the mean over tokens) has norm 1 in the per-token norm.

    Args:
        norms: the normalizations in order (at least one; the first a :class:`DyT`).
        linear: the classifier / LM head, or ``None`` (the normalizations alone).
        name: the certificate's label.
    """
    norms = list(norms)
    if not norms or not isinstance(norms[0], DyT):
        raise ValueError("a DyT head needs a DyT as its first normalization (its input bound is linear in ||x||)")
    a, g, entries = 0.0, 1.0, []
    for norm in norms:
        a, gk = norm_head_bounds(norm)
        g *= gk
        entries.append(norm.peak().b if isinstance(norm, DyT) else a)
    top = max(entries)
    if linear is None:
        return BlockCertificate(0.0, 0.0, c=0.0, b=a, l1=0.0, l0=bounds.rounded_up(g, len(norms)), name=name,
                                kind="map", peak=Peak(1.0, norms[0].alpha_bound(), top, "DyT input alpha * x"))
    w = bounds.op_norm(linear.weight)
    bias = bounds.vec_norm(linear.bias)
    logits = bounds.row_norm_max(linear.weight) * a + bounds.vec_inf_norm(linear.bias)
    return BlockCertificate(0.0, 0.0, c=0.0, b=bounds.rounded_up(w * a + bias, 2), l1=0.0,
                            l0=bounds.rounded_up(w * g, len(norms) + 1), name=name, kind="map",
                            peak=Peak(1.0, norms[0].alpha_bound(), bounds.rounded_up(max(top, logits), 2),
                                      "DyT input alpha * x"))


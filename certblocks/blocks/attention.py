"""Multi-head self-attention velocities: :class:`QKNormAttention` (certified, (1, 1)) and :class:`Attention` ((1, 2)).

Both are GPT-2 style self-attention (one fused input projection ``dim -> 3 dim`` split
into queries, keys and values, one output projection) computed with
``F.scaled_dot_product_attention``.  :class:`QKNormAttention` normalizes each head's
queries and keys (RMS, L2 or LayerNorm with a learnable scale, as in ViT-22B, OLMo-2 and
timm's ``qk_norm``); the input itself is not normalized.  The block is a velocity: the
residual ``X + dt * v(X)`` is added by the stack.

Parameter names follow the checkpoint the block replaces, chosen by ``naming``:

* ``naming="gpt2"`` (default): ``c_attn``, ``c_proj`` (nanoGPT, HF GPT-2);
* ``naming="timm"``: ``qkv``, ``proj`` (timm ``Attention``).

The QK-norm scales are ``q_norm.weight`` / ``k_norm.weight`` (and ``.bias`` for
``qk_norm="layer"``) in both namings, as in timm.  ``in_proj`` / ``out_proj`` are
name-independent aliases of the two projections.

Certificates (per-token norm ``||X|| = max_i ||x_i||_2``; the Jacobian bound is an upper
bound of the operator norm induced by that norm, through ``max_i sum_j ||dy_i/dx_j||_2``)
bound the block with dropout inactive (``eval()`` or ``p = 0``).  With ``M_h = W_O^h W_V^h``,
``kappa_h = ||W_Q^{hT} W_K^h||``, ``beta_h = ||W_K^{hT} b_Q^h||`` and ``s`` the logit scale:

* growth (both): ``||v(X)|| <= c ||X|| + b`` with ``c = min(sum_h ||M_h||, sqrt(H) ||[M_1 .. M_H]||)``
  and ``b = ||W_O b_V + b_O||`` (each output token is a convex combination of value vectors);
* Jacobian, plain attention: ``L(R) <= c + s sum_h ||M_h|| (2 kappa_h R^2 + beta_h R)``; the
  ``R^2`` term is attained on the cone where a query has two tied maximal logits;
* Jacobian, QK-norm: ``L(R) <= c + s R sum_h ||M_h|| (A_k G_q ||W_Q^h|| + A_q G_k ||W_K^h||)``,
  where ``A`` bounds the normalized vector (``||g||_inf sqrt(d_k)`` for RMS) and ``G`` bounds
  the normalization's Jacobian (``||g||_inf / sqrt(eps)``).

Derivation (one head, query ``i``, attention row ``P_i``, ``xbar_i = sum_k P_ik x_k``):
``dy_i/dx_j = P_ij M + s P_ij W_O W_V (x_j - xbar_i) q_i^T W_K + [i = j] s W_O W_V C_i W_K^T W_Q``
with ``C_i = sum_k P_ik (x_k - xbar_i)(x_k - xbar_i)^T``; then ``sum_j P_ij ||x_j - xbar_i|| <= R``
and ``||C_i|| <= R^2`` (the spread of points in a ball).  QK-norm replaces ``W_K^T q_i`` and
``W_Q`` by the normalized vectors and the normalizations' Jacobians.

In this norm none of the bounds depends on the sequence length ``n`` (docs/theory.md section 2.5's factor
``n`` belongs to the Frobenius norm over all tokens); ``seq_len=1`` is used to tighten
(the block is then linear).  The QK-norm coefficient ``l1`` grows like ``1/sqrt(eps)``: it
is attained near a query whose projection vanishes (``tests/blocks/test_growth.py``); a
larger ``qk_norm_eps`` lowers it.

Speed: in eager mode, ``"rms"``/``"l2"`` QK-norm runs through a fused split-and-normalize
``autograd.Function`` with a hand-written backward; :meth:`forward_reference` is its plain
twin, and under ``torch.compile`` the plain composition is traced (inductor fuses it).

Tracing: ``torch.fx`` keeps the fused function and the mask construction as leaf calls
(``torch.fx.wrap``), so a traced graph computes exactly what eager mode computes and has no
control flow on tensor values; TorchScript compiles the plain composition (set
``fused_qk_norm = False`` before ``torch.fx`` tracing a module that will be scripted).  The
input checks run in eager mode only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from .. import bounds
from .._validation import (
    check_bool,
    check_cert_args,
    check_choice,
    check_finite,
    check_input,
    check_int,
    check_prob,
    check_real,
)
from ..certificate import BlockCertificate, Peak
from ..exponents import ATTENTION, QK_NORM_ATTENTION, Exponents
from ..fixes import Lever, scale_l1
from ..protocol import CapSlot, linear_cap_slots
from .attention_sources import read_source
from .masks import attention_mask
from .qk_norm import QK_NORMS, QKNorm, SplitQKVRMSNorm
from .stats import stats

__all__ = ["Attention", "AttentionNorms", "QKNormAttention", "QKNorm", "attention_mask", "check_input"]

_NAMINGS = {"gpt2": ("c_attn", "c_proj"), "timm": ("qkv", "proj")}


def split_qkv_rms_norm(qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                       num_heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`SplitQKVRMSNorm` as a function: a leaf call in a ``torch.fx`` graph (each output ``(B, nh, T, hs)``)."""
    return SplitQKVRMSNorm.apply(qkv, wq, wk, eps, num_heads)


# leaf calls under torch.fx symbolic tracing (timm's FX feature extraction, torchvision's create_feature_extractor):
# the autograd.Function and the checks of the masks are not traced through
torch.fx.wrap("split_qkv_rms_norm")
torch.fx.wrap("attention_mask")


@dataclass(frozen=True)
class AttentionNorms:
    """The norms an attention certificate reads (upper bounds), per head ``h`` where it matters.

    With ``M_h = W_O^h W_V^h``, ``s`` the logit scale and ``H`` heads:

    Attributes:
        value: ``||M_h||`` per head.
        c: the value path's growth, at most ``sum_h ||M_h||`` and ``sqrt(H) ||[M_1 .. M_H]||``.
        b: ``||W_O b_V + b_O||``.
        w_in, b_in: ``||W_qkv||``, ``||b_qkv||`` (the projection's peak).
        kappa: ``||W_Q^{hT} W_K^h||`` per head (plain attention).
        beta: ``||W_K^{hT} b_Q^h||`` per head (plain attention).
        cross: ``max_h ||W_K^{hT} b_Q^h|| + ||W_Q^{hT} b_K^h||`` (the logits' linear term).
        const: ``max_h ||b_Q^h|| ||b_K^h||`` (the logits' constant).
        wq, wk: ``||W_Q^h||``, ``||W_K^h||`` per head (QK-norm).
        a_q, a_k: output bounds of the query/key normalizations (QK-norm).
        g_q, g_k: their Jacobian bounds (QK-norm).
        linear: one token (``seq_len=1``): the block is the linear map ``W_O W_V x + b``, ``c`` its exact norm.
    """

    value: Tuple[float, ...]
    c: float
    b: float
    w_in: float
    b_in: float
    kappa: Tuple[float, ...] = ()
    beta: Tuple[float, ...] = ()
    cross: float = 0.0
    const: float = 0.0
    wq: Tuple[float, ...] = ()
    wk: Tuple[float, ...] = ()
    a_q: float = 0.0
    a_k: float = 0.0
    g_q: float = 0.0
    g_k: float = 0.0
    linear: bool = False


class _SelfAttention(nn.Module):
    """Shared implementation of :class:`Attention` and :class:`QKNormAttention`."""

    exponents: ClassVar[Exponents] = ATTENTION
    # properties TorchScript does not compile (a module returned by name)
    __jit_unused_properties__ = ["in_proj", "out_proj"]

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, bias: bool = True,
                 qkv_bias: Optional[bool] = None, proj_bias: Optional[bool] = None,
                 qk_norm: Optional[str] = None, qk_norm_eps: float = 1e-6, attn_dropout: float = 0.0,
                 resid_dropout: float = 0.0, scale: Optional[float] = None, naming: str = "gpt2",
                 device=None, dtype=None) -> None:
        super().__init__()
        dim = check_int("dim", dim)
        num_heads = check_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        for name, flag in (("causal", causal), ("bias", bias)):
            check_bool(name, flag)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        proj_bias = bias if proj_bias is None else proj_bias
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.causal = causal
        if scale is None:
            scale = self.head_dim ** -0.5
        self.scale = check_real("scale", scale, gt=0.0, note="None: 1/sqrt(head_dim)")
        self.naming = check_choice("naming", naming, tuple(_NAMINGS))
        self._in_name, self._out_name = _NAMINGS[naming]
        dd = {"device": device, "dtype": dtype}
        self.add_module(self._in_name, nn.Linear(dim, 3 * dim, bias=bool(qkv_bias), **dd))
        if qk_norm is None:
            self.qk_norm: Optional[str] = None
            self.q_norm: nn.Module = nn.Identity()
            self.k_norm: nn.Module = nn.Identity()
        else:
            self.qk_norm = check_choice("qk_norm", qk_norm, QK_NORMS)
            self.q_norm = QKNorm(self.head_dim, qk_norm, eps=qk_norm_eps, **dd)
            self.k_norm = QKNorm(self.head_dim, qk_norm, eps=qk_norm_eps, **dd)
        self.add_module(self._out_name, nn.Linear(dim, dim, bias=bool(proj_bias), **dd))
        self.attn_dropout = nn.Dropout(check_prob("attn_dropout", attn_dropout))
        self.resid_dropout = nn.Dropout(check_prob("resid_dropout", resid_dropout))
        #: eager mode normalizes "rms"/"l2" queries and keys with the fused SplitQKVRMSNorm; False: the plain
        #: composition everywhere (what TorchScript compiles; timm's set_scriptable(True) sets it for the zoo's ViT)
        self.fused_qk_norm = True

    # -- name-independent aliases ---------------------------------------------------------------------------
    @property
    def in_proj(self) -> nn.Linear:
        """The fused query/key/value projection (``c_attn`` or ``qkv``)."""
        return getattr(self, self._in_name)

    @property
    def out_proj(self) -> nn.Linear:
        """The output projection (``c_proj`` or ``proj``)."""
        return getattr(self, self._out_name)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, causal={self.causal}, qk_norm={self.qk_norm!r}, "
                f"naming={self.naming!r}")

    # -- forward --------------------------------------------------------------------------------------------
    def _project_in(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "qkv"):  # evaluated when TorchScript compiles: only the existing branch is compiled
            return self.qkv(x)
        return self.c_attn(x)

    def _project_out(self, y: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "proj"):
            return self.proj(y)
        return self.c_proj(y)

    def _mask(self, x: torch.Tensor, T: int, attn_mask: Optional[torch.Tensor],
              key_padding_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """An additive float mask (B or 1, nh or 1, T, T), or None when only the causal mask applies."""
        if attn_mask is None and key_padding_mask is None:
            return None
        return attention_mask(x, self.causal, attn_mask, key_padding_mask, dtype)

    def _qkv(self, x: torch.Tensor, fast: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not torch.jit.is_scripting():
            # eager fast path; under torch.compile the plain composition is traced (inductor fuses it itself)
            if (fast and self.fused_qk_norm and self.qk_norm in ("rms", "l2") and self.q_norm.eps == self.k_norm.eps
                    and not torch.compiler.is_compiling()):
                wq, wk, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
                if self.qk_norm == "l2":  # g x / sqrt(||x||^2 + eps) = (g / sqrt(hs)) x / sqrt(mean(x^2) + eps / hs)
                    c = self.head_dim ** -0.5
                    wq, wk, eps = wq * c, wk * c, eps / self.head_dim
                return split_qkv_rms_norm(self._project_in(x), wq, wk, eps, self.num_heads)  # each (B, nh, T, hs)
        B, T, C = x.shape
        qkv = self._project_in(x).view(B, T, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, T, hs)
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The velocity ``v(x)``.

        Args:
            x: ``(batch, seq_len, dim)``.
            attn_mask: optional mask broadcastable to ``(batch, num_heads, seq_len, seq_len)``: bool
                (``True`` = may attend, as in ``scaled_dot_product_attention``) or floating (added to the
                logits); combined with the causal mask when ``causal=True``.
            key_padding_mask: optional bool ``(batch, seq_len)``, ``True`` marks padded keys (ignored), as in
                ``nn.MultiheadAttention``.  A query whose keys are all masked attends uniformly (no NaN).

        Returns:
            ``(batch, seq_len, dim)``.
        """
        if not torch.jit.is_scripting():
            check_input(x, self.dim, self.in_proj.weight, ndim=3)
        B, T, C = x.shape
        q, k, v = self._qkv(x)
        mask = self._mask(x, T, attn_mask, key_padding_mask, q.dtype)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.attn_dropout.p if self.training else 0.0,
            is_causal=self.causal and mask is None, scale=self.scale)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, nh*hs)
        return self.resid_dropout(self._project_out(y))

    def forward_reference(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                          key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Plain-torch twin of :meth:`forward` (explicit softmax, no dropout), used by the tests."""
        check_input(x, self.dim, self.in_proj.weight, ndim=3)
        B, T, C = x.shape
        q, k, v = self._qkv(x, fast=False)
        logits = (q @ k.transpose(-2, -1)) * self.scale  # (B, nh, T, T)
        mask = attention_mask(x, self.causal, attn_mask, key_padding_mask, q.dtype)
        if mask is not None:
            logits = logits + mask
        y = logits.softmax(dim=-1) @ v
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))

    # -- certificate ----------------------------------------------------------------------------------------
    def _head_weights(self) -> Dict[str, Any]:
        """float64 CPU copies of the weights, per head where it matters: ``wq, wk, wv`` are ``(H, d_k, D)``,
        ``wo`` is ``(H, D, d_k)``, ``bq, bk`` are ``(H, d_k)`` or ``None``."""
        D, hd, H = self.dim, self.head_dim, self.num_heads
        w = self.in_proj.weight.detach().double().cpu()
        wo = self.out_proj.weight.detach().double().cpu()
        b = None if self.in_proj.bias is None else self.in_proj.bias.detach().double().cpu()
        bo = None if self.out_proj.bias is None else self.out_proj.bias.detach().double().cpu()
        return {"wq": w[:D].reshape(H, hd, D), "wk": w[D:2 * D].reshape(H, hd, D), "wv": w[2 * D:].reshape(H, hd, D),
                "wo": wo.reshape(D, H, hd).permute(1, 0, 2),
                "bq": None if b is None else b[:D].reshape(H, hd),
                "bk": None if b is None else b[D:2 * D].reshape(H, hd),
                "b_in": b, "wo_full": wo, "wv_full": w[2 * D:], "bv_full": None if b is None else b[2 * D:], "bo": bo}

    def _in_proj_norm(self) -> float:
        """``||W_qkv||``: bounds every query, key and value entry (the projection's peak)."""
        return bounds.op_norm(self.in_proj.weight)

    def _norms(self, seq_len: Optional[int]) -> AttentionNorms:
        """The norms of the current weights (exact up to the bounds layer's margin; heads batched)."""
        hw = self._head_weights()
        H = self.num_heads
        value = tuple(bounds.product_norms(hw["wo"], hw["wv"]))  # ||W_O^h W_V^h||
        bias = torch.zeros(self.dim, dtype=torch.float64)
        if hw["bv_full"] is not None:
            bias = bias + hw["wo_full"] @ hw["bv_full"]
        if hw["bo"] is not None:
            bias = bias + hw["bo"]
        b = bounds.vec_norm(bias)
        if seq_len == 1:  # one token: v(x) = W_O W_V x + bias exactly
            c = bounds.product_norm(hw["wo_full"], hw["wv_full"])
        else:
            # ||[M_1 .. M_H]|| = ||W_O blockdiag(R_h^T)|| with W_V^h = (Q_h R_h)^T.  Rounding: R_h is exact for
            # W_V^h + E_h, ||E_h||_F <= 8 D d_k u ||W_V^h||_F (Householder QR), which moves the norm by at most
            # ||W_O|| max_h ||E_h|| (||W_O|| <= sqrt(sum_h ||W_O^h||^2)); the products W_O^h R_h^T err by
            # gamma_{d_k} ||W_O||_F ||W_V||_F
            with bounds.one_thread():
                r = torch.linalg.qr(hw["wv"].mT, mode="r")[1]  # (H, d_k, d_k)
            blocks = hw["wo"] @ r.mT  # (H, D, d_k)
            u = bounds.UNIT_ROUNDOFF
            wo_norm = math.sqrt(math.fsum(n * n for n in bounds.op_norms(hw["wo"]))) * (1.0 + 2.0 * H * u)
            err = (8.0 * self.dim * self.head_dim * u * wo_norm
                   * float(torch.linalg.vector_norm(hw["wv"], dim=(-2, -1)).max()) * (1.0 + 1e-12)
                   + 2.0 * self.head_dim * u * bounds.vec_norm(hw["wo_full"]) * bounds.vec_norm(hw["wv_full"]))
            concat = bounds.op_norm(blocks.permute(1, 0, 2).reshape(self.dim, -1)) + err
            c = min(math.fsum(value), math.sqrt(H) * concat)
        common = dict(value=value, c=c, b=b, w_in=self._in_proj_norm(),
                      b_in=bounds.vec_norm(hw["b_in"]), linear=seq_len == 1)
        if self.qk_norm is not None:
            return AttentionNorms(**common, wq=tuple(bounds.op_norms(hw["wq"])), wk=tuple(bounds.op_norms(hw["wk"])),
                                  a_q=self.q_norm.output_bound(), a_k=self.k_norm.output_bound(),
                                  g_q=self.q_norm.jacobian_bound(), g_k=self.k_norm.jacobian_bound())
        kappa = tuple(bounds.product_norms(hw["wq"].mT, hw["wk"]))  # ||W_Q^{hT} W_K^h||
        bq = [None] * H if hw["bq"] is None else list(hw["bq"])
        bk = [None] * H if hw["bk"] is None else list(hw["bk"])
        beta = tuple(0.0 if q is None else bounds.vec_norm(wk.T @ q) for wk, q in zip(hw["wk"], bq))
        cross = max(bt + (0.0 if k is None else bounds.vec_norm(wq.T @ k)) for wq, bt, k in zip(hw["wq"], beta, bk))
        return AttentionNorms(**common, kappa=kappa, beta=beta, cross=cross,
                              const=max(bounds.vec_norm(q) * bounds.vec_norm(k) for q, k in zip(bq, bk)))

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """Certificate of this velocity from its current weights (dropout inactive).

        Args:
            seq_len: number of tokens ``n``.  Optional: in the per-token norm the bounds hold for every
                ``n``; ``seq_len=1`` gives the exact linear bound (``l1 = 0``).
            r0: accepted for a uniform block API; the coefficients are global (valid at every radius),
                so ``r0`` does not change them.

        Returns:
            A :class:`BlockCertificate` with ``(q, sigma)`` = :attr:`exponents`.
        """
        check_cert_args(seq_len, r0)
        check_finite(self)
        return self._certificate(self._norms(seq_len))

    def attention_stats(self, x: Optional[torch.Tensor] = None, *, samples: int = 8, kappa: bool = True,
                        warm: Optional[Dict[str, torch.Tensor]] = None, iters: int = 50,
                        generator: Optional[torch.Generator] = None) -> Dict[str, Any]:
        """``{"kappa", "max_logit", "qk_norm"}``: the query-key coefficient ``max_h ||W_Q^{hT} W_K^h||`` (power
        iteration from ``warm``'s vectors, ``iters`` steps; ``kappa=False`` skips it) and the largest logit on the
        first ``samples`` samples of ``x`` (``None`` without ``x``); diagnostics, :mod:`certblocks.blocks.stats`."""
        return stats(self._head_weights, lambda xs: self._qkv(xs, fast=False)[:2], self.scale, self.causal,
                     self.qk_norm is not None, x, samples=samples, kappa=kappa, warm=warm, iters=iters,
                     generator=generator)

    def levers(self) -> List[Lever]:
        """With QK-norm, ``qk_norm_eps``: ``G = ||g||_inf / sqrt(eps)`` is the only place ``eps`` enters the bound, so
        ``l1`` at a common ``eps'`` is at most ``l1 sqrt(max(eps_q, eps_k) / eps')`` and nothing else moves."""
        if self.qk_norm is None:
            return []
        current = max(float(self.q_norm.eps), float(self.k_norm.eps))
        return [Lever("qk_norm_eps", current, True, lambda cert, eps: scale_l1(cert, math.sqrt(current / eps)))]

    def cap_slots(self) -> List[CapSlot]:
        """``in_proj`` in three row blocks (``aq, ak, av`` / ``betaq, betak, betav``), ``out_proj`` (``ao``,
        ``betao``) and, with QK-norm, the norms' scales (``gammaq``, ``gammak``) and biases (``betanq``, ``betank``)."""
        D, hd = self.dim, self.head_dim
        slots = linear_cap_slots(self.in_proj, (D, D, D), ("aq", "ak", "av"), ("betaq", "betak", "betav")) + \
            linear_cap_slots(self.out_proj, (D,), ("ao",), ("betao",))
        if self.qk_norm is not None:
            for tag, norm in (("q", self.q_norm), ("k", self.k_norm)):
                slots.append(CapSlot(norm, "weight", "clamp", (hd,), (f"gamma{tag}",)))
                if getattr(norm, "bias", None) is not None:
                    slots.append(CapSlot(norm, "bias", "vector", (hd,), (f"betan{tag}",)))
        return slots

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate that holds while every projection block, bias and QK-norm scale is within its cap.

        Each head's block of a capped matrix is at most the cap, so ``||M_h|| <= a_o a_v``,
        ``||[M_1 .. M_H]|| <= a_o a_v``, ``kappa_h <= a_q a_k`` and ``||W_K^{hT} b_Q^h|| <= a_k beta_q``.
        """
        return self._certificate(self._caps_norms(caps))

    def _caps_norms(self, caps: Mapping[str, float]) -> AttentionNorms:
        """The norms :meth:`certificate_from_caps` reads: every part at its cap (per head, a block of a matrix)."""
        H = self.num_heads
        aq, ak, av, ao = caps["aq"], caps["ak"], caps["av"], caps["ao"]
        bq, bk, bv = (caps.get(f"beta{t}", 0.0) for t in "qkv")
        common = dict(value=(ao * av,) * H, c=math.sqrt(H) * ao * av, b=ao * bv + caps.get("betao", 0.0),
                      w_in=math.sqrt(aq * aq + ak * ak + av * av), b_in=math.sqrt(bq * bq + bk * bk + bv * bv))
        if self.qk_norm is None:
            return AttentionNorms(**common, kappa=(aq * ak,) * H, beta=(ak * bq,) * H, cross=aq * bk + ak * bq,
                                  const=bq * bk)
        hd = self.head_dim
        (a_q, g_q), (a_k, g_k) = (
            bounds.scalar_norm_bounds(self.qk_norm, caps[f"gamma{t}"], caps.get(f"betan{t}", 0.0), norm.eps, numel=hd)
            for t, norm in (("q", self.q_norm), ("k", self.k_norm)))
        return AttentionNorms(**common, wq=(aq,) * H, wk=(ak,) * H, a_q=a_q, a_k=a_k, g_q=g_q, g_k=g_k)

    def _certificate(self, n: AttentionNorms) -> BlockCertificate:
        """The one formula behind :meth:`certificate` and :meth:`certificate_from_caps` (module docstring)."""
        s = self.scale
        if n.linear:
            l1, l0 = 0.0, n.c
        elif self.qk_norm is None:
            # s R beta <= s beta (R^2 + 1) / 2
            l1 = s * math.fsum(m * (2.0 * k + 0.5 * bt) for m, k, bt in zip(n.value, n.kappa, n.beta))
            l0 = n.c + s * math.fsum(m * 0.5 * bt for m, bt in zip(n.value, n.beta))
        else:
            l1 = s * math.fsum(m * (n.a_k * n.g_q * wq + n.a_q * n.g_k * wk) for m, wq, wk in zip(n.value, n.wq, n.wk))
            l0 = n.c
        if self.qk_norm is None:
            e = type(self).exponents
            culprit = "query-key logits s X^T Wq^T Wk X inside the softmax (Jacobian ~ kappa s R^2)"
            fix = "normalize queries and keys (QKNormAttention): sigma 2 -> 1"
        else:
            e = QK_NORM_ATTENTION
            culprit = f"QK-normalized ({self.qk_norm}) attention: Jacobian ~ R through the spread of the values"
            fix = ("its Jacobian coefficient l1 grows like 1/sqrt(qk_norm_eps): raise qk_norm_eps, give the branch a "
                   "small gain (init_values) or a smaller dt, or use fewer updates")
        return BlockCertificate(e.q, e.sigma, c=n.c, b=n.b, l1=l1, l0=l0, name=type(self).__name__,
                                culprit=culprit, fix=fix, peak=self._peak(n))

    def _peak(self, n: AttentionNorms) -> Peak:
        """Bound on every value the forward computes: q/k/v, the query-key products, the output.

        The query-key products are bounded before the logit scale (``max(1, s)`` covers kernels that
        scale after the product).  Subtracting the row maximum inside the softmax may round a far-below
        logit to ``-inf``; its exponential is then an exact 0, which is harmless.
        """
        qkv = {1.0: n.w_in, 0.0: n.b_in}
        out = {1.0: n.c, 0.0: n.b}
        probs = {0.0: 1.0}  # the softmax
        s = max(1.0, self.scale)
        if self.qk_norm is None:
            logits = {2.0: s * max(n.kappa), 1.0: s * n.cross, 0.0: s * n.const}
            return bounds.fold_peak([qkv, logits, out, probs], "query-key logits")
        logits = {0.0: s * n.a_q * n.a_k}
        # the normalized queries and keys themselves: entries below their norm bound A; the l2 kind is computed
        # as an RMS normalization scaled by 1/sqrt(head_dim) afterwards, whose entries reach sqrt(head_dim) A
        widen = math.sqrt(self.head_dim) if self.qk_norm == "l2" else 1.0
        normed = {0.0: widen * max(n.a_q, n.a_k)}
        return bounds.fold_peak([qkv, logits, out, probs, normed], "q/k/v projection")

    # -- conversion -----------------------------------------------------------------------------------------
    @classmethod
    def _from_module(cls, src: nn.Module, qk_norm_required: bool, **overrides: Any) -> _SelfAttention:
        kind, cfg, sd = read_source(src)
        src_norm = cfg.pop("qk_norm")
        if src_norm is not None and not qk_norm_required:
            raise ValueError(f"{type(src).__name__} normalizes queries and keys ({src_norm}); convert it with "
                             "QKNormAttention.from_module, Attention has no QK-norm")
        if qk_norm_required:
            want = overrides.pop("qk_norm", None)
            if src_norm is not None and want is not None and want != src_norm:
                raise ValueError(f"qk_norm={want!r} differs from the source's QK-norm {src_norm!r}")
            cfg["qk_norm"] = src_norm if src_norm is not None else (want or "rms")
        cfg.update(overrides)
        block = cls(**cfg)
        if qk_norm_required and src_norm is None:
            # the source has no QK-norm: its scales start at the block's initial values (g = 1, bias 0)
            for key, value in block.state_dict().items():
                if key.startswith(("q_norm.", "k_norm.")):
                    sd[key] = value
        block.load_state_dict(sd, strict=True)
        return block


class Attention(_SelfAttention):
    """GPT-2 multi-head self-attention without QK-norm: exponents (1, 2), kept for comparison.

    Args:
        dim: model width.
        num_heads: number of heads (must divide ``dim``).
        causal: causal (GPT-2) or bidirectional (ViT, PatchTST) attention.
        bias: biases of both projections (``qkv_bias`` / ``proj_bias`` override each).
        qkv_bias: bias of the fused input projection (default: ``bias``).
        proj_bias: bias of the output projection (default: ``bias``).
        attn_dropout: dropout on the attention probabilities (training only).
        resid_dropout: dropout on the output (training only).
        scale: logit scale ``s`` (default ``head_dim ** -0.5``).
        naming: ``"gpt2"`` (``c_attn``, ``c_proj``) or ``"timm"`` (``qkv``, ``proj``).
        device, dtype: as for torch layers.
    """

    exponents: ClassVar[Exponents] = ATTENTION

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, bias: bool = True,
                 qkv_bias: Optional[bool] = None, proj_bias: Optional[bool] = None, attn_dropout: float = 0.0,
                 resid_dropout: float = 0.0, scale: Optional[float] = None, naming: str = "gpt2",
                 device=None, dtype=None) -> None:
        super().__init__(dim, num_heads, causal=causal, bias=bias, qkv_bias=qkv_bias, proj_bias=proj_bias,
                         qk_norm=None, attn_dropout=attn_dropout, resid_dropout=resid_dropout, scale=scale,
                         naming=naming, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, src: nn.Module, **overrides: Any) -> Attention:
        """Build from nanoGPT ``CausalSelfAttention``, HF ``GPT2Attention`` or timm ``Attention`` (no QK-norm).

        The converted block computes the same function (names are mapped, HF's transposed ``Conv1D``
        weights are transposed back).  nanoGPT and HF sources get ``naming="gpt2"``, timm sources
        ``naming="timm"`` and ``causal=False``; ``overrides`` replace constructor arguments.
        """
        return cls._from_module(src, False, **overrides)  # type: ignore[return-value]


class QKNormAttention(_SelfAttention):
    """GPT-2 multi-head self-attention with per-head QK-norm: exponents (1, 1), the certified attention.

    Queries and keys of each head are normalized over the head dimension with a learnable scale
    (``q_norm``, ``k_norm``); the block's input is not normalized.

    Args:
        dim: model width.
        num_heads: number of heads (must divide ``dim``).
        causal: causal (GPT-2) or bidirectional attention.
        bias: biases of both projections (``qkv_bias`` / ``proj_bias`` override each).
        qk_norm: ``"rms"`` (default), ``"l2"`` or ``"layer"`` (LayerNorm, for timm checkpoints using it).
        qk_norm_eps: the normalizations' ``eps`` (> 0; the Jacobian coefficient grows like ``1/sqrt(eps)``).
        attn_dropout: dropout on the attention probabilities (training only).
        resid_dropout: dropout on the output (training only).
        qkv_bias, proj_bias, scale, naming, device, dtype: as for :class:`Attention`.
    """

    exponents: ClassVar[Exponents] = QK_NORM_ATTENTION

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, bias: bool = True, qk_norm: str = "rms",
                 attn_dropout: float = 0.0, resid_dropout: float = 0.0, qk_norm_eps: float = 1e-6,
                 qkv_bias: Optional[bool] = None, proj_bias: Optional[bool] = None, scale: Optional[float] = None,
                 naming: str = "gpt2", device=None, dtype=None) -> None:
        if qk_norm is None:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got None (use Attention for no QK-norm)")
        super().__init__(dim, num_heads, causal=causal, bias=bias, qkv_bias=qkv_bias, proj_bias=proj_bias,
                         qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, attn_dropout=attn_dropout,
                         resid_dropout=resid_dropout, scale=scale, naming=naming, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, src: nn.Module, **overrides: Any) -> QKNormAttention:
        """Build from nanoGPT ``CausalSelfAttention``, HF ``GPT2Attention`` or timm ``Attention``.

        A source with QK-norm (timm ``qk_norm=True`` with an RMSNorm or LayerNorm) is copied exactly.  A
        source without one gets fresh norms (``qk_norm`` override, default ``"rms"``, scales 1): the
        projections are copied, and the block differs from the source by the normalization of queries
        and keys -- the certified replacement.  ``overrides`` replace other constructor arguments.
        """
        return cls._from_module(src, True, **overrides)  # type: ignore[return-value]

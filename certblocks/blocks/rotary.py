"""Llama-style attention made certified: :class:`RotaryQKNormAttention` (RoPE, grouped-query, QK-norm; (1, 1)).

The attention of Llama, Mistral, Qwen2/3, Phi-3 and Gemma: separate query, key and value projections
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, HF's names), ``num_kv_heads <= num_heads`` key/value heads
shared by groups of query heads (GQA; query head ``h`` reads key/value head ``h // (num_heads / num_kv_heads)``,
HF's ``repeat_kv``), rotary position embeddings in HF's convention (``rope_theta``, ``partial_rotary_factor``:
the first ``rotary_dim`` entries of each head rotate in two halves, ``rotate_half``), and, what makes it
certified, a per-head normalization of queries and keys (``q_norm``, ``k_norm`` over the head dimension,
Qwen3's and OLMo-2's place: after the projection, before the rotation).  Qwen3 checkpoints load unchanged;
a Llama attention gets fresh norms (scales 1) from :meth:`RotaryQKNormAttention.from_module`.

**What RoPE does to the bounds: nothing.**  At position ``i`` the rotation ``R_i`` is orthogonal and does not
depend on the input, so the rotated normalization ``x -> R_i N(x)`` has the same output bound ``A`` and the
same Jacobian bound ``G`` as ``N``; the QK-norm certificate of :class:`~certblocks.QKNormAttention` reads the
queries and keys only through ``A``, ``G``, ``||W_Q^h||`` and ``||W_K^h||``, so it holds unchanged, for every
position, with the key/value weights of each query head's group (``M_h = W_O^h W_V^{g(h)}``).  (Without
QK-norm RoPE would matter: ``||W_Q^T R_i^T R_j W_K||`` is not ``kappa = ||W_Q^T W_K||``.)  HF's RoPE
variants that scale cos and sin (YaRN, LongRoPE: ``attention_scaling`` ``m >= 1``) multiply ``A`` and ``G`` by
``m`` (``rope_attention_scaling``).  Rounding: ``cos`` and ``sin`` are computed in float32 (as HF does) and cast to
the run's dtype, so ``cos^2 + sin^2`` is 1 only up to that rounding: the rotation's norm is at most
:data:`ROPE_ROUNDING` ``= (1 + 2^-8)(1 + 2^-23)`` for bf16 or any finer dtype, and the certificate multiplies
``A`` and ``G`` by it too (``l1`` by 1.008).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import torch
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
from ..certificate import BlockCertificate
from ..exponents import QK_NORM_ATTENTION, Exponents
from ..protocol import CapSlot, linear_cap_slots
from .attention import AttentionNorms, _SelfAttention, attention_mask
from .qk_norm import QK_NORMS, QKNorm
from .stats import stats

__all__ = ["RotaryQKNormAttention", "ROPE_ROUNDING", "rope_inv_freq", "rope_cos_sin", "apply_rope"]

#: Bound on the norm of a computed rotation: ``cos``, ``sin`` rounded to float32 then to bf16 (or finer).
ROPE_ROUNDING = (1.0 + 2.0**-8) * (1.0 + 2.0**-23)

_GQA_KWARG = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """HF's default inverse frequencies ``theta ** (-2j / rotary_dim)``, ``j < rotary_dim / 2`` (float32)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim))


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype,
                 attention_scaling: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(batch, seq_len, rotary_dim)`` for ``position_ids`` ``(batch, seq_len)``, as HF's
    ``rotary_emb`` returns them (angles in float32, both halves repeated, times ``attention_scaling``)."""
    freqs = position_ids[..., None].float() * inv_freq.float()  # (B, T, rotary_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` entries of each head of ``x`` ``(B, heads, T, head_dim)`` (HF's
    ``rotate_half`` convention; ``cos``/``sin`` are ``(B, T, rotary_dim)``); the rest passes unchanged."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


class RotaryQKNormAttention(nn.Module):
    """Grouped-query self-attention with RoPE and per-head QK-norm, in HF Llama's names: exponents (1, 1).

    Args:
        dim: model width (``hidden_size``).
        num_heads: query heads (``num_attention_heads``).
        num_kv_heads: key/value heads (``num_key_value_heads``; must divide ``num_heads``; default ``num_heads``).
        head_dim: per-head width (default ``dim // num_heads``; Gemma and some Qwen/Mistral sizes differ).
        causal: causal (decoder) or bidirectional attention.
        bias: biases of all four projections (``qkv_bias`` / ``proj_bias`` override; Qwen2 has ``qkv_bias`` only).
        qk_norm: ``"rms"`` (default), ``"l2"`` or ``"layer"``.
        qk_norm_eps: the normalizations' ``eps`` (> 0; the Jacobian coefficient grows like ``1/sqrt(eps)``).
        rope_theta: RoPE base (HF ``rope_theta``).
        partial_rotary_factor: the rotated fraction of each head (Phi-3, some Qwen); ``rotary_dim`` is
            ``int(head_dim * partial_rotary_factor)``, even.
        rope_attention_scaling: HF's ``attention_scaling`` of scaled RoPE variants (>= 1; 1 for the default).
        attn_dropout: dropout on the attention probabilities (training only).
        scale: logit scale ``s`` (default ``head_dim ** -0.5``).
        device, dtype: as for torch layers.

    ``forward(x)`` is the velocity on positions ``0 .. T-1``; ``position_ids`` or HF's ``position_embeddings``
    (``(cos, sin)``) place the tokens elsewhere.
    """

    exponents: ClassVar[Exponents] = QK_NORM_ATTENTION

    def __init__(self, dim: int, num_heads: int, num_kv_heads: Optional[int] = None, *, head_dim: Optional[int] = None,
                 causal: bool = True, bias: bool = False, qkv_bias: Optional[bool] = None,
                 proj_bias: Optional[bool] = None, qk_norm: str = "rms", qk_norm_eps: float = 1e-6,
                 rope_theta: float = 10000.0, partial_rotary_factor: float = 1.0, rope_attention_scaling: float = 1.0,
                 attn_dropout: float = 0.0, scale: Optional[float] = None, device=None, dtype=None) -> None:
        super().__init__()
        self.dim = check_int("dim", dim)
        self.num_heads = check_int("num_heads", num_heads)
        self.num_kv_heads = self.num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"num_heads={num_heads} must divide dim={dim}, or pass head_dim")
            head_dim = dim // num_heads
        self.head_dim = check_int("head_dim", head_dim)
        self.causal = check_bool("causal", causal)
        self.qk_norm = check_choice("qk_norm", qk_norm, QK_NORMS)
        self.rope_theta = check_real("rope_theta", rope_theta, ge=1.0)
        check_real("rope_attention_scaling", rope_attention_scaling, ge=1.0)
        self.partial_rotary_factor = check_real("partial_rotary_factor", partial_rotary_factor, gt=0.0, le=1.0)
        self.rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim = int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be even "
                             "and >= 2")
        self.rope_attention_scaling = float(rope_attention_scaling)
        if scale is None:
            scale = self.head_dim ** -0.5
        self.scale = check_real("scale", scale, gt=0.0, note="None: 1/sqrt(head_dim)")
        qkv_bias = bias if qkv_bias is None else qkv_bias
        proj_bias = bias if proj_bias is None else proj_bias
        dd = {"device": device, "dtype": dtype}
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(dim, H * hd, bias=bool(qkv_bias), **dd)
        self.k_proj = nn.Linear(dim, Hkv * hd, bias=bool(qkv_bias), **dd)
        self.v_proj = nn.Linear(dim, Hkv * hd, bias=bool(qkv_bias), **dd)
        self.o_proj = nn.Linear(H * hd, dim, bias=bool(proj_bias), **dd)
        self.q_norm = QKNorm(hd, qk_norm, eps=qk_norm_eps, **dd)
        self.k_norm = QKNorm(hd, qk_norm, eps=qk_norm_eps, **dd)
        self.attn_dropout = nn.Dropout(check_prob("attn_dropout", attn_dropout))
        self.register_buffer("inv_freq", rope_inv_freq(self.rotary_dim, self.rope_theta, device=device),
                             persistent=False)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, qk_norm={self.qk_norm!r}, "
                f"rope_theta={self.rope_theta:g}, rotary_dim={self.rotary_dim}")

    # -- forward --------------------------------------------------------------------------------------------
    def rope(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for the tokens of ``x`` ``(B, T, dim)`` at ``position_ids`` (default ``0 .. T-1``)."""
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)[None]
        elif not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != x.shape[1]:
            raise ValueError(f"position_ids must be a tensor (batch or 1, {x.shape[1]}), got "
                             f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
        dtype = x.dtype if not torch.is_autocast_enabled(x.device.type) else torch.get_autocast_dtype(x.device.type)
        return rope_cos_sin(self.inv_freq, position_ids, dtype, self.rope_attention_scaling)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, H, T, hd)`` and keys, values ``(B, H_kv, T, hd)``: projected, keys and queries
        normalized per head, then rotated."""
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        n = self.num_heads // self.num_kv_heads
        return t if n == 1 else t.repeat_interleave(n, dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               causal: bool) -> torch.Tensor:
        """``softmax(s q k^T + mask) v`` for every query head, ``(B, T, H * hd)``."""
        kw: Dict[str, Any] = {}
        if self.num_kv_heads != self.num_heads:
            if _GQA_KWARG and mask is None:
                kw["enable_gqa"] = True
            else:
                k, v = self._repeat_kv(k), self._repeat_kv(v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           dropout_p=self.attn_dropout.p if self.training else 0.0,
                                           scale=self.scale, **kw)
        B, _, T, _ = y.shape
        return y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                position_ids: Optional[torch.Tensor] = None,
                position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """The velocity ``v(x)``.

        Args:
            x: ``(batch, seq_len, dim)``.
            attn_mask: optional mask broadcastable to ``(batch, num_heads, seq_len, seq_len)``: bool (``True`` =
                may attend) or floating (added to the logits); combined with the causal mask when ``causal``.
            position_ids: ``(batch or 1, seq_len)`` token positions (default ``0 .. seq_len - 1``).
            position_embeddings: HF's ``(cos, sin)``, each ``(batch, seq_len, rotary_dim)``, instead of
                ``position_ids``.

        Returns:
            ``(batch, seq_len, dim)``.
        """
        check_input(x, self.dim, self.q_proj.weight, ndim=3)
        cos, sin = position_embeddings if position_embeddings is not None else self.rope(x, position_ids)
        q, k, v = self.project(x, cos, sin)
        mask = None if attn_mask is None else attention_mask(x, self.causal, attn_mask, None, q.dtype)
        return self.o_proj(self.attend(q, k, v, mask, self.causal))

    def forward_reference(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                          position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Plain-torch twin of :meth:`forward` (explicit rotation matrices and softmax, keys and values repeated
        per group, no dropout), used by the tests."""
        check_input(x, self.dim, self.q_proj.weight, ndim=3)
        B, T, _ = x.shape
        H, hd, r = self.num_heads, self.head_dim, self.rotary_dim
        pos = (torch.arange(T, device=x.device)[None] if position_ids is None else position_ids).expand(B, T)
        cos, sin = rope_cos_sin(self.inv_freq, pos, x.dtype, self.rope_attention_scaling)  # angles as HF's: float32
        rot = torch.zeros(B, T, hd, hd, dtype=x.dtype, device=x.device)
        idx = torch.arange(r // 2, device=x.device)
        c, s = cos[..., : r // 2], sin[..., : r // 2]
        rot[..., idx, idx], rot[..., idx + r // 2, idx + r // 2] = c, c
        rot[..., idx, idx + r // 2], rot[..., idx + r // 2, idx] = -s, s
        rest = torch.arange(r, hd, device=x.device)
        rot[..., rest, rest] = 1.0

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(B, T, n, hd).transpose(1, 2)

        q = torch.einsum("btij,bhtj->bhti", rot, self.q_norm(heads(self.q_proj(x), H)))
        k = torch.einsum("btij,bhtj->bhti", rot, self.k_norm(heads(self.k_proj(x), self.num_kv_heads)))
        k, v = self._repeat_kv(k), self._repeat_kv(heads(self.v_proj(x), self.num_kv_heads))
        logits = (q @ k.transpose(-2, -1)) * self.scale
        mask = attention_mask(x, self.causal, attn_mask, None, q.dtype)
        if mask is None and self.causal:
            mask = torch.zeros(T, T, dtype=q.dtype, device=x.device).masked_fill(
                ~torch.ones(T, T, dtype=torch.bool, device=x.device).tril(), torch.finfo(q.dtype).min / 2)
        if mask is not None:
            logits = logits + mask
        y = logits.softmax(dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))

    # -- certificate: QKNormAttention's formula on the expanded heads -----------------------------------------
    def _head_weights(self) -> Dict[str, Any]:
        """float64 CPU copies in :class:`~certblocks.QKNormAttention`'s layout, key/value heads repeated per group."""
        H, hd, D, n = self.num_heads, self.head_dim, self.dim, self.num_heads // self.num_kv_heads

        def f64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.detach().double().cpu()

        def per_head(w: torch.Tensor) -> torch.Tensor:  # (heads * hd, D) -> (H, hd, D)
            return w.reshape(-1, hd, D).repeat_interleave(H // (w.shape[0] // hd), dim=0)

        wq, wk, wv, wo = (f64(p.weight) for p in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))
        bq, bk, bv, bo = (f64(p.bias) for p in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))
        wv_h = per_head(wv)
        return {"wq": wq.reshape(H, hd, D), "wk": per_head(wk), "wv": wv_h,
                "wo": wo.reshape(D, H, hd).permute(1, 0, 2),
                "bq": None if bq is None else bq.reshape(H, hd),
                "bk": None if bk is None else bk.reshape(-1, hd).repeat_interleave(n, dim=0),
                "b_in": None if bq is None else torch.cat([bq, bk, bv]), "wo_full": wo,
                "wv_full": wv_h.reshape(H * hd, D),
                "bv_full": None if bv is None else bv.reshape(-1, hd).repeat_interleave(n, dim=0).reshape(-1),
                "bo": bo}

    def _in_proj_norm(self) -> float:
        """``||[W_Q; W_K; W_V]||``: bounds every query, key and value entry."""
        return bounds.op_norm(torch.cat([p.weight.detach() for p in (self.q_proj, self.k_proj, self.v_proj)]))

    def attention_stats(self, x: Optional[torch.Tensor] = None, *, samples: int = 8, kappa: bool = True,
                        warm: Optional[Dict[str, torch.Tensor]] = None, iters: int = 50,
                        generator: Optional[torch.Generator] = None) -> Dict[str, Any]:
        """``{"kappa", "max_logit", "qk_norm"}`` as :meth:`QKNormAttention.attention_stats`: ``kappa`` over the query
        heads (each with its group's key head), the logits of the normalized, rotated queries and keys at positions
        ``0 .. T-1`` (:mod:`certblocks.blocks.stats`)."""
        def qk(xs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            q, k, _ = self.project(xs, *self.rope(xs))
            return q, self._repeat_kv(k)

        return stats(self._head_weights, qk, self.scale, self.causal, True, x, samples=samples, kappa=kappa,
                     warm=warm, iters=iters, generator=generator)

    _norms = _SelfAttention._norms
    _caps_norms = _SelfAttention._caps_norms
    _certificate = _SelfAttention._certificate
    _peak = _SelfAttention._peak
    levers = _SelfAttention.levers

    def _rotated(self, n: AttentionNorms) -> AttentionNorms:
        """The norms with the rotation applied to the normalized queries and keys: RoPE's ``attention_scaling``
        ``m`` times :data:`ROPE_ROUNDING`."""
        m = self.rope_attention_scaling * ROPE_ROUNDING
        return dataclasses.replace(n, a_q=n.a_q * m, a_k=n.a_k * m, g_q=n.g_q * m, g_k=n.g_k * m)

    def certificate(self, *, seq_len: Optional[int] = None, r0: Optional[float] = None) -> BlockCertificate:
        """Certificate from the current weights (dropout inactive), valid at every position and sequence length.

        ``seq_len=1`` gives the exact linear bound (one token attends to itself; ``l1 = 0``); ``r0`` is accepted
        for the uniform block API and does not change the coefficients.
        """
        check_cert_args(seq_len, r0)
        check_finite(self)
        cert = self._certificate(self._rotated(self._norms(seq_len)))
        return dataclasses.replace(cert, culprit=cert.culprit.replace("attention", "attention (RoPE, GQA)", 1))

    def cap_slots(self) -> List[CapSlot]:
        """The four projections (``aq``, ``ak``, ``av``, ``ao`` and biases ``betaq`` ...) and the QK-norms'
        scales (``gammaq``, ``gammak``) and biases (``betanq``, ``betank``)."""
        slots: List[CapSlot] = []
        for tag, lin in zip("qkvo", (self.q_proj, self.k_proj, self.v_proj, self.o_proj)):
            slots += linear_cap_slots(lin, (lin.out_features,), (f"a{tag}",), (f"beta{tag}",))
        for tag, norm in (("q", self.q_norm), ("k", self.k_norm)):
            slots.append(CapSlot(norm, "weight", "clamp", (self.head_dim,), (f"gamma{tag}",)))
            if norm.bias is not None:
                slots.append(CapSlot(norm, "bias", "vector", (self.head_dim,), (f"betan{tag}",)))
        return slots

    def certificate_from_caps(self, caps: Mapping[str, float], *, seq_len: Optional[int] = None) -> BlockCertificate:
        """The certificate while every projection, bias and QK-norm scale is within its cap.

        Each head's block of a capped matrix is at most the cap, also for a key/value head shared by a group, so
        :class:`~certblocks.QKNormAttention`'s worst case holds with ``H`` query heads.
        """
        return self._certificate(self._rotated(self._caps_norms(caps)))

    # -- conversion -----------------------------------------------------------------------------------------
    @classmethod
    def from_module(cls, src: nn.Module, **overrides: Any) -> RotaryQKNormAttention:
        """Build from an HF Llama-family attention (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma) and copy its weights.

        The projections are copied (Phi-3's fused ``qkv_proj`` split into ``q_proj``, ``k_proj``, ``v_proj``); a
        source with QK-norm (Qwen3's RMSNorm ``q_norm``/``k_norm``) is copied exactly, a source without one
        gets fresh norms (scales 1): the certified replacement, which differs from the source by the
        normalization of queries and keys.  The RoPE settings come from ``src.config``;
        ``overrides`` replace constructor arguments (``rope_attention_scaling``: the model's
        ``rotary_emb.attention_scaling``, which the attention module does not hold).
        """
        from .attention_sources import qk_norm_kind

        cfg = getattr(src, "config", None)
        if cfg is None or not hasattr(src, "o_proj"):
            raise TypeError(f"cannot convert {type(src).__name__}: expected an HF Llama-family attention (q_proj, "
                            "k_proj, v_proj or qkv_proj, o_proj and a config)")
        for attr, why in (("attn_logit_softcapping", "logit soft-capping"), ("sliding_window_pattern", None)):
            if why and getattr(cfg, attr, None):
                raise ValueError(f"{type(src).__name__} uses {why} ({attr}={getattr(cfg, attr)}); it is not converted")
        D = int(cfg.hidden_size)
        H = int(cfg.num_attention_heads)
        Hkv = int(getattr(cfg, "num_key_value_heads", None) or H)
        hd = int(getattr(src, "head_dim", None) or getattr(cfg, "head_dim", None) or D // H)
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
        if hasattr(src, "qkv_proj"):  # Phi-3
            w = src.qkv_proj.weight
            b = src.qkv_proj.bias
            sizes = [H * hd, Hkv * hd, Hkv * hd]
            ws, bs = torch.split(w, sizes), (torch.split(b, sizes) if b is not None else (None,) * 3)
        else:
            ws = tuple(getattr(src, n).weight for n in ("q_proj", "k_proj", "v_proj"))
            bs = tuple(getattr(src, n).bias for n in ("q_proj", "k_proj", "v_proj"))
        if tuple(ws[0].shape) != (H * hd, D) or tuple(ws[1].shape) != (Hkv * hd, D):
            raise ValueError(f"{type(src).__name__}: projection shapes {tuple(ws[0].shape)}, {tuple(ws[1].shape)} do "
                             f"not match hidden_size={D}, heads={H}, kv heads={Hkv}, head_dim={hd}")
        scaling = float(getattr(src, "scaling", hd ** -0.5))
        norm_kind, eps = qk_norm_kind(getattr(src, "q_norm", nn.Identity()))
        if norm_kind is not None and "Gemma" in type(src.q_norm).__name__:
            raise ValueError(f"{type(src).__name__}: Gemma's QK-norm scales by (1 + weight); it is not converted")
        kw: Dict[str, Any] = dict(
            dim=D, num_heads=H, num_kv_heads=Hkv, head_dim=hd, causal=bool(getattr(src, "is_causal", True)),
            qkv_bias=bs[0] is not None, proj_bias=src.o_proj.bias is not None, rope_theta=theta,
            partial_rotary_factor=partial, attn_dropout=float(getattr(src, "attention_dropout", 0.0)),
            scale=scaling, device=ws[0].device, dtype=ws[0].dtype)
        if norm_kind is not None:
            kw.update(qk_norm=norm_kind, qk_norm_eps=eps)
        kw.update(overrides)
        block = cls(**kw)
        sd = {k: v for k, v in block.state_dict().items() if k.startswith(("q_norm.", "k_norm."))}
        for name, wt, bt in zip(("q_proj", "k_proj", "v_proj"), ws, bs):
            sd[f"{name}.weight"] = wt.detach().clone()
            if bt is not None:
                sd[f"{name}.bias"] = bt.detach().clone()
        sd.update({f"o_proj.{k}": v.detach().clone() for k, v in src.o_proj.state_dict().items()})
        if norm_kind is not None:
            for n in ("q_norm", "k_norm"):
                sd.update({f"{n}.{k}": v.detach().clone() for k, v in getattr(src, n).state_dict().items()})
        block.load_state_dict(sd, strict=True)
        return block

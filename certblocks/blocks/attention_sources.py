"""Reading the attention modules the certified blocks replace: nanoGPT, HF GPT-2, timm and certblocks' ``Attention``.

:func:`read_source` recognizes a source module and returns its kind, the block constructor's configuration and a
state dict in the block's names (HF's transposed ``Conv1D`` weights transposed back), so that
``Attention.from_module`` / ``QKNormAttention.from_module`` load it with ``strict=True``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

__all__ = ["read_source", "linear_state_dict", "qk_norm_kind"]


def linear_state_dict(prefix: str, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {f"{prefix}.weight": weight.detach().clone()}
    if bias is not None:
        out[f"{prefix}.bias"] = bias.detach().clone()
    return out


def qk_norm_kind(norm: nn.Module) -> Tuple[Optional[str], Optional[float]]:
    """Map a source's q_norm/k_norm module to ``(kind, eps)``."""
    if isinstance(norm, nn.Identity):
        return None, None
    name = type(norm).__name__
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))  # HF RMSNorms: variance_epsilon
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor):
        raise ValueError(f"unsupported QK-norm module {name}: need an affine RMSNorm or LayerNorm with eps")
    if isinstance(norm, nn.LayerNorm) or "LayerNorm" in name:
        if getattr(norm, "bias", None) is None:
            raise ValueError(f"unsupported QK-norm module {name} without bias")
        return "layer", float(eps)
    if isinstance(norm, nn.RMSNorm) or "RmsNorm" in name or "RMSNorm" in name:
        return "rms", float(eps if eps is not None else torch.finfo(weight.dtype).eps)
    raise ValueError(f"unsupported QK-norm module {name}: need an affine RMSNorm or LayerNorm")


def read_source(src: nn.Module) -> Tuple[str, Dict[str, Any], Dict[str, torch.Tensor]]:
    """Recognize a source attention module; return its kind, constructor config and a state dict in block names."""
    if not isinstance(src, nn.Module):
        raise TypeError(f"src must be an nn.Module, got {type(src).__name__}")
    from .attention import _SelfAttention

    if isinstance(src, _SelfAttention):  # certblocks' own Attention (QKNormAttention.from_module adds the norms)
        cfg = dict(dim=src.dim, num_heads=src.num_heads, causal=src.causal, qkv_bias=src.in_proj.bias is not None,
                   proj_bias=src.out_proj.bias is not None, attn_dropout=src.attn_dropout.p,
                   resid_dropout=src.resid_dropout.p, scale=src.scale, naming=src.naming, qk_norm=src.qk_norm,
                   device=src.in_proj.weight.device, dtype=src.in_proj.weight.dtype)
        if src.qk_norm is not None:
            cfg["qk_norm_eps"] = src.q_norm.eps
        return "certblocks", cfg, {k: v.detach().clone() for k, v in src.state_dict().items()}
    mod: Any = src  # a foreign attention, read by duck typing
    if hasattr(src, "c_attn") and hasattr(src, "c_proj"):
        w_in, w_out = mod.c_attn.weight, mod.c_proj.weight
        is_hf = type(mod.c_attn).__name__ == "Conv1D" and hasattr(mod.c_attn, "nf")
        if is_hf:  # HF GPT2Attention: Conv1D weights are (in, out)
            if getattr(mod, "is_cross_attention", False):
                raise ValueError("cross-attention GPT2Attention is not self-attention; it cannot be converted")
            dim, heads = int(mod.embed_dim), int(mod.num_heads)
            hd = dim // heads
            scaling = float(getattr(mod, "scaling", hd ** -0.5))
            if not math.isclose(scaling, hd ** -0.5, rel_tol=1e-12):
                raise ValueError(f"GPT2Attention with logit scale {scaling} (scale_attn_weights=False or "
                                 "scale_attn_by_inverse_layer_idx) is not supported; pass scale= to the block")
            w_in, w_out = w_in.T, w_out.T
            kind = "hf_gpt2"
            attn_p, resid_p = mod.attn_dropout.p, mod.resid_dropout.p
            causal = bool(getattr(mod, "is_causal", True))
        else:  # nanoGPT CausalSelfAttention
            dim, heads = int(mod.n_embd), int(mod.n_head)
            kind = "nanogpt"
            attn_p = mod.attn_dropout.p if hasattr(src, "attn_dropout") else float(getattr(mod, "dropout", 0.0))
            resid_p = mod.resid_dropout.p if hasattr(src, "resid_dropout") else float(getattr(mod, "dropout", 0.0))
            causal = True
        if tuple(w_in.shape) != (3 * dim, dim) or tuple(w_out.shape) != (dim, dim):
            raise ValueError(f"{type(src).__name__}: c_attn/c_proj shapes {tuple(w_in.shape)}/{tuple(w_out.shape)} "
                             f"do not match dim={dim}")
        sd = {**linear_state_dict("c_attn", w_in, mod.c_attn.bias),
              **linear_state_dict("c_proj", w_out, mod.c_proj.bias)}
        cfg = dict(dim=dim, num_heads=heads, causal=causal, qkv_bias=mod.c_attn.bias is not None,
                   proj_bias=mod.c_proj.bias is not None, attn_dropout=float(attn_p), resid_dropout=float(resid_p),
                   naming="gpt2", qk_norm=None)
        norm_kind = None
        if hasattr(src, "q_norm") and hasattr(src, "k_norm"):
            norm_kind, eps = qk_norm_kind(mod.q_norm)
            if norm_kind is not None:
                cfg["qk_norm"], cfg["qk_norm_eps"] = norm_kind, eps
                for n in ("q_norm", "k_norm"):
                    sd.update({f"{n}.{k}": v.detach().clone() for k, v in getattr(mod, n).state_dict().items()})
        cfg.update(device=w_in.device, dtype=w_in.dtype)
        return kind, cfg, sd
    if hasattr(src, "qkv") and hasattr(src, "proj") and hasattr(src, "num_heads"):  # timm Attention
        heads, hd = int(mod.num_heads), int(mod.head_dim)
        dim = mod.qkv.in_features
        if heads * hd != dim or mod.proj.out_features != dim:
            raise ValueError(f"timm Attention with attn_dim {heads * hd} or dim_out {mod.proj.out_features} "
                             f"different from dim {dim} is not supported")
        if getattr(mod, "gate", None) is not None:
            raise ValueError("timm Attention(gated=True) is not supported")
        if not isinstance(getattr(mod, "norm", nn.Identity()), nn.Identity):
            raise ValueError("timm Attention(scale_norm=True) is not supported")
        if not math.isclose(float(mod.scale), hd ** -0.5, rel_tol=1e-12):
            raise ValueError(f"timm Attention with scale {mod.scale} != head_dim**-0.5 is not supported")
        norm_kind, eps = qk_norm_kind(mod.q_norm)
        k_kind, _ = qk_norm_kind(mod.k_norm)
        if k_kind != norm_kind:
            raise ValueError(f"q_norm ({norm_kind}) and k_norm ({k_kind}) must be the same kind")
        cfg = dict(dim=dim, num_heads=heads, causal=False, qkv_bias=mod.qkv.bias is not None,
                   proj_bias=mod.proj.bias is not None, attn_dropout=float(mod.attn_drop.p),
                   resid_dropout=float(mod.proj_drop.p), naming="timm", qk_norm=norm_kind,
                   device=mod.qkv.weight.device, dtype=mod.qkv.weight.dtype)
        if norm_kind is not None:
            cfg["qk_norm_eps"] = eps
        sd = {k: v.detach().clone() for k, v in mod.state_dict().items()}
        return "timm", cfg, sd
    raise TypeError(f"cannot convert {type(src).__name__}: expected nanoGPT CausalSelfAttention (c_attn, c_proj, "
                    "n_head, n_embd), HF GPT2Attention or timm Attention (qkv, proj, num_heads)")

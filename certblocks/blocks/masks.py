"""The additive mask of one attention call (:func:`attention_mask`): causal, boolean or additive ``attn_mask``,
``key_padding_mask``; masked logits at ``finfo.min / 2``.  Checked in eager mode; TorchScript compiles it."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["attention_mask"]


def _check_masks(x: torch.Tensor, attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor]) -> None:
    """Raise a clear error for a mask that does not fit ``x`` ``(batch, seq_len, dim)`` (eager mode)."""
    T = x.shape[1]
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.shape[-2:] != (T, T) or attn_mask.ndim > 4:
            raise ValueError(f"attn_mask must broadcast to (batch, num_heads, {T}, {T}) with its last two "
                             f"dimensions equal to ({T}, {T}), got shape {tuple(attn_mask.shape)}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool (True = attend) or floating (additive), got {attn_mask.dtype}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True = padded key, ignored), got "
                            f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}")
        if key_padding_mask.shape != (x.shape[0], T):
            raise ValueError(f"key_padding_mask must have shape (batch, seq_len) = {(x.shape[0], T)}, "
                             f"got {tuple(key_padding_mask.shape)}")


def attention_mask(x: torch.Tensor, causal: bool, attn_mask: Optional[torch.Tensor],
                   key_padding_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The additive float mask ``(B or 1, nh or 1, T, T)`` of one attention call, ``None`` when nothing is masked.

    Args:
        x: the block's input ``(batch, seq_len, dim)`` (its sequence length and device).
        causal: include the causal mask.
        attn_mask, key_padding_mask: as in :meth:`QKNormAttention.forward`.
        dtype: the logits' dtype.
    """
    if not torch.jit.is_scripting():
        _check_masks(x, attn_mask, key_padding_mask)
    T = x.shape[1]
    allowed: Optional[torch.Tensor] = None
    additive: Optional[torch.Tensor] = None
    if causal:
        allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            additive = attn_mask.to(dtype)
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    if allowed is None:
        return additive
    if additive is None:
        additive = torch.zeros((), dtype=dtype, device=x.device)
    # finfo.min / 2 rather than -inf: a query whose keys are all masked attends uniformly instead of giving
    # NaN, and logit + mask cannot overflow to -inf in fp16.
    return additive.masked_fill(~allowed, _masked_logit(dtype))


def _masked_logit(dtype: torch.dtype) -> float:
    """``finfo(dtype).min / 2``, the value of a masked logit (TorchScript has no ``finfo``: the values are spelled)."""
    if not torch.jit.is_scripting():
        return torch.finfo(dtype).min / 2
    if dtype == torch.float16:
        return -32752.0
    if dtype == torch.bfloat16:
        return -1.6947656946257677e38
    if dtype == torch.float32:
        return -1.7014117331926443e38
    return -8.988465674311579e307

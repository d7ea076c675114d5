"""The swapped modules of :func:`certblocks.convert`, called the way their hosts call the modules they replace.

Each adapter is a certified block (same parameters, same certificate) whose ``forward`` takes the host's
arguments: timm's ``Attention`` (``attn_mask``, ``is_causal``), HF ``GPT2Attention`` (returns ``(output, None)``),
HF ``MambaMixer`` (``cache_params``, ``attention_mask``) and the HF Llama family's attentions
(:class:`HFRotaryQKNormAttention`: HF's ``position_embeddings``, KV cache, attention kernels and masks).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

from .blocks.attention import QKNormAttention as _QKA
from .blocks.mamba import LinearGrowthMamba as _LGM
from .blocks.rotary import RotaryQKNormAttention

__all__ = ["HFRotaryQKNormAttention", "TimmQKNormAttention", "HFGPT2QKNormAttention", "HFLinearGrowthMamba"]




class TimmQKNormAttention(_QKA):
    """:class:`QKNormAttention` called like timm's ``Attention`` (``attn_mask``, ``is_causal``)."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,  # type: ignore[override]
                is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
        if is_causal:
            raise ValueError("the converted attention is bidirectional (timm ViT); is_causal=True is not supported")
        return super().forward(x, attn_mask=attn_mask)


class HFGPT2QKNormAttention(_QKA):
    """:class:`QKNormAttention` called like HF ``GPT2Attention``: returns ``(output, None)``."""

    def forward(self, hidden_states: torch.Tensor, cache: Any = None,  # type: ignore[override]
                attention_mask: Optional[torch.Tensor] = None, encoder_hidden_states: Any = None,
                output_attentions: bool = False, **kwargs: Any) -> Tuple[torch.Tensor, None]:
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("past_key_values/cache: a converted GPT-2 attention does not use HF's KV cache; "
                             "call the model with use_cache=False")
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states: cross-attention is not converted; only self-attention is")
        mask = attention_mask
        if mask is not None and mask.ndim == 4 and mask.shape[-2] != hidden_states.shape[1]:
            mask = None
        return super().forward(hidden_states, attn_mask=mask), None


class HFLinearGrowthMamba(_LGM):
    """:class:`LinearGrowthMamba` called like HF ``MambaMixer`` (``cache``, ``attention_mask``)."""

    def forward(self, hidden_states: torch.Tensor, cache: Any = None,  # type: ignore[override]
                attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if cache is not None or kwargs.get("cache_params") is not None:
            raise ValueError("cache_params: a converted MambaMixer does not use HF's cache; call the model with "
                             "use_cache=False")
        mask = attention_mask
        if mask is not None and mask.ndim == 2 and mask.shape[1] == hidden_states.shape[1]:
            hidden_states = hidden_states * mask[:, :, None].to(hidden_states.dtype)
        return super().forward(hidden_states)


class HFRotaryQKNormAttention(RotaryQKNormAttention):
    """:class:`~certblocks.RotaryQKNormAttention` called like an HF Llama-family attention.

    It takes the decoder layer's arguments (``position_embeddings`` = HF's ``(cos, sin)``, ``attention_mask``,
    ``cache``/``past_key_values``), writes its normalized and rotated keys into HF's KV cache (so ``generate``
    runs cached, as the source did), and computes the attention with the kernel the model's config selects
    (``config._attn_implementation``: sdpa, eager, flash; HF's masks, sliding windows and GQA handling).  The
    function is :class:`~certblocks.RotaryQKNormAttention`'s: its certificate holds for every mask (a mask only
    restricts each query's convex combination of values) and at every position.
    """

    config: Any
    layer_idx: Optional[int]
    sliding_window: Optional[int]
    _eager: Callable[..., Tuple[torch.Tensor, Any]]

    @classmethod
    def from_module(cls, src: nn.Module, **overrides: Any) -> HFRotaryQKNormAttention:  # type: ignore[override]
        block = super().from_module(src, **overrides)
        assert isinstance(block, HFRotaryQKNormAttention)
        block.config = src.config
        block.layer_idx = getattr(src, "layer_idx", None)
        block.sliding_window = getattr(src, "sliding_window", None)
        # the source family's eager attention: the kernel when the config asks for "eager" (Gemma-2-style variants
        # differ from Llama's), resolved once here rather than at every call
        block._eager = getattr(sys.modules.get(type(src).__module__), "eager_attention_forward", None)
        if block._eager is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward

            block._eager = eager_attention_forward
        return block

    @property
    def num_key_value_groups(self) -> int:  # read by HF's attention kernels
        return self.num_heads // self.num_kv_heads

    @property
    def is_causal(self) -> bool:  # read by HF's attention kernels
        return self.causal

    @property
    def attention_dropout(self) -> float:
        return self.attn_dropout.p

    def _kernel(self) -> Callable[..., Tuple[torch.Tensor, Any]]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager)

    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override]
                position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                attention_mask: Optional[torch.Tensor] = None, cache: Any = None, **kwargs: Any
                ) -> Tuple[torch.Tensor, None]:
        past = cache if cache is not None else kwargs.pop("past_key_values", None)
        kwargs.pop("past_key_value", None)
        if position_embeddings is None:
            position_embeddings = self.rope(hidden_states, kwargs.get("position_ids"))
        q, k, v = self.project(hidden_states, *position_embeddings)
        if past is not None:
            k, v = past.update(k, v, self.layer_idx, kwargs=kwargs)
        extra = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        out, _ = self._kernel()(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                                scaling=self.scale, **extra, **kwargs)
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(out), None

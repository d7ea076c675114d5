"""The built-in converters (attentions, Mamba mixers, gated MLPs), the residual norms ``remove_norms`` takes out,
and the branch gains put into timm blocks (the ``init_values`` lever)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..exponents import Exponents
from ..fixes import Lever
from .registry import Converter
from .registry import builtin as _builtin

__all__ = ["ROTARY_ATTENTIONS", "IdentityNorm", "BRANCH_NAMES", "GAIN_SLOTS", "NORM_TARGETS", "from_package",
           "residual_norm", "insert_gains", "gain_lever", "is_normalizer", "norm_converter"]

RESIDUAL_NORM_NAMES = ("norm", "norm1", "norm2", "ln_1", "ln_2", "input_layernorm", "post_attention_layernorm",
                       "pre_norm", "attn_norm", "mlp_norm", "ffn_norm", "norm_attn", "norm_ffn")
#: The attributes of a residual block that hold its branches (a norm beside one of them is a residual norm).
BRANCH_NAMES = ("attn", "mlp", "mixer", "self_attn", "attention", "ff", "ffn", "feed_forward")


#: HF attentions of the Llama family that :class:`~certblocks.RotaryQKNormAttention` replaces.
ROTARY_ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "Phi3Attention",
                     "GemmaAttention")


def from_package(m: nn.Module, package: str) -> bool:
    return type(m).__module__.startswith(package)


def _has_qk_norm(m: nn.Module) -> bool:
    qn = getattr(m, "q_norm", None)
    return qn is not None and not isinstance(qn, nn.Identity)


def _attention_before(m: nn.Module) -> Exponents:
    from ..exponents import ATTENTION, QK_NORM_ATTENTION

    return QK_NORM_ATTENTION if _has_qk_norm(m) else ATTENTION


def _is_rotary_attention(m: nn.Module) -> bool:
    return type(m).__name__ in ROTARY_ATTENTIONS and from_package(m, "transformers")


def _rope_scaling(model: nn.Module) -> float:
    """The largest ``attention_scaling`` of an HF rotary embedding in ``model`` (1 when there is none)."""
    found = [float(m.attention_scaling) for m in model.modules()  # type: ignore[arg-type]  # HF: a float
             if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "attention_scaling")]
    return max(found, default=1.0)


@_builtin(_is_rotary_attention, "attention", _attention_before, exact=_has_qk_norm, keeps_hf_cache=True)
def _hf_rotary_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from .. import _adapters

    block = _adapters.HFRotaryQKNormAttention.from_module(src, rope_attention_scaling=_rope_scaling(model))
    if hasattr(src, "qkv_proj"):  # Phi-3 stores one fused projection
        _adapters.install_source_layout(block, _adapters.fused_qkv_layout(block))
    return block


def _is_hf_gpt2_attention(m: nn.Module) -> bool:
    return (type(m).__name__ == "GPT2Attention" and from_package(m, "transformers")
            and not getattr(m, "is_cross_attention", False))


@_builtin(_is_hf_gpt2_attention, "attention", _attention_before)
def _hf_gpt2_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from .. import _adapters

    block = _adapters.HFGPT2QKNormAttention.from_module(src)
    return _adapters.install_source_layout(block, _adapters.gpt2_conv1d_layout(block))


def _is_timm_attention(m: nn.Module) -> bool:
    return (type(m).__name__ == "Attention" and from_package(m, "timm") and hasattr(m, "qkv") and hasattr(m, "proj")
            and hasattr(m, "num_heads"))


@_builtin(_is_timm_attention, "attention", _attention_before, exact=_has_qk_norm)
def _timm_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from .. import _adapters

    return _adapters.TimmQKNormAttention.from_module(src)


def _is_gpt_attention(m: nn.Module) -> bool:
    """nanoGPT's ``CausalSelfAttention`` (``c_attn``, ``c_proj``, ``n_head``) and certblocks' ``Attention``."""
    from ..blocks.attention import Attention, QKNormAttention

    if isinstance(m, QKNormAttention):
        return False
    if isinstance(m, Attention):
        return True
    return (hasattr(m, "c_attn") and hasattr(m, "c_proj") and type(m).__name__ != "GPT2Attention"
            and (type(m).__name__ in ("CausalSelfAttention", "Attention") or hasattr(m, "n_head")))


@_builtin(_is_gpt_attention, "attention", _attention_before, exact=_has_qk_norm)
def _gpt_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from ..blocks.attention import QKNormAttention

    return QKNormAttention.from_module(src)


def _is_hf_patchtst_attention(m: nn.Module) -> bool:
    return (type(m).__name__ == "PatchTSTAttention" and from_package(m, "transformers")
            and not getattr(m, "is_decoder", False))


@_builtin(_is_hf_patchtst_attention, "attention", _attention_before, keeps_hf_cache=True)
def _hf_patchtst_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from .. import _adapters

    block = _adapters.HFPatchTSTQKNormAttention.from_module(src)
    return _adapters.install_source_layout(block, _adapters.separate_qkv_layout(block))


def _is_hf_mamba(m: nn.Module) -> bool:
    return type(m).__name__ == "MambaMixer" and from_package(m, "transformers")


def _mamba_before(m: nn.Module) -> Exponents:
    from ..exponents import MAMBA_SSM

    return MAMBA_SSM


@_builtin(_is_hf_mamba, "mamba", _mamba_before)
def _hf_mamba_mixer(src: nn.Module, model: nn.Module) -> nn.Module:
    from .. import _adapters

    return _adapters.HFLinearGrowthMamba.from_module(src)


def _is_mamba(m: nn.Module) -> bool:
    """``mamba_ssm.Mamba`` and certblocks' ``Mamba`` (the (5, 5) block)."""
    return type(m).__name__ == "Mamba" and (from_package(m, "mamba_ssm") or from_package(m, "certblocks"))


@_builtin(_is_mamba, "mamba", _mamba_before)
def _mamba(src: nn.Module, model: nn.Module) -> nn.Module:
    from ..blocks.mamba import LinearGrowthMamba

    return LinearGrowthMamba.from_module(src)


def _act_is(act: Optional[nn.Module], keys: Tuple[str, ...]) -> bool:
    return act is None or any(k in type(act).__name__.lower() for k in keys)


def _is_glu(m: nn.Module) -> bool:
    """A gated MLP whose gate grows (SiLU: SwiGLU; GELU: Gemma's GeGLU): q = 2."""
    from ..blocks.mlp import GatedMLP

    if isinstance(m, GatedMLP):
        return m.gate == "silu"
    name = type(m).__name__
    if hasattr(m, "gate_proj") and hasattr(m, "up_proj") and hasattr(m, "down_proj"):
        return _act_is(getattr(m, "act_fn", None), ("silu", "swish", "gelu"))
    if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and from_package(m, "transformers"):
        return _act_is(getattr(m, "activation_fn", None), ("silu", "swish", "gelu"))  # Phi-3
    if name in ("SwiGLU", "SwiGLUPacked", "GluMlp") and from_package(m, "timm"):
        act = getattr(m, "act", None)
        return act is None or type(act).__name__ in ("SiLU", "Swish")
    return False


@_builtin(_is_glu, "glu", Exponents(2, 1))
def _gated_mlp(src: nn.Module, model: nn.Module) -> nn.Module:
    from .. import _adapters
    from ..blocks.mlp import GatedMLP

    block = GatedMLP.from_module(src, gate="sigmoid")
    layout = _adapters.glu_layout(block, src)
    return block if layout is None else _adapters.install_source_layout(block, layout)


# ---------------------------------------------------------------------------------------------- norms and gains
def _is_norm(child: nn.Module) -> bool:
    name = type(child).__name__
    return isinstance(child, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("LayerNorm", "RMSNorm", "RmsNorm",
                                                                             "LayerNorm2d"))


def residual_norm(parent: nn.Module, name: str, child: nn.Module) -> bool:
    if not _is_norm(child) or name not in RESIDUAL_NORM_NAMES:
        return False
    return any(hasattr(parent, b) for b in BRANCH_NAMES)


class IdentityNorm(nn.Identity):
    """``nn.Identity`` replacing a residual branch's normalization.

    Keeps the norm's ``weight`` as a non-persistent buffer (not in the state_dict), because some callers
    read it (HF ``MambaBlock`` casts its input to ``norm.weight.dtype``).
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        w = getattr(norm, "weight", None)
        if isinstance(w, torch.Tensor):
            self.register_buffer("weight", w.detach().clone(), persistent=False)


#: The branch gains of a timm ``Block`` (``ls1`` after ``attn``, ``ls2`` after ``mlp``).
GAIN_SLOTS = (("attn", "ls1"), ("mlp", "ls2"))


def insert_gains(block: nn.Module) -> List[str]:
    """Put a :class:`~certblocks.LayerScale` with gain 1 (the function unchanged) where a timm block has none
    (``ls1`` / ``ls2`` are ``nn.Identity`` when timm's ``init_values`` is None); returns the slots filled."""
    from ..blocks.gain import LayerScale

    filled = []
    for branch, slot in GAIN_SLOTS:
        if isinstance(getattr(block, slot, None), nn.Identity) and isinstance(getattr(block, branch, None), nn.Module):
            ref = next(getattr(block, branch).parameters(), None)
            dim = getattr(block.attn, "dim", None) or getattr(getattr(block.attn, "qkv", None), "in_features", None)
            if ref is None or dim is None:
                continue
            setattr(block, slot, LayerScale(int(dim), 1.0, device=ref.device, dtype=ref.dtype))
            filled.append(slot)
    return filled


def gain_lever(model: nn.Module, path: str) -> Optional[Lever]:
    """The ``init_values`` lever of the traced update ``path`` (``blocks.3.attn``) when its block holds its gain
    (``ls1``, a timm or certblocks ``LayerScale``): the gain ``v`` in place of ``g = max |gamma|`` scales every
    coefficient of the update by ``v / g`` (in the per-token norm ``||gamma * y|| <= max |gamma| ||y||``:
    :mod:`certblocks.blocks.gain`)."""
    from ..blocks.gain import scaled_certificate

    parent_path, _, branch = path.rpartition(".")
    slot = dict(GAIN_SLOTS).get(branch)
    try:
        gain = model.get_submodule(f"{parent_path}.{slot}" if parent_path else slot) if slot else None
    except AttributeError:
        return None
    gamma = getattr(gain, "gamma", None)
    if not isinstance(gamma, torch.Tensor):
        return None
    g = float(gamma.detach().abs().max())
    if not g > 0:
        return None
    return Lever("init_values", g, False, lambda cert, v: scaled_certificate(cert, v / g))



# ---------------------------------------------------------------------------------------------- normalizers -> DyT
#: What ``convert(model, norm=...)`` replaces the normalizers with.
NORM_TARGETS = ("dyt",)


def is_normalizer(m: nn.Module) -> bool:
    """A LayerNorm or RMSNorm over one last dimension (torch's, timm's, HF's: ``LlamaRMSNorm``, ...), not a DyT."""
    from ..blocks.dyt import DyT

    if isinstance(m, DyT) or not _is_norm(m) or type(m).__name__.endswith("LayerNorm2d"):
        return False
    shape = getattr(m, "normalized_shape", None)
    weight = getattr(m, "weight", None)
    if shape is not None:
        return len(tuple(shape) if not isinstance(shape, int) else (shape,)) == 1
    return isinstance(weight, torch.Tensor) and weight.ndim == 1


def norm_converter(target: str, alpha: Callable[[str, nn.Module], float], paths: Dict[int, str]) -> Converter:
    """The converter of ``convert(model, norm=target)``: a normalizer -> :class:`~certblocks.blocks.DyT` with its
    ``weight`` / ``bias`` as ``gamma`` / ``beta`` and ``alpha = alpha(path, module)`` (``paths``: module id -> path).

    Not in the registry's list (a norm is converted only when asked): :func:`~certblocks.conversion.convert` plans
    its swaps with it.
    """
    from ..blocks.dyt import DyT
    from ..exponents import NORM

    if target not in NORM_TARGETS:
        raise ValueError(f"norm must be one of {NORM_TARGETS} or None, got {target!r}")

    def build(src: nn.Module, model: nn.Module) -> nn.Module:
        return DyT.from_module(src, alpha_init=alpha(paths.get(id(src), ""), src))

    return Converter("norm_to_dyt", is_normalizer, build, "norm", NORM)

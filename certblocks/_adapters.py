"""The swapped modules of :func:`certblocks.convert`, called the way their hosts call the modules they replace, and
stored the way their hosts store them.

Each adapter is a certified block (same parameters, same certificate) whose ``forward`` takes the host's
arguments: timm's ``Attention`` (``attn_mask``, ``is_causal``), HF ``GPT2Attention`` (returns ``(output, None)``),
HF ``MambaMixer`` (``cache_params``, ``attention_mask``), HF ``PatchTSTAttention`` (returns ``(output, None)``) and
the HF Llama family's attentions (:class:`HFRotaryQKNormAttention`: HF's ``position_embeddings``, KV cache,
attention kernels and masks).

Checkpoints.  A converted module's ``state_dict`` has its source's names and layouts (:class:`SourceLayout`): HF
GPT-2's ``Conv1D`` weights are ``(in, out)``, the Llama family's MLP keeps ``gate_proj``, ``up_proj`` and
``down_proj``, Phi-3 its fused ``qkv_proj`` and ``gate_up_proj``, PatchTST its ``q_proj``, ``k_proj``, ``v_proj``,
``out_proj``.  Inside, the block keeps the layout its certificate reads (``nn.Linear``: ``(out, in)``, fused
projections), so the certificate's norms are those of the map the block computes; the conversion happens in the
module's ``state_dict`` post-hook and ``load_state_dict`` pre-hook.  A converted module whose ``state_dict`` would
have exactly its source's keys and shapes although it computes another function (a sigmoid-gated MLP in place of a
SwiGLU, a linear-growth scan in place of Mamba's) carries one more entry, :data:`MARKER` (an ``int8`` scalar), so
that the source's class refuses the checkpoint with ``strict=True`` (an unexpected key) instead of loading it into
another function; loading the source's own checkpoint into the converted module still works with ``strict=True``
(the marker is filled in when absent).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .blocks.attention import QKNormAttention as _QKA
from .blocks.mamba import LinearGrowthMamba as _LGM
from .blocks.mlp import GatedMLP
from .blocks.rotary import RotaryQKNormAttention

__all__ = ["HFRotaryQKNormAttention", "TimmQKNormAttention", "HFGPT2QKNormAttention", "HFLinearGrowthMamba",
           "HFPatchTSTQKNormAttention", "SourceLayout", "MARKER", "install_source_layout", "mark_converted"]

#: The ``state_dict`` entry of a converted module whose keys and shapes are its source's but whose function is not.
MARKER = "certblocks_converted"


# ---------------------------------------------------------------------------------------------- checkpoint layouts
@dataclass(frozen=True)
class _Piece:
    """``rows`` rows of the block's tensor ``own`` (from row ``own_row``) are rows ``src_row ..`` of the source's
    tensor ``src`` (in the block's orientation: a transposed source tensor is read transposed)."""

    own: str
    own_row: int
    src: str
    src_row: int
    rows: int


@dataclass(frozen=True)
class SourceLayout:
    """How a converted block's tensors are stored under its source's names and layouts.

    Each block tensor named in :attr:`pieces` is a stack of row blocks of source tensors; the source tensors in
    :attr:`transposed` are stored transposed (HF ``Conv1D``: ``(in, out)``).  Tensors not named keep their name
    and layout.

    Attributes:
        pieces: the row blocks.
        src_shapes: each source tensor's shape as stored (``(key, shape)`` pairs).
        transposed: the source tensors stored transposed.
    """

    pieces: Tuple[_Piece, ...]
    src_shapes: Tuple[Tuple[str, Tuple[int, ...]], ...]
    transposed: Tuple[str, ...] = ()

    @classmethod
    def build(cls, module: nn.Module, parts: Mapping[str, Sequence[Tuple[str, int, int]]],
              src_shapes: Mapping[str, Sequence[int]], transposed: Sequence[str] = ()) -> SourceLayout:
        """The layout whose block tensor ``own`` stacks the source's row blocks ``parts[own]``, each
        ``(source key, first row, rows)``; checked against ``module``'s tensors and ``src_shapes``.

        Raises:
            ValueError: the row blocks do not tile each block tensor, or a source tensor, exactly.
        """
        own: Dict[str, torch.Tensor] = dict(module.named_parameters())
        own.update(module.named_buffers())
        pieces: List[_Piece] = []
        covered: Dict[str, int] = {}
        for key, blocks in parts.items():
            if key not in own:
                raise ValueError(f"{type(module).__name__} has no tensor {key!r}")
            row = 0
            for src, start, rows in blocks:
                if src not in src_shapes:
                    raise ValueError(f"source tensor {src!r} has no shape in src_shapes")
                pieces.append(_Piece(key, row, src, int(start), int(rows)))
                covered[src] = covered.get(src, 0) + int(rows)
                row += int(rows)
            if row != own[key].shape[0]:
                raise ValueError(f"the row blocks of {key!r} have {row} rows, the tensor {own[key].shape[0]}")
        for src, shape in src_shapes.items():
            lead = shape[-1] if src in transposed else shape[0]
            if covered.get(src) != lead:
                raise ValueError(f"the row blocks of source tensor {src!r} cover {covered.get(src, 0)} of {lead} rows")
        return cls(tuple(pieces), tuple((k, tuple(int(n) for n in v)) for k, v in src_shapes.items()),
                   tuple(transposed))

    def own_keys(self) -> List[str]:
        return list(dict.fromkeys(p.own for p in self.pieces))

    def src_keys(self) -> List[str]:
        return [k for k, _ in self.src_shapes]

    def _oriented(self, src: str) -> Tuple[int, ...]:
        shape = dict(self.src_shapes)[src]
        return tuple(reversed(shape)) if src in self.transposed else shape

    def to_source(self, own: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The source's tensors (fresh, contiguous) from the block's."""
        out: Dict[str, torch.Tensor] = {}
        for src in self.src_keys():
            ref = next(own[p.own] for p in self.pieces if p.src == src)
            t = torch.empty(self._oriented(src), dtype=ref.dtype, device=ref.device)
            for p in self.pieces:
                if p.src == src:
                    t[p.src_row:p.src_row + p.rows] = own[p.own].detach()[p.own_row:p.own_row + p.rows]
            out[src] = (t.T if src in self.transposed else t).contiguous()
        return out

    def from_source(self, src: Mapping[str, torch.Tensor], own_shapes: Mapping[str, Sequence[int]]
                    ) -> Dict[str, torch.Tensor]:
        """The block's tensors from the source's (whose shapes :meth:`matches`)."""
        view = {k: (src[k].T if k in self.transposed else src[k]) for k in self.src_keys()}
        out: Dict[str, torch.Tensor] = {}
        for key in self.own_keys():
            ref = next(view[p.src] for p in self.pieces if p.own == key)
            t = torch.empty(tuple(own_shapes[key]), dtype=ref.dtype, device=ref.device)
            for p in self.pieces:
                if p.own == key:
                    t[p.own_row:p.own_row + p.rows] = view[p.src][p.src_row:p.src_row + p.rows]
            out[key] = t
        return out


def install_source_layout(module: nn.Module, layout: SourceLayout) -> nn.Module:
    """Store ``module``'s tensors in ``layout`` (its ``state_dict`` and ``load_state_dict``); returns ``module``."""
    if getattr(module, "_source_layout", None) is not None:
        raise ValueError(f"{type(module).__name__} already has a source layout")
    module._source_layout = layout  # type: ignore[assignment]  # a plain attribute, not a submodule
    _install_hooks(module)
    return module


def mark_converted(module: nn.Module) -> nn.Module:
    """Add :data:`MARKER` to ``module``'s ``state_dict`` (module docstring); returns ``module``."""
    if MARKER in dict(module.named_buffers(recurse=False)):
        return module
    module.register_buffer(MARKER, torch.ones((), dtype=torch.int8, device=_device_of(module)))
    _install_hooks(module)
    return module


def _device_of(module: nn.Module) -> Optional[torch.device]:
    return next((t.device for t in module.parameters()), None)


def _install_hooks(module: nn.Module) -> None:
    if getattr(module, "_source_hooks", False):
        return
    module._source_hooks = True  # type: ignore[assignment]  # a plain attribute, not a submodule
    module.register_state_dict_post_hook(_to_source_layout)
    module.register_load_state_dict_pre_hook(_from_source_layout)


def _to_source_layout(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    layout: Optional[SourceLayout] = getattr(module, "_source_layout", None)
    if layout is None:
        return
    own = {k: state_dict.pop(prefix + k) for k in layout.own_keys()}
    for k, v in layout.to_source(own).items():
        state_dict[prefix + k] = v


def _from_source_layout(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any,
                        strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                        error_msgs: List[str]) -> None:
    if MARKER in module._buffers and prefix + MARKER not in state_dict:  # the source's own checkpoint
        state_dict[prefix + MARKER] = module._buffers[MARKER].detach().clone()  # type: ignore[union-attr]  # set
    layout: Optional[SourceLayout] = getattr(module, "_source_layout", None)
    if layout is None:
        return
    shapes = dict(layout.src_shapes)
    present = [k for k in layout.src_keys() if prefix + k in state_dict]
    if len(present) != len(shapes) or any(tuple(state_dict[prefix + k].shape) != shapes[k] for k in present):
        return  # not the source's layout: load_state_dict reports the missing, unexpected or mismatched keys
    src = {k: state_dict.pop(prefix + k) for k in present}
    state_dict.update({prefix + k: v for k, v in layout.from_source(src, own_shapes(module)).items()})


def own_shapes(module: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """The keys and shapes of ``module``'s ``state_dict`` in the blocks' own layouts (without building it)."""
    out = {k: tuple(v.shape) for k, v in module.named_parameters(remove_duplicate=False)}
    for mname, mod in module.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = tuple(b.shape)
    return out


def stored_shapes(module: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """The keys and shapes of ``module``'s ``state_dict`` as stored (every :class:`SourceLayout` applied)."""
    shapes = own_shapes(module)
    for mname, mod in module.named_modules():
        layout: Optional[SourceLayout] = getattr(mod, "_source_layout", None)
        if layout is not None:
            pre = f"{mname}." if mname else ""
            for k in layout.own_keys():
                shapes.pop(pre + k, None)
            shapes.update({pre + k: v for k, v in layout.src_shapes})
    return shapes


def gpt2_conv1d_layout(block: nn.Module) -> SourceLayout:
    """HF ``Conv1D``: ``c_attn.weight`` and ``c_proj.weight`` stored ``(in, out)``."""
    pieces = {}
    shapes = {}
    for name in ("c_attn", "c_proj"):
        w = getattr(block, name).weight
        pieces[f"{name}.weight"] = [(f"{name}.weight", 0, w.shape[0])]
        shapes[f"{name}.weight"] = (w.shape[1], w.shape[0])
    return SourceLayout.build(block, pieces, shapes, transposed=("c_attn.weight", "c_proj.weight"))


def stacked_layout(block: nn.Module, own: Mapping[str, Sequence[Tuple[str, int]]], order: Mapping[str, Sequence[str]]
                   ) -> SourceLayout:
    """A layout where block tensor ``own[k]`` stacks named source row blocks ``(part, rows)`` and each source tensor
    ``s`` stacks the parts ``order[s]`` (in that order): e.g. the block's ``fc1 = [up; gate]`` and Phi-3's
    ``gate_up_proj = [gate; up]``."""
    sizes = {part: rows for blocks in own.values() for part, rows in blocks}
    where: Dict[str, Tuple[str, int]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    tensors = dict(block.named_parameters())
    for src, parts in order.items():
        row = 0
        for part in parts:
            where[part] = (src, row)
            row += sizes[part]
        own_key = next(k for k, blocks in own.items() if any(p == parts[0] for p, _ in blocks))
        shapes[src] = (row, *tensors[own_key].shape[1:])
    pieces = {k: [(where[part][0], where[part][1], rows) for part, rows in blocks] for k, blocks in own.items()}
    return SourceLayout.build(block, pieces, shapes)


def glu_layout(block: GatedMLP, src: nn.Module) -> Optional[SourceLayout]:
    """The source's names and layout for a :class:`~certblocks.blocks.mlp.GatedMLP` (``fc1 = [value; gate]``,
    ``fc2``) converted from ``src``: LLaMA's ``gate_proj``, ``up_proj``, ``down_proj``, Phi-3's
    ``gate_up_proj = [gate; up]``, timm ``SwiGLU``'s ``fc1_g``, ``fc1_x``, timm ``GluMlp(gate_last=False)``'s
    ``fc1 = [gate; value]``; ``None`` when the source stores ``fc1 = [value; gate]`` and ``fc2`` itself."""
    if hasattr(src, "gate_proj") and hasattr(src, "up_proj") and hasattr(src, "down_proj"):
        names = {"gate_proj": ["g"], "up_proj": ["v"], "down_proj": ["d"]}
    elif hasattr(src, "gate_up_proj") and hasattr(src, "down_proj"):
        names = {"gate_up_proj": ["g", "v"], "down_proj": ["d"]}
    elif hasattr(src, "fc1_g") and hasattr(src, "fc1_x"):
        names = {"fc1_g": ["g"], "fc1_x": ["v"], "fc2": ["d"]}
    elif hasattr(src, "fc1") and not getattr(src, "gate_last", True):
        names = {"fc1": ["g", "v"], "fc2": ["d"]}
    else:
        return None
    h, d = block.fc2.in_features, block.fc2.out_features
    return _stacked(block, {"fc1": [("v", h), ("g", h)], "fc2": [("d", d)]}, names)


def fused_qkv_layout(block: nn.Module, fused: str = "qkv_proj") -> SourceLayout:
    """Phi-3's fused ``qkv_proj = [q; k; v]`` for a block with ``q_proj``, ``k_proj``, ``v_proj``."""
    own = {n: [(n[0], getattr(block, n).out_features)] for n in ("q_proj", "k_proj", "v_proj")}
    return _stacked(block, own, {fused: ["q", "k", "v"]})


def separate_qkv_layout(block: _QKA) -> SourceLayout:
    """HF ``PatchTSTAttention``'s ``k_proj``, ``v_proj``, ``q_proj``, ``out_proj`` for a block with fused ``qkv``
    (``[q; k; v]``) and ``proj``."""
    d = block.dim
    return _stacked(block, {"qkv": [("q", d), ("k", d), ("v", d)], "proj": [("o", d)]},
                    {"k_proj": ["k"], "v_proj": ["v"], "q_proj": ["q"], "out_proj": ["o"]})


def _stacked(block: nn.Module, own: Mapping[str, Sequence[Tuple[str, int]]], names: Mapping[str, Sequence[str]]
             ) -> SourceLayout:
    """:func:`stacked_layout` for the weights and, when the block has them, the biases of linear layers."""
    kinds = ["weight"] + (["bias"] if getattr(block, next(iter(own))).bias is not None else [])
    return stacked_layout(block, {f"{k}.{t}": [(f"{p}.{t}", n) for p, n in v] for k, v in own.items() for t in kinds},
                          {f"{k}.{t}": [f"{p}.{t}" for p in v] for k, v in names.items() for t in kinds})


# ---------------------------------------------------------------------------------------------- adapters
class TimmQKNormAttention(_QKA):
    """:class:`QKNormAttention` called like timm's ``Attention`` (``attn_mask``, ``is_causal``)."""

    # the same function as _QKA's forward, called with the host's arguments: its certificate is this class's too
    # (the tracer uses a module's own certificate only for the forward of the class that defines it)
    certificate = _QKA.certificate

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,  # type: ignore[override]
                is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
        if is_causal:
            raise ValueError("the converted attention is bidirectional (timm ViT); is_causal=True is not supported")
        return super().forward(x, attn_mask=attn_mask)


class HFGPT2QKNormAttention(_QKA):
    """:class:`QKNormAttention` called like HF ``GPT2Attention``: returns ``(output, None)``."""

    # the same function as _QKA's forward, called with the host's arguments: its certificate is this class's too
    # (the tracer uses a module's own certificate only for the forward of the class that defines it)
    certificate = _QKA.certificate

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

    # the same function as _LGM's forward, called with the host's arguments: its certificate is this class's too
    # (the tracer uses a module's own certificate only for the forward of the class that defines it)
    certificate = _LGM.certificate

    def forward(self, hidden_states: torch.Tensor, cache: Any = None,  # type: ignore[override]
                attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if cache is not None or kwargs.get("cache_params") is not None:
            raise ValueError("cache_params: a converted MambaMixer does not use HF's cache; call the model with "
                             "use_cache=False")
        mask = attention_mask
        if mask is not None and mask.ndim == 2 and mask.shape[1] == hidden_states.shape[1]:
            hidden_states = hidden_states * mask[:, :, None].to(hidden_states.dtype)
        return super().forward(hidden_states)


class HFPatchTSTQKNormAttention(_QKA):
    """:class:`QKNormAttention` called like HF ``PatchTSTAttention``: returns ``(output, None)``."""

    # the same function as _QKA's forward, called with the host's arguments: its certificate is this class's too
    # (the tracer uses a module's own certificate only for the forward of the class that defines it)
    certificate = _QKA.certificate

    def forward(self, hidden_states: torch.Tensor, key_value_states: Optional[torch.Tensor] = None,  # type: ignore[override]
                attention_mask: Optional[torch.Tensor] = None, output_attentions: bool = False,
                **kwargs: Any) -> Tuple[torch.Tensor, None]:
        if key_value_states is not None:
            raise ValueError("key_value_states: cross-attention is not converted; only self-attention is")
        return super().forward(hidden_states, attn_mask=attention_mask), None

    @classmethod
    def from_module(cls, src: nn.Module, **overrides: Any) -> HFPatchTSTQKNormAttention:
        """Build from HF ``PatchTSTAttention`` (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``; copied) with fresh
        RMS QK-norm scales 1; ``overrides`` replace constructor arguments."""
        mod: Any = src  # HF PatchTSTAttention, read by duck typing
        dim, heads = int(mod.embed_dim), int(mod.num_heads)
        hd = dim // heads
        if abs(float(mod.scaling) - hd ** -0.5) > 1e-12 * hd ** -0.5:
            raise ValueError(f"PatchTSTAttention with logit scale {mod.scaling} != head_dim**-0.5 is not supported")
        w = mod.q_proj.weight
        cfg: Dict[str, Any] = dict(causal=bool(getattr(mod, "is_causal", False)), qkv_bias=mod.q_proj.bias is not None,
                                   proj_bias=mod.out_proj.bias is not None, attn_dropout=float(mod.dropout),
                                   naming="timm", device=w.device, dtype=w.dtype)
        cfg.update(overrides)
        block = cls(dim, heads, **cfg)
        sd = {k: v.detach().clone() for k, v in block.state_dict().items() if k.startswith(("q_norm.", "k_norm."))}
        sd["qkv.weight"] = torch.cat([mod.q_proj.weight, mod.k_proj.weight, mod.v_proj.weight]).detach().clone()
        sd["proj.weight"] = mod.out_proj.weight.detach().clone()
        if mod.q_proj.bias is not None:
            sd["qkv.bias"] = torch.cat([mod.q_proj.bias, mod.k_proj.bias, mod.v_proj.bias]).detach().clone()
        if mod.out_proj.bias is not None:
            sd["proj.bias"] = mod.out_proj.bias.detach().clone()
        block.load_state_dict(sd, strict=True)
        return block


class HFRotaryQKNormAttention(RotaryQKNormAttention):
    """:class:`~certblocks.RotaryQKNormAttention` called like an HF Llama-family attention.

    It takes the decoder layer's arguments (``position_embeddings`` = HF's ``(cos, sin)``, ``attention_mask``,
    ``cache``/``past_key_values``), writes its normalized and rotated keys into HF's KV cache (so ``generate``
    runs cached, as the source did), and computes the attention with the kernel the model's config selects
    (``config._attn_implementation``: sdpa, eager, flash; HF's masks, sliding windows and GQA handling).  The
    function is :class:`~certblocks.RotaryQKNormAttention`'s: its certificate holds for every mask (a mask only
    restricts each query's convex combination of values) and at every position.
    """

    # the same function as RotaryQKNormAttention's forward, called with HF's arguments and kernels: its certificate
    certificate = RotaryQKNormAttention.certificate

    config: Any
    layer_idx: Optional[int]
    sliding_window: Optional[int]
    _eager: Callable[..., Tuple[torch.Tensor, Any]]

    @classmethod
    def from_module(cls, src: nn.Module, **overrides: Any) -> HFRotaryQKNormAttention:
        block = super().from_module(src, **overrides)
        assert isinstance(block, HFRotaryQKNormAttention)
        block.config = src.config
        block.layer_idx = getattr(src, "layer_idx", None)
        block.sliding_window = getattr(src, "sliding_window", None)
        # the source family's eager attention: the kernel when the config asks for "eager" (Gemma-2-style variants
        # differ from Llama's), resolved once here rather than at every call
        block._eager = getattr(sys.modules.get(type(src).__module__), "eager_attention_forward", None)  # type: ignore[assignment]  # None: set below
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

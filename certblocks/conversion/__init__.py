"""``convert``: swap certified blocks into an existing backbone, and say what the swap does to its certificate.

``convert(model)`` walks the model and replaces the modules a registered converter recognizes, copying their
weights.  Conversions are registered like the tracer's rules (:func:`register_converter`: a ``match`` and a
``build``; yours are consulted before the built-in ones).  The built-in converters:

* ``mamba_ssm.Mamba``, HF ``MambaMixer``, certblocks ``Mamba`` -> :class:`~certblocks.blocks.mamba.LinearGrowthMamba`:
  (5, 5) -> (1, 1);
* timm ``Attention``, nanoGPT ``CausalSelfAttention``, HF ``GPT2Attention``, HF ``PatchTSTAttention``, certblocks
  ``Attention`` -> :class:`~certblocks.blocks.attention.QKNormAttention` (RMS QK-norm, scales 1): (1, 2) -> (1, 1);
  in a timm ``Block`` without gains (``init_values=None``: ``ls1``/``ls2`` are ``nn.Identity``) certified
  :class:`~certblocks.LayerScale` gains 1 are put in their place (the function is unchanged; the fixes name their
  ``init_values``);
* the HF Llama family's attention (:data:`ROTARY_ATTENTIONS`: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma) ->
  :class:`~certblocks.RotaryQKNormAttention` (RoPE, grouped-query heads, QK-norm; Qwen3's own QK-norm is
  copied): (1, 2) -> (1, 1);
* gated MLPs whose gate grows (timm ``SwiGLU`` / ``SwiGLUPacked`` / ``GluMlp``, LLaMA-style ``gate_proj``,
  ``up_proj``, ``down_proj`` with SiLU or GELU, Phi-3's ``gate_up_proj``) -> :class:`~certblocks.blocks.mlp.GatedMLP`
  with a sigmoid gate: (2, 1) -> (1, 1);
* with ``remove_norms=True``: the LayerNorm / RMSNorm of a residual branch (``norm1``, ``norm2``, ``ln_1``,
  ``ln_2``, ``input_layernorm``, a Mamba block's ``norm``, ...; a norm whose parent also holds an attention, MLP
  or mixer) -> :class:`IdentityNorm` (an ``nn.Identity``): the normalization (0, 0) is removed.  A branch left
  without its norm must be at most (1, 1): an attention or mixer that is not swapped (excluded by ``filter_fn``,
  or one certblocks has no replacement for, such as Gemma-2's soft-capped attention) is refused with
  :class:`ConversionError` naming it, before anything is lost.

The replacements keep the source's device, dtype and train/eval mode.  HF and timm callers pass extra arguments
(``cache``, ``attention_mask``, ``position_embeddings``, ``is_causal``); the swapped modules are thin subclasses
(:mod:`certblocks._adapters`) that accept them.  A converted Llama-family model keeps HF's KV cache (``generate``
runs cached and gives what recomputing gives); the converted GPT-2 attention and Mamba mixers do not read HF's
cache, and ``convert`` sets such a model's ``config.use_cache`` to False (listed in ``report.notes``; ``revert``
restores it).  The swaps change the function (QK-norm, sigmoid gate, linear-growth scan): the weights are the
source's, the model needs fine-tuning.

**Checkpoints.**  A converted model's ``state_dict`` keeps its source's names and layouts (HF GPT-2's ``Conv1D``
``(in, out)``, LLaMA's ``gate_proj``/``up_proj``/``down_proj``, Phi-3's fused ``qkv_proj``, ...: :mod:`certblocks.
_adapters`), plus what the source lacks (QK-norm scales, inserted gains, and ``certblocks_converted`` on a module
whose keys would otherwise be the source's although its function is not) and minus the norms removed.  The source's
class loading it is therefore exact or fails loudly (``load_state_dict(strict=True)`` raises on the tensors it does
not have; HF's non-strict ``from_pretrained`` lists them in its load report).  :func:`load_converted` reads a
converted checkpoint back: ``save_pretrained`` of a converted HF model records the conversion in its config
(``certblocks_conversion``), and ``load_converted(directory)`` rebuilds and converts the model, then loads it
strictly; for other models ``load_converted(freshly_built_source, checkpoint, remove_norms=...)``.

**A conversion never weakens a model silently.**  With an ``example_input`` the tracer
(:func:`certblocks.trace.certify`) certifies the model before and after, and the :class:`ConversionReport` holds the
certified depth in each of ``dtypes`` before and after (:attr:`ConversionReport.depths`,
:meth:`ConversionReport.table`).
A swap can lower it: QK-norm bounds the logits but its Jacobian coefficient grows like ``1/sqrt(qk_norm_eps)``, so
at small radii it can exceed the plain attention's.  Then ``convert`` warns (:class:`ConversionWarning`) with the
update that consumes the budget, its culprit and the computed fixes that certify again the depth certified before,
each a lever the converted model has (``qk_norm_eps`` of an update that is exactly the block, ``init_values`` of the
branch gains, a wider dtype: :mod:`certblocks.fixes`; a converted backbone has no residual step ``dt``), or refuses
with ``strict=True``.  :meth:`ConversionReport.revert` puts the original modules back.  The steps are logged at
``INFO`` on ``certblocks.conversion`` (the command line shows them as progress).
"""

from __future__ import annotations

from . import builtin as _builtin_converters  # noqa: F401  (the built-in converters register themselves)
from .api import CONFIG_KEY, REPORT_DTYPES, convert
from .builtin import ROTARY_ATTENTIONS, IdentityNorm
from .checkpoints import load_converted
from .registry import Converter, converter_for, register_converter, registered_converters, unregister_converter
from .report import ConversionError, ConversionReport, ConversionWarning, DepthChange, Swap

__all__ = ["convert", "ConversionReport", "ConversionError", "ConversionWarning", "DepthChange", "Swap",
           "IdentityNorm", "REPORT_DTYPES", "ROTARY_ATTENTIONS", "Converter", "register_converter",
           "unregister_converter", "registered_converters", "converter_for", "load_converted", "CONFIG_KEY"]

# the public names are documented (and pickled) under the package, where users import them
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith(f"{__name__}."):
        _obj.__module__ = __name__
del _name, _obj

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

import copy
import dataclasses
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._format import fmt_num
from .certificate import BlockCertificate, StackCertificate
from .exponents import NORM, Exponents
from .fixes import Fix, Lever, compute_fixes, recertify

__all__ = ["convert", "ConversionReport", "ConversionError", "ConversionWarning", "DepthChange", "Swap",
           "IdentityNorm", "REPORT_DTYPES", "ROTARY_ATTENTIONS", "Converter", "register_converter",
           "unregister_converter", "registered_converters", "converter_for", "load_converted", "CONFIG_KEY"]

_log = logging.getLogger(__name__)  # the steps of a conversion, at INFO (the command line shows them as progress)

#: The dtypes of a report's before/after depths, by default.
REPORT_DTYPES = ("fp16", "bf16", "fp32")

_RESIDUAL_NORM_NAMES = ("norm", "norm1", "norm2", "ln_1", "ln_2", "input_layernorm", "post_attention_layernorm",
                        "pre_norm", "attn_norm", "mlp_norm", "ffn_norm", "norm_attn", "norm_ffn")
_BRANCH_NAMES = ("attn", "mlp", "mixer", "self_attn", "attention", "ff", "ffn", "feed_forward")


@dataclass(frozen=True)
class Swap:
    """One module replaced by :func:`convert`.

    Attributes:
        path: module path in the model.
        before: class name of the source module.
        after: class name of the replacement.
        exponents_before: the source's exponents ``(q, sigma)`` (of the normalization, for a norm removal).
        exponents_after: the replacement's exponents (``Identity``: (1, 0)).
    """

    path: str
    before: str
    after: str
    exponents_before: Exponents
    exponents_after: Exponents

    def __str__(self) -> str:
        return f"{self.path}: {self.before} {self.exponents_before} -> {self.after} {self.exponents_after}"


class ConversionWarning(UserWarning):
    """A conversion lowered the model's certified depth in some dtype (the message has the table and the fixes)."""


class ConversionError(ValueError):
    """:func:`convert` refused: a swap lowers the certified depth (``strict=True``), or ``remove_norms=True`` would
    leave a residual branch above (1, 1).  The model is left as it was."""


@dataclass(frozen=True)
class DepthChange:
    """The certified depth of a model in one dtype before and after :func:`convert` (traced).

    Attributes:
        dtype: the dtype.
        before, after: the certified residual updates.
        depth_before, depth_after: the residual updates (the same unless a swap changed the structure).
        reason: when the depth drops, the update whose log factor grew most, with its culprit.
        fixes: when the depth drops, the value of each lever that certifies again the updates certified before
            (each certified again: :func:`certblocks.fixes.compute_fixes`).
    """

    dtype: str
    before: int
    after: int
    depth_before: int
    depth_after: int
    reason: str = ""
    fixes: Tuple[Fix, ...] = ()

    @property
    def lowered(self) -> bool:
        """The conversion certifies fewer updates than before."""
        return self.after < self.before

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.dtype} {self.before}/{self.depth_before} -> {self.after}/{self.depth_after}{why}"

    def to_dict(self) -> Dict[str, Any]:
        return {"dtype": self.dtype, "before": self.before, "after": self.after, "depth_before": self.depth_before,
                "depth_after": self.depth_after, "reason": self.reason, "fixes": [f.to_dict() for f in self.fixes]}


@dataclass
class ConversionReport:
    """What :func:`convert` did.

    Attributes:
        model: the converted model (the input itself when ``inplace=True``, else a deep copy).
        swaps: every swap, in module order.
        certificate_before, certificate_after: the model's stack certificates (tracer) for ``dtype``,
            or ``None`` when no ``example_input`` was given or the tracer failed.
        trace_error_before, trace_error_after: why a certificate is missing (empty when present).
        dtype: the dtype of the certificates.
        notes: other changes made to the model (e.g. an HF ``config.use_cache`` set to False).
        depths: the certified depth per dtype before and after (:class:`DepthChange`; empty without both
            certificates).
    """

    model: nn.Module
    swaps: List[Swap] = field(default_factory=list)
    certificate_before: Optional[StackCertificate] = None
    certificate_after: Optional[StackCertificate] = None
    trace_error_before: str = ""
    trace_error_after: str = ""
    dtype: str = "bf16"
    notes: List[str] = field(default_factory=list)
    depths: List[DepthChange] = field(default_factory=list)
    _undo: List[Tuple[Any, str, Any]] = field(default_factory=list, repr=False)

    @property
    def lowered(self) -> List[DepthChange]:
        """The dtypes in which the conversion certifies fewer updates than before."""
        return [d for d in self.depths if d.lowered]

    def table(self, *, markdown: bool = False) -> str:
        """Certified depth per dtype before and after, and for a drop its reason and fixes."""
        from .cli.formatting import render_table

        if not self.depths:
            why = self.trace_error_before or self.trace_error_after or "no example_input given"
            return f"certified depths not available: {why.splitlines()[0]}"
        rows = []
        for d in self.depths:
            note = "" if not d.lowered else d.reason + (
                ("; fixes: " + ", ".join(f.text for f in d.fixes)) if d.fixes else "")
            rows.append([d.dtype, f"{d.before}/{d.depth_before}", f"{d.after}/{d.depth_after}",
                         f"{d.after - d.before:+d}", note])
        return render_table(["dtype", "before", "after", "change", "reason and fix"], rows, markdown=markdown)

    @property
    def max_q_after(self) -> Optional[float]:
        """Largest ``q`` over the residual updates after conversion (tracer), ``None`` if unknown."""
        return _max_q(self.certificate_after)

    @property
    def max_q_before(self) -> Optional[float]:
        """Largest ``q`` over the residual updates before conversion (tracer), ``None`` if unknown."""
        return _max_q(self.certificate_before)

    def revert(self) -> nn.Module:
        """Put the original modules (and changed settings) back into :attr:`model` and return it."""
        for parent, name, old in reversed(self._undo):
            if old is _ABSENT:
                delattr(parent, name)
            else:
                setattr(parent, name, old)
        self._undo.clear()
        self.swaps = []
        self.notes = []
        self.depths = []
        return self.model

    def explain(self) -> str:
        """The swaps, then the certificates before and after."""
        out = [f"{len(self.swaps)} swaps"]
        out += [f"  {s}" for s in self.swaps]
        for tag, cert, err in (("before", self.certificate_before, self.trace_error_before),
                               ("after", self.certificate_after, self.trace_error_after)):
            out.append(f"certificate {tag}:")
            out.append(cert.explain() if cert is not None else f"  not available: {err}")
        if self.depths:
            out += ["certified depth before and after:", self.table()]
        return "\n".join(out)

    def __str__(self) -> str:
        def short(c: Optional[StackCertificate], err: str) -> str:
            if c is None:
                return f"n/a ({err.splitlines()[0][:80] if err else 'no example_input'})"
            return f"{c.certified_depth}/{c.depth} certified in {c.dtype}, max q {_max_q(c)}"

        before = short(self.certificate_before, self.trace_error_before)
        after = short(self.certificate_after, self.trace_error_after)
        return f"ConversionReport({len(self.swaps)} swaps; before: {before}; after: {after})"


_ABSENT = object()  # an attribute convert() added (revert deletes it)


def _max_q(cert: Optional[StackCertificate]) -> Optional[float]:
    if cert is None or not cert.updates:
        return None
    qs = [u.q for u in cert.updates]
    return None if any(q is None for q in qs) else max(qs)  # type: ignore[type-var]


# ---------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Converter:
    """One registered conversion (:func:`register_converter`).

    Attributes:
        name: the converter's name (unique in the registry).
        match: ``match(module) -> bool``: the source modules it converts.
        build: ``build(module, model) -> replacement``: the certified replacement of ``module`` (a module of
            ``model``, the model being converted) with its weights copied.
        kind: what the source is (``"attention"``, ``"mamba"``, ``"glu"`` for the built-in ones, any word for
            others); an attention or mixer (``"attention"``, ``"mamba"``) of a Hugging Face model whose
            replacement does not read HF's cache switches the model's ``use_cache`` off.
        exponents_before: the source's exponents ``(q, sigma)``, or ``exponents_before(module) -> Exponents``.
        exact: ``exact(module) -> bool``: the replacement computes the source's function (a source that is
            already certified: Qwen3's QK-norm attention); otherwise a replacement whose checkpoint has exactly the
            source's keys and shapes gets :data:`certblocks._adapters.MARKER`, so that the source's class refuses it.
        keeps_hf_cache: the replacement reads and writes HF's KV cache as the source did (or the source has none).
    """

    name: str
    match: Callable[[nn.Module], bool]
    build: Callable[[nn.Module, nn.Module], nn.Module]
    kind: str
    exponents_before: Union[Exponents, Callable[[nn.Module], Exponents]]
    exact: Callable[[nn.Module], bool] = field(default=lambda m: False)
    keeps_hf_cache: bool = False

    def before(self, module: nn.Module) -> Exponents:
        """The source's exponents."""
        e = self.exponents_before
        return e if isinstance(e, Exponents) else e(module)


_USER: List[Converter] = []
_BUILTIN: List[Converter] = []


def _matcher(match: Union[Callable[[nn.Module], bool], type, str]) -> Callable[[nn.Module], bool]:
    if isinstance(match, type):
        if not issubclass(match, nn.Module):
            raise TypeError(f"match must be an nn.Module subclass, a class name or a predicate, got {match!r}")
        return lambda m: isinstance(m, match)
    if isinstance(match, str):
        if not match:
            raise ValueError("match must be a non-empty class name")
        if "." in match:  # a qualified name: module.Class
            return lambda m: f"{type(m).__module__}.{type(m).__qualname__}" == match
        return lambda m: type(m).__name__ == match
    if callable(match):
        return match
    raise TypeError(f"match must be a predicate, an nn.Module subclass or a class name, got {type(match).__name__}")


def register_converter(match: Union[Callable[[nn.Module], bool], type, str],
                       build: Callable[[nn.Module, nn.Module], nn.Module], *, kind: str,
                       exponents_before: Union[Exponents, Tuple[float, float], Callable[[nn.Module], Exponents]],
                       name: Optional[str] = None, exact: Optional[Callable[[nn.Module], bool]] = None,
                       keeps_hf_cache: bool = False, replace: bool = False) -> Converter:
    """Teach :func:`convert` a new source module, like :func:`certblocks.trace.register_rule` teaches the tracer an op.

    Converters registered here are consulted before the built-in ones, in the order they were registered; the
    first whose ``match`` accepts a module converts it (and nothing under it is visited).

    Args:
        match: the source modules: a predicate ``match(module) -> bool``, an ``nn.Module`` subclass
            (``isinstance``) or a class name (``"MyAttention"``, or ``"pkg.mod.MyAttention"``).
        build: ``build(module, model) -> nn.Module``: the certified replacement with the source's weights (its
            ``exponents`` attribute, when it has one, is the swap's exponents after); ``model`` is the model being
            converted (for settings that live elsewhere in it).
        kind: what the source is: ``"attention"``, ``"mamba"``, ``"glu"`` or another word.
        exponents_before: the source's exponents, as :class:`~certblocks.Exponents`, a pair ``(q, sigma)`` or
            ``exponents_before(module) -> Exponents``.
        name: the converter's name (default: ``build``'s qualified name).
        exact: ``exact(module) -> bool``, the replacement computes the source's function (default: never).
        keeps_hf_cache: the replacement uses HF's KV cache as the source did.
        replace: replace a registered converter of the same name (else that is an error).

    Returns:
        The registered :class:`Converter`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``name`` is already registered and ``replace`` is False.
    """
    if not callable(build):
        raise TypeError(f"build must be callable(module, model) -> nn.Module, got {type(build).__name__}")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"kind must be a non-empty str, got {kind!r}")
    if isinstance(exponents_before, tuple) and not isinstance(exponents_before, Exponents):
        exponents_before = Exponents(*exponents_before)
    if not isinstance(exponents_before, Exponents) and not callable(exponents_before):
        raise TypeError(f"exponents_before must be an Exponents, a (q, sigma) pair or a callable, got "
                        f"{type(exponents_before).__name__}")
    if exact is not None and not callable(exact):
        raise TypeError(f"exact must be callable(module) -> bool, got {type(exact).__name__}")
    name = name or getattr(build, "__qualname__", None) or repr(build)
    conv = Converter(name, _matcher(match), build, kind, exponents_before, exact or (lambda m: False),
                     bool(keeps_hf_cache))
    taken = [i for i, c in enumerate(_USER) if c.name == name]
    if taken or any(c.name == name for c in _BUILTIN):
        if not replace:
            raise ValueError(f"a converter named {name!r} is already registered; pass replace=True to replace it")
        if taken:
            _USER[taken[0]] = conv
            return conv
    _USER.append(conv)
    return conv


def unregister_converter(name: str) -> Converter:
    """Remove the converter registered with :func:`register_converter` as ``name`` and return it.

    Raises:
        KeyError: no user converter of that name (the built-in ones cannot be removed; register one before them).
    """
    for i, c in enumerate(_USER):
        if c.name == name:
            return _USER.pop(i)
    raise KeyError(f"no converter named {name!r} was registered with register_converter; registered: "
                   f"{[c.name for c in _USER]}")


def registered_converters() -> List[Converter]:
    """Every converter in the order :func:`convert` consults them: the user's, then the built-in ones."""
    return list(_USER) + list(_BUILTIN)


def converter_for(module: nn.Module) -> Optional[Converter]:
    """The first registered converter whose ``match`` accepts ``module``, or ``None``."""
    return next((c for c in (*_USER, *_BUILTIN) if c.match(module)), None)


def _builtin(match: Callable[[nn.Module], bool], kind: str, exponents_before: Any, *, exact: Any = None,
             keeps_hf_cache: bool = False) -> Callable[[Callable[[nn.Module, nn.Module], nn.Module]], Any]:
    def deco(build: Callable[[nn.Module, nn.Module], nn.Module]) -> Callable[[nn.Module, nn.Module], nn.Module]:
        _BUILTIN.append(Converter(build.__name__.lstrip("_"), match, build, kind, exponents_before,
                                  exact or (lambda m: False), keeps_hf_cache))
        return build

    return deco


# ---------------------------------------------------------------------------------------------- built-in converters
#: HF attentions of the Llama family that :class:`~certblocks.RotaryQKNormAttention` replaces.
ROTARY_ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "Phi3Attention",
                     "GemmaAttention")


def _from(m: nn.Module, package: str) -> bool:
    return type(m).__module__.startswith(package)


def _has_qk_norm(m: nn.Module) -> bool:
    qn = getattr(m, "q_norm", None)
    return qn is not None and not isinstance(qn, nn.Identity)


def _attention_before(m: nn.Module) -> Exponents:
    from .exponents import ATTENTION, QK_NORM_ATTENTION

    return QK_NORM_ATTENTION if _has_qk_norm(m) else ATTENTION


def _is_rotary_attention(m: nn.Module) -> bool:
    return type(m).__name__ in ROTARY_ATTENTIONS and _from(m, "transformers")


def _rope_scaling(model: nn.Module) -> float:
    """The largest ``attention_scaling`` of an HF rotary embedding in ``model`` (1 when there is none)."""
    found = [float(m.attention_scaling) for m in model.modules()
             if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "attention_scaling")]
    return max(found, default=1.0)


@_builtin(_is_rotary_attention, "attention", _attention_before, exact=_has_qk_norm, keeps_hf_cache=True)
def _hf_rotary_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from . import _adapters

    block = _adapters.HFRotaryQKNormAttention.from_module(src, rope_attention_scaling=_rope_scaling(model))
    if hasattr(src, "qkv_proj"):  # Phi-3 stores one fused projection
        _adapters.install_source_layout(block, _adapters.fused_qkv_layout(block))
    return block


def _is_hf_gpt2_attention(m: nn.Module) -> bool:
    return (type(m).__name__ == "GPT2Attention" and _from(m, "transformers")
            and not getattr(m, "is_cross_attention", False))


@_builtin(_is_hf_gpt2_attention, "attention", _attention_before)
def _hf_gpt2_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from . import _adapters

    block = _adapters.HFGPT2QKNormAttention.from_module(src)
    return _adapters.install_source_layout(block, _adapters.gpt2_conv1d_layout(block))


def _is_timm_attention(m: nn.Module) -> bool:
    return (type(m).__name__ == "Attention" and _from(m, "timm") and hasattr(m, "qkv") and hasattr(m, "proj")
            and hasattr(m, "num_heads"))


@_builtin(_is_timm_attention, "attention", _attention_before, exact=_has_qk_norm)
def _timm_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from . import _adapters

    return _adapters.TimmQKNormAttention.from_module(src)


def _is_gpt_attention(m: nn.Module) -> bool:
    """nanoGPT's ``CausalSelfAttention`` (``c_attn``, ``c_proj``, ``n_head``) and certblocks' ``Attention``."""
    from .blocks.attention import Attention, QKNormAttention

    if isinstance(m, QKNormAttention):
        return False
    if isinstance(m, Attention):
        return True
    return (hasattr(m, "c_attn") and hasattr(m, "c_proj") and type(m).__name__ != "GPT2Attention"
            and (type(m).__name__ in ("CausalSelfAttention", "Attention") or hasattr(m, "n_head")))


@_builtin(_is_gpt_attention, "attention", _attention_before, exact=_has_qk_norm)
def _gpt_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from .blocks.attention import QKNormAttention

    return QKNormAttention.from_module(src)


def _is_hf_patchtst_attention(m: nn.Module) -> bool:
    return (type(m).__name__ == "PatchTSTAttention" and _from(m, "transformers")
            and not getattr(m, "is_decoder", False))


@_builtin(_is_hf_patchtst_attention, "attention", _attention_before, keeps_hf_cache=True)
def _hf_patchtst_attention(src: nn.Module, model: nn.Module) -> nn.Module:
    from . import _adapters

    block = _adapters.HFPatchTSTQKNormAttention.from_module(src)
    return _adapters.install_source_layout(block, _adapters.separate_qkv_layout(block))


def _is_hf_mamba(m: nn.Module) -> bool:
    return type(m).__name__ == "MambaMixer" and _from(m, "transformers")


def _mamba_before(m: nn.Module) -> Exponents:
    from .exponents import MAMBA_SSM

    return MAMBA_SSM


@_builtin(_is_hf_mamba, "mamba", _mamba_before)
def _hf_mamba_mixer(src: nn.Module, model: nn.Module) -> nn.Module:
    from . import _adapters

    return _adapters.HFLinearGrowthMamba.from_module(src)


def _is_mamba(m: nn.Module) -> bool:
    """``mamba_ssm.Mamba`` and certblocks' ``Mamba`` (the (5, 5) block)."""
    return type(m).__name__ == "Mamba" and (_from(m, "mamba_ssm") or _from(m, "certblocks"))


@_builtin(_is_mamba, "mamba", _mamba_before)
def _mamba(src: nn.Module, model: nn.Module) -> nn.Module:
    from .blocks.mamba import LinearGrowthMamba

    return LinearGrowthMamba.from_module(src)


def _act_is(act: Optional[nn.Module], keys: Tuple[str, ...]) -> bool:
    return act is None or any(k in type(act).__name__.lower() for k in keys)


def _is_glu(m: nn.Module) -> bool:
    """A gated MLP whose gate grows (SiLU: SwiGLU; GELU: Gemma's GeGLU): q = 2."""
    from .blocks.mlp import GatedMLP

    if isinstance(m, GatedMLP):
        return m.gate == "silu"
    name = type(m).__name__
    if hasattr(m, "gate_proj") and hasattr(m, "up_proj") and hasattr(m, "down_proj"):
        return _act_is(getattr(m, "act_fn", None), ("silu", "swish", "gelu"))
    if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and _from(m, "transformers"):
        return _act_is(getattr(m, "activation_fn", None), ("silu", "swish", "gelu"))  # Phi-3
    if name in ("SwiGLU", "SwiGLUPacked", "GluMlp") and _from(m, "timm"):
        act = getattr(m, "act", None)
        return act is None or type(act).__name__ in ("SiLU", "Swish")
    return False


@_builtin(_is_glu, "glu", Exponents(2, 1))
def _gated_mlp(src: nn.Module, model: nn.Module) -> nn.Module:
    from . import _adapters
    from .blocks.mlp import GatedMLP

    block = GatedMLP.from_module(src, gate="sigmoid")
    layout = _adapters.glu_layout(block, src)
    return block if layout is None else _adapters.install_source_layout(block, layout)


# ---------------------------------------------------------------------------------------------- norms and gains
def _is_norm(child: nn.Module) -> bool:
    name = type(child).__name__
    return isinstance(child, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("LayerNorm", "RMSNorm", "RmsNorm",
                                                                             "LayerNorm2d"))


def _residual_norm(parent: nn.Module, name: str, child: nn.Module) -> bool:
    if not _is_norm(child) or name not in _RESIDUAL_NORM_NAMES:
        return False
    return any(hasattr(parent, b) for b in _BRANCH_NAMES)


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
_GAIN_SLOTS = (("attn", "ls1"), ("mlp", "ls2"))


def _insert_gains(block: nn.Module) -> List[str]:
    """Put a :class:`~certblocks.LayerScale` with gain 1 (the function unchanged) where a timm block has none
    (``ls1`` / ``ls2`` are ``nn.Identity`` when timm's ``init_values`` is None); returns the slots filled."""
    from .blocks.gain import LayerScale

    filled = []
    for branch, slot in _GAIN_SLOTS:
        if isinstance(getattr(block, slot, None), nn.Identity) and isinstance(getattr(block, branch, None), nn.Module):
            ref = next(getattr(block, branch).parameters(), None)
            dim = getattr(block.attn, "dim", None) or getattr(getattr(block.attn, "qkv", None), "in_features", None)
            if ref is None or dim is None:
                continue
            setattr(block, slot, LayerScale(int(dim), 1.0, device=ref.device, dtype=ref.dtype))
            filled.append(slot)
    return filled


def _gain_lever(model: nn.Module, path: str) -> Optional[Lever]:
    """The ``init_values`` lever of the traced update ``path`` (``blocks.3.attn``) when its block holds its gain
    (``ls1``, a timm or certblocks ``LayerScale``): the gain ``v`` in place of ``g = max |gamma|`` scales every
    coefficient of the update by ``v / g`` (in the per-token norm ``||gamma * y|| <= max |gamma| ||y||``:
    :mod:`certblocks.blocks.gain`)."""
    from .blocks.gain import scaled_certificate

    parent_path, _, branch = path.rpartition(".")
    slot = dict(_GAIN_SLOTS).get(branch)
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


def _build(conv: Converter, src: nn.Module, model: nn.Module, path: str) -> nn.Module:
    """``conv``'s replacement of ``src``; marked (:data:`certblocks._adapters.MARKER`) when its checkpoint would have
    the source's keys and shapes although it computes another function."""
    from . import _adapters

    new = conv.build(src, model)
    if not isinstance(new, nn.Module):
        raise TypeError(f"converter {conv.name!r} returned a {type(new).__name__} for {path} ({type(src).__name__}); "
                        "build must return an nn.Module")
    if not conv.exact(src) and _adapters.stored_shapes(new) == _adapters.stored_shapes(src):
        _adapters.mark_converted(new)
    return new


#: The key of an HF config that records what :func:`convert` did (read back by :func:`load_converted`).
CONFIG_KEY = "certblocks_conversion"


def _record(report: ConversionReport, plan: Sequence[Tuple[nn.Module, str, str, nn.Module, Optional[Converter]]],
            gained: Sequence[str]) -> None:
    """Write the conversion into an HF model's ``config`` (saved by ``save_pretrained``; :func:`load_converted`)."""
    cfg = getattr(report.model, "config", None)
    if not plan or cfg is None or not callable(getattr(cfg, "to_dict", None)):
        return
    record = {"version": 1, "converted": {path: conv.name for _, _, path, _, conv in plan if conv is not None},
              "norms": [path for _, _, path, _, conv in plan if conv is None], "gains": list(gained)}
    report._undo.append((cfg, CONFIG_KEY, getattr(cfg, CONFIG_KEY, _ABSENT)))
    setattr(cfg, CONFIG_KEY, record)


# ---------------------------------------------------------------------------------------------- checks
def _trace(model: nn.Module, example_input: Any, dtype: str, r0: float) -> Tuple[Optional[StackCertificate], str]:
    from .trace import ModelCertificate, certify

    was = model.training
    model.eval()
    try:
        cert = certify(model, example_input)
        if not isinstance(cert, ModelCertificate):
            return None, "the tracer found no residual update in the model"
        return cert.stack(dtype, r0=r0), ""
    except Exception as e:  # the tracer's failure is reported, not raised
        return None, f"{type(e).__name__}: {e}"
    finally:
        model.train(was)


def _own_module(model: nn.Module, u: BlockCertificate) -> Optional[nn.Module]:
    """The certified module whose own certificate the traced update ``u`` is (same exponents and coefficients),
    or ``None`` (an update that also holds a norm, a gain or other ops: a block lever does not apply to it)."""
    try:
        mod = model.get_submodule(u.name) if u.name else None
    except AttributeError:
        return None
    if mod is None or not callable(getattr(mod, "certificate", None)):
        return None
    try:
        own = mod.certificate()
    except Exception:  # a block whose certificate needs arguments the trace had (seq_len): not matched
        return None
    same = all(math.isclose(getattr(own, f), getattr(u, f), rel_tol=1e-9, abs_tol=1e-300)
               for f in ("c", "b", "l1", "l0"))
    return mod if same and own.exponents == u.exponents else None


def _depth_change(before: StackCertificate, after: StackCertificate, model: nn.Module) -> DepthChange:
    """Before and after in one dtype; when the depth drops, the update that consumes more and the fixes."""
    change = DepthChange(before.dtype, before.certified_depth, after.certified_depth, before.depth, after.depth)
    if not change.lowered:
        return change
    grown = [(a_lf - before.log_factors[k], u) for k, (u, a_lf) in enumerate(zip(after.updates, after.log_factors))
             if k < len(before.log_factors) and before.updates[k].name == u.name and u.is_update]
    reason = ""
    if grown:
        delta, u = max(grown, key=lambda t: t[0])
        if delta > 0:
            culprit = ""
            try:  # the block's own culprit and the first clause of its fix (the module named like the update)
                mod = model.get_submodule(u.name)
                if callable(getattr(mod, "certificate", None)):
                    own = mod.certificate()
                    culprit = own.culprit + (f" ({own.fix.split(':')[0]})" if own.fix else "")
            except Exception:  # not a module, or a certificate that needs arguments: the traced culprit
                pass
            reason = f"{u.name}: log factor +{fmt_num(delta)} nats; {culprit or u.culprit or u.exponents}"
    # the levers' values that certify the updates certified before (the converted chain cut there); a block lever
    # only for an update that is exactly that block
    ends = [k for k, u in enumerate(after.updates) if u.is_update]
    want = before.certified_depth
    cut = after if want >= len(ends) or want == 0 else recertify(after, after.updates[: ends[want - 1] + 1])
    levers: Dict[int, List[Lever]] = {}
    for k, u in enumerate(cut.updates):
        if not u.is_update:
            continue
        mod = _own_module(model, u)
        own = list(mod.levers()) if mod is not None and callable(getattr(mod, "levers", None)) else []
        gain = _gain_lever(model, u.name)
        if gain is not None and not any(lv.name == gain.name for lv in own):
            own.append(gain)
        if own:
            levers[k] = own
    # a converted backbone has no residual step dt: the levers are its blocks' and its branch gains'
    fixes = tuple(f for f in compute_fixes(cut, levers=levers, dt=False) if f.lever != "depth")
    return dataclasses.replace(change, reason=reason, fixes=fixes)


def _left_above(target: nn.Module, plan: Sequence[Tuple[nn.Module, str, str, nn.Module, Optional[Converter]]]
                ) -> List[str]:
    """The residual branches whose norm :func:`convert` removed and that stay above (1, 1): ``"path (why)"``."""
    out = []
    parents = dict.fromkeys(path.rpartition(".")[0] for _, _, path, _, conv in plan if conv is None)
    for pp in parents:
        parent = target.get_submodule(pp)
        for b in _BRANCH_NAMES:
            child = getattr(parent, b, None)
            if not isinstance(child, nn.Module):
                continue
            path, cls = f"{pp}.{b}" if pp else b, type(child).__name__
            ex = getattr(child, "exponents", None)
            if isinstance(ex, Exponents) and ex.q is not None and ex.sigma is not None:
                if ex.q > 1 or ex.sigma > 1:
                    out.append(f"{path} ({cls}, {ex})")
            elif converter_for(child) is not None:
                out.append(f"{path} ({cls}: excluded by filter_fn)")
            elif any(k in cls.lower() for k in ("attention", "mixer", "ssm", "glu")):
                out.append(f"{path} ({cls}: certblocks has no certified replacement for it)")
    return out


# ---------------------------------------------------------------------------------------------- convert
def convert(model: nn.Module, *, filter_fn: Optional[Callable[[str, nn.Module], bool]] = None,
            remove_norms: bool = False, inplace: bool = False, example_input: Any = None, dtype: str = "bf16",
            r0: float = 1.0, dtypes: Sequence[str] = REPORT_DTYPES, strict: bool = False) -> ConversionReport:
    """Swap the modules of ``model`` that certblocks knows for their certified replacements.

    Args:
        model: any ``nn.Module``.
        filter_fn: ``filter_fn(path, module) -> bool``; only modules for which it returns True are swapped.
        remove_norms: also replace the LayerNorm / RMSNorm on residual branches by ``nn.Identity``.  A branch
            whose norm is removed must then be at most (1, 1): a known module is swapped, and an attention or
            mixer left as it is (excluded by ``filter_fn``, or one certblocks cannot convert) is refused with
            :class:`ConversionError` naming it, as is (with ``example_input``) any traced update above (1, 1).
        inplace: modify ``model`` itself (default: a deep copy is converted and ``model`` is untouched).
        example_input: an input for ``model`` (tensor, tuple or dict); when given, the tracer derives the
            model's certificate before and after the conversion, and the certified depths per dtype.
        dtype: the dtype of :attr:`ConversionReport.certificate_before` / ``_after``.
        r0: the input radius of those certificates.
        dtypes: the dtypes of the before/after depths (:attr:`ConversionReport.depths`).
        strict: raise :class:`ConversionError` (and leave ``model`` as it was) when a swap lowers the certified
            depth in one of ``dtypes``; by default a :class:`ConversionWarning` says so.

    Returns:
        A :class:`ConversionReport`; ``report.model`` is the converted model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(path, module) -> bool, got {type(filter_fn).__name__}")
    for name, flag in (("remove_norms", remove_norms), ("inplace", inplace), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    from .budget import dtype_name

    dtype = dtype_name(dtype)
    if isinstance(dtypes, str):
        raise TypeError(f"dtypes must be a sequence of dtype names, got the string {dtypes!r}")
    table_dtypes = list(dict.fromkeys([dtype_name(d) for d in dtypes] + [dtype]))
    target = model if inplace else copy.deepcopy(model)
    report = ConversionReport(target, dtype=dtype)
    if example_input is not None:
        _log.info("capture and certify the model before conversion")
        report.certificate_before, report.trace_error_before = _trace(target, example_input, dtype, r0)
    else:
        report.trace_error_before = "no example_input given"

    plan: List[Tuple[nn.Module, str, str, nn.Module, Optional[Converter]]] = []  # parent, attr, path, module, how
    skip_under: List[str] = []
    for path, mod in target.named_modules():
        if any(path.startswith(p + ".") for p in skip_under):
            continue
        conv = converter_for(mod) if path else None
        if conv is not None and (filter_fn is None or filter_fn(path, mod)):
            parent_path, _, attr = path.rpartition(".")
            plan.append((target.get_submodule(parent_path), attr, path, mod, conv))
            skip_under.append(path)
            continue
        if remove_norms:
            for cname, child in mod.named_children():
                cpath = f"{path}.{cname}" if path else cname
                if _residual_norm(mod, cname, child) and (filter_fn is None or filter_fn(cpath, child)):
                    plan.append((mod, cname, cpath, child, None))

    order = {p: i for i, (p, _) in enumerate(target.named_modules(remove_duplicate=False))}
    plan.sort(key=lambda t: order.get(t[2], len(order)))
    _log.info("swap %d modules", len(plan))
    gained: List[str] = []
    for parent, attr, path, mod, conv in plan:
        if conv is None:
            new: nn.Module = IdentityNorm(mod)
            before, after = NORM, Exponents(1, 0)
        else:
            new = _build(conv, mod, target, path)
            before, after = conv.before(mod), getattr(new, "exponents", None)
            after = after if isinstance(after, Exponents) else Exponents(None, None)
        new.train(mod.training)
        setattr(parent, attr, new)
        report._undo.append((parent, attr, mod))
        public = next(c for c in type(new).__mro__ if not c.__name__.startswith(("_", "HF", "Timm")))
        report.swaps.append(Swap(path, type(mod).__name__, "Identity" if conv is None else public.__name__, before,
                                 after))
        if conv is not None and conv.name == "timm_attention" and _from(parent, "timm"):
            old = {slot: getattr(parent, slot) for _, slot in _GAIN_SLOTS if hasattr(parent, slot)}
            for slot in _insert_gains(parent):
                report._undo.append((parent, slot, old[slot]))
                gained.append(f"{path.rpartition('.')[0]}.{slot}")
    _record(report, plan, gained)
    if gained:
        report.notes.append(f"LayerScale gains (timm's ls1/ls2, init_values 1: the function is unchanged) inserted at "
                            f"{len(gained)} branches ({gained[0]}, ...): the fixes' init_values lever")

    def refuse(msg: str) -> None:
        if inplace:
            report.revert()
        raise ConversionError(msg)

    if remove_norms:
        left = _left_above(target, plan)
        if left:
            refuse("remove_norms=True would leave residual branches above (1, 1) without their norm: "
                   + "; ".join(left) + ". Convert them (or keep their norms: filter_fn, remove_norms=False)")

    # the swapped attentions and mixers that do not read HF's cache: run HF models without one
    uncached = [p for p in plan if p[4] is not None and _from(p[3], "transformers")
                and p[4].kind in ("attention", "mamba") and not p[4].keeps_hf_cache]
    for owner, what in ((getattr(target, "config", None), "config"),
                        (getattr(target, "generation_config", None), "generation_config")):
        if uncached and owner is not None and getattr(owner, "use_cache", False):
            report._undo.append((owner, "use_cache", owner.use_cache))
            owner.use_cache = False
            report.notes.append(f"{what}.use_cache set to False: the converted GPT-2 attention / Mamba mixers do not "
                                "use HF's cache (generate() recomputes, uncached)")
    if example_input is None:
        report.trace_error_after = "no example_input given"
        return report
    _log.info("capture and certify the converted model")
    report.certificate_after, report.trace_error_after = _trace(target, example_input, dtype, r0)
    before, after_cert = report.certificate_before, report.certificate_after
    if remove_norms and after_cert is not None:
        above = [f"{u.name} (traced {u.exponents})" for u in after_cert.updates if u.is_update and u.q is not None
                 and u.sigma is not None and (u.q > 1 or u.sigma > 1)]
        if above:
            refuse("remove_norms=True left residual updates above (1, 1): " + "; ".join(above))
    if before is not None and after_cert is not None:
        _log.info("certified depths before and after, fixes")
        report.depths = [_depth_change(before.in_dtype(d), after_cert.in_dtype(d), target) for d in table_dtypes]
        lowered = [d for d in report.depths if d.lowered]
        if lowered:
            msg = ("the conversion lowers the certified depth: " + "; ".join(str(d) for d in lowered)
                   + "\n" + report.table())
            if strict:
                refuse(msg)
            warnings.warn(msg, ConversionWarning, stacklevel=2)
    return report


# ---------------------------------------------------------------------------------------------- checkpoints
def load_converted(source: Union[str, os.PathLike, nn.Module], checkpoint: Any = None, *,
                   remove_norms: Optional[bool] = None, filter_fn: Optional[Callable[[str, nn.Module], bool]] = None,
                   dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Rebuild a converted model and load its checkpoint strictly: the round trip of :func:`convert`'s checkpoints.

    A converted model's ``state_dict`` has its source's names and layouts (:mod:`certblocks._adapters`), plus the
    tensors the source lacks (QK-norm scales, inserted gains, :data:`certblocks._adapters.MARKER`) and minus the
    norms ``remove_norms`` took out.  To read it back, the source architecture is built and converted the same way,
    then the weights are loaded:

    * ``load_converted(path)``: ``path`` is a directory written by ``save_pretrained`` of a converted Hugging Face
      model; its ``config.json`` names the class (``architectures``) and holds what :func:`convert` did
      (``certblocks_conversion``), so the model is rebuilt from the config, converted as recorded and loaded;
    * ``load_converted(model, checkpoint, remove_norms=..., filter_fn=...)``: ``model`` is a freshly built source
      model of the converted one's architecture (``timm.create_model(name, ...)``, ``mamba_ssm.Mamba(...)``, your
      own); it is converted in place as recorded in its HF config when it has one, else with ``remove_norms`` and
      ``filter_fn`` as given to :func:`convert`, and ``checkpoint`` is loaded: a state dict, a ``.safetensors`` file,
      a ``torch.save`` file (read with ``weights_only=True``) or a directory of ``model.safetensors`` (sharded or
      not) or ``pytorch_model.bin``.

    Loading is strict: a missing or unexpected tensor raises (tied weights that ``save_pretrained`` leaves out are
    not missing).  The source's own class loading a converted checkpoint is never silently another function: with
    ``load_state_dict(strict=True)`` it raises on the tensors it lacks (HF's ``from_pretrained``, which is not
    strict, lists them as unexpected keys in its load report and warning).

    Args:
        source: an HF directory, or a freshly built source model.
        checkpoint: the weights (with a model ``source``; ignored for a directory, whose weights are read).
        remove_norms: as given to :func:`convert` (default: as recorded, else False).
        filter_fn: as given to :func:`convert` (default: as recorded, else every known module).
        dtype: the dtype of the loaded model (default: the checkpoint's, when all its floating tensors share one).

    Returns:
        The converted model with the checkpoint's weights (in eval mode when built from a directory).

    Raises:
        ValueError: a checkpoint that does not match the converted architecture (missing, unexpected or misshapen
            tensors), a recorded module that no registered converter converts, or a directory without a config.
        TypeError: arguments of the wrong type.
    """
    if isinstance(source, nn.Module):
        model, state = source, _read_checkpoint(checkpoint)
    elif isinstance(source, (str, os.PathLike)):
        model, state = _build_from_config(os.fspath(source)), _read_checkpoint(os.fspath(source))
    else:
        raise TypeError(f"source must be a directory or an nn.Module, got {type(source).__name__}")
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if isinstance(record, dict):
        wanted = set(record.get("converted", {})) | set(record.get("norms", []))
        rep = convert(model, inplace=True, remove_norms=bool(record.get("norms")) if remove_norms is None
                      else remove_norms, filter_fn=filter_fn or (lambda path, m: path in wanted))
        done = {s.path for s in rep.swaps}
        lost = sorted(wanted - done)
        if lost:
            raise ValueError(f"the checkpoint was converted at {lost}, which no registered converter converts now "
                             "(register the converters used when it was saved)")
    else:
        convert(model, inplace=True, remove_norms=bool(remove_norms), filter_fn=filter_fn)
    floating = {t.dtype for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    target = dtype if dtype is not None else (floating.pop() if len(floating) == 1 else None)
    if target is not None:
        model.to(target)
    _load_strict(model, state)
    return model


def _read_checkpoint(checkpoint: Any) -> Dict[str, torch.Tensor]:
    """A state dict from a mapping, a file or an HF-style directory (module docstring of :func:`load_converted`)."""
    import json
    from collections.abc import Mapping

    if isinstance(checkpoint, Mapping):
        return dict(checkpoint)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a state dict, a file or a directory, got {type(checkpoint).__name__}")
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        for index, single in (("model.safetensors.index.json", "model.safetensors"),
                              ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            if os.path.isfile(os.path.join(path, index)):
                with open(os.path.join(path, index)) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
                out: Dict[str, torch.Tensor] = {}
                for name in files:
                    out.update(_read_checkpoint(os.path.join(path, name)))
                return out
            if os.path.isfile(os.path.join(path, single)):
                return _read_checkpoint(os.path.join(path, single))
        raise ValueError(f"checkpoint directory {path!r} has no model.safetensors or pytorch_model.bin")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r}: no such file or directory")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path!r} holds a {type(state).__name__}, not a state dict")
    return state


def _build_from_config(path: str) -> nn.Module:
    """The HF model class named in ``path``'s ``config.json``, built from that config (random weights)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: pass a freshly built source model and the checkpoint, "
                         "load_converted(model, checkpoint)")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise ValueError(f"{path}/config.json names no transformers class in 'architectures' ({archs}); pass a "
                         "freshly built source model: load_converted(model, checkpoint)")
    return cls(config).eval()


def _load_strict(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)``; a tensor missing from ``state`` is allowed only when it is tied to one
    present (``save_pretrained`` saves a tied weight once)."""
    result = model.load_state_dict(state, strict=False)
    groups: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    tied = {name: names for names in groups.values() for name in names if len(names) > 1}
    missing = [k for k in result.missing_keys if not any(t in state for t in tied.get(k, ()))]
    if missing or result.unexpected_keys:
        raise ValueError(f"the checkpoint does not match the converted {type(model).__name__}: missing "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                         f"{result.unexpected_keys[:8]}{' ...' if len(result.unexpected_keys) > 8 else ''}")

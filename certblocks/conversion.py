"""``convert``: swap certified blocks into an existing backbone.

``convert(model)`` walks the model and replaces the modules it recognizes, copying their weights:

* ``mamba_ssm.Mamba``, HF ``MambaMixer``, certblocks ``Mamba`` -> :class:`~certblocks.blocks.mamba.LinearGrowthMamba`:
  (5, 5) -> (1, 1);
* timm ``Attention``, nanoGPT ``CausalSelfAttention``, HF ``GPT2Attention`` ->
  :class:`~certblocks.blocks.attention.QKNormAttention` (RMS QK-norm, scales 1): (1, 2) -> (1, 1);
* SwiGLU-style MLPs (timm ``SwiGLU`` / ``SwiGLUPacked`` / ``GluMlp``, LLaMA-style ``gate_proj``,
  ``up_proj``, ``down_proj``) -> :class:`~certblocks.blocks.mlp.GatedMLP` with a sigmoid gate: (2, 1) -> (1, 1);
* with ``remove_norms=True``: the LayerNorm / RMSNorm of a residual branch (``norm1``, ``norm2``, ``ln_1``,
  ``ln_2``, a Mamba block's ``norm``, ...; a norm whose parent also holds an attention, MLP or mixer) ->
  :class:`IdentityNorm` (an ``nn.Identity``): the normalization (0, 0) is removed.

The replacements keep the source's device, dtype and train/eval mode.  HF and timm callers pass
extra arguments (``cache``, ``attention_mask``, ``is_causal``); the swapped modules are thin
subclasses that accept them.  They do not use HF's KV or SSM cache: ``convert`` sets an HF model's
``config.use_cache`` to False (listed in ``report.notes``; ``revert`` restores it).  The swaps
change the function (QK-norm, sigmoid gate, linear-growth scan):
the weights are the source's, the model needs fine-tuning.

The returned :class:`ConversionReport` lists every swap (module path, exponents before and after),
the model's certificate before and after when an ``example_input`` is given (derived by the
tracer, :func:`certblocks.trace.certify`; when the tracer cannot capture the model, the report
says so in ``trace_error_before`` / ``trace_error_after``), and offers :meth:`ConversionReport.revert`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from .certificate import StackCertificate
from .exponents import NORM, Exponents

__all__ = ["convert", "ConversionReport", "Swap", "IdentityNorm"]

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
    """

    model: nn.Module
    swaps: List[Swap] = field(default_factory=list)
    certificate_before: Optional[StackCertificate] = None
    certificate_after: Optional[StackCertificate] = None
    trace_error_before: str = ""
    trace_error_after: str = ""
    dtype: str = "bf16"
    notes: List[str] = field(default_factory=list)
    _undo: List[Tuple[Any, str, Any]] = field(default_factory=list, repr=False)

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
            setattr(parent, name, old)
        self._undo.clear()
        self.swaps = []
        self.notes = []
        return self.model

    def explain(self) -> str:
        """The swaps, then the certificates before and after."""
        out = [f"{len(self.swaps)} swaps"]
        out += [f"  {s}" for s in self.swaps]
        for tag, cert, err in (("before", self.certificate_before, self.trace_error_before),
                               ("after", self.certificate_after, self.trace_error_after)):
            out.append(f"certificate {tag}:")
            out.append(cert.explain() if cert is not None else f"  not available: {err}")
        return "\n".join(out)

    def __str__(self) -> str:
        def short(c: Optional[StackCertificate], err: str) -> str:
            if c is None:
                return f"n/a ({err.splitlines()[0][:80] if err else 'no example_input'})"
            return f"{c.certified_depth}/{c.depth} certified in {c.dtype}, max q {_max_q(c)}"

        before = short(self.certificate_before, self.trace_error_before)
        after = short(self.certificate_after, self.trace_error_after)
        return f"ConversionReport({len(self.swaps)} swaps; before: {before}; after: {after})"


def _max_q(cert: Optional[StackCertificate]) -> Optional[float]:
    if cert is None or not cert.updates:
        return None
    qs = [u.q for u in cert.updates]
    return None if any(q is None for q in qs) else max(qs)  # type: ignore[type-var]


# ---------------------------------------------------------------------------------------------- recognizers
def _is_mamba(m: nn.Module) -> bool:
    name = type(m).__name__
    mod = type(m).__module__
    if name == "MambaMixer" and "transformers" in mod:
        return True
    if name == "Mamba" and (mod.startswith("mamba_ssm") or mod.startswith("certblocks")):
        return True
    return False


def _is_attention(m: nn.Module) -> bool:
    from .blocks.attention import QKNormAttention

    if isinstance(m, QKNormAttention):
        return False
    name = type(m).__name__
    if hasattr(m, "c_attn") and hasattr(m, "c_proj"):
        if name == "GPT2Attention" and getattr(m, "is_cross_attention", False):
            return False
        return name in ("CausalSelfAttention", "GPT2Attention", "Attention") or hasattr(m, "n_head")
    if name == "Attention" and hasattr(m, "qkv") and hasattr(m, "proj") and hasattr(m, "num_heads"):
        return type(m).__module__.startswith("timm")
    return False


def _is_swiglu(m: nn.Module) -> bool:
    from .blocks.mlp import GatedMLP

    if isinstance(m, GatedMLP):
        return m.gate == "silu"
    name = type(m).__name__
    if hasattr(m, "gate_proj") and hasattr(m, "up_proj") and hasattr(m, "down_proj"):
        act = getattr(m, "act_fn", None)
        return act is None or any(k in type(act).__name__.lower() for k in ("silu", "swish"))
    if name in ("SwiGLU", "SwiGLUPacked", "GluMlp") and type(m).__module__.startswith("timm"):
        act = getattr(m, "act", None)
        return act is None or type(act).__name__ in ("SiLU", "Swish")
    return False


def _residual_norm(parent: nn.Module, name: str, child: nn.Module) -> bool:
    norm_types: Tuple[type, ...] = (nn.LayerNorm, nn.RMSNorm)
    is_norm = isinstance(child, norm_types) or type(child).__name__ in (
        "LayerNorm", "RMSNorm", "RmsNorm", "MambaRMSNorm", "LlamaRMSNorm", "LayerNorm2d")
    if not is_norm or name not in _RESIDUAL_NORM_NAMES:
        return False
    return any(hasattr(parent, b) for b in _BRANCH_NAMES)


# ---------------------------------------------------------------------------------------------- adapters
def _attention_adapter(src: nn.Module) -> nn.Module:
    from .blocks.attention import QKNormAttention

    name = type(src).__name__
    if name == "GPT2Attention":
        return _HFGPT2QKNormAttention.from_module(src)
    if hasattr(src, "qkv"):
        return _TimmQKNormAttention.from_module(src)
    return QKNormAttention.from_module(src)


def _mamba_adapter(src: nn.Module) -> nn.Module:
    from .blocks.mamba import LinearGrowthMamba

    if type(src).__name__ == "MambaMixer":
        blk = _HFLinearGrowthMamba.from_module(src)
        return blk
    return LinearGrowthMamba.from_module(src)


from .blocks.attention import QKNormAttention as _QKA  # noqa: E402  (cheap: no optional dependency)
from .blocks.mamba import LinearGrowthMamba as _LGM  # noqa: E402


class _TimmQKNormAttention(_QKA):
    """:class:`QKNormAttention` called like timm's ``Attention`` (``attn_mask``, ``is_causal``)."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,  # type: ignore[override]
                is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
        if is_causal:
            raise ValueError("the converted attention is bidirectional (timm ViT); is_causal=True is not supported")
        return super().forward(x, attn_mask=attn_mask)


class _HFGPT2QKNormAttention(_QKA):
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


class _HFLinearGrowthMamba(_LGM):
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


def _exps_before(m: nn.Module, kind: str) -> Exponents:
    from .exponents import ATTENTION, MAMBA_SSM, QK_NORM_ATTENTION

    if kind == "attention":
        qn = getattr(m, "q_norm", None)
        return QK_NORM_ATTENTION if qn is not None and not isinstance(qn, nn.Identity) else ATTENTION
    if kind == "mamba":
        return MAMBA_SSM
    if kind == "swiglu":
        return Exponents(2, 1)
    return NORM


# ---------------------------------------------------------------------------------------------- convert
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


def convert(model: nn.Module, *, filter_fn: Optional[Callable[[str, nn.Module], bool]] = None,
            remove_norms: bool = False, inplace: bool = False, example_input: Any = None, dtype: str = "bf16",
            r0: float = 1.0) -> ConversionReport:
    """Swap the modules of ``model`` that certblocks knows for their certified replacements.

    Args:
        model: any ``nn.Module``.
        filter_fn: ``filter_fn(path, module) -> bool``; only modules for which it returns True are swapped.
        remove_norms: also replace the LayerNorm / RMSNorm on residual branches by ``nn.Identity``.
        inplace: modify ``model`` itself (default: a deep copy is converted and ``model`` is untouched).
        example_input: an input for ``model`` (tensor, tuple or dict); when given, the tracer derives the
            model's certificate before and after the conversion.
        dtype: the dtype of those certificates.
        r0: the input radius of those certificates.

    Returns:
        A :class:`ConversionReport`; ``report.model`` is the converted model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(path, module) -> bool, got {type(filter_fn).__name__}")
    for name, flag in (("remove_norms", remove_norms), ("inplace", inplace)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    from .budget import dtype_name

    dtype = dtype_name(dtype)
    target = model if inplace else copy.deepcopy(model)
    report = ConversionReport(target, dtype=dtype)
    if example_input is not None:
        report.certificate_before, report.trace_error_before = _trace(target, example_input, dtype, r0)
    else:
        report.trace_error_before = "no example_input given"

    plan: List[Tuple[nn.Module, str, str, nn.Module, str]] = []  # parent, attr, path, module, kind
    skip_under: List[str] = []
    for path, mod in target.named_modules():
        if any(path.startswith(p + ".") for p in skip_under):
            continue
        kind = ("mamba" if _is_mamba(mod) else "attention" if _is_attention(mod) else
                "swiglu" if _is_swiglu(mod) else "")
        if kind and path and (filter_fn is None or filter_fn(path, mod)):
            parent_path, _, attr = path.rpartition(".")
            plan.append((target.get_submodule(parent_path), attr, path, mod, kind))
            skip_under.append(path)
            continue
        if remove_norms:
            for cname, child in mod.named_children():
                cpath = f"{path}.{cname}" if path else cname
                if _residual_norm(mod, cname, child) and (filter_fn is None or filter_fn(cpath, child)):
                    plan.append((mod, cname, cpath, child, "norm"))

    from .blocks.mlp import GatedMLP

    order = {p: i for i, (p, _) in enumerate(target.named_modules(remove_duplicate=False))}
    plan.sort(key=lambda t: order.get(t[2], len(order)))
    for parent, attr, path, mod, kind in plan:
        if kind == "attention":
            new = _attention_adapter(mod)
        elif kind == "mamba":
            new = _mamba_adapter(mod)
        elif kind == "swiglu":
            new = GatedMLP.from_module(mod, gate="sigmoid")
        else:
            new = IdentityNorm(mod)
        new.train(mod.training)
        after = Exponents(1, 0) if kind == "norm" else new.exponents
        setattr(parent, attr, new)
        report._undo.append((parent, attr, mod))
        public = next(c for c in type(new).__mro__ if not c.__name__.startswith("_"))  # the block, not the adapter
        after_name = "Identity" if kind == "norm" else public.__name__
        report.swaps.append(Swap(path, type(mod).__name__, after_name, _exps_before(mod, kind), after))

    hf_swaps = [p for p in plan if isinstance(p[3], nn.Module) and type(p[3]).__module__.startswith("transformers")
                and p[4] in ("attention", "mamba")]
    config = getattr(target, "config", None)
    if hf_swaps and config is not None and getattr(config, "use_cache", False):
        # the swapped mixers do not read HF's KV/SSM cache: run without one (generate() stays correct, uncached)
        report._undo.append((config, "use_cache", config.use_cache))
        config.use_cache = False
        report.notes.append("config.use_cache set to False: the converted attention/mixers do not use HF's cache")
    gen_config = getattr(target, "generation_config", None)
    if hf_swaps and gen_config is not None and getattr(gen_config, "use_cache", False):
        report._undo.append((gen_config, "use_cache", gen_config.use_cache))
        gen_config.use_cache = False
        report.notes.append("generation_config.use_cache set to False (generate() recomputes, uncached)")
    if example_input is not None:
        report.certificate_after, report.trace_error_after = _trace(target, example_input, dtype, r0)
    else:
        report.trace_error_after = "no example_input given"
    return report

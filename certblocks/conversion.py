"""``convert``: swap certified blocks into an existing backbone, and say what the swap does to its certificate.

``convert(model)`` walks the model and replaces the modules it recognizes, copying their weights:

* ``mamba_ssm.Mamba``, HF ``MambaMixer``, certblocks ``Mamba`` -> :class:`~certblocks.blocks.mamba.LinearGrowthMamba`:
  (5, 5) -> (1, 1);
* timm ``Attention``, nanoGPT ``CausalSelfAttention``, HF ``GPT2Attention``, certblocks ``Attention`` ->
  :class:`~certblocks.blocks.attention.QKNormAttention` (RMS QK-norm, scales 1): (1, 2) -> (1, 1);
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

**A conversion never weakens a model silently.**  With an ``example_input`` the tracer
(:func:`certblocks.trace.certify`) certifies the model before and after, and the :class:`ConversionReport` holds the
certified depth in each of ``dtypes`` before and after (:attr:`ConversionReport.depths`,
:meth:`ConversionReport.table`).
A swap can lower it: QK-norm bounds the logits but its Jacobian coefficient grows like ``1/sqrt(qk_norm_eps)``, so
at small radii it can exceed the plain attention's.  Then ``convert`` warns (:class:`ConversionWarning`) with the
update that consumes the budget, its culprit and the computed fixes that certify again the depth certified before
(``qk_norm_eps``, ``dt``, a wider dtype: :mod:`certblocks.fixes`), or refuses with ``strict=True``.
:meth:`ConversionReport.revert` puts the original modules back.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._format import fmt_num
from .certificate import BlockCertificate, StackCertificate
from .exponents import NORM, Exponents
from .fixes import Fix, Lever, compute_fixes, recertify

__all__ = ["convert", "ConversionReport", "ConversionError", "ConversionWarning", "DepthChange", "Swap",
           "IdentityNorm", "REPORT_DTYPES", "ROTARY_ATTENTIONS"]

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


def _max_q(cert: Optional[StackCertificate]) -> Optional[float]:
    if cert is None or not cert.updates:
        return None
    qs = [u.q for u in cert.updates]
    return None if any(q is None for q in qs) else max(qs)  # type: ignore[type-var]


# ---------------------------------------------------------------------------------------------- recognizers
#: HF attentions of the Llama family that :class:`~certblocks.RotaryQKNormAttention` replaces.
ROTARY_ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "Phi3Attention",
                     "GemmaAttention")


def _is_mamba(m: nn.Module) -> bool:
    name = type(m).__name__
    mod = type(m).__module__
    if name == "MambaMixer" and "transformers" in mod:
        return True
    if name == "Mamba" and (mod.startswith("mamba_ssm") or mod.startswith("certblocks")):
        return True
    return False


def _is_rotary_attention(m: nn.Module) -> bool:
    return type(m).__name__ in ROTARY_ATTENTIONS and type(m).__module__.startswith("transformers")


def _is_attention(m: nn.Module) -> bool:
    from .blocks.attention import QKNormAttention

    if isinstance(m, QKNormAttention):
        return False
    name = type(m).__name__
    if _is_rotary_attention(m):
        return True
    if hasattr(m, "c_attn") and hasattr(m, "c_proj"):
        if name == "GPT2Attention" and getattr(m, "is_cross_attention", False):
            return False
        return name in ("CausalSelfAttention", "GPT2Attention", "Attention") or hasattr(m, "n_head")
    if name == "Attention" and hasattr(m, "qkv") and hasattr(m, "proj") and hasattr(m, "num_heads"):
        return type(m).__module__.startswith("timm")
    return False


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
    if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and type(m).__module__.startswith("transformers"):
        return _act_is(getattr(m, "activation_fn", None), ("silu", "swish", "gelu"))  # Phi-3
    if name in ("SwiGLU", "SwiGLUPacked", "GluMlp") and type(m).__module__.startswith("timm"):
        act = getattr(m, "act", None)
        return act is None or type(act).__name__ in ("SiLU", "Swish")
    return False


def _is_norm(child: nn.Module) -> bool:
    name = type(child).__name__
    return isinstance(child, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("LayerNorm", "RMSNorm", "RmsNorm",
                                                                             "LayerNorm2d"))


def _residual_norm(parent: nn.Module, name: str, child: nn.Module) -> bool:
    if not _is_norm(child) or name not in _RESIDUAL_NORM_NAMES:
        return False
    return any(hasattr(parent, b) for b in _BRANCH_NAMES)


# ---------------------------------------------------------------------------------------------- adapters
def _attention_adapter(src: nn.Module, rope_scaling: float) -> nn.Module:
    from . import _adapters
    from .blocks.attention import QKNormAttention

    if _is_rotary_attention(src):
        return _adapters.HFRotaryQKNormAttention.from_module(src, rope_attention_scaling=rope_scaling)
    if type(src).__name__ == "GPT2Attention":
        return _adapters.HFGPT2QKNormAttention.from_module(src)
    if hasattr(src, "qkv"):
        return _adapters.TimmQKNormAttention.from_module(src)
    return QKNormAttention.from_module(src)


def _mamba_adapter(src: nn.Module) -> nn.Module:
    from . import _adapters
    from .blocks.mamba import LinearGrowthMamba

    if type(src).__name__ == "MambaMixer":
        return _adapters.HFLinearGrowthMamba.from_module(src)
    return LinearGrowthMamba.from_module(src)


def _rope_scaling(model: nn.Module) -> float:
    """The largest ``attention_scaling`` of an HF rotary embedding in ``model`` (1 when there is none)."""
    found = [float(m.attention_scaling) for m in model.modules()
             if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "attention_scaling")]
    return max(found, default=1.0)


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
    if kind == "glu":
        return Exponents(2, 1)
    return NORM


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
        mod = _own_module(model, u) if u.is_update else None
        if mod is not None and callable(getattr(mod, "levers", None)):
            levers[k] = list(mod.levers())
    fixes = tuple(f for f in compute_fixes(cut, levers=levers) if f.lever != "depth")
    return dataclasses.replace(change, reason=reason, fixes=fixes)


def _left_above(target: nn.Module, plan: Sequence[Tuple[nn.Module, str, str, nn.Module, str]]) -> List[str]:
    """The residual branches whose norm :func:`convert` removed and that stay above (1, 1): ``"path (why)"``."""
    out = []
    parents = dict.fromkeys(path.rpartition(".")[0] for _, _, path, _, kind in plan if kind == "norm")
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
            elif _is_attention(child) or _is_mamba(child) or _is_glu(child):
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
        report.certificate_before, report.trace_error_before = _trace(target, example_input, dtype, r0)
    else:
        report.trace_error_before = "no example_input given"

    plan: List[Tuple[nn.Module, str, str, nn.Module, str]] = []  # parent, attr, path, module, kind
    skip_under: List[str] = []
    for path, mod in target.named_modules():
        if any(path.startswith(p + ".") for p in skip_under):
            continue
        kind = ("mamba" if _is_mamba(mod) else "attention" if _is_attention(mod) else
                "glu" if _is_glu(mod) else "")
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
    rope_scaling = _rope_scaling(target)
    for parent, attr, path, mod, kind in plan:
        if kind == "attention":
            new = _attention_adapter(mod, rope_scaling)
        elif kind == "mamba":
            new = _mamba_adapter(mod)
        elif kind == "glu":
            new = GatedMLP.from_module(mod, gate="sigmoid")
        else:
            new = IdentityNorm(mod)
        new.train(mod.training)
        after = Exponents(1, 0) if kind == "norm" else new.exponents
        setattr(parent, attr, new)
        report._undo.append((parent, attr, mod))
        public = next(c for c in type(new).__mro__ if not c.__name__.startswith(("_", "HF", "Timm")))
        after_name = "Identity" if kind == "norm" else public.__name__
        report.swaps.append(Swap(path, type(mod).__name__, after_name, _exps_before(mod, kind), after))

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
    uncached = [p for p in plan if type(p[3]).__module__.startswith("transformers") and p[4] in ("attention", "mamba")
                and not _is_rotary_attention(p[3])]
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
    report.certificate_after, report.trace_error_after = _trace(target, example_input, dtype, r0)
    before, after_cert = report.certificate_before, report.certificate_after
    if remove_norms and after_cert is not None:
        above = [f"{u.name} (traced {u.exponents})" for u in after_cert.updates if u.is_update and u.q is not None
                 and u.sigma is not None and (u.q > 1 or u.sigma > 1)]
        if above:
            refuse("remove_norms=True left residual updates above (1, 1): " + "; ".join(above))
    if before is not None and after_cert is not None:
        report.depths = [_depth_change(before.in_dtype(d), after_cert.in_dtype(d), target) for d in table_dtypes]
        lowered = [d for d in report.depths if d.lowered]
        if lowered:
            msg = ("the conversion lowers the certified depth: " + "; ".join(str(d) for d in lowered)
                   + "\n" + report.table())
            if strict:
                refuse(msg)
            warnings.warn(msg, ConversionWarning, stacklevel=2)
    return report

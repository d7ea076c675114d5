"""The conversion itself: :func:`convert` swaps, certifies before and after, and reports."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn

from .._format import fmt_num
from .._validation import check_bool, check_callable, check_real
from ..certificate import BlockCertificate, StackCertificate
from ..exponents import NORM, Exponents
from ..fixes import Lever, compute_fixes, recertify
from ..precision import as_precision
from .builtin import (
    BRANCH_NAMES,
    GAIN_SLOTS,
    IdentityNorm,
    from_package,
    gain_lever,
    insert_gains,
    is_normalizer,
    norm_converter,
    residual_norm,
)
from .registry import Converter, converter_for
from .report import ABSENT, ConversionError, ConversionReport, ConversionWarning, DepthChange, Swap

__all__ = ["convert", "CONFIG_KEY", "REPORT_DTYPES", "traced_levers"]

_log = logging.getLogger("certblocks.conversion")  # the steps of a conversion, at INFO (the CLI shows them)

#: The dtypes of a report's before/after depths, by default.
REPORT_DTYPES = ("fp16", "bf16", "fp32")


def _build(conv: Converter, src: nn.Module, model: nn.Module, path: str) -> nn.Module:
    """``conv``'s replacement of ``src``; marked (:data:`certblocks._adapters.MARKER`) when its checkpoint would have
    the source's keys and shapes although it computes another function."""
    from .. import _adapters

    new = conv.build(src, model)
    if not isinstance(new, nn.Module):
        raise TypeError(f"converter {conv.name!r} returned a {type(new).__name__} for {path} ({type(src).__name__}); "
                        "build must return an nn.Module")
    if not conv.exact(src) and _adapters.stored_shapes(new) == _adapters.stored_shapes(src):
        _adapters.mark_converted(new)
    return new


#: The key of an HF config that records what :func:`convert` did (read back by :func:`load_converted`).
CONFIG_KEY = "certblocks_conversion"


def _dyt_alpha(value: Union[float, Callable[[str, nn.Module], float]]) -> Callable[[str, nn.Module], float]:
    """``dyt_alpha`` as a function of the normalizer (a number: the same for every one)."""
    if callable(value):
        return value
    alpha = check_real("dyt_alpha", value, gt=0.0, note="the DyTs' initial alpha, or a callable(path, module)")
    return lambda path, module: alpha


def _record(report: ConversionReport, plan: Sequence[Tuple[nn.Module, str, str, nn.Module, Optional[Converter]]],
            gained: Sequence[str]) -> None:
    """Write the conversion into an HF model's ``config`` (saved by ``save_pretrained``; :func:`load_converted`)."""
    cfg = getattr(report.model, "config", None)
    if not plan or cfg is None or not callable(getattr(cfg, "to_dict", None)):
        return
    record = {"version": 1, "converted": {path: conv.name for _, _, path, _, conv in plan if conv is not None},
              "norms": [path for _, _, path, _, conv in plan if conv is None], "gains": list(gained)}
    if any(conv is not None and conv.kind == "norm" for *_, conv in plan):  # convert(norm="dyt")
        record["norm"] = "dyt"
    report._undo.append((cfg, CONFIG_KEY, getattr(cfg, CONFIG_KEY, ABSENT)))
    setattr(cfg, CONFIG_KEY, record)


# ---------------------------------------------------------------------------------------------- checks
def _trace(model: nn.Module, example_input: Any, dtype: str, r0: float,
           precision: Optional[str] = None) -> Tuple[Optional[StackCertificate], str]:
    """The model's chain certified in ``dtype`` from its graph (captured under ``precision``, a mixed policy's name,
    when given: each value then bounded in the dtype it is held in); ``(None, why)`` when the tracer fails."""
    from ..trace import ModelCertificate, certify

    was = model.training
    model.eval()
    try:
        cert = certify(model, example_input) if precision is None else \
            certify(model, example_input, precision=precision)
        if not isinstance(cert, ModelCertificate):
            return None, "the tracer found no residual update in the model"
        return cert.stack(dtype, r0=r0), ""
    except Exception as e:  # the tracer's failure is reported, not raised
        return None, f"{type(e).__name__}: {e}"
    finally:
        model.train(was)


def _mixed_stacks(model: nn.Module, example_input: Any, names: Sequence[str], r0: float
                  ) -> Dict[str, Optional[StackCertificate]]:
    """The chain under each mixed precision policy of ``names`` (pure dtypes are :meth:`StackCertificate.in_dtype`
    of one capture), each from a graph captured under it; ``None`` where the tracer fails."""
    return {n: _trace(model, example_input, n, r0, precision=n)[0] for n in names if not as_precision(n).pure}


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
        own = mod.certificate()  # type: ignore[operator]  # a certified block
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
                    own = mod.certificate()  # type: ignore[operator]  # a certified block
                    culprit = own.culprit + (f" ({own.fix.split(':')[0]})" if own.fix else "")
            except Exception:  # not a module, or a certificate that needs arguments: the traced culprit
                pass
            reason = f"{u.name}: log factor +{fmt_num(delta)} nats; {culprit or u.culprit or u.exponents}"
    # the levers' values that certify the updates certified before (the converted chain cut there); a block lever
    # only for an update that is exactly that block
    ends = [k for k, u in enumerate(after.updates) if u.is_update]
    want = before.certified_depth
    cut = after if want >= len(ends) or want == 0 else recertify(after, after.updates[: ends[want - 1] + 1])
    # a converted backbone has no residual step dt: the levers are its blocks' and its branch gains'
    fixes = tuple(f for f in compute_fixes(cut, levers=traced_levers(model, cut), dt=False) if f.lever != "depth")
    return dataclasses.replace(change, reason=reason, fixes=fixes)


def traced_levers(model: nn.Module, cert: StackCertificate) -> Dict[int, List[Lever]]:
    """The levers of each update of a chain traced from ``model`` (:func:`certblocks.certify`), by segment index: a
    block's ``levers()`` for an update that is exactly that block (its own certificate: same exponents and
    coefficients), and the ``init_values`` of the branch gain that scales it (a timm block's ``ls1`` / ``ls2``)."""
    levers: Dict[int, List[Lever]] = {}
    for k, u in enumerate(cert.updates):
        if not u.is_update:
            continue
        mod = _own_module(model, u)
        own = list(mod.levers()) if mod is not None and callable(getattr(mod, "levers", None)) else []  # type: ignore[operator]  # a certified block
        gain = gain_lever(model, u.name)
        if gain is not None and not any(lv.name == gain.name for lv in own):
            own.append(gain)
        if own:
            levers[k] = own
    return levers


def _left_above(target: nn.Module, plan: Sequence[Tuple[nn.Module, str, str, nn.Module, Optional[Converter]]]
                ) -> List[str]:
    """The residual branches whose norm :func:`convert` removed and that stay above (1, 1): ``"path (why)"``."""
    out = []
    parents = dict.fromkeys(path.rpartition(".")[0] for _, _, path, _, conv in plan if conv is None)
    for pp in parents:
        parent = target.get_submodule(pp)
        for b in BRANCH_NAMES:
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
#: ``alpha`` of the DyTs ``convert(model, norm="dyt")`` puts in: the DyT paper's default (its ``alpha_0``).
DYT_ALPHA = 0.5


def convert(model: nn.Module, *, filter_fn: Optional[Callable[[str, nn.Module], bool]] = None,
            remove_norms: bool = False, norm: Optional[str] = None,
            dyt_alpha: Union[float, Callable[[str, nn.Module], float]] = DYT_ALPHA, inplace: bool = False,
            example_input: Any = None, dtype: str = "bf16", r0: float = 1.0, dtypes: Sequence[str] = REPORT_DTYPES,
            strict: bool = False) -> ConversionReport:
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
        norm: ``"dyt"``: replace every normalizer (LayerNorm, RMSNorm -- the residual branches', the final one before
            the head, a QK-norm's) by a :class:`~certblocks.blocks.DyT` whose ``gamma`` / ``beta`` are its ``weight`` /
            ``bias`` and nothing else (the blocks are kept: behind a DyT every update is (0, 0) whatever its branch,
            and an RMS QK-norm swapped in would bring back the ``1/sqrt(eps)`` a DyT removes; docs/theory.md section
            7.2).  ``None`` (default): the normalizers are kept (or removed: ``remove_norms``).
        dyt_alpha: the DyTs' initial ``alpha``: a number (default 0.5, the DyT paper's) or ``dyt_alpha(path,
            module) -> float`` per normalizer (the paper's LLaMA recipe takes a larger one before attention).
        dtype: the dtype of :attr:`ConversionReport.certificate_before` / ``_after``.
        r0: the input radius of those certificates.
        dtypes: the dtypes or precision policies of the before/after depths (:attr:`ConversionReport.depths`): a
            mixed policy (``"amp-fp16"``, ``"fp8-e4m3"``, ...) certifies graphs captured under it, before and after.
        strict: raise :class:`ConversionError` (and leave ``model`` as it was) when a swap lowers the certified
            depth in one of ``dtypes``; by default a :class:`ConversionWarning` says so.

    Returns:
        A :class:`ConversionReport`; ``report.model`` is the converted model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_callable("filter_fn", filter_fn, "callable(path, module) -> bool", optional=True)
    for name, flag in (("remove_norms", remove_norms), ("inplace", inplace), ("strict", strict)):
        check_bool(name, flag)
    if norm is not None and remove_norms:
        raise ValueError(f"norm={norm!r} replaces the normalizers and remove_norms=True removes them: pass one")
    alpha_of = _dyt_alpha(dyt_alpha)
    from ..budget import dtype_name

    dtype = dtype_name(dtype)
    if isinstance(dtypes, str):
        raise TypeError(f"dtypes must be a sequence of dtype names, got the string {dtypes!r}")
    table_dtypes = list(dict.fromkeys([as_precision(d).name for d in dtypes] + [dtype]))
    target = model if inplace else copy.deepcopy(model)
    report = ConversionReport(target, dtype=dtype)
    mixed_before: Dict[str, Optional[StackCertificate]] = {}
    if example_input is not None:
        _log.info("capture and certify the model before conversion")
        report.certificate_before, report.trace_error_before = _trace(target, example_input, dtype, r0)
        mixed_before = _mixed_stacks(target, example_input, table_dtypes, r0)
    else:
        report.trace_error_before = "no example_input given"

    plan: List[Tuple[nn.Module, str, str, nn.Module, Optional[Converter]]] = []  # parent, attr, path, module, how
    skip_under: List[str] = []
    if norm is not None:  # the normalizers only
        paths = {id(m): p for p, m in target.named_modules()}
        conv_norm = norm_converter(norm, alpha_of, paths)
        plan = [(target.get_submodule(p.rpartition(".")[0]), p.rpartition(".")[2], p, m, conv_norm)
                for p, m in target.named_modules() if p and is_normalizer(m) and (filter_fn is None or filter_fn(p, m))]
    for path, mod in target.named_modules() if norm is None else ():
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
                if residual_norm(mod, cname, child) and (filter_fn is None or filter_fn(cpath, child)):
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
            before, own = conv.before(mod), getattr(new, "exponents", None)
            after = own if isinstance(own, Exponents) else Exponents(None, None)
        new.train(mod.training)
        setattr(parent, attr, new)
        report._undo.append((parent, attr, mod))
        public = next(c for c in type(new).__mro__ if not c.__name__.startswith(("_", "HF", "Timm")))
        report.swaps.append(Swap(path, type(mod).__name__, "Identity" if conv is None else public.__name__, before,
                                 after))
        if conv is not None and conv.name == "timm_attention" and from_package(parent, "timm"):
            old = {slot: getattr(parent, slot) for _, slot in GAIN_SLOTS if hasattr(parent, slot)}
            for slot in insert_gains(parent):
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
    uncached = [p for p in plan if p[4] is not None and from_package(p[3], "transformers")
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
    before_cert, after_cert = report.certificate_before, report.certificate_after
    if remove_norms and after_cert is not None:
        above = [f"{u.name} (traced {u.exponents})" for u in after_cert.updates if u.is_update and u.q is not None
                 and u.sigma is not None and (u.q > 1 or u.sigma > 1)]
        if above:
            refuse("remove_norms=True left residual updates above (1, 1): " + "; ".join(above))
    if before_cert is not None and after_cert is not None:
        _log.info("certified depths before and after, fixes")
        mixed_after = _mixed_stacks(target, example_input, table_dtypes, r0)
        report.depths = []
        for d in table_dtypes:
            if d in mixed_after:  # a mixed policy: its own captures before and after
                b, a = mixed_before.get(d), mixed_after[d]
                if b is None or a is None:
                    report.notes.append(f"{d}: no depths (the tracer failed under the policy "
                                        f"{'before' if b is None else 'after'} the conversion)")
                    continue
                report.depths.append(_depth_change(b, a, target))
            else:
                report.depths.append(_depth_change(before_cert.in_dtype(d), after_cert.in_dtype(d), target))
        lowered = [d for d in report.depths if d.lowered]
        if lowered:
            msg = ("the conversion lowers the certified depth: " + "; ".join(str(d) for d in lowered)
                   + "\n" + report.table())
            if strict:
                refuse(msg)
            warnings.warn(msg, ConversionWarning, stacklevel=2)
    return report


"""``certify(module, example_input)``: certificates of a module's residual updates from its graph."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from .._validation import check_finite
from ..bounds import concurrent_calls
from ..certificate import BlockCertificate
from ..precision import as_precision
from .capture import CapturedGraph, capture, held_dtype
from .chain import Chain, Segment, certify_outputs, model_chain, segment_name
from .collapse import coefficients, held_peaks, peak
from .diagnosis import culprit
from .interp import VelocityInterpreter
from .nodes import op_name
from .own import own_certificate
from .report import ModelCertificate, TraceCertificate, node_row
from .residual import dedupe_names, find_residual_updates, module_velocities, velocity_name

# find_residual_updates is re-exported: it lived here before residual.py
__all__ = ["certify", "certify_velocity", "find_residual_updates"]


def certify_velocity(g: CapturedGraph, x: torch.fx.Node, out: torch.fx.Node, name: str = "",
                     state: Optional[torch.fx.Node] = None) -> TraceCertificate:
    """Certify the velocity ``x -> out`` of a captured graph.

    Under a mixed precision policy (``g.precision``; docs/theory.md section 7) the certificate carries the peak of
    the values held in each dtype (:func:`~certblocks.trace.collapse.held_peaks`) and the dtype of ``state``, the
    segment's output state (default ``out``): a certified block's own certificate carries no per-dtype peaks (its
    intermediates' dtypes are not known one by one: the chain bounds them against the narrowest dtype).
    """
    it = VelocityInterpreter(g, x, out)
    res = it.run()
    co = coefficients(res)
    text, node, fix = culprit(g, it, out)
    cert = BlockCertificate(res.exps.q, res.exps.sigma, c=co.c, b=co.b, l1=co.l1, l0=co.l0, name=name,
                            culprit=text, fix=fix, peak=peak(it))
    own = own_certificate(g, x, out, name, it.notes)  # one call of a certified block: its own certificate, exactly
    if own is not None:
        cert, text, fix = own, own.culprit or text, own.fix or fix
    prec = g.precision
    if prec is not None and not prec.pure:
        held = held_dtype(g, out if state is None else state) or ""
        cert = replace(cert, precision=prec.name, state_dtype=held,
                       peaks=None if own is not None else held_peaks(it), peaks_of=None)
    rows = []
    for n in it.order:
        av = it.value_of(n.name)
        if av is None:
            continue
        rows.append(node_row(n, av, g.module_path(n), op_name(n.target) if n.op == "call_function" else n.op))
    shape = tuple(g.env[x.name].shape) if isinstance(g.env.get(x.name), torch.Tensor) else ()
    return TraceCertificate(name, cert, text, node, fix, rows, co.derived or own is not None, x.name, out.name,
                            shape, notes=list(it.notes))


def _velocity_notes(certs: Sequence[TraceCertificate]) -> List[str]:
    """The velocities' notes (values read at their example, own certificates not used), each once with the names of
    the velocities it is about."""
    where: Dict[str, List[str]] = {}
    for tc in certs:
        for note in tc.notes:
            where.setdefault(note, []).append(tc.name or "velocity")
    return [f"{', '.join(names)}: {note}" for note, names in where.items()]


def certify(module: nn.Module, example_input: Any, *, residual: Union[str, Sequence[str], None, bool] = "auto",
            kwargs: Optional[Dict[str, Any]] = None, precision: Any = None
            ) -> Union[TraceCertificate, ModelCertificate]:
    """Certify a module from its graph (captured with ``torch.export``).

    Args:
        module: any ``nn.Module`` (it is traced in its current train/eval mode; call ``.eval()`` first
            to remove dropout).
        example_input: a tensor, a tuple of positional arguments, or a dict of keyword arguments.  The
            graph is specialized to these shapes: coefficients hold for inputs of the same shape.
        residual: ``"auto"`` finds the residual updates ``X + f(X)`` (add nodes where one operand is
            an ancestor of the other) and certifies each velocity ``f``; when there is none, the whole
            module is certified as one velocity.  ``None``/``False``: the whole module is one velocity
            (its first floating-point input to its first output).  A module path or glob pattern
            (``"blocks.*.attn"``), or a list of them: each matching module is a velocity of its own input.
        kwargs: extra keyword arguments for the forward.
        precision: a precision policy to capture the module under (:func:`certblocks.precision.as_precision`:
            ``"amp-fp16"``, ``"amp-bf16"``, ``"fsdp-bf16"``, ``"fp8-e4m3"``, a
            :class:`~certblocks.precision.Precision`): autocast on the module's device type, parameters and
            inputs cast as the policy holds them, each node's dtype read from the captured graph; every certificate
            then carries the peak of the values held in each dtype, and ``.stack(precision)`` checks each against
            its dtype's ``M`` (docs/theory.md section 7).  ``None`` or a pure dtype: the module as it is (a pure
            dtype's certificate checks every value against that dtype's ``M``).

    Returns:
        A :class:`TraceCertificate` for a single velocity, or a :class:`ModelCertificate` listing the
        residual updates (or the selected modules) in depth order; ``.stack(dtype, r0=...)`` on it
        gives a :class:`~certblocks.certificate.StackCertificate`.

    Raises:
        NonFiniteWeightError: a parameter or buffer holds NaN or inf (the message names it by its path).
        CaptureError: ``torch.export`` could not capture the module (one message, both attempts' reasons).
    """
    from ..model import as_args  # the one reading of a batch (the spine); model imports this package lazily

    args, kw = as_args(example_input)
    kw.update(kwargs or {})
    if isinstance(module, nn.Module):
        check_finite(module)  # names a NaN/inf weight by its path, instead of a certificate computed from it
    prec = None if precision is None else as_precision(precision)
    g = capture(module, args, kw, precision=None if prec is None or prec.pure else prec)
    model_name = type(module).__name__
    if residual is None or residual is False:
        return _whole(g, model_name)
    if isinstance(residual, str) and residual == "auto":
        ups = find_residual_updates(g)
        if not ups:
            return _whole(g, model_name)
        chain = model_chain(g, ups)
        if chain is None or not chain.segments:
            certs = [certify_velocity(g, x, f, velocity_name(g, f, add) or f"update {k}", state=add)
                     for k, (x, f, add) in enumerate(ups)]
            dedupe_names(certs)
            return ModelCertificate(certs, model_name, g.strict, precision=_policy(g), notes=(
                chain.notes if chain is not None else [
                "the residual updates do not lie on one path from an input to an output (two stacks side by "
                "side, an encoder and a decoder): the maps between them, the stem and the head are not "
                "certified"]) + _velocity_notes(certs))
        return _certify_chain(g, chain, model_name)
    if isinstance(residual, str):
        residual = [residual]
    if not isinstance(residual, (list, tuple)) or not all(isinstance(p, str) for p in residual):
        raise TypeError(f"residual must be 'auto', None, a module path/pattern or a list of them, got {residual!r}")
    certs = [certify_velocity(g, x, o, p) for p, x, o in module_velocities(g, residual)]
    return ModelCertificate(certs, model_name, g.strict, precision=_policy(g))  # each velocity's notes: its own


def certify_segment(g: CapturedGraph, seg: Segment, k: int) -> TraceCertificate:
    """Certify segment ``k`` of a model's chain: an update through its velocity, any other segment as a map."""
    if seg.kind == "update":
        assert seg.velocity is not None
        return certify_velocity(g, seg.start, seg.velocity, velocity_name(g, seg.velocity, seg.end) or f"update {k}",
                                state=seg.end)
    tc = certify_velocity(g, seg.start, seg.end, segment_name(g, seg))
    tc.certificate = replace(tc.certificate, kind="block" if seg.kind == "block" else "map")
    return tc


def _certify_chain(g: CapturedGraph, chain: Chain, model_name: str,
                   certified: Optional[Sequence[TraceCertificate]] = None) -> ModelCertificate:
    """Certify every segment of a model's chain (:func:`certify_segment`) and assemble them; ``certified``: the
    segments' certificates already computed, in chain order (a checkpoint's ranks, :mod:`certblocks.checkpoint`)."""
    body: List[TraceCertificate] = []
    stem = head = None
    done = list(certified) if certified is not None else _certify_segments(g, chain.segments)
    for seg, tc in zip(chain.segments, done):
        if seg.kind == "stem":
            stem = tc
        elif seg.kind == "head":
            head = tc
        else:
            body.append(tc)
    dedupe_names(body)
    updates = [tc for tc in body if tc.certificate.is_update]
    every = ([stem] if stem is not None else []) + body + ([head] if head is not None else [])
    return ModelCertificate(updates, model_name, g.strict, segments=body, stem=stem, head=head, precision=_policy(g),
                            integer_input=chain.integer_input, notes=list(chain.notes) + _velocity_notes(every),
                            chained=True, outputs=certify_outputs(g, chain), graph=g)


def _certify_segments(g: CapturedGraph, segments: Sequence[Segment]) -> List[TraceCertificate]:
    """:func:`certify_segment` of every segment, in order, computed side by side on the CPU threads torch may use
    (:func:`certblocks.bounds.concurrent_calls`: each task on one thread, so each certificate is what it is alone).
    The head (a tied embedding table's norm, usually the largest matrix) is started first so that it does not run
    alone at the end."""
    order = sorted(range(len(segments)), key=lambda k: segments[k].kind != "head")
    out = dict(zip(order, concurrent_calls([partial(certify_segment, g, segments[k], k) for k in order])))
    return [out[k] for k in range(len(segments))]


def _policy(g: CapturedGraph) -> str:
    """The name of the mixed policy ``g`` was captured under (``""``: none)."""
    return g.precision.name if g.precision is not None and not g.precision.pure else ""


def _whole(g: CapturedGraph, model_name: str) -> TraceCertificate:
    """The whole graph as one velocity: its first floating-point input to its first tensor output."""
    xs = [n for n in g.user_inputs if isinstance(g.env.get(n.name), torch.Tensor)
          and (g.env[n.name].is_floating_point() or g.env[n.name].is_complex())]
    if not xs:
        raise ValueError(f"{model_name} has no floating-point tensor input to certify as a velocity "
                         "(integer inputs such as token ids: use residual='auto' or module paths)")
    outs = [o for o in g.outputs if isinstance(g.env.get(o.name), torch.Tensor)]
    if not outs:
        raise ValueError(f"{model_name} has no tensor output")
    tc = certify_velocity(g, xs[0], outs[0], model_name)
    if len(outs) > 1:  # the velocity is the first output's: say which outputs it does not cover
        tc.notes.append(f"the whole-module velocity is {xs[0].name} -> {outs[0].name}; the module's other outputs "
                        f"({', '.join(o.name for o in outs[1:])}) are not covered by this certificate "
                        "(residual='auto' certifies every output of a chained model)")
    return tc

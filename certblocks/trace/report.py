"""Certificates produced by the tracer: one velocity (:class:`TraceCertificate`) or a whole model
(:class:`ModelCertificate`), with the culprit, a suggested fix and a per-node table."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from ..bounds.poly import fold_peak, power_terms
from ..certificate import BlockCertificate, Peak, StackCertificate, certify_stack, cross_entropy_gradient, json_number
from ..exponents import Exponents
from ..failures import Failure
from .values import AValue

__all__ = ["NodeRow", "TraceCertificate", "ModelCertificate", "Unbounded", "NOT_DERIVED", "PIECEWISE_NOTE", "jsonable"]

#: Coefficient reported when no finite bound was derived (the certificate stays sound: it is huge).
NOT_DERIVED = sys.float_info.max
#: The note of a velocity whose output jumps between branches (an input-dependent index, mask, boolean or rounding:
#: docs/theory.md section 1.1); the interpreter appends the switches.  Its Jacobian bound bounds the derivative autograd
#: computes (the branch it takes) at every input of the ball, not a Lipschitz constant between two inputs.
PIECEWISE_NOTE = "piecewise: the derivative bound is that of the branch autograd takes; the map jumps between branches"


def _fmt(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:g}"


class Unbounded(str):
    """A note naming a value of the model that its chain does not bound (docs/theory.md section 6: unknown is never
    zero).

    It reads as the note's text; :meth:`ModelCertificate.stack` is not certified while it stands: the segment it
    belongs to gets an unbounded peak (:meth:`~certblocks.certificate.Peak.unbounded`) that names it.

    Attributes:
        place: the graph node that is not bounded (an output of the model, a value read at its example).
        segment: the input node of the segment that computes or reads it (``None``: the head).
    """

    place: str
    segment: Optional[str]

    def __new__(cls, text: str, place: str = "", segment: Optional[str] = None) -> Unbounded:
        note = super().__new__(cls, text)
        note.place, note.segment = place, segment
        return note

    def __reduce__(self) -> Any:
        return (Unbounded, (str(self), self.place, self.segment))


@dataclass(frozen=True)
class NodeRow:
    """One row of the per-node table."""

    node: str
    op: str
    module: str
    q: Optional[float]
    sigma: Optional[float]
    rule: str
    growth: str
    jacobian: str
    note: str = ""
    floating: bool = True

    def to_dict(self) -> Dict[str, Any]:
        return {"node": self.node, "op": self.op, "module": self.module, "q": self.q, "sigma": self.sigma,
                "rule": self.rule, "growth": self.growth, "jacobian": self.jacobian, "note": self.note,
                "floating": self.floating}


@dataclass
class TraceCertificate:
    """The certificate of one velocity derived from its graph.

    Attributes:
        name: module path of the velocity (e.g. ``"blocks.3.attn"``) or the module's class name.
        certificate: the :class:`~certblocks.certificate.BlockCertificate` (coefficients are sound
            upper bounds in the per-token norm; :data:`NOT_DERIVED` when no finite bound was derived).
        culprit: the node (and module) responsible for the exponents, with the reason.
        culprit_node: that node's name in the exported graph.
        suggestion: a fix in words (docs/theory.md section 4).
        nodes: the per-node table, in topological order.
        coefficients_derived: whether c, b, l1, l0 are finite derived bounds.
        input_node, output_node: the graph nodes of the velocity's input and output.
        notes: values read at their example value although they depend on a model input, and certified modules
            traced op by op instead of by their own certificate (and why).
    """

    name: str
    certificate: BlockCertificate
    culprit: str
    culprit_node: str
    suggestion: str
    nodes: List[NodeRow]
    coefficients_derived: bool
    input_node: str = ""
    output_node: str = ""
    input_shape: Sequence[int] = field(default_factory=tuple)
    notes: List[str] = field(default_factory=list)

    @property
    def exponents(self) -> Exponents:
        return self.certificate.exponents

    @property
    def piecewise(self) -> bool:
        """Whether the velocity jumps between branches (its notes say where: :data:`PIECEWISE_NOTE`)."""
        return any(str(note).startswith(PIECEWISE_NOTE) for note in self.notes)

    @property
    def q(self) -> Optional[float]:
        return self.certificate.q

    @property
    def sigma(self) -> Optional[float]:
        return self.certificate.sigma

    def explain(self) -> str:
        """A readable per-node table, then the certificate, the culprit and the fix."""
        cols = ("node", "op", "module", "(q, sigma)", "rule", "N bound", "J bound")
        rows = [(r.node, r.op, r.module or "-", f"({_fmt(r.q)}, {_fmt(r.sigma)})", r.rule + (f" [{r.note}]"
                 if r.note else ""), r.growth, r.jacobian) for r in self.nodes]
        widths = [min(60, max(len(c), *(len(x[i]) for x in rows))) if rows else len(c) for i, c in enumerate(cols)]

        def line(r):
            return "  ".join(s[:w].ljust(w) for s, w in zip(r, widths)).rstrip()
        out = [f"velocity {self.name or '-'}: input {self.input_node} {tuple(self.input_shape)}, "
               f"output {self.output_node}", line(cols), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
        out.append(str(self.certificate))
        if not self.coefficients_derived:
            out.append("coefficients: not derived (reported as the largest float)")
        if self.culprit:
            out.append(f"culprit: {self.culprit}")
        if self.suggestion:
            out.append(f"fix: {self.suggestion}")
        out += [f"note: {note}" for note in self.notes]
        return "\n".join(out)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "q": self.q, "sigma": self.sigma, "certificate": self.certificate.to_dict(),
                "coefficients_derived": self.coefficients_derived, "culprit": self.culprit,
                "culprit_node": self.culprit_node, "suggestion": self.suggestion,
                "input_node": self.input_node, "output_node": self.output_node,
                "nodes": [r.to_dict() for r in self.nodes], "notes": [str(note) for note in self.notes]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(jsonable(self.to_dict()), **kwargs)

    def __str__(self) -> str:
        s = str(self.certificate)
        if self.culprit:
            s += f"; culprit: {self.culprit}"
        return s


@dataclass
class ModelCertificate:
    """A model's certificate: its chain of segments from input to output (docs/theory.md section 6).

    Attributes:
        updates: one :class:`TraceCertificate` per residual update ``X + f(X)`` (the velocity ``f``) or
            residual block with a non-identity shortcut (kind ``"block"``), in depth order.
        model: the model's class name.
        strict: which ``torch.export`` mode captured the graph.
        segments: the chain between the stem and the head: the updates, blocks and the maps between them
            (patch merging, downsampling, any scaling), in order.  Empty when the model is not one chain
            (``chained`` is False: only the updates are certified, see ``notes``).
        stem: the segment from the model input to the first update (``None`` when the first update reads
            the input itself).
        head: the segment from the last update to the model output (``None`` when the output is the last
            state).
        integer_input: the model input holds integers (token ids): the stem bounds ``R_0`` from its tables
            (``r0`` is not needed) and no gradient flows into the input.
        notes: what the chain assumed (inputs read at their example value) or why there is no chain; an
            :class:`Unbounded` note names a value the chain does not bound (the stack is then not certified).
        chained: True when the certificate covers the whole path from the model input to its output
            (False: only the updates, listed in ``updates``, are certified; with notes, :meth:`stack` is not
            certified).
        outputs: the model's other outputs (a second head, auxiliary logits), each certified as a map from the input
            of the segment (or head) it is computed from; :meth:`chain` folds each into that segment's peak.
        precision: the name of the mixed precision policy the graph was captured under (``""``: the model as it
            is); its segments' certificates then carry the peak of the values held in each dtype, which
            :meth:`stack` in that policy checks each against its dtype's ``M`` (docs/theory.md section 7).
    """

    updates: List[TraceCertificate]
    model: str = ""
    strict: bool = False
    segments: List[TraceCertificate] = field(default_factory=list)
    stem: Optional[TraceCertificate] = None
    head: Optional[TraceCertificate] = None
    integer_input: bool = False
    notes: List[str] = field(default_factory=list)
    chained: bool = False
    outputs: List[TraceCertificate] = field(default_factory=list)
    precision: str = ""
    #: the captured graph of a chained certificate (its gradients are bounded from it: :meth:`stack`'s loss scale)
    graph: Any = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.updates)

    def __iter__(self) -> Iterator[TraceCertificate]:
        return iter(self.updates)

    def __getitem__(self, k: Any) -> TraceCertificate:
        if isinstance(k, str):
            for u in self.all_segments():
                if u.name == k:
                    return u
            raise KeyError(f"no update or segment named {k!r}; names: {[u.name for u in self.all_segments()]}")
        return self.updates[k]

    @property
    def names(self) -> List[str]:
        return [u.name for u in self.updates]

    @property
    def certificates(self) -> List[BlockCertificate]:
        return [u.certificate for u in self.updates]

    def all_segments(self) -> List[TraceCertificate]:
        """Stem, segments (or the updates when not chained) and head, in order."""
        body = self.segments if self.chained else self.updates
        return ([self.stem] if self.stem is not None else []) + list(body) + (
            [self.head] if self.head is not None else [])

    def chain(self) -> List[BlockCertificate]:
        """The certificates :meth:`stack` chains: the stem (as a map), then the segments.

        With an integer input the stem's Jacobian is not used (no gradient flows into token ids): its
        certificate is given ``sigma = 0``, ``L = 1`` so that it passes the costate on unchanged; its growth
        and peak must not depend on the ids' values (token ids used as numbers are not bounded by ``r0``).

        Each segment's peak covers the model outputs computed from its input (:attr:`outputs`).  A segment
        whose values are not all bounded -- an :class:`Unbounded` note, no peak stated, token ids used as
        numbers -- gets an unbounded peak that names the value: the stack is not certified (unknown is never
        zero).  A model that is not one chain (``notes`` say why) is refused at its first update.
        """
        if not self.chained:
            certs = [_stated(u.certificate) for u in self.updates]
            if self.notes and certs:
                certs[0] = _refused(certs[0], f"the model is not one chain ({self.notes[0]}): the stem, the maps "
                                    "between the updates and the head are not certified")
            return certs
        segs = ([self.stem] if self.stem is not None else []) + list(self.segments)
        out = [self._bounded(tc) for tc in segs]
        if self.integer_input and out:
            out[0] = _token_ids(segs[0], out[0])
        return out

    def head_certificate(self) -> Optional[BlockCertificate]:
        """The head as the map :meth:`stack` certifies (``None``: the output is the last state): its peak covers the
        outputs computed from the last state; a head left out of the chain (an :class:`Unbounded` note) is a map of
        unknown exponents that names why."""
        why = [n for n in self.notes if isinstance(n, Unbounded) and n.segment is None]
        if why and self.chained:
            name = self.head.name if self.head is not None else "head"
            return BlockCertificate(None, None, name=name, kind="map", culprit=str(why[0]),
                                    peak=Peak.unbounded(str(why[0])))
        if not self.chained or self.head is None:
            return None
        return replace(self._bounded(self.head), kind="map")

    def unbounded(self) -> List[Unbounded]:
        """The :class:`Unbounded` notes that stand: the model's (less the outputs certified in :attr:`outputs`), then
        those of the segments' certificates."""
        covered = {o.output_node for o in self.outputs}
        own = [n for n in self.notes if isinstance(n, Unbounded) and n.place not in covered]
        return own + [n for tc in self.all_segments() for n in _unbounded_notes(tc)]

    def _bounded(self, tc: TraceCertificate) -> BlockCertificate:
        """``tc``'s certificate with the outputs computed from its input folded into its peak, refused when a value of
        it is not bounded (a note of the model's about its input node, or one of its own)."""
        cert = _stated(tc.certificate)
        covered = {o.output_node for o in self.outputs}
        why = [n for n in self.notes if isinstance(n, Unbounded) and n.segment == tc.input_node
               and n.place not in covered] + _unbounded_notes(tc)
        if why:
            return _refused(cert, str(why[0]))
        for o in self.outputs:
            if o.input_node == tc.input_node:
                cert = _with_output(cert, o)
        return cert

    def stack(self, dtype: object, *, r0: float = 1.0, dt: float = 1.0, lip_g: Optional[float] = None,
              loss: Union[None, str, float] = None, target_radius: float = 0.0) -> StackCertificate:
        """Certify the model's chain in ``dtype`` (:func:`certblocks.certificate.certify_stack`).

        Args:
            dtype: torch dtype, name, or precision policy (:func:`certblocks.precision.as_precision`).  Under the
                mixed policy the graph was captured under (:attr:`precision`), every value is checked against the
                ``M`` of the dtype it is held in, casts and the head included, and the failure names the tensor
                (node, module, dtype) and a lever; under another mixed policy the segments' values are bounded
                against the policy's narrowest dtype (the certificate's notes say so: capture the model under it,
                ``certblocks.certify(model, x, precision=...)``).
            r0: bound on the model input's per-token norm (Euclidean norm along its last dimension, largest
                over the other indices); not needed for token ids (an embedding's bound does not depend on
                it).  When the model is not chained, the bound on the first update's input.
            dt: residual step, scaling the velocities of the identity-shortcut updates.
            lip_g: ``Lip(G)`` for a model without a head (its output is the last state, ``G`` the identity);
                default 1.  Not used when the model has a head, certified or not (a head left out of the chain is
                not certified: its ``Lip(G)`` is not taken from this argument).
            loss: ``None`` (the costate at the output has norm 1), ``"cross_entropy"`` (mean reduction:
                ``sqrt(2)``), ``"mse"`` (mean reduction: ``2 (||y|| + target_radius)``, with ``||y||`` the
                output bound) or a number bounding the loss gradient in the output.
            target_radius: bound on the targets' per-token norm, for ``loss="mse"``.

        Returns:
            The :class:`~certblocks.certificate.StackCertificate` of the chain: stem, maps and updates in
            order, the head's ``Lip(G)`` times the loss gradient as the backward budget's ``Lip(G)``.  It is
            not certified when a value of the model is not bounded (:meth:`chain`, :meth:`unbounded`): the
            failure names it.  The gradient bound is that of a loss of the first output; the other outputs
            are bounded forward (their values stay below ``M``).
        """
        head = self.head_certificate()
        grad = _loss_gradient(loss, target_radius)
        if grad is None:  # MSE: 2 (||y|| + ||t||), with ||y|| bounded by the output bound
            first = self._certify(dtype, r0, dt, lip_g, head, 1.0)
            out = first.output_bound if head is not None else first.radii[-1]
            grad = 2.0 * (out + target_radius) if math.isfinite(out) else sys.float_info.max
            grad = min(max(grad, sys.float_info.min), sys.float_info.max)
        return self._with_loss_scale(self._certify(dtype, r0, dt, lip_g, head, grad), dtype, dt, loss)

    def _with_loss_scale(self, st: StackCertificate, dtype: object, dt: float,
                         loss: Union[None, str, float]) -> StackCertificate:
        """``st`` with :attr:`~certblocks.certificate.StackCertificate.max_loss_scale` where gradients are held in
        fp16 (pure fp16, amp-fp16): every gradient of the graph bounded from the chain's costates
        (:mod:`certblocks.trace.backward`), ``S* = min M_16 / bound`` over those held in fp16.  Certified means
        forward-safe and ``S* >= 1`` (an unscaled step cannot overflow): below 1 the chain fails backward at the
        segment of the gradient that sets it (docs/theory.md section 7).  Needs the captured graph of a chain
        certified with ``dt = 1`` (the graph computes ``x + f(x)``); otherwise ``st`` as it is."""
        from ..precision import as_precision

        if self.graph is None or not self.chained or dt != 1.0 or as_precision(dtype).grad_dtype != "fp16":
            return st
        import torch

        from .backward import loss_scale_from, model_gradient_bounds

        prec = as_precision(dtype)
        dtypes = None
        if prec.pure:  # the model runs in fp16 throughout: every floating tensor (and its gradient) is held in it
            dtypes = {name: torch.float16 for name, v in self.graph.env.items()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()}
        try:
            grads = model_gradient_bounds(self.graph, st, loss=loss if isinstance(loss, str) or loss is None else None,
                                          dtypes=dtypes)
        except ValueError as exc:  # not the graph's chain: say so instead of a scale
            return replace(st, notes=tuple(st.notes) + (f"loss scale: not computed ({exc})",))
        ls = loss_scale_from(grads, torch.float16)
        st = replace(st, max_loss_scale=ls.value)
        if st.first_failure is None and not ls.value >= 1.0:
            ng = next((x for x in ls.gradients if x.name == ls.node), None)
            label = ng.segment if ng is not None else ""
            k = next((j for j, u in enumerate(st.updates) if u.name and label.endswith(u.name)), None)
            if k is None:
                k = len(st.updates) if label.startswith("head") else 0
            name = st.updates[k].name if k < len(st.updates) else (st.head.name if st.head is not None else "head")
            seg = st.updates[k].kind if k < len(st.updates) else "head"
            st = replace(st, first_failure=Failure(
                k, name, "backward", f"a gradient held in fp16 can overflow without a loss scale: {ls.reason}",
                f"keep {ls.module or ls.node} in fp32, or lower the backward factors before it (a smaller branch gain, "
                "caps with certblocks.enforce)", seg))
        return st

    def _certify(self, dtype: object, r0: float, dt: float, lip_g: Optional[float],
                 head: Optional[BlockCertificate], grad: float) -> StackCertificate:
        if head is not None:
            return certify_stack(self.chain(), dtype, dt=dt, r0=r0, head=head, loss_grad=grad)
        return certify_stack(self.chain(), dtype, dt=dt, r0=r0, lip_g=(1.0 if lip_g is None else lip_g) * grad)

    def explain(self) -> str:
        segs = self.all_segments()
        n_maps = len(segs) - len(self.updates)
        out = [f"{self.model}: {len(self.updates)} residual updates"
               + (f", {n_maps} other segments (stem, maps, head)" if n_maps else "")
               + (f"; captured under {self.precision} (each value's dtype read from the graph)" if self.precision
                  else "")]
        w = max([len(u.name) for u in segs] + [6])
        for k, u in enumerate(segs):
            c = u.certificate
            kind = ("stem" if u is self.stem else "head" if u is self.head else c.kind)
            coef = (f"c={c.c:.4g} b={c.b:.4g} l1={c.l1:.4g} l0={c.l0:.4g}" if u.coefficients_derived
                    else "coefficients not derived")
            out.append(f"{k:3d}  {kind:6s}  {u.name.ljust(w)}  {str(u.exponents):22s}  {coef}"
                       + (f"  culprit: {u.culprit}" if u.culprit and (u.q is None or u.q > 1 or (u.sigma or 0) > 0)
                          else ""))
        out += [f"output {o.output_node}: bounded from the input of segment {o.input_node}: {o.certificate}"
                for o in self.outputs]
        standing = self.unbounded()
        out += [f"{'NOT BOUNDED' if any(n is u for u in standing) else 'note'}: {n}" for n in self.notes]
        return "\n".join(out)

    def to_dict(self) -> Dict[str, Any]:
        return {"model": self.model, "strict": self.strict, "depth": len(self.updates), "chained": self.chained,
                "precision": self.precision,
                "integer_input": self.integer_input, "notes": list(self.notes),
                "stem": None if self.stem is None else self.stem.to_dict(),
                "segments": [u.to_dict() for u in self.segments],
                "head": None if self.head is None else self.head.to_dict(),
                "outputs": [o.to_dict() for o in self.outputs],
                "unbounded": [{"note": str(n), "place": n.place, "segment": n.segment} for n in self.unbounded()],
                "updates": [u.to_dict() for u in self.updates]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(jsonable(self.to_dict()), **kwargs)

    def __str__(self) -> str:
        return self.explain()


def _unbounded_notes(tc: TraceCertificate) -> List[Unbounded]:
    """The :class:`Unbounded` notes a segment's certificate carries (a rule that read a value at its example)."""
    return [n for n in getattr(tc, "notes", ()) if isinstance(n, Unbounded)]


def _stated(cert: BlockCertificate) -> BlockCertificate:
    """``cert``, its peak unbounded when it states none (a certified block's own certificate without one): a chain
    that certifies a whole model bounds every intermediate."""
    if cert.peak is not None:
        return cert
    return replace(cert, peak=Peak.unbounded(f"{cert.name or 'this segment'} states no bound on its intermediates"))


def _refused(cert: BlockCertificate, why: str) -> BlockCertificate:
    """``cert`` with an unbounded peak naming ``why``: the chain is not certified from this segment on."""
    return replace(cert, peak=Peak.unbounded(why))


def _with_output(cert: BlockCertificate, out: TraceCertificate) -> BlockCertificate:
    """``cert``'s peak raised over a model output computed from the same input: the output's norm bound and its own
    peak, both functions of that input's radius (docs/theory.md section 6); under a policy, each dtype's peak over
    the output's values held in it (the output's norm bound in its own dtype)."""
    oc = out.certificate
    label = f"output {out.output_node} of the model"
    if cert.peak is None or not cert.peak.derived:
        return cert
    if oc.q is None or oc.peak is None or not oc.peak.derived:
        why = oc.peak.what if oc.peak is not None and not oc.peak.derived else f"exponents {oc.exponents}"
        return _refused(cert, f"{label} is not bounded: {why}")
    polys = [power_terms(cert.peak.q, cert.peak.c, cert.peak.b), power_terms(oc.q, oc.c, oc.b),
             power_terms(oc.peak.q, oc.peak.c, oc.peak.b)]
    mine = (cert.peak.q, cert.peak.c + cert.peak.b) >= max((oc.q, oc.c + oc.b), (oc.peak.q, oc.peak.c + oc.peak.b))
    try:
        folded = fold_peak(polys, cert.peak.what if mine else f"{label} ({oc.peak.what})")
    except ValueError as exc:
        return _refused(cert, f"{label}: its bound does not fold into the segment's peak ({exc})")
    held = cert.held_peaks(cert.precision) if cert.precision else None
    theirs = oc.held_peaks(cert.precision) if held is not None else None
    if held is None or theirs is None or not oc.state_dtype:
        return replace(cert, peak=folded, peaks=None, peaks_of=None)  # the dtypes no longer known one by one
    groups: Dict[str, List[Peak]] = {d: [p] for d, p in held.items()}
    for d, p in theirs.items():
        groups.setdefault(d, []).append(p)
    groups.setdefault(oc.state_dtype, []).append(Peak(oc.q, oc.c, oc.b, f"{label} (its norm bound)"))
    peaks = {}
    for d, ps in groups.items():
        top = max(ps, key=lambda p: (p.q, p.c + p.b))
        parts = tuple(x for p in ps for x in (p.parts or ((tuple(sorted(power_terms(p.q, p.c, p.b).items())), p.what,
                                                           p.lever),)))
        try:
            peaks[d] = replace(fold_peak([power_terms(p.q, p.c, p.b) for p in ps], top.what), lever=top.lever,
                               parts=parts)
        except ValueError as exc:
            peaks[d] = Peak.unbounded(f"{label}: its {d} bounds do not fold into the segment's ({exc})")
    return replace(cert, peak=folded, peaks=peaks, peaks_of=None)



def _token_ids(tc: TraceCertificate, cert: BlockCertificate) -> BlockCertificate:
    """The first segment of a model whose input is token ids: no gradient flows into them (``sigma = 0``, ``L = 1``);
    refused when its growth or peak grows with the input (the ids used as numbers: ``r0`` does not bound them)."""
    if cert.q is None:
        return cert
    cert = replace(cert, sigma=0.0, l1=0.0, l0=1.0)
    grows = (cert.q or 0.0) > 0 and cert.c > 0  # q is derived (checked above)
    peak_grows = cert.peak is not None and cert.peak.derived and cert.peak.q > 0 and cert.peak.c > 0
    if not (grows or peak_grows):
        return cert
    node = next((r.node for r in tc.nodes if r.node != tc.input_node and r.floating and r.q is not None and r.q > 0),
                "")
    at = f" (node {node!r} is the first floating value that grows with them)" if node else ""
    return _refused(cert, f"token ids are used as numbers in {tc.name or 'the stem'}: its "
                          f"{'growth' if grows else 'peak'} grows with the ids' values{at}, which r0 does not bound")


def _loss_gradient(loss: Union[None, str, float], target_radius: float) -> Optional[float]:
    """The bound on the loss gradient in the model output (``None`` for MSE: it needs the output bound)."""
    if loss is None:
        return 1.0
    if isinstance(loss, str):
        if loss in ("cross_entropy", "ce"):
            return cross_entropy_gradient
        if loss == "mse":
            if not (isinstance(target_radius, (int, float)) and math.isfinite(target_radius) and target_radius >= 0):
                raise ValueError(f"target_radius must be a finite number >= 0, got {target_radius!r}")
            return None
        raise ValueError(f"loss must be None, 'cross_entropy', 'mse' or a number, got {loss!r}")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss) or loss <= 0:
        raise ValueError(f"loss must be None, 'cross_entropy', 'mse' or a finite number > 0, got {loss!r}")
    return float(loss)


def jsonable(x: Any) -> Any:
    """``x`` with every float made JSON-safe (inf -> ``"inf"``, NaN -> ``None``), through dicts, lists and tuples."""
    if isinstance(x, float):
        return json_number(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def node_row(node: Any, av: AValue, module: str, op: str) -> NodeRow:
    dtype = getattr(node.meta.get("val"), "dtype", None) if hasattr(node, "meta") else None
    floating = dtype is None or dtype.is_floating_point or dtype.is_complex
    return NodeRow(node.name, op, module, av.exps.q, av.exps.sigma, av.rule,
                   repr(av.growth) if av.growth is not None else "?",
                   repr(av.jacobian) if av.jacobian is not None else "?", av.bad, floating)

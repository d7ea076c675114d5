"""Unknown is never zero (issue 31, docs/theory.md section 6): every place where a bound may be unknown, and the
outcome.

``PLACES`` lists each place where a bound of a chain may be missing -- a segment's exponents or peak, the stem's,
the head's, an output of the model other than the head's, token ids used as numbers, an integer value computed from
the input and read at its example, a model that is not one chain, a segment that states no peak -- with a small
certificate or model that has it.  At every place the stack certificate is NOT certified and its failure names the
place: nothing is skipped because its input is ``None``.  The model searches agree: wherever a certificate is
certified the search does not beat it, and where the old reading would have certified a model (an unknown bound
read as no bound) the search beats what that certificate claimed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from typing import Callable, Dict, List, NamedTuple, Tuple

import pytest
import torch
from torch import nn

import certblocks.testing as cbt
from certblocks.certificate import BlockCertificate, Peak, StackCertificate, certify_stack
from certblocks.trace import ModelCertificate, capture, certify, find_residual_updates
from certblocks.trace.chain import certify_outputs, model_chain
from certblocks.trace.report import Unbounded

D, V = 8, 40
SEARCH = dict(count=6, restarts=1, from_best=1, steps=6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- small models


class Blk(nn.Module):
    """A tanh update: bounded growth, Lipschitz."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * torch.tanh(self.l(x))


class Body(nn.Module):
    """Two tanh updates between a stem and a head the subclasses define."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.ModuleList([Blk(), Blk()])
        self.head = nn.Linear(D, 4)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.b:
            x = blk(x)
        return x


class ExpInsideStem(Body):
    """Token ids; the stem's tanh(exp(E[ids])) is bounded, its exp is not (it reaches 2e24 with these tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        with torch.no_grad():
            self.emb.weight.mul_(20.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.tanh(torch.exp(self.emb(ids)))))


class NoRuleInUpdate(Body):
    """The second update computes cosh: no rule, unknown exponents."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b[0](x)
        x = x + torch.tanh(torch.cosh(self.b[1].l(x)))
        return self.head(x)


class ExpStem(Body):
    """A stem exp(W x): exp of an argument of unknown sign."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.exp(self.stem(x))))


class ExpHead(Body):
    """A head exp(W x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.head(self.body(x)))


class HeadReadsTheInput(Body):
    """A head that undoes the input's scaling with its statistics: not a function of the last state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(dim=-1, keepdim=True) + 1.0
        return self.head(self.body(x / scale)) * scale[..., :1]


class HugeSecondOutput(Body):
    """Returns the logits and ``1e30 x``: the second output overflows fp16, not fp32."""

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.body(x)), 1e30 * x


class ExpAuxiliaryOutput(Body):
    """Returns the logits and an auxiliary ``exp`` of the first state (a router's logits' exp)."""

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.b[0](x)
        return self.head(self.b[1](h)), torch.exp(h)


class PoolerOutput(Body):
    """Returns the last state and a pooled tanh head of it (a BERT-style pooler): both bounded."""

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        h = self.body(x)
        return {"last_hidden_state": h, "pooler_output": torch.tanh(self.head(h[:, 0]))}


class IdsAsNumbers(Body):
    """Token ids embedded and also used as numbers: ``E[ids] + ids w``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.w = nn.Parameter(torch.full((D,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids) + ids.to(torch.float32)[..., None] * self.w))


class IntegerNodeReadLater(Body):
    """A boolean value computed from the ids (``ids > 20``) selects, after the first update, between the state and
    three times it: read at its example value, the map would be bounded by the factor of the example's choice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flag = ids > 20
        x = self.b[0](self.emb(ids))
        x = torch.where(flag[..., None], 3.0 * x, x)
        return self.head(self.b[1](x))


class SideBySide(nn.Module):
    """Two stacks side by side on halves of the features: the updates are not on one path."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Blk(), Blk()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], dim=-1)


# ------------------------------------------------------------------------------------------------- the places


class Place(NamedTuple):
    """A place where a bound may be unknown: how to build a stack certificate that has it, and what its failure says.

    ``build`` returns the stack certificate (fp32) and, for a traced model, the model, its example and its model
    certificate (``None`` for a certificate built by hand).  ``index`` is the failing segment (``-1``: the head).
    """

    build: Callable[[], Tuple[StackCertificate, object]]
    kind: str
    index: int
    names: Tuple[str, ...]


def _stack(certs: List[BlockCertificate], **kw) -> Callable[[], Tuple[StackCertificate, object]]:
    return lambda: (certify_stack(certs, "fp32", **kw), None)


_OK = BlockCertificate(1, 0, c=0.1, l0=0.1, peak=Peak(1, 1.0, 0.1))
_HEAD = BlockCertificate(1, 0, c=1.0, l0=1.0, kind="map", name="head", peak=Peak(1, 1.0))
_BUILT: Dict[str, Tuple[nn.Module, torch.Tensor, ModelCertificate]] = {}


def _traced(cls: type, integer: bool = False, outputs: bool = False, dtype: str = "fp32"
            ) -> Callable[[], Tuple[StackCertificate, object]]:
    """The model's stack certificate as ``certify`` gives it (its other outputs certified in
    ``ModelCertificate.outputs``); ``outputs=False``: with those certificates removed, so that what the chain does
    when an output is not covered is tested too."""

    def build() -> Tuple[StackCertificate, object]:
        key = f"{cls.__name__}{outputs}"
        if key not in _BUILT:
            torch.manual_seed(0)
            m = cls().eval()
            x = torch.randint(0, V, (1, 6)) if integer else torch.randn(1, 4, D)
            rep = certify(m, x)
            if outputs:  # certify's outputs are the chain's, certified one by one
                g = capture(m, (x,))
                chain = model_chain(g, find_residual_updates(g))
                assert [o.output_node for o in rep.outputs] == [
                    o.output_node for o in certify_outputs(g, chain)] == [s.end.name for s in chain.outputs]
            else:
                rep = replace(rep, outputs=[])
            _BUILT[key] = (m, x, rep)
        m, x, rep = _BUILT[key]
        r0 = 1.0 if integer else float(x.norm(dim=-1).max())
        return rep.stack(dtype, r0=r0), (m, x, rep)

    return build


def _no_peak_own_certificate() -> Tuple[StackCertificate, object]:
    """A traced segment whose certificate states no peak (a certified block's own certificate without one)."""
    m, x, rep = _traced(HugeSecondOutput, outputs=True)()[1]
    segs = [replace(s, certificate=replace(s.certificate, peak=None)) if k == 1 else s
            for k, s in enumerate(rep.segments)]
    rep2 = replace(rep, segments=segs, updates=[s for s in segs if s.certificate.is_update])
    return rep2.stack("fp32", r0=1.0), None


def _segment_note() -> Tuple[StackCertificate, object]:
    """A segment's certificate carrying an Unbounded note of its own (a rule read a value at its example)."""
    m, x, rep = _traced(HugeSecondOutput, outputs=True)()[1]
    segs = [replace(s) for s in rep.segments]
    segs[0].notes = [Unbounded("node 'topk_indices' is read at its example value", "topk_indices", None)]
    return replace(rep, segments=segs).stack("fp32", r0=1.0), None


PLACES: Dict[str, Place] = {
    # certificates built by hand (certify_stack)
    "peak of one intermediate": Place(_stack([_OK, _OK, replace(_OK, name="gate", peak=Peak.unbounded(
        "node exp_3 (aten.exp) has no finite entry bound")), _OK]), "unknown", 2, ("gate", "exp_3")),
    "growth of one update": Place(_stack([_OK, BlockCertificate(None, 0, name="mystery"), _OK]), "unknown", 1,
                                  ("mystery", "q not derived")),
    "Jacobian of one update": Place(_stack([_OK, BlockCertificate(1, None, name="mystery"), _OK]), "unknown", 1,
                                    ("mystery", "sigma not derived")),
    "stem": Place(_stack([BlockCertificate(None, None, kind="map", name="stem"), _OK]), "unknown", 0,
                  ("stem", "q and sigma not derived")),
    "head growth": Place(_stack([_OK, _OK], head=replace(_HEAD, q=None)), "unknown", -1, ("head", "q not derived")),
    "head Jacobian": Place(_stack([_OK, _OK], head=replace(_HEAD, sigma=None)), "unknown", -1,
                           ("head", "sigma not derived")),
    "head peak": Place(_stack([_OK, _OK], head=replace(_HEAD, peak=Peak.unbounded("node exp (aten.exp)"))),
                       "unknown", -1, ("head", "node exp")),
    # traced models
    "traced intermediate": Place(_traced(ExpInsideStem, integer=True), "unknown", 0, ("node exp", "emb")),
    "traced update": Place(_traced(NoRuleInUpdate), "unknown", 1, ("cosh", "sigma not derived")),
    "traced stem": Place(_traced(ExpStem), "unknown", 0, ("stem", "exp")),
    "traced head": Place(_traced(ExpHead), "unknown", -1, ("head", "exp")),
    "head not a function of the last state": Place(_traced(HeadReadsTheInput), "unknown", -1,
                                                   ("head", "not a function of the last state alone")),
    "second output": Place(_traced(HugeSecondOutput), "unknown", 0, ("output 1 (mul", "not bounded by the chain")),
    "second output certified, fp16": Place(_traced(HugeSecondOutput, outputs=True, dtype="fp16"), "forward", 0,
                                           ("output mul",)),
    "auxiliary exp output": Place(_traced(ExpAuxiliaryOutput, outputs=True), "unknown", 1,
                                  ("output exp", "not bounded")),
    "token ids used as numbers": Place(_traced(IdsAsNumbers, integer=True), "unknown", 0,
                                       ("token ids are used as numbers", "'to'")),
    "integer node computed from the input": Place(_traced(IntegerNodeReadLater, integer=True), "unknown", 2,
                                                  ("reads 'unsqueeze'", "at its example value")),
    "not one chain": Place(_traced(SideBySide), "unknown", 0, ("not one chain",)),
    "segment without a peak": Place(_no_peak_own_certificate, "unknown", 1, ("states no bound on its intermediates",)),
    "segment's own note": Place(_segment_note, "unknown", 0, ("topk_indices", "example value")),
}


@pytest.mark.parametrize("place", list(PLACES))
def test_unknown_bound_is_not_certified_and_named(place):
    p = PLACES[place]
    st, _ = p.build()
    f = st.first_failure
    assert not st.ok and f is not None, st.explain()
    assert f.kind == p.kind, f
    assert f.index == (len(st.updates) if p.index < 0 else p.index), f
    assert (f.segment == "head") == (p.index < 0), f
    for name in p.names:
        assert name in f.reason, (name, f.reason)
    text, data = st.explain(), st.to_dict()
    assert "NOT certified" in text and f.reason in text
    assert data["ok"] is False and data["first_failure"]["reason"] == f.reason
    assert st.certified_depth <= sum(1 for u in st.updates[:f.index] if u.is_update)


def test_the_places_that_refuse_are_all_listed():
    """Every kind of refusal the code has is a place above: the segment and head checks of certify_stack, each
    Unbounded note of the chain, the token-id stem, a model that is not one chain, a segment without a peak."""
    built = {name: PLACES[name].build() for name in PLACES}
    reasons = " | ".join(st.first_failure.reason for st, _ in built.values())
    for phrase in ("q not derived", "sigma not derived", "leaves a value unbounded", "the head 'head'",
                   "not bounded by the chain", "token ids are used as numbers", "at its example value",
                   "not one chain", "states no bound", "is not bounded: node exp"):
        assert phrase in reasons, phrase


# ----------------------------------------------------------------------------------- the searches agree


@pytest.mark.parametrize("place", [p for p in PLACES if PLACES[p].build.__name__ == "build"])
def test_search_does_not_beat_what_is_certified(place):
    """The traced models: certified in fp64 or not, a search never beats a certificate that is certified."""
    st, (m, x, rep) = PLACES[place].build()
    for dtype in ("fp32", "fp64"):
        s = rep.stack(dtype, r0=st.r0)
        report = cbt.search_model(m, s, x, model_certificate=rep if rep.chained else None, dtype=torch.float64,
                                  **SEARCH)
        assert report.ok or not s.ok, (place, dtype, str(report), s.explain())


def test_second_output_certified_is_folded_and_sound():
    st, (m, x, rep) = PLACES["second output certified, fp16"].build()
    st32 = rep.stack("fp32", r0=st.r0)
    assert st32.ok and not rep.unbounded(), st32.explain()
    assert st32.updates[0].peak.bound(st.r0) >= 1e30 * st.r0  # the output 1e30 x lies in the first segment's peak
    out = rep.outputs[0].output_node
    assert f"output {out}" in st32.updates[0].peak.what
    report = cbt.assert_model_sound(m, st32, x, model_certificate=rep, **SEARCH)
    assert report["intermediate"].ratio > 0.5, report  # the search reads the huge output; the peak holds it
    uncovered = replace(certify(m, x), outputs=[])
    assert [n.place for n in uncovered.unbounded()] == [out]  # without rep.outputs it is refused (the place above)


def test_pooler_output_is_bounded_once_certified():
    torch.manual_seed(0)
    m, x = PoolerOutput().eval(), torch.randn(1, 4, D)
    uncovered = replace(certify(m, x), outputs=[])
    assert [n.place for n in uncovered.unbounded()] == ["tanh_2"] and not uncovered.stack("fp32").ok
    g = capture(m, (x,))
    chain = model_chain(g, find_residual_updates(g))
    assert [(s.kind, s.start.name, s.end.name) for s in chain.outputs] == [("output", chain.segments[-1].start.name,
                                                                            "tanh_2")]
    rep = certify(m, x)  # certify certifies the chain's every output
    assert [o.output_node for o in rep.outputs] == ["tanh_2"]
    st = rep.stack("fp32", r0=float(x.norm(dim=-1).max()))
    assert st.ok, st.explain()
    assert "output tanh_2" in rep.explain() and rep.to_dict()["unbounded"] == []
    assert "NOT BOUNDED" not in rep.explain() and "note: output 1 (tanh_2)" in rep.explain()
    cbt.assert_model_sound(m, st, x, model_certificate=rep, **SEARCH)


def test_the_old_reading_is_beaten():
    """Where an unknown bound used to read as none, the search beats what that certificate claimed."""
    st, (m, ids, rep) = PLACES["traced intermediate"].build()
    chain = rep.chain()
    chain[0] = replace(chain[0], peak=None)  # the exp inside the stem skipped, as before
    old = certify_stack(chain, "fp32", head=rep.head_certificate())
    assert old.ok, old.explain()  # what used to be certified
    report = cbt.search_model(m, old, ids, model_certificate=rep, checks=["intermediate"], **SEARCH)
    assert report["intermediate"].ratio > 1e20 and "exp" in report["intermediate"].where, report
    st, (m, ids, rep) = PLACES["token ids used as numbers"].build()
    report = cbt.search_model(m, st, ids, model_certificate=rep, checks=["state"], **SEARCH)
    assert report["state"].ratio > 2 and report["state"].where.startswith("boundary 1"), report  # ids up to V - 1


def test_unbounded_notes_are_strings_that_survive_copies():
    import copy
    import pickle

    n = Unbounded("output 1 (mul) is not bounded", "mul", "x")
    for c in (copy.deepcopy(n), pickle.loads(pickle.dumps(n))):
        assert isinstance(c, Unbounded) and str(c) == str(n) and (c.place, c.segment) == ("mul", "x")
    assert n == "output 1 (mul) is not bounded"


def test_unknown_factors_and_peaks_are_not_zero():
    st = certify_stack([_OK, BlockCertificate(1, None), _OK], "fp32")
    assert any(math.isnan(f) for f in st.log_factors) and st.log_gradient_bound == math.inf
    d = replace(_OK, peak=Peak.unbounded("node exp")).depths("fp32")
    assert d.forward == 0 and d.certified == 0
    assert str(Peak.unbounded("node exp")) == "peak not derived (node exp)" and not Peak.unbounded("x").derived
    hand = certify_stack([replace(_OK, peak=None), _OK], "fp32")  # built by hand without a peak: said, not hidden
    assert hand.ok and hand.unchecked == [0] and "not checked: segment(s) 0" in hand.explain()
    assert hand.to_dict()["unchecked"] == [0]


def test_a_collapsed_certified_call_keeps_its_peak():
    """A velocity that holds a certified block's call among other ops: the call hides its nodes, and the peak it
    leaves on one of them (its representative) is in the velocity's peak, even where the call's output is bounded
    far below its intermediates (a small down-projection after a large gate)."""
    from certblocks.blocks import GatedMLP
    from certblocks.bounds.poly import Poly
    from certblocks.trace.collapse import peak
    from certblocks.trace.interp import VelocityInterpreter

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = GatedMLP(D, 4 * D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0.25 * torch.tanh(self.mlp(x))

    torch.manual_seed(0)
    m = Scaled().eval()
    rep = certify(m, torch.randn(1, 4, D))
    cert, own = rep.updates[0].certificate, m.mlp.certificate()
    assert cert.peak is not None and cert.peak.derived and own.peak is not None
    g = capture(m, (torch.randn(1, 4, D),))
    x, f, _ = find_residual_updates(g)[0]
    it = VelocityInterpreter(g, x, f)
    it.run()
    (call, _), = it.certified_calls.values()
    out = it.values[call.output.name]
    out.max_abs = out.growth = Poly.const(1e-3)  # the call's output far below its intermediates
    folded = peak(it)
    for r in (0.5, 3.0, 40.0):
        assert cert.peak.bound(r) >= own.peak.bound(r), (r, cert.peak, own.peak)
        assert folded.bound(r) >= own.peak.bound(r), (r, folded, own.peak)


@dataclasses.dataclass
class _AuxOutput:
    """A model output that is a dataclass, not a mapping (its fields are outputs too)."""

    aux: torch.Tensor


class DataclassAuxOutput(Body):
    """Returns the logits and a dataclass holding ``1e30 x``."""

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, _AuxOutput]:
        return self.head(self.body(x)), _AuxOutput(1e30 * x)


def test_an_output_inside_a_dataclass_is_in_the_chain():
    torch.manual_seed(0)
    m, x = DataclassAuxOutput().eval(), torch.randn(1, 4, D)
    rep = certify(m, x)
    assert len(rep.outputs) == 1, rep.explain()
    r0 = float(x.norm(dim=-1).max())
    assert not rep.stack("fp16", r0=r0).ok and rep.stack("fp32", r0=r0).ok
    assert rep.outputs[0].output_node in rep.stack("fp16", r0=r0).explain()

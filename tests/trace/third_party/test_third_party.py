"""The harder third-party set (issue 31 item 7): 39 models from transformers and timm, each certified from its graph and
searched, against the table of docs/third_party.md.

A model is **covered** when (:func:`~.registry.assess`, the registry's docstring states it in full): ``certify(model,
example)`` gives a chained ``ModelCertificate`` with no unbounded value, in which every certificate the stack uses --
stem, updates, blocks, maps, head, the model's other outputs -- has known exponents, finite coefficients and a derived
peak; ``stack(dtype, r0=...)`` gives the depths in fp32, bf16 and fp16 (``r0``: the example's per-token norm, or token
ids); and the whole-model counterexample search (random and gradient-ascent inputs, every intermediate recorded, the
cross-entropy loss) does not beat the fp32 certificate.  A model that is not covered is **refused** (the tracer names
the value it does not bound) or a **capture failure**.

Every model is searched, refused or not (a refused segment's unbounded checks cannot fail, its bounded ones can), and
its outcome must be the one the table's ``covered`` column states: the document cannot drift from the tracer.  The
default run checks a few fast models; the others and the printed summary are ``slow``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest

from .registry import DTYPES, MODELS, Outcome, assess, read_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "third_party.md"
NAMED = ("mixtral", "rwkv", "efficientvit_b0")

_OUTCOMES: Dict[str, Outcome] = {}


def _outcome(name: str) -> Outcome:
    pytest.importorskip(MODELS[name].library)
    if name not in _OUTCOMES:
        _OUTCOMES[name] = assess(name)
    return _OUTCOMES[name]


def _column(o: Outcome) -> str:
    return "yes" if o.status == "covered" else f"no: {o.status}"


def test_the_set_and_its_table():
    assert len(MODELS) == 39 and set(NAMED) <= set(MODELS)
    assert all(m.construct and "|" not in m.construct and m.library in ("transformers", "timm")
               for m in MODELS.values())
    assert {m.library for m in MODELS.values()} == {"transformers", "timm"}
    table = read_table(DOC.read_text())
    assert list(table) == list(MODELS), "docs/third_party.md must list the set in its order"
    assert set(table.values()) <= {"yes", "no: refused", "no: capture failure"}, set(table.values())
    refused = {n for n, m in MODELS.items() if m.refusal}
    assert refused == {n for n, v in table.items() if v != "yes"}, "a model the table does not cover says why"
    assert sum(m.slow is False for m in MODELS.values()) <= 6


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if m.slow else [])
                                  for n, m in MODELS.items()])
def test_model(name):
    o = _outcome(name)
    assert not o.search_failures, f"{name}: the search beat the certificate: {o.search_failures}"
    expected = read_table(DOC.read_text())[name]
    assert _column(o) == expected, f"{name}: docs/third_party.md says {expected!r}, the tracer gives {o.status!r}: " \
                                   f"{o.reason}"
    if o.status == "covered":
        assert o.reason == "" and o.search_ratio is not None and 0 < o.search_ratio <= 1 + 1e-6, o
        assert set(o.verdicts) == set(DTYPES) and all(depth >= 0 for _, depth, _ in o.verdicts.values())
    else:
        assert MODELS[name].refusal and MODELS[name].refusal in o.reason, o.reason


@pytest.mark.slow
def test_coverage_summary(capsys):
    outcomes = {name: _outcome(name) for name in MODELS}
    covered = [n for n, o in outcomes.items() if o.status == "covered"]
    lines = [f"harder third-party set: {len(covered)} of {len(outcomes)} covered"]
    for status in ("refused", "capture failure"):
        for n, o in outcomes.items():
            if o.status == status:
                lines.append(f"  {status}: {n}: {o.reason}")
    lines.append(f"  certify: {sum(o.certify_seconds for o in outcomes.values()):.1f} s for the set")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    table = read_table(DOC.read_text())
    assert {n for n, v in table.items() if v == "yes"} == set(covered)
    assert all(not o.search_failures for o in outcomes.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mixtral", "rwkv", "convnext_atto", "efficientnet_b0", "t5_encoder"])
def test_segments_side_by_side_give_the_one_thread_certificate(name, monkeypatch):
    """With two CPU threads certify() certifies the chain's segments concurrently: the certificate equals, every
    field, the one computed one segment after another (HF decoders, a mixture of experts, RWKV, convolutions, T5)."""
    import torch

    from certblocks.trace import api, certify

    from .registry import build

    pytest.importorskip(MODELS[name].library)
    model, x = build(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        side_by_side = certify(model, x).to_dict()
        original = api.certify_segment
        monkeypatch.setattr(api, "_certify_segments", lambda g, segs: [original(g, s, k) for k, s in enumerate(segs)])
        in_order = certify(model, x).to_dict()
    finally:
        torch.set_num_threads(threads)
    assert side_by_side == in_order

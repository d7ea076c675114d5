"""OpInfo conformance of the tracer's rules (:mod:`certblocks.testing.conformance`): every registered rule is run
on PyTorch's own OpInfo samples and on hand-written ones, and every bound it states (growth, entries, Jacobian,
sign, row-stochasticity, constants, exponents) is checked against the op itself on the sample and on searched
inputs.

* the checker finds each kind of planted defect in a rule of a custom op, passes a sound rule and counts a
  refusal apart;
* switches (docs/theory.md section 1.1: the Jacobian bound is of the derivative autograd takes, the branch's): a
  planted switch with a derivative bound too small is found by autograd's products, the same switch with a sound
  bound passes although it jumps (no difference quotient across the jump), an integer step has derivative 0, and
  the rules of ``where``, ``masked_fill``, gathers and reads by computed indices, order statistics, argmax,
  comparisons and rounding conform on samples whose conditions and indices are computed from the input;
* every registered rule has samples (an OpInfo naming it, hand-written ones, or a reason in
  ``conformance_samples.unreachable``): a new rule without them fails here;
* the fast subset (the first float64 sample of each OpInfo, one per op, and the hand-written samples; the
  :data:`~certblocks.testing.conformance.FAST` search) runs in four chunks of the sorted rule list: each reaches
  every rule of its chunk, finds no beaten bound and no rule that raises; the sweep of 12 samples per OpInfo is
  ``slow`` and prints the coverage table.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Dict, List

import pytest
import torch

from certblocks import exponents as E
from certblocks.bounds.poly import Poly
from certblocks.testing.conformance import (
    FAST,
    FULL,
    ConformanceReport,
    Effort,
    Sample,
    check_rule,
    check_samples,
    main,
    opinfo_samples,
    run_conformance,
    run_fast,
)
from certblocks.testing.conformance_samples import conformance_samples, unreachable
from certblocks.trace.rules import register_rule, registered_rules
from certblocks.trace.values import AValue

#: The namespace of this file's planted rules (custom ops), left out of the project's coverage.
PLANTED = "cbconformance"
CHUNKS = 4

X = torch.linspace(-1.0, 2.0, 15, dtype=torch.float64).reshape(3, 5)
X3 = torch.linspace(-2.0, 1.0, 24, dtype=torch.float64).reshape(2, 3, 4)


# ---------------------------------------------------------------------------------------------- planted rules
def _double(name: str, autograd: bool = True, integer: bool = False, switch: bool = False) -> None:
    """A custom op ``cbconformance::<name>``: ``2 x`` (``integer``: ``x > 0`` as int64; ``switch``: ``2 x + 1`` where
    ``x > 0``, ``-3 x`` elsewhere, which jumps by 1 at 0, with autograd's derivative 2 or -3, the branch's)."""
    qual = f"{PLANTED}::{name}"

    def fwd(x: torch.Tensor) -> torch.Tensor:
        if switch:
            return torch.where(x > 0, 2 * x + 1, -3 * x)
        return (x > 0).long() if integer else 2 * x

    op = torch.library.custom_op(qual, fwd, mutates_args=(), schema="(Tensor x) -> Tensor")
    op.register_fake(lambda x: torch.empty_like(x, dtype=torch.long) if integer else torch.empty_like(x))
    if switch:
        torch.library.register_autograd(qual, lambda ctx, g: torch.where(ctx.x > 0, 2.0, -3.0) * g,
                                        setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))
    elif autograd and not integer:
        torch.library.register_autograd(qual, lambda ctx, g: 2 * g)


def _scaled(x: AValue, shape: Any, g: float = 2.0, m: float = 2.0, j: float = 2.0) -> AValue:
    return AValue(exps=x.exps, shape=tuple(shape), growth=x.growth.scale(g), max_abs=x.entry_bound().scale(m),
                  jacobian=x.jacobian.scale(j), rule="planted")


def _switch(it: Any, n: Any, a: Any, shape: Any, j: float) -> AValue:
    """The planted switch's rule: ``|out| <= 3 |x| + 1``, derivative bound ``j`` (3 is sound), marked piecewise."""
    x = a["x"]
    it.piecewise[n.name] = (f"{n.name} (planted switch)",)
    return AValue(exps=x.exps, shape=tuple(shape), growth=x.growth.scale(3.0) + Poly.const(math.sqrt(shape[-1])),
                  max_abs=x.entry_bound().scale(3.0) + Poly.const(1.0), jacobian=x.jacobian.scale(j), rule="planted")


_PLANTED_RULES = {
    "sound": lambda it, n, a, shape: _scaled(a["x"], shape),
    "growth_low": lambda it, n, a, shape: _scaled(a["x"], shape, g=1.5),
    "entries_low": lambda it, n, a, shape: _scaled(a["x"], shape, m=1.5),
    "jacobian_low": lambda it, n, a, shape: _scaled(a["x"], shape, j=1.5),
    "jacobian_low_noad": lambda it, n, a, shape: _scaled(a["x"], shape, j=1.5),
    "sign_wrong": lambda it, n, a, shape: replace(_scaled(a["x"], shape), sign="+"),
    "constant": lambda it, n, a, shape: AValue.constant(it.g.env[n.name]),
    "exponents": lambda it, n, a, shape: replace(_scaled(a["x"], shape), exps=E.Exponents(0.5, 0)),
    "refused": lambda it, n, a, shape: AValue.unknown(shape, "planted", "planted refusal"),
    "step": lambda it, n, a, shape: AValue(exps=E.Exponents(0, 0), shape=tuple(shape),
                                           growth=Poly.const(math.sqrt(shape[-1])), max_abs=Poly.const(1.0),
                                           jacobian=Poly.ZERO, rule="planted"),
    "switch_low": lambda it, n, a, shape: _switch(it, n, a, shape, 2.0),
    "switch_sound": lambda it, n, a, shape: _switch(it, n, a, shape, 3.0),
}


def _planted_ready() -> None:
    if f"{PLANTED}.sound" in registered_rules():
        return
    for name, rule in _PLANTED_RULES.items():
        _double(name, autograd=name != "jacobian_low_noad", integer=name == "step", switch=name.startswith("switch"))
        register_rule(f"{PLANTED}::{name}")(rule)


@pytest.mark.parametrize("kind, check", [("growth_low", "growth"), ("entries_low", "entries"),
                                         ("jacobian_low", "jacobian"), ("jacobian_low_noad", "jacobian"),
                                         ("sign_wrong", "sign"), ("constant", "constant"), ("exponents", "exponents"),
                                         ("switch_low", "jacobian")])
def test_planted_defect_is_found(kind: str, check: str) -> None:
    _planted_ready()
    rep = check_rule(f"{PLANTED}.{kind}", [Sample((X,))], effort=FAST)
    found = [f for f in rep.findings if f.op == f"{PLANTED}.{kind}"]
    assert {f.check for f in found} == {check}, rep.table()
    assert rep.rows[f"{PLANTED}.{kind}"].failed == 1


@pytest.mark.parametrize("kind", ["growth_low", "entries_low", "jacobian_low"])
def test_full_search_reaches_the_worst_case(kind: str) -> None:
    """``2 x`` against a bound ``1.5 x``: the full search finds the largest ratio, 4/3."""
    _planted_ready()
    rep = check_rule(f"{PLANTED}.{kind}", [Sample((X3,))], effort=FULL)
    assert max(f.ratio for f in rep.findings) == pytest.approx(4 / 3, rel=1e-6), rep.table()


def test_sound_rule_passes_and_refusal_is_counted_apart() -> None:
    _planted_ready()
    rep = check_rule(f"{PLANTED}.sound", [Sample((X,)), Sample((X3,))], effort=FULL)
    assert rep.ok, rep.table()
    assert rep.rows[f"{PLANTED}.sound"].checked == 2 and rep.rows[f"{PLANTED}.sound"].failed == 0
    rep = check_rule(f"{PLANTED}.refused", [Sample((X,))], effort=FAST)
    row = rep.rows[f"{PLANTED}.refused"]
    assert rep.ok and (row.checked, row.refused, row.failed) == (0, 1, 0), rep.table()


def test_a_switch_is_checked_by_autograd_products_only() -> None:
    """The planted switch jumps by 1 at 0 (a sample entry sits there): with the sound bound 3 it passes (a difference
    quotient there would read 1/(2h)); with 2 its derivative, -3 on the negative entries, is found at ratio 3/2 by an
    exact product.  An integer step's derivative is 0: any bound holds (the map jumps: no finding either)."""
    _planted_ready()
    x = X.clone()
    x[1, 2] = 0.0
    rep = check_rule(f"{PLANTED}.switch_sound", [Sample((x,)), Sample((X3,))], effort=FULL)
    assert rep.ok and rep.rows[f"{PLANTED}.switch_sound"].checked == 2, rep.table()
    rep = check_rule(f"{PLANTED}.switch_low", [Sample((x,))], effort=FULL)
    found = [f for f in rep.findings if f.op == f"{PLANTED}.switch_low"]
    assert {f.check for f in found} == {"jacobian"} and max(f.ratio for f in found) == pytest.approx(1.5, rel=1e-9)
    assert all("exact" in f.detail for f in found), [f.detail for f in found]
    rep = check_rule(f"{PLANTED}.step", [Sample((x,))], effort=FULL)
    assert rep.ok and rep.rows[f"{PLANTED}.step"].checked == 1, rep.table()


#: Samples whose conditions, masks and indices are computed from the input (the OpInfo samples hold them constant).
SWITCH_SAMPLES = [
    ("aten.where", lambda x: torch.where(x > 0, 2.0 * x + 1.0, torch.tanh(x))),
    ("aten.where", lambda x: torch.where(x.sum(-1, keepdim=True) > 0.5, 10.0, -2.0)),
    ("aten.masked_fill", lambda x: x.masked_fill(x < 0, 3.0)),
    ("aten.gather", lambda x: x.gather(-1, x.argsort(-1).flip(-1))),
    ("aten.gather", lambda x: x.gather(0, x.argmax(0, keepdim=True).expand(2, -1))),
    ("aten.index", lambda x: x[..., x[0].argmax()]),
    ("aten.index", lambda x: x[x[:, 0].argsort()]),
    ("aten.index_select", lambda x: x.index_select(-1, x[0].argsort())),
    ("aten.topk", lambda x: torch.topk(x, 2, dim=-1).values * torch.topk(x, 2, dim=-1).indices),
    ("aten.sort", lambda x: torch.sort(x, dim=0).indices.to(x.dtype) + x),
    ("aten.max", lambda x: x + 10.0 * x.max(-1, keepdim=True).indices.to(x.dtype)),
    ("aten.argmax", lambda x: x * x.argmax(-1, keepdim=True)),
    ("aten.gt", lambda x: (x > 0.5).to(x.dtype) * x),
    ("aten.round", lambda x: torch.round(3.0 * x) * x),
    ("aten.floor", lambda x: torch.floor(x) + torch.sign(x) * x),
    ("aten.embedding", lambda x: torch.nn.functional.embedding(x.argmax(-1), x.new_ones(5, 3)) + x[..., :3]),
]


def test_switches_conform() -> None:
    """The rules of switches on samples whose conditions and indices depend on the input (piecewise values: autograd's
    products, no difference quotient), with the full search: no bound is beaten."""
    samples = [(Sample((X,), fn=fn, label=f"{op} switch {k}"), [op], "hand")
               for k, (op, fn) in enumerate(SWITCH_SAMPLES)]
    rep = check_samples(samples, effort=FULL)
    assert rep.ok and not rep.crashes, rep.table()
    for op, _ in SWITCH_SAMPLES:
        assert rep.rows[op].checked >= 1, rep.table()


def test_variants_make_other_arguments_inputs() -> None:
    c = torch.linspace(0.5, 1.5, 15, dtype=torch.float64).reshape(3, 5)
    rep = check_rule("aten.mul", [Sample((X, c))], effort=Effort(radii=(1.0,), draws=1, ascents=0, variants=5))
    assert rep.samples == 3  # x * c, x * x, x * flip(x)
    assert rep.rows["aten.mul"].reached == 3, rep.table()


def test_the_search_is_deterministic() -> None:
    _planted_ready()
    runs = [check_rule(f"{PLANTED}.jacobian_low", [Sample((X3,))], effort=FAST, seed=3) for _ in range(2)]
    assert [vars(f) for f in runs[0].findings] == [vars(f) for f in runs[1].findings]


def test_the_caller_keeps_its_generators_and_flags() -> None:
    """Loading the OpInfo database and checking samples leave the global random generators and torch's backend
    flags as they were (the database freezes the flags on import; sample functions and random ops draw)."""
    import random

    torch.manual_seed(5)
    random.seed(5)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(5)
    random.seed(5)
    opinfo_samples(["aten.add"], per_opinfo=1, spread=False)
    check_rule("aten.dropout", [Sample((X, 0.5, True))], effort=Effort(radii=(1.0,), draws=1, ascents=0))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert not torch.backends.flags_frozen()


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="op must name a registered rule"):
        check_rule("aten.no_such_op", [Sample((X,))])
    with pytest.raises(TypeError, match="effort must be an Effort"):
        check_samples([(Sample((X,)), ["aten.relu"], "hand")], effort="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Sample.dtype"):
        check_rule("aten.relu", [Sample((X,), dtype=torch.int64)])
    with pytest.raises(ValueError, match="radii"):
        Effort(radii=())
    with pytest.raises(ValueError, match="steps"):
        Effort(steps=-1)
    with pytest.raises(ValueError, match="these have none"):
        run_conformance(["aten.no_such_op"], opinfo=False)


# ---------------------------------------------------------------------------------------------- coverage
def _project_rules() -> List[str]:
    return sorted(k for k in registered_rules() if not k.startswith(PLANTED + "."))


def test_every_rule_has_samples() -> None:
    """A registered rule needs an OpInfo naming it, hand-written samples, or a reason it cannot be reached."""
    named = {op for _, targets, _ in opinfo_samples(per_opinfo=1, spread=False, float32=False) for op in targets}
    rules = _project_rules()
    missing = [op for op in rules if op not in named and not conformance_samples.get(op) and op not in unreachable]
    assert not missing, f"rules without conformance samples (add them to certblocks/testing/conformance_samples.py): " \
                        f"{missing}"
    stale = sorted((set(conformance_samples) | set(unreachable)) - set(rules))
    assert not stale, f"samples or reasons for ops without a rule: {stale}"
    assert not set(conformance_samples) & set(unreachable), "an op both sampled and unreachable"


_FAST: Dict[int, ConformanceReport] = {}


def _chunk(k: int) -> List[str]:
    rules = _project_rules()
    return rules[k * len(rules) // CHUNKS:(k + 1) * len(rules) // CHUNKS]


@pytest.mark.parametrize("k", range(CHUNKS))
def test_fast_subset_conforms(k: int) -> None:
    """The fast subset of chunk ``k``: every rule reached (those named unreachable not), no bound beaten."""
    ops = _chunk(k)
    rep = _FAST[k] = _FAST.get(k) or run_fast(ops)
    problems = [f"{op}: no sample reached its rule ({rep.rows[op].skipped or 'no sample'})" for op in ops
                if op not in unreachable and rep.rows[op].reached == 0]
    problems += [f"{op}: listed as unreachable but a sample reached it" for op in ops
                 if op in unreachable and rep.rows[op].reached]
    problems += [str(f) for f in rep.findings]
    problems += [f"rule raised: {msg} (on {where})" for msg, where in rep.crashes.items()]
    assert not problems, "\n".join(problems) + "\n\n" + rep.table(ops)


def test_cli_prints_the_table_and_writes_json(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "rep.json"
    status = main(["--ops", "aten.relu,aten.tanh", "--effort", "fast", "--json", str(path)])
    out = capsys.readouterr().out
    assert "aten.relu" in out and "checked" in out and "no OpInfo sample reached" in out
    data = json.loads(path.read_text())
    assert data["rows"]["aten.relu"]["checked"] >= 1 and "opinfo" in data["rows"]["aten.relu"]["sources"]
    assert status == (0 if not data["findings"] else 1)


@pytest.mark.slow
def test_whole_sweep_conforms(capsys: Any) -> None:
    """Up to 12 samples of every OpInfo (evenly spread over its float64 and distinct float32 ones: 1775 of 5670,
    every class of failure the complete sweep finds) and every hand-written sample, the FULL search (about 5 minutes
    on one core; ``python -m certblocks.testing.conformance`` sweeps every sample); the coverage table goes to
    stdout."""
    ops = _project_rules()
    rep = run_conformance(ops, effort=FULL, per_opinfo=12)
    with capsys.disabled():
        print("\n" + rep.table(ops))
    unreached = [op for op in ops if op not in unreachable and rep.rows[op].reached == 0]
    assert not unreached, f"rules no sample reached: {unreached}"
    problems = [str(f) for f in rep.findings] + [f"rule raised: {m} (on {w})" for m, w in rep.crashes.items()]
    assert not problems, "\n".join(problems)

"""Every rule declares what it reads of its ops' schemas, and the registry refuses what a rule does not read.

The declarations are checked against ``torch.ops``: every argument of every overload a rule accepts is read,
read through the output's shape, inert, or default-only; every declared overload exists.  A call with a
default-only argument away from its default, or of an overload the rule does not accept, is refused with the
argument and its value named.
"""

from __future__ import annotations

import warnings

import certblocks.kernels.ops  # noqa: F401  (registers certblocks::selective_scan with torch)
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.trace import certify
from certblocks.trace.capture import capture
from certblocks.trace.interp import VelocityInterpreter
from certblocks.trace.rules import check_call, register_rule, registered_rules, rule_for, rule_spec
from certblocks.trace.rules.registry import _RULES, _SPECS, op_packet

RULES = sorted(registered_rules())


@pytest.mark.parametrize("op", RULES)
def test_every_argument_of_every_accepted_overload_is_declared(op):
    spec = rule_spec(op)
    assert spec is not None and spec.fn is rule_for(op) and spec.declared, op
    packet = op_packet(op)
    assert packet is not None, f"{op} has a rule but no torch op"
    accepted = spec.accepted_overloads()
    assert accepted, f"{op}: the rule accepts no overload"
    for ov in accepted:
        assert ov in packet.overloads(), f"{op}: declared overload {ov} does not exist"
        undeclared = spec.undeclared_of(ov)
        assert not undeclared, f"{op}.{ov}: {undeclared} neither read nor declared default-only by {spec.fn.__name__}"
        names = {a.name for a in spec.schema(ov).arguments}
        assert set(spec.reads_of(ov)) | set(spec.default_only_of(ov)) == names


def test_declared_arguments_are_arguments():
    """A declared name that no accepted overload of the op has is a typo (registration also refuses it)."""
    for op in RULES:
        spec = rule_spec(op)
        names = set()
        for ov in spec.accepted_overloads():
            names |= {a.name for a in spec.schema(ov).arguments}
        declared = set(spec.reads) | set(spec.via_shape) | set(spec.default_only)
        # a registration may cover several ops: each name must belong to one of its ops
        siblings = [o for o in RULES if rule_spec(o).fn is spec.fn and rule_spec(o).reads == spec.reads]
        for o in siblings:
            for ov in rule_spec(o).accepted_overloads():
                names |= {a.name for a in rule_spec(o).schema(ov).arguments}
        assert declared <= names, f"{op}: declared {sorted(declared - names)} are no arguments"


def test_registration_refuses_unknown_names_and_overloads():
    with pytest.raises(ValueError, match="not an argument"):
        register_rule("aten.erfc", reads=("self", "alpah"))
    with pytest.raises(ValueError, match="no overload"):
        register_rule("aten.erfc", overloads=("Tensor",), reads=("self",))
    with pytest.raises(ValueError, match="both"):
        register_rule("aten.erfc", reads=("self",), default_only=("self",))
    assert "aten.erfc" not in registered_rules()


def _node(module: nn.Module, x: torch.Tensor, op: str) -> tuple:
    g = capture(module.eval(), (x,))
    nodes = [n for n in g.nodes if n.op == "call_function" and str(n.target).startswith(op)]
    assert nodes, [str(n.target) for n in g.nodes]
    return g, nodes[0]


class AvgPoolOverride(nn.Module):
    def forward(self, x):
        return F.avg_pool2d(x, 2, divisor_override=1)


class CumsumDtype(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=-1, dtype=torch.int64).to(x.dtype)


def test_a_default_only_argument_away_from_its_default_is_refused_by_name():
    """A rule registered with a default-only argument: the call with another value is refused, the argument named,
    and the node is unknown with that reason."""
    key = "aten.erfc"

    @register_rule(key, reads=("self",))
    def erfc_rule(it, n, a, shape):  # pragma: no cover - never called on a refused node
        raise AssertionError("the rule ran on a refused call")

    try:
        class Erfc(nn.Module):
            def forward(self, x):
                return torch.erfc(x)

        g, n = _node(Erfc(), torch.randn(2, 3), key)
        assert check_call(n) is None
        # a declaration that keeps `self` at a default that no call has: every call is refused, `self` named
        _SPECS[key] = type(_SPECS[key])(key, erfc_rule, frozenset(), frozenset(), {"self": None}, None, True)
        why = check_call(n)
        assert why is not None and "argument self=" in why and "erfc" in why, why
        it = VelocityInterpreter(g, g.user_inputs[0], n)
        out = it.run()
        assert out.exps.q is None and "argument self=" in out.bad
    finally:
        _RULES.pop(key, None)
        _SPECS.pop(key, None)


def test_an_overload_not_accepted_is_refused():
    """``view.dtype`` reinterprets the bits: the reshape rule accepts ``view.default`` only."""

    class Bits(nn.Module):
        def forward(self, x):
            return x.view(torch.int32).float()

    g, n = _node(Bits(), torch.randn(2, 4), "aten.view")
    why = check_call(n)
    assert why is not None and "view.dtype" in why and "not accepted" in why
    c = certify(Bits(), torch.randn(2, 4), residual=None)
    assert c.q is None and "view.dtype" in c.culprit


def test_undeclared_user_rule_warns_and_keeps_non_tensor_arguments_at_their_defaults():
    key = "aten.special_entr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        @register_rule(key)
        def entr(it, n, a, shape):  # pragma: no cover
            raise AssertionError

    try:
        assert any("declares no reads=" in str(w.message) for w in caught)
        spec = rule_spec(key)
        assert not spec.declared and spec.kind("default", "self") == "read"
        assert rule_spec("aten.softmax").kind("int", "dtype") == "read"
        # an op with a non-tensor argument without a default: refused until declared
        _SPECS["aten.glu"] = type(spec)("aten.glu", entr, frozenset(), frozenset(), {}, None, False)
        assert _SPECS["aten.glu"].kind("default", "dim") == "default-only"  # glu's dim has a default (-1)

        class Glu(nn.Module):
            def forward(self, x):
                return F.glu(x, dim=0)

        g, n = _node(Glu(), torch.randn(4, 4), "aten.glu")
        why = check_call(n)
        assert why is not None and "argument dim=0" in why
    finally:
        for k in (key, "aten.glu"):
            _RULES.pop(k, None)
            _SPECS.pop(k, None)


@pytest.mark.parametrize("op", ["aten.avg_pool2d", "aten.cumsum", "aten.add", "aten.sum", "aten.group_norm",
                                "aten.softplus", "aten.elu"])
def test_the_arguments_of_the_issue_are_read(op):
    """The arguments reviewers changed (divisor_override, alpha, dtype, affine parameters, beta/threshold,
    input_scale) are read by their rules, not left at a default."""
    spec = rule_spec(op)
    wanted = {"aten.avg_pool2d": "divisor_override", "aten.cumsum": "dtype", "aten.add": "alpha",
              "aten.sum": "dtype", "aten.group_norm": "weight", "aten.softplus": "threshold",
              "aten.elu": "input_scale"}[op]
    assert spec.kind(spec.accepted_overloads()[0], wanted) == "read"


def test_a_builtin_default_only_argument_is_refused_by_name():
    """The attention rule does not read a given dropout mask (``dropout_mask`` is default-only): a call with one
    is refused, the argument and its node named; without one the rule may run."""
    graph = torch.fx.Graph()
    q, k, v, mask = (graph.placeholder(name) for name in ("q", "k", "v", "mask"))
    op = torch.ops.aten._scaled_dot_product_attention_math.default
    with_mask = graph.call_function(op, (q, k, v), {"dropout_mask": mask})
    plain = graph.call_function(op, (q, k, v))
    assert rule_spec("aten._scaled_dot_product_attention_math").kind("default", "dropout_mask") == "default-only"
    why = check_call(with_mask)
    assert why is not None and "argument dropout_mask=mask" in why and "differs from None" in why, why
    assert check_call(plain) is None

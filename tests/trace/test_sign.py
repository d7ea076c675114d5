"""Sign analysis behind ``exp``: property tests on random expression trees.

The tracer bounds ``exp(g)`` only when it proves ``g <= 0``.  For random expressions built from
softplus, ReLU, exp, squares, negation, products, sums and ``x - max(x)``, the sign the tracer
claims must hold on random inputs, and ``exp`` of the expression is derived exactly when the
claimed sign is ``<= 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from certblocks.trace import certify
from certblocks.trace.capture import capture
from certblocks.trace.interp import VelocityInterpreter

D = 4
W = torch.randn(D, D, generator=torch.Generator().manual_seed(0))

leaves = st.sampled_from(["x", "lin", "pos_const", "neg_const"])


def _extend(children):
    unary = st.tuples(st.sampled_from(["relu", "softplus", "neg", "square", "exp", "sigmoid", "tanh", "shift_max"]),
                      children)
    binary = st.tuples(st.sampled_from(["mul", "add", "sub"]), children, children)
    return unary | binary


exprs = st.recursive(leaves, _extend, max_leaves=5)


def evaluate(e, x):
    if isinstance(e, str):
        if e == "x":
            return x
        if e == "lin":
            return x @ W
        if e == "pos_const":
            return torch.full_like(x, 0.5)
        return torch.full_like(x, -0.5)
    op = e[0]
    if op == "relu":
        return F.relu(evaluate(e[1], x))
    if op == "softplus":
        return F.softplus(evaluate(e[1], x))
    if op == "neg":
        return -evaluate(e[1], x)
    if op == "square":
        a = evaluate(e[1], x)
        return a * a
    if op == "exp":
        return torch.exp(-F.softplus(evaluate(e[1], x)))  # always a valid bounded exp
    if op == "sigmoid":
        return torch.sigmoid(evaluate(e[1], x))
    if op == "tanh":
        return torch.tanh(evaluate(e[1], x))
    if op == "shift_max":
        a = evaluate(e[1], x)
        return a - a.amax(-1, keepdim=True)
    a, b = evaluate(e[1], x), evaluate(e[2], x)
    return {"mul": a * b, "add": a + b, "sub": a - b}[op]


class Expr(nn.Module):
    def __init__(self, e, wrap_exp: bool = False) -> None:
        super().__init__()
        self.e, self.wrap_exp = e, wrap_exp

    def forward(self, x):
        g = evaluate(self.e, x)
        return torch.exp(g) if self.wrap_exp else g


def claimed_sign(e):
    x = torch.randn(2, 3, D)
    g = capture(Expr(e), (x,))
    out = g.outputs[0]
    if out.name not in g.between(g.user_inputs[0], out):
        return "const"
    it = VelocityInterpreter(g, g.user_inputs[0], out)
    v = it.run()
    return "const" if v.const else v.sign


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(exprs)
def test_claimed_sign_holds_on_samples(e):
    s = claimed_sign(e)
    if s in (None, "const"):
        return
    gen = torch.Generator().manual_seed(1)
    for scale in (0.1, 1.0, 10.0):
        v = evaluate(e, torch.randn(64, 3, D, generator=gen) * scale)
        if s == "+":
            assert bool((v >= 0).all()), e
        elif s == "-":
            assert bool((v <= 0).all()), e
        else:
            assert bool((v == 0).all()), e


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(exprs)
def test_exp_derived_iff_nonpositive(e):
    s = claimed_sign(e)
    if s == "const":
        return
    c = certify(Expr(e, wrap_exp=True), torch.randn(2, 3, D), residual=None)
    if s in ("-", "0"):
        assert c.exponents.known, (e, c.explain())
        assert c.q == 0
    else:
        assert c.q is None and c.culprit_node.startswith("exp"), (e, s, c.culprit)


def test_known_nonpositive_patterns():
    cases = {
        "neg_softplus": ("neg", ("softplus", "lin")),
        "neg_relu": ("neg", ("relu", "lin")),
        "neg_square": ("neg", ("square", "lin")),
        "shift_max": ("shift_max", "lin"),
        "softplus_times_negative": ("mul", ("softplus", "lin"), "neg_const"),
        "relu_minus_positive": ("sub", ("neg", ("relu", "x")), ("exp", "lin")),
    }
    for name, e in cases.items():
        assert claimed_sign(e) == "-", name
        c = certify(Expr(e, wrap_exp=True), torch.randn(2, 3, D), residual=None)
        assert c.q == 0, (name, c.explain())


def test_unknown_sign_patterns():
    for e in ["lin", ("sub", ("relu", "x"), ("relu", "lin")), ("mul", "lin", ("softplus", "x")), ("tanh", "x")]:
        assert claimed_sign(e) is None, e

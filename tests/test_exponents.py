"""The exponent algebra (docs/theory.md section 2): rules, reference values, properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from certblocks import exponents as ex
from certblocks.exponents import Exponents, add, compose, normalize, power, product, residual

# Exponents on a grid of halves keep float arithmetic exact, so equalities are exact.
halves = st.integers(min_value=0, max_value=16).map(lambda k: k / 2)
exps = st.builds(Exponents, halves, halves)
maybe = st.one_of(st.none(), halves)
partial = st.builds(Exponents, maybe, maybe)


def matmul(a, b):
    return tuple(tuple(sum(a[i][k] * b[k][j] for k in range(2)) for j in range(2)) for i in range(2))


# ----------------------------------------------------------------------------- value type

def test_exponents_is_a_frozen_pair():
    x = Exponents(1, 2)
    q, sigma = x
    assert (q, sigma) == (1.0, 2.0)
    assert x == Exponents(1.0, 2.0) and hash(x) == hash(Exponents(1.0, 2.0))
    with pytest.raises(AttributeError):
        x.q = 3  # type: ignore[misc]
    assert str(x) == "(q=1, sigma=2)" and repr(UNKNOWN := ex.UNKNOWN) == "Exponents(q=?, sigma=?)"
    assert not UNKNOWN.known and x.known


@pytest.mark.parametrize("q, sigma, arg", [(-1, 0, "q"), (0, -0.5, "sigma"), (math.nan, 0, "q"), (math.inf, 0, "q"),
                                           (0, math.nan, "sigma")])
def test_invalid_exponents_name_the_argument(q, sigma, arg):
    with pytest.raises(ValueError, match=rf"^{arg} must be a finite number >= 0"):
        Exponents(q, sigma)


def test_non_numbers_are_type_errors():
    with pytest.raises(TypeError, match="q must be a real number"):
        Exponents("1", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sigma must be a real number"):
        Exponents(1, True)  # type: ignore[arg-type]


def test_power_needs_p_at_least_one():
    assert power(2) == Exponents(2, 1) and power(3) == Exponents(3, 2) and power(1) == Exponents(1, 0)
    with pytest.raises(ValueError, match="power"):
        power(0.5)


# ----------------------------------------------------------------------------- reference derivations

def test_theory_table_of_derived_blocks():
    affine, lip, sat = ex.AFFINE, ex.LIPSCHITZ, ex.SATURATING
    mlp = compose(affine, compose(lip, affine))
    assert mlp == Exponents(1, 0)
    assert compose(ex.ATTENTION, ex.NORM) == Exponents(0, 0)  # pre-normalization
    swiglu = compose(affine, product(affine, compose(lip, affine)))
    assert swiglu == Exponents(2, 1)
    sigmoid_glu = compose(affine, product(affine, compose(sat, affine)))
    assert sigmoid_glu == Exponents(1, 1)
    # softmax(QK^T) V: the logits are a product of two affine maps; softmax of them is bounded with
    # sigma = sigma_logits; times V (affine) by the product rule.
    logits = product(affine, affine)
    assert logits == ex.QK_LOGITS
    attention = product(compose(ex.SOFTMAX, logits), affine)
    assert attention == ex.ATTENTION == Exponents(1, 2)
    qk_norm_logits = product(normalize(affine), normalize(affine))
    assert product(compose(ex.SOFTMAX, qk_norm_logits), affine) == ex.QK_NORM_ATTENTION == Exponents(1, 1)
    assert product(affine, affine) == power(2) == Exponents(2, 1)  # entrywise square
    assert compose(ex.NORM, swiglu) == Exponents(0, 1) == normalize(swiglu)
    assert residual(Exponents(0, 0)) == Exponents(1, 0) and residual(Exponents(2, 1)) == Exponents(2, 1)


def test_mamba_derivation_reaches_q5_and_linear_growth_reaches_q1():
    affine, lip, sat = ex.AFFINE, ex.LIPSCHITZ, ex.SATURATING
    x = compose(lip, affine)  # x = SiLU(conv(W_in u))
    delta = compose(lip, compose(affine, x))  # softplus(W_dt x)
    B = compose(affine, x)
    C = compose(affine, x)
    abar = ex.exp_of_nonpositive(product(delta, ex.CONSTANT))  # exp(delta * A), A < 0
    bbar = product(delta, B)
    h = add(product(abar, x), product(bbar, x))  # one step of the recurrence, state entering at the same q
    y = product(C, h)
    out = compose(affine, product(y, compose(lip, affine)))  # gate y * SiLU(z)
    assert out.q == 5 and 4 <= out.sigma <= 5

    xn = normalize(x)  # the parameter branch sees x / ||x||
    delta, B, C = compose(lip, compose(affine, xn)), compose(affine, xn), compose(affine, xn)
    abar = ex.exp_of_nonpositive(product(delta, ex.CONSTANT))
    h = add(product(abar, x), product(product(delta, B), x))
    y = product(C, h)
    out = compose(affine, product(y, compose(sat, affine)))  # sigmoid gate
    assert out == ex.LINEAR_GROWTH_MAMBA == Exponents(1, 1)


def test_unknown_propagates_but_a_bounded_outer_map_keeps_q():
    u = ex.UNKNOWN
    assert compose(ex.AFFINE, u) == u
    assert product(u, ex.AFFINE) == u and add(u, ex.AFFINE) == u
    assert compose(ex.NORM, u) == Exponents(0, None)  # normalized output is bounded whatever the input
    assert residual(u) == u
    assert compose(u, ex.NORM) == u  # an unknown map of a bounded input is still unknown
    assert ex.exp_of_nonpositive(Exponents(None, 1)) == Exponents(0, 1)


def test_operations_need_operands():
    with pytest.raises(ValueError):
        add()
    with pytest.raises(ValueError):
        product()
    with pytest.raises(TypeError):
        compose((1, 2, 3), ex.AFFINE)  # type: ignore[arg-type]
    assert compose((2, 1), (1, 0)) == Exponents(2, 1)  # plain pairs are accepted


# ----------------------------------------------------------------------------- properties

@given(exps, exps, exps)
def test_compose_is_associative(a, b, c):
    assert compose(a, compose(b, c)) == compose(compose(a, b), c)


@given(exps, exps)
def test_compose_is_the_matrix_product(a, b):
    # outer o inner is the product inner.matrix() @ outer.matrix()
    assert compose(a, b).matrix() == matmul(b.matrix(), a.matrix())


@given(exps, exps, exps)
def test_add_and_product_are_associative(a, b, c):
    assert add(a, add(b, c)) == add(add(a, b), c) == add(a, b, c)
    assert product(a, product(b, c)) == product(product(a, b), c) == product(a, b, c)


@given(exps, exps)
def test_add_and_product_are_commutative(a, b):
    assert add(a, b) == add(b, a)
    assert product(a, b) == product(b, a)


@given(exps, exps, exps, halves, halves)
def test_rules_are_monotone(a, b, c, dq, ds):
    bigger = Exponents(a.q + dq, a.sigma + ds)
    assert a <= bigger
    assert compose(a, c) <= compose(bigger, c)
    assert compose(c, a) <= compose(c, bigger)
    assert add(a, b) <= add(bigger, b)
    assert product(a, b) <= product(bigger, b)
    assert residual(a) <= residual(bigger)
    assert normalize(a) <= normalize(bigger)


@given(partial, partial)
def test_unknown_results_only_from_unknown_operands(a, b):
    for result in (compose(a, b), add(a, b), product(a, b)):
        if a.known and b.known:
            assert result.known


@given(exps, exps)
def test_product_dominates_its_factors_and_the_sum(a, b):
    p = product(a, b)
    assert p.q == a.q + b.q
    assert add(a, b) <= p

"""Depth budgets: reference values, exact boundaries, closed forms, validation."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from certblocks import budget
from certblocks.budget import (
    UpdateCoefficients,
    backward_overflow_depth,
    float_max,
    forward_overflow_depth,
    forward_radii,
    jacobian_budget,
    radius_closed_form,
    scan_stack,
)

# ----------------------------------------------------------------------------- dtype limits


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
                                         ("fp64", torch.float64), ("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8_e5m2", torch.float8_e5m2)])
def test_float_max_is_exact(name, dtype):
    assert float_max(name) == torch.finfo(dtype).max == float_max(dtype)


def test_float_max_reference_values():
    assert float_max("fp16") == 65504 and float_max("fp8_e4m3") == 448 and float_max("fp8_e5m2") == 57344
    assert float_max("float16") == float_max("half") == 65504
    assert float_max("bfloat16") == float_max("bf16")


@pytest.mark.parametrize("bad", ["fp12", "int8", "", torch.int32])
def test_unknown_dtype_names_allowed_values(bad):
    with pytest.raises(ValueError, match="allowed: .*fp16.*"):
        float_max(bad)


def test_non_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="dtype must be"):
        float_max(3.0)


# ----------------------------------------------------------------------------- reference numbers (paper Table 4)


def test_uniform_budget_reference_values():
    assert jacobian_budget(24, "fp32") == pytest.approx(39.3, abs=0.05)
    assert jacobian_budget(96, "fp32") == pytest.approx(1.52, abs=0.005)
    assert jacobian_budget(24, torch.float32, dt=0.5) == pytest.approx(2 * jacobian_budget(24, "fp32"))


@pytest.mark.parametrize("q, expected", [(0, (65503, None, None)), (0.5, (513, None, None)), (1, (16, 128, 1024)),
                                         (2, (5, 8, 11)), (5, (3, 5, 6))])
def test_forward_overflow_depths_table4(q, expected):
    for dtype, want in zip(("fp16", "fp32", "fp64"), expected):
        got = forward_overflow_depth(q, 1.0, 0.0, dtype)
        if want is not None:
            assert got.depth == want and got.exact, (q, dtype, got)


def test_q0_depths_are_exact_ints_of_any_size():
    o = forward_overflow_depth(0, 1.0, 0.0, "fp64")
    assert isinstance(o.depth, int) and o.exact
    assert o.depth == int(Fraction(float_max("fp64"))) - 1  # R_D = 1 + D reaches M at D = M - 1
    assert forward_overflow_depth(0, 1.0, 0.0, "fp32").depth == int(Fraction(float_max("fp32"))) - 1


def test_q_half_beyond_the_recursion_uses_the_closed_form_bound():
    o = forward_overflow_depth(0.5, 1.0, 0.0, "fp32")
    assert not o.exact
    assert float(o.depth) == pytest.approx(3.7e19, rel=0.01)  # paper Table 4
    o64 = forward_overflow_depth(0.5, 1.0, 0.0, "fp64")
    assert float(o64.depth) == pytest.approx(2.7e154, rel=0.01)


@pytest.mark.parametrize("L, expected", [(0.5, (28, 219, 1751)), (1.0, (16, 128, 1024)), (2.0, (11, 81, 647))])
def test_backward_overflow_depths_table4(L, expected):
    for dtype, want in zip(("fp16", "fp32", "fp64"), expected):
        got = backward_overflow_depth(1, 0, 1.0, 0.0, 0.0, L, dtype)
        assert got.depth == want and got.exact
        assert got.depth == math.ceil(math.log(float_max(dtype)) / math.log1p(L)) or dtype == "fp64"


def test_q1_sigma2_backward_depth_is_about_eleven_in_fp32():
    o = backward_overflow_depth(1, 2, 1.0, 0.0, 1.0, 0.0, "fp32")
    assert o.depth - 1 == 11  # certified D_grad
    # the asymptotic reading sqrt(2 log M / (sigma log(1 + c dt))) is 11.3
    assert math.sqrt(2 * math.log(float_max("fp32")) / (2 * math.log(2))) == pytest.approx(11.3, abs=0.05)


def test_fp64_boundary_is_1024_not_1025():
    # 2^1024 exceeds the fp64 maximum by less than one part in 2^53: double logarithms get this wrong.
    assert math.log2(float_max("fp64")) == 1024.0  # a double logarithm cannot tell M from 2^1024
    assert forward_overflow_depth(1, 1.0, 0.0, "fp64").depth == 1024
    assert backward_overflow_depth(1, 0, 1.0, 0.0, 0.0, 1.0, "fp64").depth == 1024
    scan = scan_stack([UpdateCoefficients(1, 0, 1.0, 0.0, 0.0, 1.0)] * 1100, float_max("fp64"))
    assert scan.forward_overflow == 1024 and scan.backward_overflow == 1024


# ----------------------------------------------------------------------------- exactness against rational twins


def _cap(q: int) -> int:
    # dyadic denominators square at every step when q = 2: keep the exact twin's numbers small
    return 400 if q <= 1 else 12


def exact_forward(q: int, c: Fraction, b: Fraction, dt: Fraction, r0: Fraction, M: Fraction):
    cap = _cap(q)
    R = r0
    for k in range(cap):
        R = R + dt * (c * R**q + b)
        if R >= M:
            return k + 1
    return None


def exact_backward(q: int, sigma: int, c, b, l1, l0, dt, r0, lip_g, M):
    cap = _cap(max(q, sigma))
    R, prod = r0, lip_g
    for k in range(cap):
        prod *= 1 + dt * (l1 * max(R, Fraction(1)) ** sigma + l0)
        if prod >= M:
            return k + 1
        R = R + dt * (c * R**q + b)
    return None


dyadic = st.integers(min_value=0, max_value=64).map(lambda k: k / 32)


@settings(max_examples=120, deadline=None)
@given(q=st.sampled_from([0, 1, 2]), c=dyadic, b=dyadic, dt=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
       r0=dyadic, dtype=st.sampled_from(["fp16", "fp8_e4m3", "bf16"]))
def test_forward_depth_equals_exact_rational_recursion(q, c, b, dt, r0, dtype):
    M = float_max(dtype)
    want = exact_forward(q, Fraction(c), Fraction(b), Fraction(dt), Fraction(r0), Fraction(M))
    got = forward_overflow_depth(q, c, b, dtype, dt=dt, r0=r0).depth
    if want is None:
        assert got > _cap(q)
    else:
        assert got == want


@settings(max_examples=120, deadline=None)
@given(q=st.sampled_from([0, 1, 2]), sigma=st.sampled_from([0, 1, 2]), c=dyadic, b=dyadic, l1=dyadic, l0=dyadic,
       dt=st.sampled_from([0.5, 1.0]), r0=dyadic, lip_g=st.sampled_from([0.5, 1.0, 4.0]),
       dtype=st.sampled_from(["fp16", "fp8_e5m2", "fp32"]))
def test_backward_depth_equals_exact_rational_product(q, sigma, c, b, l1, l0, dt, r0, lip_g, dtype):
    M = float_max(dtype)
    F = Fraction
    want = exact_backward(q, sigma, F(c), F(b), F(l1), F(l0), F(dt), F(r0), F(lip_g), F(M))
    got = backward_overflow_depth(q, sigma, c, b, l1, l0, dtype, dt=dt, r0=r0, lip_g=lip_g).depth
    if want is None:
        assert got > _cap(max(q, sigma))
    else:
        assert got == want


def test_scan_stack_equals_rational_twin_on_heterogeneous_stacks():
    rng = random.Random(7)
    M = float_max("fp16")
    for _ in range(60):
        n = rng.randint(1, 40)
        ups = [UpdateCoefficients(rng.choice([0, 1, 1, 2]), rng.choice([0, 1, 2]), rng.randint(0, 48) / 32,
                                  rng.randint(0, 8) / 32, rng.randint(0, 16) / 32, rng.randint(0, 32) / 32)
               for _ in range(n)]
        scan = scan_stack(ups, M, dt=0.5, r0=1.0)
        R, prod, fwd, bwd, steps = Fraction(1), Fraction(1), None, None, 0
        for k, u in enumerate(ups):
            if R.denominator.bit_length() > 4096:  # keep the exact twin cheap: compare the prefix only
                break
            prod *= 1 + Fraction(1, 2) * (Fraction(u.l1) * max(R, Fraction(1)) ** int(u.sigma) + Fraction(u.l0))
            if bwd is None and prod >= M:
                bwd = k + 1
            R = R + Fraction(1, 2) * (Fraction(u.c) * R ** int(u.q) + Fraction(u.b))
            assert scan.radii[k + 1] >= R  # the reported radii are upper bounds
            if fwd is None and R >= M:
                fwd = k + 1
            steps = k + 1
        for got, want in ((scan.forward_overflow, fwd), (scan.backward_overflow, bwd)):
            if want is not None:
                assert got == want
            else:
                assert got is None or got > steps


def test_exact_tie_counts_as_reaching():
    # R_D = 1 + D * 0.5 reaches 448 exactly at D = 894: "reaches" includes equality.
    assert forward_overflow_depth(0, 0.5, 0.0, "fp8_e4m3").depth == 894
    scan = scan_stack([UpdateCoefficients(0, 0, 0.5, 0.0, 0.0, 0.0)] * 900, 448.0)
    assert scan.forward_overflow == 894


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("c, b", [(1.0, 0.0), (0.3, 0.2), (0.05, 1.0)])
def test_closed_forms_bound_the_recursion(q, c, b):
    D = 30 if q <= 1 else 6
    radii = forward_radii([(q, c, b)] * D, dt=0.5, r0=1.5)
    for d in range(D + 1):
        assert radius_closed_form(q, c, b, d, dt=0.5, r0=1.5) >= radii[d] * (1 - 1e-12)


def test_q1_closed_form_is_exact():
    radii = forward_radii([(1.0, 0.5, 0.25)] * 20, dt=1.0, r0=2.0)
    for d in range(21):
        assert radius_closed_form(1.0, 0.5, 0.25, d, dt=1.0, r0=2.0) == pytest.approx(radii[d], rel=1e-12)


def test_long_recursions_fall_back_to_sound_lower_bounds():
    # tiny coefficients: the recursion would run far past MAX_STEPS
    for q in (0.5, 1.5, 2.0):
        o = forward_overflow_depth(q, 1e-7, 0.0, "fp16")
        assert not o.exact and o.depth > budget.MAX_STEPS
    o = backward_overflow_depth(0.5, 1.0, 1e-6, 0.0, 1e-6, 1e-6, "fp16")
    assert not o.exact and o.depth > budget.MAX_STEPS


def test_lower_bounds_are_below_the_exact_depth():
    # With MAX_STEPS lowered, the closed-form tail must not overshoot the exact crossing.
    saved = budget.MAX_STEPS
    try:
        exact = {q: forward_overflow_depth(q, 0.01, 0.0, "fp16").depth for q in (0.5, 1.5, 2.0)}
        exact_b = backward_overflow_depth(0.5, 1.0, 0.01, 0.0, 0.01, 0.01, "fp16").depth
        budget.MAX_STEPS = 50
        for q, want in exact.items():
            o = forward_overflow_depth(q, 0.01, 0.0, "fp16")
            assert not o.exact and o.depth <= want, (q, o, want)
            assert o.depth >= 0.5 * want  # and still informative
        o = backward_overflow_depth(0.5, 1.0, 0.01, 0.0, 0.01, 0.01, "fp16")
        assert not o.exact and o.depth <= exact_b
    finally:
        budget.MAX_STEPS = saved


def test_never_overflowing_bounds_report_infinity():
    assert forward_overflow_depth(1, 0.0, 0.0, "fp16").depth == math.inf
    assert forward_overflow_depth(2, 1.0, 0.0, "fp16", r0=0.0).depth == math.inf
    assert backward_overflow_depth(1, 0, 1.0, 0.0, 0.0, 0.0, "fp16").depth == math.inf


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, arg", [
    (dict(q=-1.0), "q"), (dict(c=-0.1), "c"), (dict(b=math.nan), "b"), (dict(dt=0.0), "dt"), (dict(r0=-1.0), "r0"),
    (dict(q=math.inf), "q"), (dict(r0=1e6), "r0"),
])
def test_forward_validation_names_the_argument(kwargs, arg):
    args = dict(q=1.0, c=1.0, b=0.0, dtype="fp16")
    args.update(kwargs)
    q, c, b, dtype = args.pop("q"), args.pop("c"), args.pop("b"), args.pop("dtype")
    with pytest.raises(ValueError, match=rf"^{arg} must be"):
        forward_overflow_depth(q, c, b, dtype, **args)


@pytest.mark.parametrize("kwargs, arg", [(dict(sigma=-1.0), "sigma"), (dict(l1=-1.0), "l1"), (dict(l0=math.nan), "l0"),
                                         (dict(lip_g=0.0), "lip_g"), (dict(lip_g=1e9), "lip_g")])
def test_backward_validation_names_the_argument(kwargs, arg):
    args = dict(q=1.0, sigma=1.0, c=1.0, b=0.0, l1=1.0, l0=1.0)
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k == "lip_g"}
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{arg} must be"):
        backward_overflow_depth(*args.values(), "fp16", **extra)


@pytest.mark.parametrize("depth", [0, -3])
def test_budget_rejects_nonpositive_depth(depth):
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        jacobian_budget(depth, "fp32")


def test_budget_rejects_non_int_depth():
    with pytest.raises(TypeError, match="depth must be an int"):
        jacobian_budget(2.5, "fp32")  # type: ignore[arg-type]


def test_long_stacks_and_fp64_answer():
    # Functional check on long stacks (closed forms, no pathological iteration); the timings are measured in
    # benchmarks/bench_budget.py (benchmarks/results/certification_time.md), never asserted here.
    ups = [UpdateCoefficients(1, 1, 1e-3, 0.0, 1e-3, 1e-3)] * 10_000
    scan = scan_stack(ups, float_max("bf16"))
    assert len(scan.radii) == 10_001
    for q in (0, 0.5, 1, 2, 5):
        forward_overflow_depth(q, 1.0, 0.0, "fp64")
        backward_overflow_depth(q, 2.0, 1.0, 0.0, 1.0, 1.0, "fp64")


def test_tiny_rates_give_exact_huge_depths():
    import mpmath

    c = 1e-300
    D = forward_overflow_depth(1, c, 0.0, "fp64").depth
    G = backward_overflow_depth(1, 0, 1.0, 0.0, 0.0, 1e-200, "fp16").depth
    assert isinstance(D, int) and D > 10**302
    with mpmath.workprec(D.bit_length() + 1200):  # enough bits to hold 1 + 1e-300 exactly
        base, M = 1 + mpmath.mpf(c), mpmath.mpf(float_max("fp64"))
        assert base**D >= M > base ** (D - 1)
        base, M = 1 + mpmath.mpf(1e-200), mpmath.mpf(float_max("fp16"))
        assert base**G >= M > base ** (G - 1)


# ----------------------------------------------------------------------------- intermediates (peaks)


def exact_forward_with_peak(q, c, b, pq, pc, pb, dt, r0, M, cap):
    """First D at which the state R_D or the intermediate bound P(R_{D-1}) reaches M (rationals)."""
    R = r0
    for k in range(cap):
        if pc * R**pq + pb >= M:
            return k + 1
        R = R + dt * (c * R**q + b)
        if R >= M:
            return k + 1
    return None


@settings(max_examples=150, deadline=None)
@given(q=st.sampled_from([0, 1, 2]), c=dyadic, b=dyadic, pq=st.sampled_from([0, 1, 2, 3]),
       pc=st.integers(min_value=0, max_value=4096).map(lambda k: k / 16), pb=dyadic,
       dt=st.sampled_from([0.25, 0.5, 1.0]), r0=dyadic, dtype=st.sampled_from(["fp16", "fp8_e4m3", "bf16"]))
def test_forward_depth_with_peak_equals_exact_rational_recursion(q, c, b, pq, pc, pb, dt, r0, dtype):
    M = float_max(dtype)
    F = Fraction
    want = exact_forward_with_peak(q, F(c), F(b), pq, F(pc), F(pb), F(dt), F(r0), F(M), _cap(q))
    got = forward_overflow_depth(q, c, b, dtype, dt=dt, r0=r0, peak=(pq, pc, pb))
    plain = forward_overflow_depth(q, c, b, dtype, dt=dt, r0=r0)
    assert got.depth <= plain.depth  # a peak can only lower the depth
    if want is None:
        assert got.depth > _cap(q)
    else:
        assert got.depth == want and got.exact


def test_peak_of_attention_logits_sets_the_depth_exactly():
    # q = 1 state (R_k = 3^k r0) with logits kappa R^2: in bf16 the logits reach M about half-way to the state.
    M = Fraction(float_max("bf16"))
    kappa = 0.75
    got = forward_overflow_depth(1, 2.0, 0.0, "bf16", r0=100.0, peak=(2, kappa, 0.0))
    j = 0
    while Fraction(kappa) * (100 * Fraction(3) ** j) ** 2 < M:
        j += 1
    assert got.depth == j + 1 and got.exact
    assert got.depth < forward_overflow_depth(1, 2.0, 0.0, "bf16", r0=100.0).depth
    # huge depths (tiny growth rates, fp64) are still exact: the bisection runs on the closed form
    big = forward_overflow_depth(1, 1e-12, 0.0, "fp64", peak=(2, 1.0, 0.0))
    R = lambda D: mpmath.mpf(1) * mpmath.exp(D * mpmath.log1p(mpmath.mpf(1e-12)))  # noqa: E731
    with mpmath.workprec(400):
        assert R(big.depth - 1) ** 2 >= mpmath.mpf(float_max("fp64")) > R(big.depth - 2) ** 2


def test_peak_ties_count_as_reaching():
    # R_j = 1 + j; P(R) = 7 R^2 reaches M = 448 = 7 * 8^2 exactly at R_7 = 8: overflow at D = 8.
    assert forward_overflow_depth(0, 1.0, 0.0, "fp8_e4m3", peak=(2, 7.0, 0.0)).depth == 8
    assert forward_overflow_depth(0, 1.0, 0.0, "fp8_e4m3", peak=(2, 6.999, 0.0)).depth == 9


def test_peak_past_the_recursion_gives_a_sound_lower_bound():
    # q = 3/2 with a small coefficient runs past MAX_STEPS; the intermediate (a large multiple of R) binds first.
    got = forward_overflow_depth(1.5, 2e-5, 0.0, "fp16", peak=(1, 1e3, 0.0))
    assert not got.exact and got.depth > budget.MAX_STEPS
    R, D = 1.0, 0
    while True:  # the crossing by brute force (about 90,000 steps; float rounding is far below the slack)
        D += 1
        if 1000 * R >= 65504:
            break
        R = R + 2e-5 * R**1.5
    assert budget.MAX_STEPS < got.depth <= D
    assert got.depth < forward_overflow_depth(1.5, 2e-5, 0.0, "fp16").depth


def test_scan_stack_checks_each_updates_peak_at_its_input_radius():
    rng = random.Random(11)
    M = float_max("fp16")
    F = Fraction
    for _ in range(80):
        n = rng.randint(1, 30)
        ups = []
        for _ in range(n):
            pq = rng.choice([None, 0, 1, 2])
            ups.append(UpdateCoefficients(rng.choice([0, 1, 1]), 0, rng.randint(0, 48) / 32, rng.randint(0, 8) / 32,
                                          0.0, 1.0, pq, rng.randint(0, 4096) / 16 if pq is not None else 0.0,
                                          rng.randint(0, 64) / 4 if pq is not None else 0.0))
        scan = scan_stack(ups, M, dt=0.5, r0=1.0)
        R, fwd, inter = F(1), None, False
        for k, u in enumerate(ups):
            if u.pq is not None and F(u.pc) * R ** int(u.pq) + F(u.pb) >= M:
                fwd, inter = k + 1, True
                break
            R = R + F(1, 2) * (F(u.c) * R ** int(u.q) + F(u.b))
            if R >= M:
                fwd = k + 1
                break
        assert scan.forward_overflow == fwd
        assert scan.forward_intermediate == inter

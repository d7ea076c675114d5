"""Chains of segments (docs/theory.md section 6): maps between updates, the costate at every boundary, the head.

The exact twins: forward radii in rational arithmetic (q in {0, 1}), the backward condition in 200-digit
arithmetic over every boundary j <= D, against :func:`certify_stack`'s depths on random chains.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import mpmath
import pytest

from certblocks.budget import DTYPE_MAX
from certblocks.certificate import BlockCertificate, Peak, certify_stack, cross_entropy_gradient

M16 = DTYPE_MAX["fp16"]


def _map(c: float, b: float = 0.0, l0: float | None = None, name: str = "m", **kw) -> BlockCertificate:
    return BlockCertificate(1.0, 0.0, c=c, b=b, l1=0.0, l0=c if l0 is None else l0, name=name, kind="map", **kw)


def _upd(c: float, b: float, l0: float, name: str = "u", **kw) -> BlockCertificate:
    return BlockCertificate(1.0, 0.0, c=c, b=b, l1=0.0, l0=l0, name=name, **kw)


def test_map_boundary_is_exact():
    # R_1 = c * r0 reaches M exactly at c = M (r0 = 1): certified below, refused at
    ok = certify_stack([_upd(0.0, 0.0, 0.0), _map(M16 - 1, l0=1.0), _upd(0.0, 0.0, 0.0)], "fp16")
    bad = certify_stack([_upd(0.0, 0.0, 0.0), _map(M16, l0=1.0), _upd(0.0, 0.0, 0.0)], "fp16")
    assert ok.ok and ok.certified_depth == 2 and ok.depth == 2
    assert not bad.ok and bad.certified_depth == 1
    f = bad.first_failure
    assert f.index == 1 and f.segment == "map" and f.kind == "forward" and "not certified at any depth" in f.reason
    assert "map" in f.fix and "operator norm" in f.fix


def test_map_does_not_take_dt_and_is_not_counted():
    chain = [_upd(1.0, 0.0, 1.0), _map(2.0), _upd(1.0, 0.0, 1.0)]
    st = certify_stack(chain, "fp32", dt=0.5, r0=1.0)
    assert st.depth == 2 and len(st.updates) == 3
    assert st.radii[1] == pytest.approx(1.5) and st.radii[2] == pytest.approx(3.0) and st.radii[3] == pytest.approx(4.5)
    assert st.log_factors[1] == pytest.approx(math.log(2.0))
    with pytest.raises(ValueError, match="certify_stack"):
        _map(2.0).depths("fp16")


def test_contracting_map_checks_the_costate_at_every_boundary():
    # factors: update e^5 then a map 1e-6: the prefix sum drops below log M, the costate after the update does not
    big = math.e**5 - 1
    chain = [_upd(0.0, 0.0, big), _upd(0.0, 0.0, big), _upd(0.0, 0.0, big), _map(1e-6, l0=1e-6)]
    st = certify_stack(chain, "fp16")
    assert math.fsum(st.log_factors) < math.log(M16)  # the sum over the whole chain is small
    assert not st.ok and st.first_failure.kind == "backward" and st.first_failure.index == 2


def _twin(chain, M, dt, r0, lip_g):
    """Exact certified depth (counted in updates): rationals forward (q in {0, 1}), 200 digits backward."""
    R = Fraction(r0)
    radii = [R]
    for u in chain:
        g = Fraction(u.c) * (R if u.q == 1 else 1) + Fraction(u.b)
        R = R + Fraction(dt) * g if u.kind == "update" else g
        radii.append(R)
    with mpmath.workdps(200):
        budget = mpmath.log(mpmath.mpf(M)) - mpmath.log(mpmath.mpf(lip_g))
        prefix = [mpmath.mpf(0)]
        for k, u in enumerate(chain):
            L = mpmath.mpf(u.l1) * max(mpmath.mpf(radii[k].numerator) / radii[k].denominator, 1) ** u.sigma + u.l0
            f = mpmath.log1p(mpmath.mpf(dt) * L) if u.kind == "update" else mpmath.log(L)
            prefix.append(prefix[-1] + f)
        for k in range(len(chain)):
            state = radii[k + 1] >= Fraction(M)
            back = prefix[k + 1] - min(prefix[: k + 2]) >= budget
            if state or back:
                return sum(1 for u in chain[:k] if u.kind != "map")
    return sum(1 for u in chain if u.kind != "map")


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_match_the_exact_twin(seed):
    rng = random.Random(seed)
    chain = []
    for k in range(rng.randint(1, 8)):
        kind = rng.choice(["update", "update", "map", "block"])
        q = rng.choice([0.0, 1.0])
        c = rng.choice([0.0, 0.5, 1.0, 3.0, 40.0, 1e3])
        b = rng.choice([0.0, 0.25, 2.0])
        L = rng.choice([1e-3, 0.5, 1.0, 7.0, 300.0])
        chain.append(BlockCertificate(q, 0.0, c=c, b=b, l1=0.0, l0=L, name=f"s{k}", kind=kind))
    dt = rng.choice([1.0, 0.5])
    r0 = rng.choice([0.5, 1.0, 4.0])
    lip = rng.choice([1.0, 10.0])
    st = certify_stack(chain, "fp16", dt=dt, r0=r0, lip_g=lip)
    assert st.certified_depth == _twin(chain, M16, dt, r0, lip), st.explain()


def test_head_output_peak_and_lipschitz():
    ups = [_upd(0.0, 1.0, 0.5), _upd(0.0, 1.0, 0.5)]
    head = BlockCertificate(1.0, 0.0, c=10.0, b=0.0, l1=0.0, l0=10.0, name="lm_head", kind="map")
    st = certify_stack(ups, "fp16", r0=1.0, head=head, loss_grad=cross_entropy_gradient)
    assert st.ok and st.output_bound == pytest.approx(30.0)
    assert st.lip_g == pytest.approx(10.0 * math.sqrt(2.0))
    big = BlockCertificate(1.0, 0.0, c=M16 / 3, b=0.0, l1=0.0, l0=1.0, name="lm_head", kind="map")
    st = certify_stack(ups, "fp16", r0=1.0, head=big)
    assert not st.ok and st.first_failure.segment == "head" and st.first_failure.index == 2
    assert st.certified_depth == 2  # the updates themselves pass
    peaked = BlockCertificate(1.0, 0.0, c=1.0, l1=0.0, l0=1.0, name="head", kind="map",
                              peak=Peak(2.0, 1e4, 0.0, "logits"))
    st = certify_stack(ups, "fp16", r0=1.0, head=peaked)
    assert not st.ok and "logits of the head 'head'" in st.first_failure.reason
    steep = BlockCertificate(1.0, 0.0, c=1.0, l1=0.0, l0=M16, name="head", kind="map")
    st = certify_stack(ups, "fp16", r0=1.0, head=steep)
    assert not st.ok and st.first_failure.kind == "backward" and st.first_failure.segment == "head"
    assert st.backward_depth == 0


def test_head_arguments_are_checked():
    head = BlockCertificate(1.0, 0.0, c=1.0, l1=0.0, l0=1.0, kind="map")
    with pytest.raises(ValueError, match="lip_g or head"):
        certify_stack([_upd(0.0, 1.0, 0.5)], "fp16", head=head, lip_g=2.0)
    with pytest.raises(ValueError, match="must be a map"):
        certify_stack([_upd(0.0, 1.0, 0.5)], "fp16", head=_upd(1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="loss_grad needs a head"):
        certify_stack([_upd(0.0, 1.0, 0.5)], "fp16", lip_g=2.0, loss_grad=3.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        BlockCertificate(1.0, 0.0, kind="shortcut")


def test_plain_stacks_are_unchanged():
    # no maps, no head: the chain is the old stack (the costate minimum is the input's)
    ups = [BlockCertificate(1.0, 1.0, c=1.0, b=0.5, l1=2.0, l0=1.0, name=f"u{k}") for k in range(12)]
    st = certify_stack(ups, "fp16", r0=1.0)
    assert st.depth == 12 and st.head is None and math.isnan(st.output_bound)
    assert st.explain().startswith("stack of 12 updates")


def test_in_dtype_keeps_the_chain_and_the_head():
    head = BlockCertificate(1.0, 0.0, c=1e5, l1=0.0, l0=100.0, name="head", kind="map")
    st = certify_stack([_upd(0.0, 1.0, 0.5), _map(2.0)], "fp32", r0=1.0, head=head, loss_grad=2.0)
    st16 = st.in_dtype("fp16")
    assert st.ok and st16.dtype == "fp16" and st16.head == head and st16.loss_grad == 2.0 and st16.updates == st.updates
    assert st16.lip_g == st.lip_g and not st16.ok and st16.first_failure.segment == "head"

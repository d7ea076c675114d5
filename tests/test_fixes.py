"""Computed fixes: every reported value certifies when applied for real, and is the largest/smallest that does.

Each lever is checked by applying it the way a user would (rebuilding the model with the value, enforcing the
caps, cutting the stack, changing the dtype) and certifying again from the weights, not from the fix's own
arithmetic; tightness: a value 12% past the reported one (two significant digits lose at most 10%) fails.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from certblocks import MLP, BlockCertificate, CertificationError, QKNormAttention, build_stack
from certblocks.certificate import certify_stack
from certblocks.fixes import LEVERS, Fix, compute_fixes, recertify

pytest.importorskip("timm")
from certblocks.zoo import create_model  # noqa: E402


def _random_chain(rng: random.Random, n: int):
    certs = []
    for k in range(n):
        q = rng.choice([0.0, 1.0, 1.0, 1.5])
        sigma = rng.choice([0.0, 1.0, 2.0]) if q > 0 else 0.0
        certs.append(BlockCertificate(q, sigma, c=rng.uniform(0.05, 1.5), b=rng.uniform(0, 0.5),
                                      l1=rng.uniform(0, 3.0) if sigma else 0.0, l0=rng.uniform(0.1, 2.0), name=f"u{k}"))
    return certs


@pytest.mark.parametrize("seed", range(25))
def test_generic_fixes_certify_and_are_tight(seed):
    rng = random.Random(seed)
    certs = _random_chain(rng, rng.randint(4, 30))
    dtype = rng.choice(["fp16", "bf16", "fp8_e5m2"])
    cert = certify_stack(certs, dtype, r0=rng.uniform(0.5, 5.0))
    fixes = cert.fixes()
    if cert.ok:
        assert fixes == []
        return
    assert [f.lever for f in fixes] == sorted((f.lever for f in fixes), key=LEVERS.index)
    for f in fixes:
        if f.lever == "dt":
            assert certify_stack(certs, dtype, r0=cert.r0, dt=f.value).ok and f.ok
            assert not certify_stack(certs, dtype, r0=cert.r0, dt=f.value * 1.12).ok
        elif f.lever == "depth":
            assert certify_stack(certs[: f.value], dtype, r0=cert.r0).ok
            assert not certify_stack(certs[: f.value + 1], dtype, r0=cert.r0).ok
            assert f.value >= cert.certified_depth
        elif f.lever == "dtype":
            wider = certify_stack(certs, f.value, r0=cert.r0)
            assert wider.certified_depth == f.certified_depth > cert.certified_depth or (wider.ok and f.ok)
        else:  # pragma: no cover - no other generic lever
            raise AssertionError(f.lever)


def test_dtype_is_offered_only_when_it_certifies_more():
    # a bounded-Jacobian chain whose backward budget is the same in bf16 and fp32 (log M differs by 0.4%)
    certs = [BlockCertificate(1, 0, c=0.5, l0=40.0, name=f"u{k}") for k in range(30)]
    cert = certify_stack(certs, "bf16")
    assert not cert.ok
    fp32 = certify_stack(certs, "fp32")
    dtype = [f for f in cert.fixes() if f.lever == "dtype"]
    if fp32.certified_depth > cert.certified_depth:
        assert dtype and dtype[0].value == "fp32"
    else:  # fp32 certifies no more: the fix names fp64 (which does), never fp32
        assert dtype and dtype[0].value == "fp64" and dtype[0].ok


def test_no_lever_when_a_map_fails_whatever_the_step():
    certs = [BlockCertificate(1, 0, c=1e30, l0=1e30, kind="map", name="scale"),
             BlockCertificate(1, 0, c=0.1, l0=0.1, name="u")]
    cert = certify_stack(certs, "fp16", r0=1.0)
    levers = {f.lever for f in cert.fixes()}
    assert "dt" not in levers and "depth" not in levers  # no step or depth makes the map certified
    assert "dtype" in levers  # fp32 holds 1e30


def _zoo(name, seed=0, **kw):
    torch.manual_seed(seed)
    return create_model(name, **kw)


def test_zoo_refusal_names_init_values_and_qk_norm_eps_and_they_certify_when_built():
    kw = dict(n_layer=8, cert_dtype="fp16")
    with pytest.raises(CertificationError) as info:
        _zoo("gpt2_qknorm_test", init_values=0, **kw)
    msg = str(info.value)
    assert "init_values <= " in msg and "qk_norm_eps >= " in msg and "certify=False" in msg and ".fixes()" in msg
    m = _zoo("gpt2_qknorm_test", init_values=0, certify=False, **kw)
    fixes = {f.lever: f for f in m.fixes()}
    assert {"init_values", "qk_norm_eps", "depth", "enforce"} <= set(fixes)
    assert all(isinstance(f, Fix) and (f.text in msg) == (f.lever != "enforce") for f in fixes.values())
    # rebuilt with the reported value (same seed, same weights): certified; 12% past it: not
    gain = fixes["init_values"].value
    assert _zoo("gpt2_qknorm_test", init_values=gain, **kw).certificate().ok
    assert not _zoo("gpt2_qknorm_test", init_values=gain * 1.12, certify=False, **kw).certificate().ok
    eps = fixes["qk_norm_eps"].value
    assert _zoo("gpt2_qknorm_test", init_values=0, qk_norm_eps=eps, **kw).certificate().ok
    assert not _zoo("gpt2_qknorm_test", init_values=0, qk_norm_eps=eps / 1.12, certify=False, **kw).certificate().ok
    # the depth: the model cut after that many updates (whole layers; the init depends on n_layer, so cut, not rebuild)
    k = fixes["depth"].value
    assert k >= m.certificate().certified_depth
    m.transformer.h = m.transformer.h[: k // 2]
    assert m.certificate().ok and m.certificate().depth == 2 * (k // 2)


def test_zoo_enforce_fix_certifies_after_enforce():
    from certblocks.enforcement import enforce

    m = _zoo("gpt2_qknorm_test", n_layer=8, cert_dtype="fp16", init_values=0, certify=False)
    cert = m.certificate()
    fix = next(f for f in m.fixes() if f.lever == "enforce")
    rep = enforce(m, "fp16", lip_g=cert.lip_g)
    assert rep.alpha == pytest.approx(fix.value)
    assert m.certificate("fp16").ok  # the capped weights, the head's Lip(G) unchanged


def test_zoo_gain_lever_on_a_gained_model_scales_from_its_gains():
    m = _zoo("gpt2_qknorm_test", n_layer=8, cert_dtype="fp16", init_values=0.9, certify=False)
    if m.certificate().ok:
        pytest.fail("the test needs a refused configuration")
    fix = next(f for f in m.fixes() if f.lever == "init_values")
    assert fix.value < 0.9
    assert _zoo("gpt2_qknorm_test", n_layer=8, cert_dtype="fp16", init_values=fix.value).certificate().ok


def test_stack_qk_norm_eps_fix_certifies_when_set():
    torch.manual_seed(0)
    blocks = []
    for _ in range(6):
        blocks += [QKNormAttention(32, 2), MLP(32, 64)]
    stack = build_stack(blocks, "fp16", r0=2.0, seq_len=16, certify=False)
    if stack.certificate().ok:
        pytest.fail("the test needs a refused configuration")
    with pytest.raises(CertificationError, match="each certified again"):
        build_stack(blocks, "fp16", r0=2.0, seq_len=16)
    fixes = {f.lever: f for f in stack.fixes()}
    assert "dt" in fixes and "enforce" in fixes
    dt = fixes["dt"].value
    assert build_stack(blocks, "fp16", r0=2.0, seq_len=16, dt=dt).certificate().ok
    if "qk_norm_eps" in fixes:
        eps = fixes["qk_norm_eps"].value
        for b in blocks[::2]:
            b.q_norm.eps = b.k_norm.eps = eps
        assert build_stack(blocks, "fp16", r0=2.0, seq_len=16).certificate().ok


def test_fixes_in_json_and_explain():
    certs = [BlockCertificate(1, 1, c=0.5, l1=2.0, l0=1.0, name=f"u{k}") for k in range(40)]
    cert = certify_stack(certs, "fp16")
    assert not cert.ok
    assert "fixes" not in cert.to_dict() and "_fixes" not in cert.__dict__  # computed only when asked
    assert "fixes (each certified again)" not in cert.explain() and "_fixes" not in cert.__dict__
    doc = cert.to_dict(fixes=True)
    assert doc["fixes"] and {"lever", "value", "certified_depth", "depth", "ok", "text"} <= set(doc["fixes"][0])
    assert doc["fixes"] == [f.to_dict() for f in cert.fixes()]
    assert "fixes (each certified again)" in cert.explain(fixes=True)
    assert certify_stack(certs[:1], "fp32").to_dict(fixes=True)["fixes"] == []
    # a model's own fixes (its levers) are printed as given
    mine = [Fix("dt", 0.5, 40, 40, True, "dt <= 0.5")]
    assert cert.to_dict(fixes=mine)["fixes"] == [mine[0].to_dict()]
    assert cert.explain(fixes=mine).splitlines()[-1] == "fixes (each certified again): dt <= 0.5 (certifies 40/40)"
    with pytest.raises(TypeError, match="fixes must be a bool or a sequence of Fix, got str"):
        cert.explain(fixes="yes")


def test_fixes_are_cached_on_the_frozen_certificate():
    certs = [BlockCertificate(1, 1, c=0.5, l1=2.0, l0=1.0, name=f"u{k}") for k in range(40)]
    cert = certify_stack(certs, "fp16")
    first = cert.fixes()
    assert cert.__dict__["_fixes"] == tuple(first) and cert.fixes() == first and cert.fixes() is not first
    assert cert == certify_stack(certs, "fp16")  # the cache is not a field: equality unchanged


@pytest.mark.parametrize("seed", range(12))
def test_depth_fix_by_bisection_is_the_longest_certified_prefix(seed):
    # the prefix verdict is monotone in a chain of updates (fixes._depth_fix): bisection finds what the search
    # from the top finds; checked against that search, with a head and without
    rng = random.Random(100 + seed)
    certs = _random_chain(rng, rng.randint(20, 120))
    head = BlockCertificate(1, 0, c=rng.uniform(0.5, 3.0), b=1.0, l0=rng.uniform(1.0, 30.0), kind="map", name="G")
    for kw in ({}, {"head": head, "loss_grad": math.sqrt(2)}):
        cert = certify_stack(certs, "fp16", r0=rng.uniform(0.5, 3.0), **kw)
        if cert.ok:
            continue
        linear = next((n for n in range(len(certs) - 1, 0, -1) if recertify(cert, certs[:n]).ok), None)
        got = [f.value for f in cert.fixes() if f.lever == "depth"]
        assert got == ([] if linear is None else [linear])


def test_compute_fixes_recertify_keeps_the_head():
    head = BlockCertificate(0, 0, c=0.0, b=3.0, l0=50.0, kind="map", name="head")
    certs = [BlockCertificate(1, 1, c=0.5, l1=2.0, l0=1.0, name=f"u{k}") for k in range(12)]
    cert = certify_stack(certs, "fp16", head=head, loss_grad=math.sqrt(2))
    again = recertify(cert)
    assert again.lip_g == cert.lip_g and again.head is head
    for f in compute_fixes(cert):
        assert f.depth <= cert.depth

"""BlockCertificate, Depths and StackCertificate: depths, failures, rendering."""

from __future__ import annotations

import json
import math

import pytest

from certblocks import BlockCertificate
from certblocks.budget import backward_overflow_depth, float_max, forward_overflow_depth
from certblocks.certificate import Peak, certify_stack
from certblocks.exponents import Exponents


def test_block_certificate_fields_and_defaults():
    cert = BlockCertificate(1, 2)
    assert (cert.c, cert.b, cert.l1, cert.l0, cert.name) == (1.0, 0.0, 0.0, 1.0, "")
    assert cert.exponents == Exponents(1, 2)
    assert cert.growth_bound(3.0) == 3.0 and cert.jacobian_bound(0.5) == 1.0


@pytest.mark.parametrize("kwargs, arg", [(dict(q=-1), "q"), (dict(sigma=-1), "sigma"), (dict(c=-1.0), "c"),
                                         (dict(b=math.nan), "b"), (dict(l1=math.inf), "l1"), (dict(l0=-2.0), "l0")])
def test_block_certificate_validation(kwargs, arg):
    args = dict(q=1, sigma=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{arg} must be"):
        BlockCertificate(**args)


def test_depths_of_reference_blocks():
    d = BlockCertificate(1, 0, c=1.0, l1=0.0, l0=1.0).depths("fp16")
    assert (d.forward_overflow, d.backward_overflow) == (16, 16)
    assert (d.forward, d.backward, d.certified) == (15, 15, 15)
    d = BlockCertificate(1, 2, c=1.0, l1=1.0, l0=0.0).depths("fp32")
    assert d.forward == 127 and d.backward == 11 and d.certified == 11 and d.exact
    d = BlockCertificate(1, 0, c=1.0, l0=1.0).depths("fp64")
    assert d.forward_overflow == 1024


def test_depths_agree_with_the_budget_functions():
    cases = [(0.5, 1, 0.3, 0.1, 0.2, 0.5), (2, 1, 0.01, 0.0, 0.1, 1.0), (1, 1, 0.2, 0.5, 0.1, 0.1)]
    for q, sigma, c, b, l1, l0 in cases:
        cert = BlockCertificate(q, sigma, c=c, b=b, l1=l1, l0=l0)
        for dtype in ("fp16", "bf16"):
            d = cert.depths(dtype, dt=0.5, r0=2.0, lip_g=3.0)
            assert d.forward_overflow == forward_overflow_depth(q, c, b, dtype, dt=0.5, r0=2.0).depth
            assert d.backward_overflow == backward_overflow_depth(q, sigma, c, b, l1, l0, dtype, dt=0.5, r0=2.0,
                                                                  lip_g=3.0).depth
            assert d.certified == min(d.forward, d.backward)


def test_unknown_exponents_give_unknown_depths():
    d = BlockCertificate(1, None).depths("fp16")
    assert d.forward == 15 and d.backward is None and d.certified is None
    d = BlockCertificate(None, None).depths("fp16")
    assert d.forward is None and d.certified is None
    assert "?" in str(d)


def test_depths_validate_run_parameters():
    with pytest.raises(ValueError, match="^dt must be a finite number > 0"):
        BlockCertificate(1, 0).depths("fp16", dt=0)
    with pytest.raises(ValueError, match="dtype 'fp12' is not supported"):
        BlockCertificate(1, 0).depths("fp12")
    with pytest.raises(ValueError, match="^r0 must be below"):
        BlockCertificate(None, None).depths("fp16", r0=1e9)


def test_json_rendering_round_trips():
    cert = BlockCertificate(1, 1, c=0.5, b=0.1, l1=0.2, l0=0.3, name="attn", culprit="QK logits")
    assert json.loads(cert.to_json()) == cert.to_dict()
    assert BlockCertificate(**{k: v for k, v in cert.to_dict().items()}) == cert
    d = BlockCertificate(0, 0, c=1.0).depths("fp64")
    data = json.loads(d.to_json())
    assert data["forward_overflow"] == d.forward_overflow  # a 309-digit int survives JSON
    assert json.loads(BlockCertificate(1, 0, c=0.0, l0=0.0).depths("fp16").to_json())["forward"] == "inf"


def test_certify_stack_homogeneous_matches_block_depths():
    cert = BlockCertificate(1, 2, c=1.0, l1=1.0, l0=1.0, name="attn")
    depths = cert.depths("fp32")
    ok = certify_stack([cert] * depths.certified, "fp32")
    assert ok.ok and ok.certified_depth == depths.certified and ok.first_failure is None
    bad = certify_stack([cert] * (depths.certified + 1), "fp32")
    assert not bad.ok and bad.certified_depth == depths.certified
    assert bad.first_failure.kind == "backward" and bad.first_failure.index == depths.certified
    assert len(bad.radii) == bad.depth + 1 and len(bad.log_factors) == bad.depth
    for k, r in enumerate((1.0, 2.0, 4.0, 8.0)):  # radii are upper bounds, rounded outward
        assert r <= bad.radii[k] <= r * (1 + 1e-12)
    assert bad.log_factors[0] == pytest.approx(math.log(3.0))


def test_forward_failure_names_the_superlinear_update():
    certs = [BlockCertificate(1, 0, c=0.5, name=f"mlp{k}") for k in range(5)]
    certs += [BlockCertificate(2, 1, c=1.0, name=f"swiglu{k}", culprit="SiLU(W_u x) * (W_g x)") for k in (5, 6)]
    certs += [BlockCertificate(1, 0, c=0.5, name=f"mlp{k}") for k in range(7, 16)]
    s = certify_stack(certs, "fp16")
    f = s.first_failure
    assert not s.ok and f.kind == "forward"
    assert f.name.startswith("mlp") and "update 5 (swiglu5)" in f.reason
    assert "(q=2, sigma=1)" in f.reason and "SiLU(W_u x) * (W_g x)" in f.reason
    assert "q = 2 > 1" in f.fix and "normalize" in f.fix
    assert s.certified_depth == f.index == s.forward_depth


def test_unknown_update_stops_certification():
    certs = [BlockCertificate(1, 0, c=0.1)] * 3 + [BlockCertificate(1, None, name="mystery", culprit="exp(x)")]
    certs += [BlockCertificate(1, 0, c=0.1)] * 2
    s = certify_stack(certs, "fp32")
    assert not s.ok and s.certified_depth == 3 and s.first_failure.kind == "unknown"
    assert "mystery" in s.first_failure.reason and "sigma not derived" in s.first_failure.reason


def test_explain_is_a_readable_table():
    certs = [BlockCertificate(1, 2, c=1.0, l1=1.0, l0=1.0, name=f"blocks.{k}.attn") for k in range(13)]
    s = certify_stack(certs, "fp32")
    text = s.explain(fixes=True)
    assert "blocks.12.attn" in text and "NOT certified" in text and "fix:" in text
    # header, columns, rule, rows, R_n, what is not checked, verdict, culprit fix, computed fixes
    assert len(text.splitlines()) == 13 + 8
    assert "not checked: segment(s) 0, 1, 2, 3, 4, 5, 6, 7, ... (13 in all) state no peak" in text
    assert text.splitlines()[-1].startswith("fixes (each certified again): dt <= ")
    # without fixes=True nothing is computed: the last line says how to get them, the rest is the same
    plain = s.explain()
    assert plain.splitlines()[:-1] == text.splitlines()[:-1] and "explain(fixes=True)" in plain.splitlines()[-1]
    assert "_fixes" not in s.__dict__ or s.__dict__["_fixes"] == tuple(s.fixes())
    ok = certify_stack(certs[:3], "fp32")
    assert "certified: all 3 updates" in ok.explain()
    data = json.loads(s.to_json())
    assert data["ok"] is False and len(data["updates"]) == 13 and data["first_failure"]["kind"] == "backward"


def test_certify_stack_rejects_non_certificates():
    with pytest.raises(TypeError, match=r"certs\[1\] must be a BlockCertificate"):
        certify_stack([BlockCertificate(1, 0), (1, 0)], "fp16")  # type: ignore[list-item]


def test_certify_stack_radii_bound_an_aligned_trajectory():
    # v(x) = c ||x||^(q-1) x attains the forward bound: the radii must equal its trajectory (up to rounding).
    c, q = 0.3, 1.5
    s = certify_stack([BlockCertificate(q, 0, c=c)] * 12, "fp32", dt=0.5, r0=2.0)
    r = 2.0
    for k in range(12):
        r = r + 0.5 * c * r**q
        assert s.radii[k + 1] == pytest.approx(r, rel=1e-12) and s.radii[k + 1] >= r


def test_lip_g_shifts_the_backward_budget():
    cert = BlockCertificate(1, 0, c=0.0, l0=1.0)
    assert certify_stack([cert] * 15, "fp16").ok
    assert not certify_stack([cert] * 15, "fp16", lip_g=4.0).ok  # 4 * 2^14 = 65536 >= M
    assert certify_stack([cert] * 14, "fp16", lip_g=3.99).ok
    assert float_max("fp16") < 4 * 2**14


# ----------------------------------------------------------------------------- peaks (intermediates)


def test_peak_lowers_the_forward_depth_and_names_the_intermediate():
    from certblocks.certificate import Peak

    logits = Peak(2, 0.5, 0.0, what="query-key logits")
    plain = BlockCertificate(1, 2, c=2.0, l1=0.0, l0=0.0, name="attn")
    peaked = BlockCertificate(1, 2, c=2.0, l1=0.0, l0=0.0, name="attn", peak=logits)
    assert peaked.depths("bf16", r0=100.0).forward < plain.depths("bf16", r0=100.0).forward
    n = plain.depths("bf16", r0=100.0).forward
    s = certify_stack([peaked] * n, "bf16", r0=100.0)
    assert not s.ok and s.forward_depth == peaked.depths("bf16", r0=100.0).forward
    f = s.first_failure
    assert f.kind == "forward" and "query-key logits" in f.reason and "QK-norm" in f.fix
    assert certify_stack([plain] * n, "bf16", r0=100.0).ok
    assert peaked.to_dict()["peak"] == {"q": 2.0, "c": 0.5, "b": 0.0, "what": "query-key logits"}
    assert "peak <= 0.5 ||x||^2" in str(peaked) and "peak P_k(R_k)" in s.explain()
    assert peaked.peak_bound(10.0) == 50.0 and plain.peak_bound(10.0) is None


def test_stack_depth_with_peaks_matches_homogeneous_depth():
    from certblocks.certificate import Peak

    for peak in (Peak(2, 1e-3), Peak(1, 40.0, 3.0), Peak(0, 1.0, 2.0)):
        cert = BlockCertificate(1, 0, c=0.5, b=0.25, l1=0.0, l0=0.5, peak=peak)
        for dtype in ("fp16", "bf16"):
            d = cert.depths(dtype, r0=2.0)
            s = certify_stack([cert] * (d.forward + 1), dtype, r0=2.0)
            assert s.forward_depth == d.forward


def test_peak_validation():
    from certblocks.certificate import Peak

    with pytest.raises(ValueError, match="peak c"):
        Peak(1, -1.0)
    with pytest.raises(TypeError, match="peak must be a Peak"):
        BlockCertificate(1, 0, peak=(1, 2, 3))


def test_a_constant_peak_keeps_both_of_its_coefficients():
    """``c R^0 + b`` is ``c + b``: a ``{q: c, 0.0: b}`` dict literal at ``q = 0`` kept only ``b`` (an under-bound)."""
    from certblocks.bounds.poly import fold_peak, peak_poly, power_terms

    assert power_terms(0.0, 3.0, 2.0) == {0.0: pytest.approx(5.0)} and power_terms(0.0, 3.0, 2.0)[0.0] >= 5.0
    assert peak_poly(Peak(0.0, 3.0, 2.0, "x"))[0.0] >= 5.0 and peak_poly(None, 0.0, 3.0, 2.0)[0.0] >= 5.0
    assert fold_peak([peak_poly(Peak(0.0, 3.0, 2.0, "x"))], "x").bound(10.0) >= 5.0
    assert power_terms(1.0, 3.0, 2.0) == {1.0: 3.0, 0.0: 2.0}


@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_scaled_output_keeps_the_held_peaks(factor: float) -> None:
    """``s * v`` with ``|s| <= factor``: the per-dtype peaks stay usable (they go with the new peak), each bounds
    what it bounded before and, for ``factor > 1``, the scaled output too; the whole peak likewise."""
    from certblocks.blocks.gain import scaled_certificate as gained
    from certblocks.trace.own import scaled_certificate

    peaks = {"fp16": Peak(1.0, 2.0, 0.5, "fc1", lever="keep fc1 in fp32"), "fp32": Peak(1.0, 0.25, 0.0, "sum")}
    cert = BlockCertificate(1.0, 1.0, c=1.5, b=0.25, l1=0.5, l0=1.0, peak=Peak(1.0, 2.0, 0.5, "fc1"), peaks=peaks,
                            precision="amp-fp16")
    for scaled in (scaled_certificate(cert, factor), gained(cert, factor)):
        held = scaled.held_peaks("amp-fp16")
        assert held is not None and set(held) == {"fp16", "fp32"}
        assert held["fp16"].lever == "keep fc1 in fp32"
        for r in (0.0, 1.0, 10.0, 1e6):
            out = factor * cert.growth_bound(r)
            assert scaled.growth_bound(r) >= out * (1 - 1e-15)
            for d, p in held.items():
                assert p.bound(r) >= peaks[d].bound(r)
                if factor > 1.0:
                    assert p.bound(r) >= out
            assert scaled.peak.bound(r) >= max(cert.peak.bound(r), out if factor > 1.0 else 0.0)
        if factor <= 1.0:
            assert held == peaks

"""The cheap settings of the on-data certificate: ``jacobians=False`` (measured figures only, from one recorded
forward per segment whose graph serves the costates) and the exported graph kept across a monitor's checks."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from _traj_models import PlainResidual, stack

import certblocks
from certblocks.ondata.api import trajectory_of_call

capture_mod = importlib.import_module("certblocks.trace.capture")  # the module (the package exports a function)

FIELDS = ("state_norm", "out_norm", "peak", "costate_norm", "state_max", "max_logit")


def _loss(shape, seed: int = 0):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return lambda y: (y - t).square().mean()


def _same_measured(a, b) -> None:
    """Every measured figure of ``a`` equals ``b``'s (float32 rounding)."""
    assert [u.name for u in a.updates] == [u.name for u in b.updates]
    for ua, ub in zip(a.updates, b.updates):
        for f in FIELDS:
            va, vb = getattr(ua, f), getattr(ub, f)
            assert (va is None) == (vb is None), (ua.name, f)
            if va is not None:
                assert va == pytest.approx(vb, rel=1e-5, abs=1e-12), (ua.name, f, va, vb)
        assert ua.peaks.keys() == ub.peaks.keys()
    assert a.head.norm == pytest.approx(b.head.norm, rel=1e-6)
    assert a.headroom_measured == pytest.approx(b.headroom_measured, rel=1e-6, abs=1e-9)
    assert a.forward_headroom_measured == pytest.approx(b.forward_headroom_measured, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("kind", ["stack", "graph", "zoo"])
def test_measured_only_report_has_the_same_measured_figures(kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    if kind == "stack":
        model, batch, kw = stack(0).eval(), torch.randn(3, 5, 8, generator=g), {"loss": _loss((3, 5, 8))}
    elif kind == "graph":
        torch.manual_seed(1)
        model, batch, kw = PlainResidual().eval(), torch.randn(3, 4, 6, generator=g), {"loss": _loss((3, 4, 5))}
    else:
        from certblocks.zoo import create_model

        torch.manual_seed(0)
        model = create_model("gpt2_qknorm_test", certify=False).eval()
        idx = torch.randint(0, model.vocab_size, (2, 8), generator=g)
        batch, kw = (idx, idx.roll(1, dims=1)), {}
    full = certblocks.trajectory(model, batch, "fp16", **kw)
    cheap = certblocks.trajectory(model, batch, "fp16", jacobians=False, **kw)
    _same_measured(cheap, full)
    assert full.estimated and not cheap.estimated
    assert cheap.log_gradient_bound is None and cheap.headroom is None and cheap.backward_headroom is None
    assert all(u.jacobian_norm is None and u.log_factor is None and u.steps == 0 for u in cheap.updates)
    # the bases: the estimate falls back to the measured figures; ok and worst() read them
    assert cheap.headroom_on("estimate") == (cheap.headroom_measured, "measured")
    assert cheap.ok == (cheap.headroom_measured > 0)
    assert cheap.worst()[0] == cheap.worst("measured")[0]
    text = cheap.explain()
    assert "not estimated" in text and "headroom (measured)" in text
    d = cheap.to_dict()
    assert d["estimated"] is False and d["headroom"] is None and d["headroom_measured"] == cheap.headroom_measured
    # the shared graph changes nothing in the default report: the measured p_0 is the gradient
    if kind == "stack":
        x = batch.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(kw["loss"](model(x)), x)
        assert full.updates[0].costate_norm == pytest.approx(float(grad.reshape(3, -1).norm(dim=1).max()),
                                                             rel=1e-4)


def test_measured_only_needs_an_exact_costate() -> None:
    st = stack(0).eval()
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="jacobians=False needs the exact costate"):
        certblocks.trajectory(st, x, "fp16", jacobians=False)  # no loss: the stack's head is Lip(G)
    with pytest.raises(TypeError, match="jacobians must be a bool"):
        certblocks.trajectory(st, x, "fp16", jacobians="no")


def test_measured_only_sees_an_overflow() -> None:
    """A planted fp16 overflow reads negative on the cheap path too (the forward side as run)."""
    st = stack(0).eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)) * 3e4
    loss = _loss((2, 5, 8))
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            y = st(x.half())
        rep = certblocks.trajectory(st, x.half(), "fp16", loss=loss, jacobians=False)
    overflowed = not bool(torch.isfinite(y).all())
    assert overflowed and rep.headroom_measured < 0 and not rep.ok


def test_export_is_reused_across_calls_with_the_same_shapes(monkeypatch) -> None:
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(2)
    model = PlainResidual().eval()
    g = torch.Generator().manual_seed(0)
    loss = lambda y: (y - 0.5).square().mean()  # noqa: E731 - any shape
    cache: dict = {}
    run = lambda x: trajectory_of_call(model, (x,), {}, "fp16", loss=loss, jacobians=False,  # noqa: E731
                                       capture_cache=cache)
    fresh = lambda x: certblocks.trajectory(model, x, "fp16", loss=loss, jacobians=False)  # noqa: E731

    def exports(x):
        n = len(calls)
        rep = run(x)
        return rep, len(calls) - n
    a, n = exports(torch.randn(3, 4, 6, generator=g))
    assert n == 1
    x2 = torch.randn(3, 4, 6, generator=g) * 2
    with torch.no_grad():  # a training step: parameters updated in place
        for p in model.parameters():
            p.mul_(1.5)
    b, n = exports(x2)
    assert n == 0  # the program exported for the first batch ran on the second
    _same_measured(b, fresh(x2))
    assert b.headroom_measured != a.headroom_measured
    assert exports(torch.randn(3, 7, 6, generator=g))[1] == 1  # another shape: exported again
    model.mlps[1][2] = torch.nn.GELU()  # another module: exported again, and its values are the new model's
    x4 = torch.randn(3, 4, 6, generator=g)
    c, n = exports(x4)
    assert n == 1
    _same_measured(c, fresh(x4))
    h = model.mlps[0].register_forward_hook(lambda m, i, o: o * 2)  # a hook: exported again
    assert exports(x4)[1] == 1
    h.remove()
    assert len(cache) <= 4


def test_monitor_checks_on_the_measured_basis_skip_the_estimates() -> None:
    """A monitor check without the estimates costs a fraction of one with them (same measured figures)."""
    torch.manual_seed(0)
    st = stack(0)
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    loss = _loss((4, 5, 8))
    recs = {}
    for name, kw in (("measured", {}), ("estimates", {"estimate_every": 1})):
        mon = certblocks.CertificateMonitor(st, "fp16", every=1, threshold=-1e9, **kw)
        loss(st(x)).backward()
        recs[name] = mon.step()
        mon.remove()
        st.zero_grad(set_to_none=True)
    m, e = recs["measured"], recs["estimates"]
    assert m["data/alert_basis"] == e["data/alert_basis"] == "measured"
    assert m["data/headroom"] is None and math.isfinite(e["data/headroom"])
    assert m["data/headroom_measured"] == pytest.approx(e["data/headroom_measured"], rel=1e-6)
    assert m["blocks.1/data_costate_norm"] == pytest.approx(e["blocks.1/data_costate_norm"], rel=1e-6)
    with pytest.raises(ValueError, match="estimate_every"):
        certblocks.CertificateMonitor(st, "fp16", estimate_every=0)


def test_capture_cache_key_sees_autocast_and_values() -> None:
    model = PlainResidual().eval()
    x = torch.randn(2, 4, 6)
    leaves, spec = torch.utils._pytree.tree_flatten(((x,), {"flag": True}))
    k1 = capture_mod._export_key(model, leaves, spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k2 = capture_mod._export_key(model, leaves, spec)
    leaves3, spec3 = torch.utils._pytree.tree_flatten(((x,), {"flag": False}))
    k3 = capture_mod._export_key(model, leaves3, spec3)
    assert len({k1, k2, k3}) == 3
    assert capture_mod._export_key(model, leaves, spec) == k1

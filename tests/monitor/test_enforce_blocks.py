"""enforce for the Mamba blocks, SwiGLU and the zoo's forecasters: the worst-case certificate survives any weights.

After ``enforce`` the parameters are pushed far (random large values, then gradient ascent on the block's
output norm and on a Jacobian-vector product), and a counterexample search (:mod:`certblocks.testing`: random
and gradient-ascent-searched inputs) must not find a state where the velocity or its Jacobian exceeds the
worst-case certificate ``certificate_from_caps`` computed at enforce time.  The stack's states must stay within the
worst-case radii at the planned depth; ``unenforce`` restores plain parameters holding the effective values.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import certblocks
import certblocks.testing as cbt
from certblocks import bounds
from certblocks.blocks import MLP, GatedMLP, LinearGrowthMamba, Mamba
from certblocks.blocks.mixer import DT_BIAS_LOWER
from certblocks.enforcement import NormCap, SoftplusCeiling, cap_ratios, enforce, unenforce
from certblocks.protocol import softplus_ceiling

D, L = 8, 10


def _mamba(cls, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    blk = cls(D, d_state=4, d_conv=3, expand=2, bias=True)
    blk.backend = "reference"  # plain loop: forward-mode AD for the Jacobian search
    return blk


BLOCKS = {
    "linear_growth": lambda seed: _mamba(LinearGrowthMamba, seed),
    "free": lambda seed: _mamba(Mamba, seed),
    "swiglu": lambda seed: (torch.manual_seed(seed), GatedMLP(D, 12, gate="silu", bias=True))[1],
}


def _velocity(blk: nn.Module):
    """The block on float64 search inputs (the scan kernels take float32)."""
    if isinstance(blk, (LinearGrowthMamba, Mamba)):
        return lambda x: blk(x.float())
    return lambda x: blk(x.to(blk.fc1.weight.dtype))


def _norms(slot) -> list:
    """Each part's norm in the slot's kind (no floor): the caps that make the worst case the current weights."""
    t = getattr(slot.module, slot.name).detach()
    out = []
    for part in torch.split(t, list(slot.sizes), dim=0):
        if slot.kind == "matrix":
            out.append(bounds.op_norm(part))
        elif slot.kind == "vector":
            out.append(bounds.vec_norm(part))
        elif slot.kind == "clamp":
            out.append(bounds.vec_inf_norm(part))
        else:
            out.append(float(F.softplus(part.double().max())))
    return out


def _within_caps(model: nn.Module) -> None:
    """Every effective tensor within its parametrization's cap (exact norms), the dt bias above its lower end."""
    ratios = cap_ratios(model)
    assert ratios and max(ratios.values()) <= 1.0 + 1e-12, max(ratios.items(), key=lambda kv: kv[1])
    for m in model.modules():
        if parametrize.is_parametrized(m):
            for name, plist in m.parametrizations.items():
                lows = [par.lower for par in plist if isinstance(par, SoftplusCeiling)]
                assert all(float(getattr(m, name).min()) >= low for low in lows)


def _dominated(worst, actual, what: str) -> None:
    for key in ("c", "b", "l1", "l0"):
        assert getattr(worst, key) >= getattr(actual, key) * (1 - 1e-9), (what, key)
    for r in (0.1, 1.0, 30.0):
        assert worst.peak.bound(r) >= actual.peak.bound(r) * (1 - 1e-9), (what, "peak", r)


def _search(blk: nn.Module, worst, seed: int) -> None:
    """Counterexample search of the velocity against the worst-case certificate (fails when it finds one)."""
    f = _velocity(blk.eval())
    # the free block's (5, 5) worst case is loose by orders of magnitude: one radius is enough to run it
    radii = {1: (0.01, 1.0, 30.0), 2: (0.01, 0.5, 2.0)}.get(int(worst.q), (0.5,))
    g = cbt.search_growth(f, worst, (L, D), radii=radii, count=16, restarts=1, from_best=1, steps=8, lr=0.05,
                          seed=seed, rtol=1e-6)
    j = cbt.search_jacobian(f, worst, (L, D), radii=radii[:2], count=8, restarts=1, from_best=1, steps=4, lr=0.05,
                            power_iters=2, seed=seed, rtol=1e-6)
    assert g.ok and j.ok, (g.describe(), j.describe())


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_worst_case_at_the_current_norms_dominates_the_certificate(kind: str) -> None:
    # the bound from caps is the block's own bound with every norm replaced by an upper bound: at caps equal to
    # the current norms it is at least the certificate from the weights (coefficients and peak)
    blk = BLOCKS[kind](0)
    with torch.no_grad():
        if isinstance(blk, (LinearGrowthMamba, Mamba)):
            blk.dt_proj.bias.normal_(-1.0, 2.0)
            blk.D.normal_()
    caps = {k: v for sl in blk.cap_slots() for k, v in zip(sl.keys, _norms(sl))}
    _dominated(blk.certificate_from_caps(caps, seq_len=L), blk.certificate(seq_len=L), kind)
    assert blk.certificate_from_caps(caps, seq_len=L).exponents == blk.certificate(seq_len=L).exponents


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_certificate_holds_after_random_and_adversarial_weights(kind: str) -> None:
    blk = BLOCKS[kind](1)
    st = certblocks.build_stack([blk], "fp16", dt=1.0, certify=False, seq_len=L)
    rep = enforce(st, "fp16")
    worst = rep.worst_case.updates[0]
    assert rep.worst_case.ok and st.certificate().ok
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 100.0, 1e4):  # random large values of every parameter (A_log, the dt bias, D included)
        with torch.no_grad():
            for p in st.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
        _within_caps(st)
        cert = st.recertify()
        assert cert.ok
        _dominated(worst, cert.updates[0], f"{kind} at scale {scale}")
    _search(blk, worst, seed=0)
    # gradient ascent on the parameters: the output norm, then a Jacobian-vector product, at a fixed state
    blk.train()
    x = torch.randn(4, L, D, generator=g)
    x = x / cbt.token_norm(x).float()[:, None, None] * 3.0
    v = torch.randn(4, L, D, generator=g)
    v = v / cbt.token_norm(v).float()[:, None, None]
    opt = torch.optim.Adam(blk.parameters(), lr=1.0)
    for step in range(6):
        opt.zero_grad()
        if step < 3:
            out = blk(x)
            bound = worst.c * 3.0 ** worst.q + worst.b
        else:
            _, out = torch.func.jvp(blk, (x,), (v,))
            bound = worst.l1 * 3.0 ** worst.sigma + worst.l0
        ratio = float(cbt.token_norm(out.detach()).max()) / bound
        assert ratio <= 1.0 + 1e-6, (kind, step, ratio)
        (-out.square().sum()).backward()
        opt.step()
        assert all(torch.isfinite(p).all() for p in blk.parameters())
    _within_caps(st)
    assert st.recertify().ok
    _dominated(worst, blk.certificate(seq_len=L), f"{kind} after ascent")
    _search(blk, worst, seed=1)


def test_stack_stays_certified_at_the_planned_depth() -> None:
    blocks = [_mamba(LinearGrowthMamba, 2), MLP(D, 16), _mamba(Mamba, 3), BLOCKS["swiglu"](4)]
    st = certblocks.build_stack(blocks, "bf16", dt=1.0, certify=False, seq_len=L, r0=2.0)
    rep = enforce(st, "bf16", depth=12)
    worst = rep.worst_case
    assert worst.ok and worst.depth == 12
    deep = [copy.deepcopy(b) for _ in range(3) for b in st.blocks]  # 12 updates of the enforced blocks
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in deep:
            for p in b.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 50)
    deep_stack = certblocks.build_stack(deep, "bf16", dt=1.0, seq_len=L, r0=2.0)  # certify=True: raises if not
    assert deep_stack.certificate().ok
    # the states of the deep stack stay within the worst case's radii (random inputs of norm r0, then ascent)
    deep_stack.eval()
    x = torch.randn(8, L, D, generator=g)
    x = (x / cbt.token_norm(x).float()[:, None, None] * 2.0).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1)
    for _ in range(5):
        z = x / cbt.token_norm(x.detach()).float()[:, None, None] * 2.0
        for k, b in enumerate(deep_stack.blocks):
            z = z + b(z)
            assert float(cbt.token_norm(z.detach()).max()) <= worst.radii[k + 1] * (1 + 1e-6), k
        opt.zero_grad()
        (-z.square().sum()).backward()
        opt.step()


def test_softplus_ceiling() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for cap in (1e-3, 0.1, 1.0, 7.5):
            par = SoftplusCeiling(cap, DT_BIAS_LOWER)
            x = torch.tensor([-1e4, -40.0, -30.0, -3.0, 0.0, 2.0, 50.0, 6e4], dtype=dtype)
            y = par(x)
            assert y.dtype == dtype
            assert float(F.softplus(y.double()).max()) <= cap * (1 + 1e-12)
            assert float(y.double().min()) >= DT_BIAS_LOWER
            assert float(y.double().max()) <= softplus_ceiling(cap)
    below = SoftplusCeiling(1e-20, DT_BIAS_LOWER)  # the ceiling under the lower end: the ceiling wins
    assert torch.all(below(torch.zeros(3)) <= softplus_ceiling(1e-20))
    with pytest.raises(ValueError, match="softplus cap"):
        softplus_ceiling(0.0)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_extreme_decay_rates_stay_finite(backend: str) -> None:
    # A_log beyond float32's exp range and a dt bias whose softplus underflows: exp(delta * A) would be 0 * -inf
    blk = _mamba(LinearGrowthMamba, 6)
    blk.backend = backend
    with torch.no_grad():
        blk.A_log.fill_(100.0)
        blk.dt_proj.bias.fill_(-1e4)
    assert torch.isinf(torch.exp(blk.A_log.float())).all() and float(F.softplus(blk.dt_proj.bias).max()) == 0.0
    out = blk(torch.randn(2, L, D))
    assert torch.isfinite(out).all()
    cert = blk.certificate(seq_len=L)
    assert all(math.isfinite(v) for v in (cert.c, cert.b, cert.l1, cert.l0))


def test_unenforce_round_trip_and_state_dict() -> None:
    def stack(seed: int):
        blocks = [_mamba(LinearGrowthMamba, seed), _mamba(Mamba, seed + 1), BLOCKS["swiglu"](seed + 2)]
        return certblocks.build_stack(blocks, "fp16", dt=1.0, certify=False, seq_len=L)

    st = stack(0)
    enforce(st, "fp16")
    assert type(st.blocks[0]).__name__ == "ParametrizedLinearGrowthMamba"  # D is capped on the block itself
    assert st.certificate().updates[0].name.endswith("LinearGrowthMamba") and "Parametrized" not in \
        st.blocks[0].certificate(seq_len=L).name
    with torch.no_grad():
        for p in st.parameters():
            p.add_(torch.randn_like(p) * 20)
    other = stack(10)
    enforce(other, "fp16")
    other.load_state_dict(st.state_dict(), strict=True)  # between two enforced models
    x = torch.nn.functional.normalize(torch.randn(2, L, D), dim=-1)  # inside r0 = 1
    torch.testing.assert_close(other(x), st(x))
    effective = {f"{n}.{t}": getattr(m, t).detach().clone() for n, m in st.named_modules()
                 if parametrize.is_parametrized(m) for t in m.parametrizations.keys()}
    out = st(x).detach()
    assert unenforce(st) == len(effective)
    assert not any(parametrize.is_parametrized(m) for m in st.modules())
    assert type(st.blocks[0]) is LinearGrowthMamba and type(st.blocks[1]) is Mamba
    params = dict(st.named_parameters())
    for name, val in effective.items():
        torch.testing.assert_close(params[name].detach(), val)
    torch.testing.assert_close(st(x), out)
    plain = stack(20)
    plain.load_state_dict(st.state_dict(), strict=True)  # a plain checkpoint again
    torch.testing.assert_close(plain(x), out)
    assert st.recertify().ok


def test_seq_len_is_required_for_a_scan() -> None:
    blk = _mamba(LinearGrowthMamba, 7)
    with pytest.raises(ValueError, match="seq_len=N"):
        enforce([("mixer", blk)], "bf16", r0=1.0)
    assert not parametrize.is_parametrized(blk)
    rep = enforce([("mixer", blk)], "bf16", r0=1.0, seq_len=L)
    assert rep.worst_case.ok and set(rep.caps) >= {"mixer.in_proj.weight", "mixer.dt_proj.bias", "mixer.D"}
    # a longer sequence than planned is not covered: its bound is larger
    longer = blk.certificate_from_caps({k: 1.0 for sl in blk.cap_slots() for k in sl.keys}, seq_len=4 * L)
    shorter = blk.certificate_from_caps({k: 1.0 for sl in blk.cap_slots() for k in sl.keys}, seq_len=L)
    assert longer.c > shorter.c


@pytest.mark.parametrize("name", ["mamba_forecaster_lg_test", "mamba_forecaster_free_test",
                                  "mamba_forecaster_periln_test", "toto_style_test"])
def test_zoo_models_enforced(name: str) -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model(name, certify=False)
    r0 = model.input_radius()
    rep = enforce(model, "bf16", r0=r0)
    assert rep.worst_case.ok
    x = model.example_input()
    # the embedding and the head are not capped (the guarantee is for inputs within r0 and Lip(G) = 1): the
    # residual updates' parameters take huge steps pushing the output up
    updates = [p for _, m in model.residual_updates() for p in m.parameters()]
    opt = torch.optim.SGD(updates, lr=1e4)
    for _ in range(3):
        opt.zero_grad()
        (-model(x).square().mean()).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.certificate("bf16", r0=r0, lip_g=1.0).ok
    _within_caps(model)
    assert unenforce(model) == len(rep.caps)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())


def test_free_mamba_caps_shrink_the_weights() -> None:
    # q = 5: caps that certify the free forecaster's 4 updates in bf16 are far below its initial norms
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    lg, free = create_model("mamba_forecaster_lg_test"), create_model("mamba_forecaster_free_test", certify=False)
    a_lg, a_free = enforce(lg, "bf16").alpha, enforce(free, "bf16").alpha
    assert a_free < 0.5 < a_lg
    assert math.isfinite(a_free) and a_free > 0


def test_the_search_finds_a_planted_small_bound() -> None:
    # the searches above are not vacuous: the worst case shrunk below what the block attains is refuted
    import dataclasses

    blk = BLOCKS["linear_growth"](8)
    rep = enforce(certblocks.build_stack([blk], "fp16", dt=1.0, certify=False, seq_len=L), "fp16")
    worst = rep.worst_case.updates[0]
    planted = dataclasses.replace(worst, c=worst.c * 1e-3, b=worst.b * 1e-3, l1=worst.l1 * 1e-7,
                                  l0=worst.l0 * 1e-7, peak=None)
    with pytest.raises(AssertionError):
        _search(blk, planted, seed=0)


def test_casting_an_enforced_model_keeps_its_caps_exact() -> None:
    torch.manual_seed(9)
    st = certblocks.build_stack([MLP(D, 16), BLOCKS["swiglu"](9)], "fp16", dt=1.0, certify=False)
    enforce(st, "fp16")
    caps = [par.caps.clone() for m in st.modules() if parametrize.is_parametrized(m)
            for plist in m.parametrizations.values() for par in plist if isinstance(par, NormCap)]
    st.to(torch.bfloat16)  # a cast must not round a cap (up) into the parameters' dtype
    after = [par.caps for m in st.modules() if parametrize.is_parametrized(m)
             for plist in m.parametrizations.values() for par in plist if isinstance(par, NormCap)]
    assert all(a.dtype == torch.float64 and torch.equal(a, b) for a, b in zip(after, caps))
    with torch.no_grad():
        for p in st.parameters():
            p.mul_(100)
    _within_caps(st)

"""The model spine (:mod:`certblocks.model`): what :func:`as_certified` reads from each kind of model, the one batch
convention (:func:`as_args`), and consumers that read block capabilities rather than classes."""

from __future__ import annotations

import math
from collections import UserDict
from typing import Dict, List, Optional

import pytest
import torch
from torch import nn

import certblocks
from certblocks.blocks import MLP, Attention, LayerScale, QKNormAttention, ScaledBranch
from certblocks.bounds import product_norm
from certblocks.certificate import BlockCertificate
from certblocks.exponents import ATTENTION
from certblocks.model import (
    CertifiedModel,
    ResidualModel,
    as_args,
    as_certified,
    state_of,
    unwrap,
    velocity_output,
    with_state,
)
from certblocks.monitor import CertificateMonitor
from certblocks.updates import ResidualUpdates, residual_updates


def _stack() -> certblocks.stack.CertifiedStack:
    torch.manual_seed(0)
    fixed = BlockCertificate(1, 0, c=0.25, l0=0.25, name="fixed")
    return certblocks.build_stack([QKNormAttention(8, 2), (nn.Identity(), fixed), MLP(8, 16)], "bf16", dt=0.5,
                                  r0=3.0, lip_g=2.0, seq_len=16)


class _Converted(nn.Module):
    """A residual model holding certified blocks (the converted-model case), a gained MLP among them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.attn = QKNormAttention(8, 2)
        self.mlp = MLP(8, 16)
        self.ls = LayerScale(8, init_values=0.5)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        x = x + self.attn(x)
        x = x + self.ls(self.mlp(x))
        return self.head(x)


# ------------------------------------------------------------------------------------------------ kinds
def test_stack() -> None:
    st = _stack()
    cm = as_certified(st)
    assert cm.kind == "stack" and cm.module is st and cm.wrapper is st and cm.stack_forward
    assert cm.names == ["blocks.0", "blocks.1", "blocks.2"] and cm.modules == list(st.blocks)
    assert (cm.dt, cm.radius(), cm.lip_g, cm.seq_len, cm.dtype) == (0.5, 3.0, 2.0, 16, "bf16")
    assert cm.fixed[1] is not None and cm.certificates()[1].c == 0.25
    assert cm.certificate() is st.certificate()  # the stack's own (cached) certificate
    assert cm.certificate("fp16").dtype == "fp16" and cm.certificate(r0=1.0).r0 == 1.0
    assert as_certified(st, r0=1.0).certificate().r0 == 1.0
    x = torch.randn(2, 5, 8) * 0.1
    torch.testing.assert_close(cm(x), st(x))  # called through what was handed in
    with pytest.raises(ValueError, match=r"dt=0\.3 differs from the step 0\.5"):
        as_certified(st, dt=0.3)
    assert as_certified(cm) is cm and as_certified(cm, r0=2.0).radius() == 2.0


def test_zoo_model() -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test")
    assert isinstance(model, ResidualModel)
    cm = as_certified(model)
    assert cm.kind == "zoo" and cm.names == [n for n, _ in model.residual_updates()] and cm.dt == 1.0
    assert cm.radius() == model.input_radius() and cm.seq_len == model.certificate_seq_len()
    assert cm.head_certificate() is not None and cm.loss_gradient == model.loss_gradient
    want = model.certificate()
    got = cm.certificate()
    assert got.ok == want.ok and got.lip_g == want.lip_g and [u.c for u in got.updates] == [u.c for u in want.updates]
    assert [c.name for c in cm.certificates()] == cm.names
    assert set(cm.levers()) == set(model.levers())  # its gains (branch_gains) as well as its blocks'
    idx = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(cm(idx)[0], model(idx)[0])


def test_converted_model_and_conversion_report() -> None:
    from certblocks.conversion import ConversionReport

    torch.manual_seed(0)
    model = _Converted()
    cm = as_certified(model, r0=2.0)
    assert cm.kind == "blocks" and cm.names == ["attn", "mlp"] and not cm.stack_forward
    assert cm.radius() == 2.0 and cm.lip_g == 1.0 and cm.dtype is None
    with pytest.raises(ValueError, match="dtype: _Converted has no certification dtype"):
        cm.certificate()
    cert = cm.certificate("fp32", record_envelope=False)
    assert cert.r0 == 2.0 and [u.name for u in cert.updates] == ["attn", "mlp"]
    rep = ConversionReport(model, [], ())
    assert as_certified(rep).module is model and as_certified(rep).names == cm.names


def test_wrappers_are_unwrapped() -> None:
    st = _stack()
    dp = nn.DataParallel(st)
    assert unwrap(dp) is st and as_certified(dp).module is st and as_certified(dp).wrapper is dp
    compiled = torch.compile(st, backend="eager")
    assert unwrap(compiled) is st and as_certified(compiled).names == as_certified(st).names
    assert unwrap(nn.DataParallel(compiled)) is st  # nested
    assert unwrap(42) == 42 and unwrap(nn.Linear(2, 2)).in_features == 2


def test_pairs_and_graph_models() -> None:
    torch.manual_seed(0)
    pairs = [("a", MLP(8, 16)), ("b", Attention(8, 2))]
    cm = as_certified(pairs, r0=2.0, dt=0.5)
    assert cm.kind == "pairs" and cm.module is None and (cm.dt, cm.radius()) == (0.5, 2.0)
    assert cm.certificate("fp32").dt == 0.5
    with pytest.raises(TypeError, match="nothing to call"):
        cm(torch.randn(1, 2, 8))
    with pytest.raises(TypeError, match=r"model\[0\] must be a \(name, nn.Module\) pair"):
        as_certified([("a", 3)])
    with pytest.raises(ValueError, match="at least one"):
        as_certified([])
    with pytest.raises(TypeError, match="model must be a CertifiedStack"):
        as_certified(42)
    with pytest.raises(ValueError, match="r0 must be a finite number >= 0"):
        as_certified(pairs, r0=-1.0)
    with pytest.raises(ValueError, match="dt must be a finite number > 0"):
        as_certified(pairs, dt=0.0)
    class Plain(nn.Module):  # residual, no certified block: its updates are in its graph
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.f(x)

    plain = Plain()
    g = as_certified(plain)
    assert g.kind == "graph" and g.names == [] and g.modules == []
    with pytest.raises(ValueError, match="needs a batch"):
        g.certificate("fp32")
    x = torch.randn(2, 3, 6)
    want = certblocks.certify(plain, x)
    got = as_certified(plain, example_input=x).certificate("fp32")
    assert [u.c for u in got.updates] == [u.c for u in want.stack("fp32").updates]
    with pytest.raises(TypeError, match="has no certified block"):
        residual_updates(plain)  # the compatibility shim keeps its error
    assert ResidualUpdates is CertifiedModel and residual_updates(pairs).names == ["a", "b"]


# ------------------------------------------------------------------------------------------------ batches, calls
class _Batch:
    """A mapping-like batch that is not a dict (HF ``BatchEncoding`` is a ``UserDict``)."""

    def __init__(self, d: Dict[str, torch.Tensor]) -> None:
        self._d = d

    def keys(self):
        return self._d.keys()

    def __getitem__(self, k: str) -> torch.Tensor:
        return self._d[k]


def test_as_args() -> None:
    t = torch.zeros(2)
    assert as_args(t) == ((t,), {})
    assert as_args((t, 3)) == ((t, 3), {}) and as_args([t]) == ((t,), {})
    assert as_args({"x": t}) == ((), {"x": t}) and as_args(UserDict(x=t)) == ((), {"x": t})
    assert as_args(_Batch({"input_ids": t})) == ((), {"input_ids": t})
    tr = pytest.importorskip("transformers")
    assert as_args(tr.BatchEncoding({"input_ids": t})) == ((), {"input_ids": t})
    with pytest.raises(TypeError, match="batch must be a tensor"):
        as_args(3)


class _Keyworded(nn.Module):
    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0, **kwargs) -> tuple:
        return hidden_states * scale, None


def test_state_of_a_call_positional_or_keyword() -> None:
    m, x = _Keyworded(), torch.ones(2, 3)
    assert state_of(m, (x, 2.0), {})[1] == 0
    found = state_of(m, (), {"scale": 2.0, "hidden_states": x, "attention_mask": torch.zeros(2)})
    assert found[0] is x and found[1] == "hidden_states"
    assert state_of(m, (), {"attention_mask": x}) is None
    args, kwargs = with_state((), {"scale": 2.0}, "hidden_states", x)
    assert velocity_output(m(*args, **kwargs)).sum() == 12.0
    assert velocity_output([x]) is x and velocity_output((None, x)) is None


# ------------------------------------------------------------------------------------------------ capabilities
class _UserAttention(nn.Module):
    """A user's own certified attention (not a certblocks class): its capabilities are what the consumers read."""

    exponents = ATTENTION

    def __init__(self) -> None:
        super().__init__()
        self.inner = Attention(8, 2)
        self.stats_calls: List[Optional[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def certificate(self, *, seq_len=None, r0=None) -> BlockCertificate:
        return self.inner.certificate(seq_len=seq_len, r0=r0)

    def attention_stats(self, x=None, **kwargs) -> dict:
        self.stats_calls.append(x)
        return self.inner.attention_stats(x, **kwargs)


def test_consumers_read_capabilities_not_classes() -> None:
    torch.manual_seed(0)
    user = _UserAttention()
    gained = ScaledBranch(MLP(8, 16), LayerScale(8, init_values=0.25), ("mlp", "ls"))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user, self.mlp, self.ls = user, gained.branch, gained.gain

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.user(x)
            return x + self.ls(self.mlp(x))

    model = Model()
    pairs = [("user", user), ("gained", gained)]  # the gained update is a view: its branch and gain run
    cm = as_certified(pairs)
    assert cm.io(1) == (gained.branch, gained.gain) and cm.attention(0) is user
    mon = CertificateMonitor(pairs, "fp32", every=1, threshold=-1e9, headroom_threshold=None)
    x = torch.randn(2, 5, 8)
    model(x).square().mean().backward()
    rec = mon.step()
    w = user.inner.in_proj.weight.detach().double()
    kappa = max(product_norm(w[h * 4:(h + 1) * 4].T, w[8 + h * 4:8 + (h + 1) * 4]) for h in range(2))
    assert kappa * (1 - 2e-2) <= rec["user/kappa"] <= kappa * (1 + 1e-9)
    assert rec["user/max_logit"] > 0 and any(c is not None for c in user.stats_calls)  # read on the batch
    assert rec["gained/gain"] == pytest.approx(0.25) and 0 <= rec["gained/saturation"] <= 1.0
    assert math.isfinite(rec["data/alert_headroom"])
    levers = cm.levers()
    assert [lv.name for lv in levers[1]] == ["init_values"] and 0 not in levers  # plain attention: none


def test_fixes_name_only_levers_the_model_has() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[QKNormAttention(16, 2, qk_norm_eps=1e-12) for _ in range(8)])
    cm = as_certified(model, r0=4.0)
    cert = cm.certificate("bf16", record_envelope=False)
    assert not cert.ok
    fixes = cm.fixes("bf16")
    levers = [f.lever for f in fixes]
    assert "qk_norm_eps" in levers and "enforce" in levers and "dt" not in levers  # no step to change here
    eps = next(f for f in fixes if f.lever == "qk_norm_eps")
    for m in model:
        m.q_norm.eps = m.k_norm.eps = eps.value
    assert eps.ok and cm.certificate("bf16", record_envelope=False).ok  # the fix certifies, recomputed
    st = certblocks.build_stack(list(model), "bf16", r0=4.0, certify=False)
    with torch.no_grad():
        st.blocks[0].c_proj.weight.mul_(1e4)
    assert "dt" in {f.lever for f in as_certified(st).fixes()}  # a stack has one

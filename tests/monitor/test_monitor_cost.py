"""The monitor's check measured in the training step: the same figures as the separate passes, armed only when due,
hooks removed, overflows alerted with the same names (benchmarks/results/trajectory_cost.md: its cost)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional

import pytest
import torch
from certblocks.zoo import create_model
from torch import nn

import certblocks
from certblocks import CertificateMonitor
from certblocks.blocks import MLP, Attention, QKNormAttention
from certblocks.ondata import watch as watch_module
from certblocks.ondata.watch import StepRecorder
from certblocks.testing.record import _Recorder, intermediate_peaks


def _stack(overflow: bool = False) -> certblocks.stack.CertifiedStack:
    """Four updates; ``overflow``: the second one's hidden layer holds 1e5 (above float16's 65504), its output
    weight is 0 (the states and the gradient stay small)."""
    torch.manual_seed(0)
    blocks = [Attention(16, 2), MLP(16, 32), QKNormAttention(16, 2), MLP(16, 24)]
    st = certblocks.build_stack(blocks, "fp32", dt=0.5, r0=40.0, certify=False)
    if overflow:
        with torch.no_grad():
            st.blocks[1].fc1.bias.fill_(1e5)
            st.blocks[1].fc2.weight.zero_()
    return st


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y - 1.0).square().mean()


def _checked(model: nn.Module, run: Any, *, measure_in_step: bool, dtype: str = "fp32",
             autocast: Optional[torch.dtype] = None, **kw: Any) -> CertificateMonitor:
    """One checked training step of ``model`` (``run()`` returns the loss) under a new monitor."""
    mon = CertificateMonitor(model, dtype, every=1, measure_in_step=measure_in_step, **kw)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = run()
    loss.backward()
    mon.step()
    mon.remove()
    return mon


def _compare(a: Any, b: Any, path: str = "") -> List[str]:
    """Where two ``to_dict()`` reports differ (floats beyond rounding; wall time and notes left out)."""
    if isinstance(a, dict):
        return [d for key in a if key not in ("seconds", "notes") for d in _compare(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, list):
        assert len(a) == len(b), path
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _compare(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-12)
        return [] if same else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _both(model: nn.Module, run: Any, **kw: Any) -> Dict[bool, CertificateMonitor]:
    return {flag: _checked(model, run, measure_in_step=flag, **kw) for flag in (True, False)}


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_in_step_equals_separate_passes_zoo(autocast: Optional[torch.dtype]) -> None:
    """A zoo GPT with fused QK-norm, in float32 and under bf16 autocast: every figure of the report (states,
    costates, intermediates per dtype, logits, certified factors) as the separate recorded passes give it."""
    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test").train()
    idx = torch.randint(0, model.vocab_size, (3, model.block_size))
    mons = _both(model, lambda: model(idx, idx)[1], dtype="amp-bf16" if autocast else "bf16", autocast=autocast)
    new, old = mons[True], mons[False]
    assert new.records[0]["data/measured_in_step"] is True and old.records[0]["data/measured_in_step"] is False
    a, b = new._watch.last, old._watch.last
    assert a is not None and b is not None
    assert all(u.peaks and u.costate_norm is not None and u.costate_norm > 0 for u in a.updates)
    assert any(u.max_logit is not None for u in a.updates)
    if autocast is not None:  # the bf16 matmul outputs and the float32 stream are told apart
        assert any(set(u.peaks) == {"bf16", "fp32"} for u in a.updates)
    assert _compare(a.to_dict(), b.to_dict()) == []
    for key in ("data/alert_headroom", "data/headroom_measured", "data/worst_update", "data/worst_quantity"):
        assert new.records[0][key] == pytest.approx(old.records[0][key], rel=1e-6) if isinstance(
            new.records[0][key], float) else new.records[0][key] == old.records[0][key]
    assert all(m.fused_qk_norm for m in model.modules() if hasattr(m, "fused_qk_norm"))  # restored


def test_in_step_equals_separate_passes_stack() -> None:
    """A CertifiedStack (dt = 0.5, a loss on its last state) whose input requires grad: the same report; the
    costates from tensor hooks on X_k equal the separate passes' vector-Jacobian products."""
    st = _stack().train()
    x = (torch.randn(3, 6, 16) * 2.0).requires_grad_(True)
    mons = _both(st, lambda: _loss(st(x)))
    assert mons[True].records[0]["data/measured_in_step"] is True
    assert _compare(mons[True]._watch.last.to_dict(), mons[False]._watch.last.to_dict()) == []


def test_separate_passes_where_the_step_cannot_measure() -> None:
    """An input without grad (no costate at X_0 in the user's backward), a forward without grad, another basis:
    the separate passes run (the record says so), with the same figures as before."""
    st = _stack().train()
    x = torch.randn(3, 6, 16) * 2.0
    mon = _checked(st, lambda: _loss(st(x)), measure_in_step=True)
    assert mon.records[0]["data/measured_in_step"] is False and mon.records[0]["data/headroom_measured"] is not None
    mon = _checked(st, lambda: _loss(st(x.requires_grad_(True))), measure_in_step=True, headroom_basis="estimate")
    assert mon.records[0]["data/measured_in_step"] is False and mon.records[0]["data/alert_basis"] == "estimate"
    mon = CertificateMonitor(st, "fp32", every=1)
    with torch.no_grad():
        st(x)
    rec = mon.step()
    mon.remove()
    assert rec is not None and rec["data/measured_in_step"] is False and rec["data/head_source"] == "lip_g"


class _Counting(StepRecorder):
    made = 0

    def __init__(self, x: torch.Tensor) -> None:
        _Counting.made += 1
        super().__init__(x)


def test_armed_only_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """``every=3``: the recorders run in the forwards of steps 0 and 3 only; ``estimate_every=2``: a check with the
    estimates is not measured in its step (its Lanczos needs the separate passes)."""
    monkeypatch.setattr("certblocks._monitor_hooks.StepRecorder", _Counting)
    st = _stack().train()
    x = (torch.randn(2, 5, 16) * 2.0).requires_grad_(True)
    mon = CertificateMonitor(st, "fp32", every=3)
    made = []
    for _ in range(6):
        st.zero_grad()
        _loss(st(x)).backward()
        made.append(_Counting.made)
        mon.step()
    assert made == [4, 4, 4, 8, 8, 8]  # four updates, measured at steps 0 and 3
    assert [r["step"] for r in mon.records] == [0, 3] and all(r["data/measured_in_step"] for r in mon.records)
    mon.remove()
    _Counting.made = 0
    mon = CertificateMonitor(st, "fp32", every=1, estimate_every=2)
    for _ in range(3):
        st.zero_grad()
        _loss(st(x)).backward()
        mon.step()
    assert [r["data/measured_in_step"] for r in mon.records] == [False, True, False]
    assert _Counting.made == 4 and mon.records[0]["data/headroom"] is not None  # the estimate at checks 0 and 2
    mon.remove()


def test_hooks_removed_and_no_mode_left() -> None:
    """No recorder stays on the mode stack after a checked forward (nor after one that raised), and ``remove()``
    leaves the modules with the hooks they had."""
    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test").train()
    idx = torch.randint(0, model.vocab_size, (2, model.block_size))
    before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    mon = CertificateMonitor(model, "bf16", every=1)
    assert any(len(m._forward_pre_hooks) > before[n][1] for n, m in model.named_modules())
    mlp = model.transformer.h[0].mlp

    def boom(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("boom")
    mlp.forward = boom  # raises inside an update, between its entry and its exit
    with pytest.raises(RuntimeError, match="boom"):
        model(idx, idx)
    del mlp.forward
    assert len(mon._recording) == 1  # left running by the raise
    mon.step()  # ends it first
    assert _Recorder.active == [] and mon._recording == {}
    for _ in range(2):
        model.zero_grad()
        model(idx, idx)[1].backward()
        assert _Recorder.active == [] and len(mon._step_figs) == len(mon.updates.modules)
        assert mon.step()["data/measured_in_step"] is True
    assert all(m.fused_qk_norm for m in model.modules() if hasattr(m, "fused_qk_norm"))
    mon.remove()
    after = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    assert after == before


def test_overflow_alerted_with_the_same_names() -> None:
    """An MLP whose hidden layer exceeds float16's 65504 on the batch: both ways alert ``headroom`` naming the same
    update and cause, at the same value."""
    st = _stack(overflow=True).train()
    x = (torch.randn(3, 6, 16) * 2.0).requires_grad_(True)
    alerts = {}
    for flag in (True, False):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            mon = _checked(st, lambda: _loss(st(x)), measure_in_step=flag, dtype="fp16")
        alerts[flag] = [a for a in mon.alerts if a["quantity"] == "headroom"]
        assert mon.records[0]["data/measured_in_step"] is flag
    new, old = alerts[True], alerts[False]
    assert len(new) == 1 and len(old) == 1
    assert new[0]["value"] < 0  # an overflow: negative headroom
    assert (new[0]["update"], new[0]["cause"]) == (old[0]["update"], old[0]["cause"]) == ("blocks.1", "intermediate")
    assert new[0]["value"] == pytest.approx(old[0]["value"], rel=1e-6)


def test_step_recorder_matches_float64_recorder() -> None:
    """The native-dtype maxima equal the float64 recorder's: masked-logit sentinels left out, NaN read as inf,
    per dtype under autocast."""
    def f(x: torch.Tensor) -> torch.Tensor:
        logits = (x @ x.transpose(-1, -2)) * 3.0
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
        return logits.softmax(-1) @ torch.nn.functional.gelu(x * 50.0)

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    for ac in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            want = intermediate_peaks(f, x)
            xg = x.clone().requires_grad_(True)
            with StepRecorder(xg) as rec:
                f(xg)
        got = rec.peaks()
        assert got[0] == want[0] and got[1] == watch_module.named_peaks(want[1])
    xn = x.clone()
    xn[0, 0, 0] = math.nan
    xg = xn.requires_grad_(True)
    with StepRecorder(xg) as rec:
        f(xg)
    assert rec.peaks()[0] == math.inf == intermediate_peaks(f, xn)[0]


def test_certificate_every() -> None:
    """``certificate_every=2``: the worst-case figures at checks 0 and 2 only; the other checks keep the batch and
    on-data measured figures (certified ones absent), and a non-finite weight is still alerted there."""
    st = _stack().train()
    x = (torch.randn(2, 5, 16) * 2.0).requires_grad_(True)
    mon = CertificateMonitor(st, "fp32", every=1, certificate_every=2, worst_case_alerts=True, threshold=0.99)
    for _ in range(3):
        st.zero_grad()
        _loss(st(x)).backward()
        mon.step()
    with_cert = ["stack/ok" in r for r in mon.records]
    assert with_cert == [True, False, True]
    off = mon.records[1]
    assert "blocks.1/c" not in off and "blocks.1/margin_fwd" not in off and off["blocks.1/saturation"] is None
    assert off["blocks.1/state_norm"] > 0 and off["blocks.0/kappa"] > 0 and off["data/measured_in_step"] is True
    assert off["data/headroom_measured"] is not None and off["data/headroom_certified"] is None
    assert mon.records[0]["data/headroom_certified"] is not None
    worst = [a["step"] for a in mon.alerts if a["quantity"] in ("stack/margin_grad", "margin_fwd")]
    assert worst and set(worst) <= {0, 2}  # the worst-case alerts where the certificate was computed
    with torch.no_grad():
        st.blocks[2].in_proj.weight[0, 0] = math.nan
    st.zero_grad()
    st(x)
    rec = mon.step()  # check 3: no certificate due, the weights are still checked
    mon.remove()
    name = next(n for n, p in st.named_parameters() if not bool(torch.isfinite(p).all()))  # as certificates() names it
    assert rec is not None and rec["stack/ok"] is False and name in rec["nonfinite"]
    assert mon.alerts[-1]["quantity"] == "non-finite weights" and mon.alerts[-1]["update"] == name
    with pytest.raises(ValueError, match="certificate_every"):
        CertificateMonitor(st, "fp32", certificate_every=0)

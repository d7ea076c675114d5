"""``CertificateMonitor.step(loss_scale=...)``: the backward headroom reads the unscaled gradients (a GradScaler's
scaled gradient past ``M`` is a skipped step it absorbs, not an overflow of the run)."""

from __future__ import annotations

import math
from typing import Any, Dict

import pytest
import torch

import certblocks
from certblocks import CertificateMonitor
from certblocks.blocks import MLP, QKNormAttention


def _stack() -> certblocks.stack.CertifiedStack:
    torch.manual_seed(0)
    return certblocks.build_stack([QKNormAttention(16, 2), MLP(16, 32)], "fp32", dt=0.5, r0=40.0, certify=False)


def _record(scale: float, loss_scale: Any, measure_in_step: bool) -> Dict[str, Any]:
    st = _stack()
    mon = CertificateMonitor(st, "fp32", every=1, measure_in_step=measure_in_step)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ((st(x) - 1.0).square().mean() * scale).backward()
    rec = mon.step(loss_scale=loss_scale)
    mon.remove()
    assert rec is not None
    return rec


@pytest.mark.parametrize("measure_in_step", [True, False])
def test_costates_read_unscaled(measure_in_step: bool) -> None:
    plain = _record(1.0, None, measure_in_step)
    keys = [k for k in plain if k.endswith("/data_costate_norm")]
    assert keys and all(plain[k] is not None and plain[k] > 0 for k in keys), keys
    scaled = _record(1024.0, 1024.0, measure_in_step)
    assert scaled["data/loss_scale"] == 1024.0 and plain["data/loss_scale"] == 1.0
    for k in keys:
        assert scaled[k] == pytest.approx(plain[k], rel=1e-5), k
    unscaled = _record(1024.0, None, measure_in_step)  # not told: the costates are the scaled ones
    assert all(unscaled[k] == pytest.approx(1024.0 * plain[k], rel=1e-5) for k in keys)
    key = "data/backward_headroom_measured"
    assert math.isfinite(plain[key]) and scaled[key] == pytest.approx(plain[key], abs=1e-4)
    assert unscaled[key] == pytest.approx(plain[key] - math.log(1024.0), abs=1e-4)  # log(1024) nats less


def test_grad_scaler_and_bad_values() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    plain = _record(1.0, None, True)
    rec = _record(256.0, scaler, True)
    keys = [k for k in plain if k.endswith("/data_costate_norm")]
    assert rec["data/loss_scale"] == 256.0
    assert all(rec[k] == pytest.approx(plain[k], rel=1e-5) for k in keys)
    mon = CertificateMonitor(_stack(), "fp32", every=1)
    for bad in (0.0, -2.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="loss_scale"):
            mon.step(loss_scale=bad)
    mon.remove()


def test_trainer_callback_reads_the_optimizer_wrappers_scaler() -> None:
    """The HF callback passes the GradScaler that accelerate's optimizer wrapper holds (``optimizer.scaler``)."""
    from types import SimpleNamespace

    from certblocks.integrations import CertificateCallback

    plain = _record(1.0, None, True)
    keys = [k for k in plain if k.endswith("/data_costate_norm")]
    st = _stack()
    cb = CertificateCallback("fp32", every=1)
    control = SimpleNamespace(should_training_stop=False)
    cb.on_train_begin(None, None, control, model=st)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ((st(x) - 1.0).square().mean() * 64.0).backward()
    wrapper = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", init_scale=64.0))
    cb.on_pre_optimizer_step(None, SimpleNamespace(global_step=0), control, optimizer=wrapper)
    rec = cb.monitor.records[-1]
    cb.on_train_end(None, None, control)
    assert rec["data/loss_scale"] == 64.0
    assert all(rec[k] == pytest.approx(plain[k], rel=1e-5) for k in keys)

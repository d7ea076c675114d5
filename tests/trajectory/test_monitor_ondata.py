"""The monitor's on-data alert: fires on a diverging toy run before its loss is non-finite, not on a stable run;
the threshold and trend options; a model without certified blocks is watched on data only (its graph)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from _traj_models import PlainResidual

import certblocks
from certblocks.blocks import MLP
from certblocks.monitor import CertificateMonitor, CertificateWarning

DATA = ("headroom", "headroom trend")


def _run(diverge: bool, steps: int, **kw: Any) -> Tuple[Optional[int], CertificateMonitor]:
    """Train 4 MLP updates in float16 autocast; ``diverge``: maximize the output's norm (the weights grow until the
    forward overflows), else regress onto a fixed target.  Returns the first step with a non-finite loss."""
    torch.manual_seed(0)
    st = certblocks.build_stack([MLP(8, 16) for _ in range(4)], "fp16", certify=False)
    mon = CertificateMonitor(st, "fp16", every=1, **kw)
    opt = torch.optim.Adam(st.parameters(), lr=0.03 if diverge else 0.01)
    g = torch.Generator().manual_seed(0)
    target = torch.randn(4, 6, 8, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CertificateWarning)
        for step in range(steps):
            x = torch.randn(4, 6, 8, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                y = st(x)
            loss = -y.float().square().mean() if diverge else (y.float() - target).square().mean()
            if not torch.isfinite(loss):
                return step, mon
            opt.zero_grad()
            loss.backward()
            mon.step()
            opt.step()
    return None, mon


def _data_alerts(mon: CertificateMonitor, quantity: Optional[str] = None) -> List[Dict[str, Any]]:
    return [a for a in mon.alerts if a["quantity"] in DATA and (quantity is None or a["quantity"] == quantity)]


def test_alert_before_divergence_and_none_on_a_stable_run() -> None:
    bad, mon = _run(True, 60, estimate_every=1)  # the Lanczos estimates too, to compare the bases
    assert bad is not None  # the run diverges
    alerts = _data_alerts(mon, "headroom")
    assert alerts and alerts[0]["step"] < bad  # the on-data alert comes before the first non-finite loss
    first = alerts[0]
    assert first["update"] == "head" or first["update"].startswith("blocks.")
    assert first["cause"] in certblocks.ondata.QUANTITIES and "consumes the most" in first["message"]
    rec = mon.records[first["step"]]
    assert first["value"] < 1.0 and rec["data/alert_headroom"] == first["value"]
    # the alerts read the measured headroom (the training backward gave p_D); the (T) estimate is not above it
    assert first["basis"] == rec["data/alert_basis"] == "measured" and rec["data/headroom_measured"] == first["value"]
    assert all(r["data/headroom"] <= r["data/headroom_measured"] + 1e-9 for r in mon.records
               if r["data/headroom_measured"] is not None and math.isfinite(r["data/headroom_measured"]))
    headrooms = [r["data/alert_headroom"] for r in mon.records]
    assert headrooms[0] > 5.0 and headrooms[-1] < 1.0
    ok, stable = _run(False, 30)
    assert ok is None and _data_alerts(stable) == []
    assert all(r["data/alert_headroom"] > 5.0 for r in stable.records)
    # by default a check on the measured basis runs no Lanczos estimate
    assert all(r["data/headroom"] is None and r["blocks.0/jacobian_norm"] is None for r in stable.records)
    # the worst-case margins are recorded, and do not alert by default
    assert "stack/margin_grad" in stable.records[-1] and not any("margin" in a["quantity"] for a in stable.alerts)


def test_trend_option_warns_earlier_and_threshold_option() -> None:
    bad, trend = _run(True, 60, horizon=10, headroom_threshold=None)
    assert bad is not None
    alerts = _data_alerts(trend)
    assert alerts and {a["quantity"] for a in alerts} == {"headroom trend"}  # no threshold: trend alerts only
    assert alerts[0]["step"] <= bad - 5 and "reaches 0 near step" in alerts[0]["message"]
    _, none = _run(True, 60, headroom_threshold=None)
    assert _data_alerts(none) == []  # neither option: no on-data alert
    _, high = _run(False, 4, headroom_threshold=20.0)  # a threshold above the stable run's headroom
    assert [a["step"] for a in _data_alerts(high, "headroom")] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="headroom_threshold"):
        CertificateMonitor(certblocks.build_stack([MLP(4, 4)], "fp16"), "fp16", headroom_threshold=math.nan)


def test_model_without_certified_blocks_is_watched_on_data(tmp_path) -> None:
    torch.manual_seed(0)
    m = PlainResidual()
    mon = CertificateMonitor(m, "fp16", every=2, headroom_threshold=30.0)
    assert mon.updates is None and "on-data only" in repr(mon)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(3, 4, 6)
    with pytest.warns(CertificateWarning, match="on-data headroom"):
        for _ in range(3):
            loss = m(x).square().mean()
            opt.zero_grad()
            loss.backward()
            mon.step()
            opt.step()
    assert [r["step"] for r in mon.records] == [0, 2]
    rec = mon.records[-1]
    again = certblocks.trajectory(m, x, "fp16", certified=False)  # after one more small SGD step
    assert rec["data/headroom"] == pytest.approx(again.headroom, rel=0.05)
    assert [a["step"] for a in mon.alerts] == [0, 2] and m.training  # the check restores the training mode
    mon.to_csv(tmp_path / "m.csv")

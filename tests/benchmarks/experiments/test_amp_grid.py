"""benchmarks/experiments/amp_grid.py: the fp16 grid under AMP records the amp-fp16 certificate, the monitor and the
overflow; the verdicts and scores on hand-made runs."""

from __future__ import annotations

import argparse
import json
import math

import lr_sensitivity as lrs
import pytest
import torch
from amp_grid import _block_of, _pr, alert_side, main, run_bytes, summarize, table, verdict

TINY = ["--datasets", "bytes", "--variants", "qknorm_noln", "--seeds", "0", "--layers", "1", "--byte-width", "16",
        "--heads", "2", "--block", "16", "--byte-batch", "2", "--eval-windows", "4", "--corpus-bytes", "20000",
        "--monitor-every", "1"]


def _args(**kw) -> argparse.Namespace:
    grid = {name.replace("-", "_"): default for name, default, _ in lrs.INT_OPTIONS}
    grid.update(layers=1, byte_width=16, heads=2, block=16, byte_batch=2, eval_windows=4)
    return argparse.Namespace(**{**grid, "clip": 1.0, "monitor_every": 1, "stuck": 10, **kw})


def test_an_absurd_lr_overflows_in_fp16_and_the_run_records_the_certificate() -> None:
    torch.set_num_threads(1)
    a = _args(byte_steps=3, cert_steps={0})
    data = lrs.byte_data(20000, a.block, a.eval_windows)
    r = run_bytes("qknorm_noln", 3.0, 0, data, a)  # Adam at lr 3: the second forward's MLP output leaves fp16
    ov = r["overflow"]
    assert ov["kind"] == "forward" and ov["step"] == 1 and r["nonfinite_step"] == 1 and r["blew_up"]
    assert ov["observed"] == {"module": "stack.blocks.1.fc2", "dtype": "float16"}  # the last MLP's fc2, in fp16
    assert r["trace"][0]["scale"] == 65536.0 and math.isfinite(r["trace"][0]["loss"])
    (c,) = r["certs"]
    assert c["step"] == 0
    for which in ("spine", "graph"):
        s = c[which]
        assert isinstance(s["ok"], bool) and 0 <= s["certified_depth"] <= s["depth"] == 2, s
    # the whole model's graph under amp-fp16 bounds every fp16-held gradient: a finite positive safe loss scale
    assert 0 < c["graph"]["max_loss_scale"] < math.inf
    assert c["spine"]["max_loss_scale"] is None  # the blocks' own chain does not bound their gradients
    assert [m["step"] for m in r["monitor_records"]] == [0]  # checked once, before the overflowing forward
    v = verdict({**r, "dataset": "bytes"})
    assert v["overflowed"] and v["observed"] == "stack.blocks.1.fc2" and "graph" in v and "spine" in v


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("amp")
    argv = TINY + ["--quick", "--multipliers", "1", "300", "--byte-steps", "10", "--cert-steps", "0", "4",
                   "--out", str(d)]
    assert main(argv) == 0
    return d, json.loads((d / "amp_grid_quick.json").read_text())


@pytest.mark.slow  # two tiny runs of 10 steps with a monitor check at each step
def test_smoke_grid_the_monitor_warns_on_the_forward_side_before_the_overflow(smoke):
    d, s = smoke
    runs = {r["multiplier"]: r for r in map(json.loads, (d / "amp_grid_quick.jsonl").read_text().splitlines())}
    ok, bad = runs[1.0], runs[300.0]
    assert ok["overflow"] is None and not ok["blew_up"] and math.isfinite(ok["final_loss"])
    assert [c["step"] for c in ok["certs"]] == [0, 4] and len(ok["monitor_records"]) == 10
    # lr 0.3: the last MLP's fp16 output grows to the edge of fp16 (65024 at step 9 on this seed), the held-out
    # forward after the last step overflows; the monitor's measured forward headroom fell below 1 nat before
    assert bad["overflow"]["kind"] == "final" and bad["overflow"]["observed"]["module"] == "stack.blocks.1.fc2"
    v = verdict(bad)
    assert v["monitor_warned_forward"] is not None and v["monitor_warned_forward"] < v["step"]
    assert v["monitor_named"] == "blocks.1 (forward)" and v["monitor_named_observed"]
    sc = s["scores"]["bytes"]["monitor warned before the overflow, forward side"]
    assert (sc["tp"], sc["fp"], sc["fn"], sc["tn"]) == (1, 0, 0, 1)
    assert "| qknorm_noln | 0.3 |" in table(s)


def _alert(step, update, fwd, bwd):
    return {"step": step, "update": update, "quantity": "headroom", "value": min(fwd, bwd),
            "message": f"step {step}: on-data headroom {min(fwd, bwd):.4g} nats below 1 (fp16, measured: forward "
                       f"{fwd:.4g}, backward {bwd:.4g}): update {update!r} consumes the most"}


def _cert(step, ok, fwd_refused, name="blocks.7", kind="forward"):
    c = {"ok": ok, "forward_depth": 8, "backward_depth": 2, "certified_depth": 2, "depth": 8, "max_loss_scale": 1e-9,
         "forward_refused": fwd_refused, "failure": None if ok else {"kind": kind, "name": name, "index": 7,
                                                                     "reason": "r"},
         "nearest_fp16": {"segment": 7, "name": name, "what": "W2 h", "ratio": 0.5}}
    return {"step": step, "spine": c}


def _run(seed, overflow, alerts, certs, reason=""):
    return {"dataset": "bytes", "variant": "qknorm_noln", "multiplier": 6.3, "lr": 6.3e-3, "seed": seed,
            "overflow": overflow, "monitor_alerts": alerts, "certs": certs, "skipped_steps": [], "reason": reason}


def test_verdicts_and_scores_on_hand_made_runs():
    fc2 = {"module": "stack.blocks.7.fc2", "dtype": "float16"}
    runs = [
        # overflow at 23: a backward-side alert at 0, the forward-side one at 18 naming the block; the certificate
        # refuses forward from step 8 naming blocks.7
        _run(0, {"kind": "forward", "step": 23, "observed": fc2},
             [_alert(0, "head", 5.0, 0.9), _alert(18, "blocks.7", 0.97, 9.5), _alert(30, "blocks.7", 0.1, 9.0)],
             [_cert(0, False, False, kind="backward"), _cert(8, False, True), _cert(24, False, True)]),
        # no overflow, no alert; the certificate refuses (backward) at init and never forward
        _run(1, None, [], [_cert(0, False, False, kind="backward"), _cert(8, False, False, kind="backward")]),
        # overflow with no warning before it (the alert comes at the overflow step: not before)
        _run(2, {"kind": "scaler", "step": 5, "observed": None}, [_alert(5, "blocks.1", 0.5, 3.0)],
             [_cert(0, True, False)]),
    ]
    v0, v1, v2 = (verdict(r) for r in runs)
    assert (v0["overflowed"], v0["kind"], v0["step"], v0["observed"]) == (True, "forward", 23, "stack.blocks.7.fc2")
    assert (v0["monitor_warned"], v0["monitor_warned_forward"], v0["monitor_named"]) == (0, 18, "blocks.7 (forward)")
    assert v0["monitor_named_observed"] and v0["spine"]["forward_refused_before"] == 8
    assert v0["spine"]["named"] == "blocks.7" and v0["spine"]["init_failure"] == "backward at blocks.7"
    assert not v1["overflowed"] and v1["monitor_warned"] is None and v1["spine"]["forward_refused_before"] is None
    assert v1["spine"]["named"] == "blocks.7: W2 h"  # no forward refusal: the fp16 value nearest M
    assert v2["overflowed"] and v2["monitor_warned"] is None and v2["spine"]["init_ok"]
    sc = summarize(runs)["scores"]["bytes"]
    assert sc["spine: refused at init"] == {"tp": 1, "fp": 1, "fn": 1, "tn": 0, "precision": 0.5, "recall": 0.5}
    assert sc["spine: forward refused at a check before the overflow"]["tp"] == 1
    assert sc["spine: forward refused at a check before the overflow"]["fn"] == 1
    assert sc["monitor warned before the overflow"] == {"tp": 1, "fp": 0, "fn": 1, "tn": 1, "precision": 1.0,
                                                        "recall": 0.5}
    assert sc["monitor named the observed update"] == {"runs": 1, "warned": 1, "warned_forward": 1, "same_update": 1,
                                                       "spine_same_update": 1, "graph_same_update": None}
    assert v0["spine"]["named_update"] == "blocks.7" and v0["spine"]["named_observed"]


def test_a_scaler_overflow_starts_at_its_dense_run_of_skips():
    r = _run(0, {"kind": "scaler", "step": 11, "observed": {"module": "patch.W_P.weight", "dtype": "parameter"}},
             [_alert(8, "layers.1", 3.0, 0.2)], [_cert(0, False, False, kind="backward")])
    r["skipped_steps"] = [1, 2, 3, 5, 6, 9, 10, 11]  # 6 -> 9 is a gap of 3: the run of skips starts at 9
    v = verdict(r)
    assert (v["kind"], v["step"], v["observed"]) == ("scaler", 9, "patch.W_P.weight (gradient)")
    assert v["monitor_warned"] == 8 and v["monitor_warned_forward"] is None


def test_alert_side_block_of_and_pr():
    assert alert_side(_alert(0, "head", 5.0, 0.9)) == "backward"
    assert alert_side(_alert(0, "blocks.1", 0.2, 7.0)) == "forward"
    assert alert_side({"quantity": "kappa", "message": "kappa grew"}) == "kappa"
    assert _block_of("stack.blocks.7.fc2") == "blocks.7" and _block_of("layers.2.mixer.out_proj") == "layers.2"
    assert _block_of("head") is None and _block_of(None) is None
    assert _pr([True, True, False, False], [True, False, True, False]) == {
        "tp": 1, "fp": 1, "fn": 1, "tn": 1, "precision": 0.5, "recall": 0.5}
    assert _pr([False], [False])["precision"] is None


def test_command_line_rejects_bad_settings():
    for argv in (["--multipliers", "0"], ["--monitor-every", "-1"], ["--variants", "nope"], ["--stuck", "0"],
                 ["--lr", "1e-3", "nan"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_probe_names_the_first_nonfinite_gradient_output_then_parameter():
    from amp_grid import Probe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    probe = Probe(model)
    x = torch.full((1000, 4), 300.0)
    # an output gradient past fp16's M: the last Linear's fp16 output gets an infinite gradient
    probe.start()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    probe.stop()
    (out.float().sum() * 1e6).backward()
    assert [(n, d) for n, _, d in probe.grads] == [("1", "float16"), ("0", "float16")]
    assert probe.first_grad_nonfinite() == {"module": "1", "dtype": "float16"}
    # finite output gradients, a weight gradient summed over 1000 rows in fp16 past M: named by its parameter
    model.zero_grad()
    probe.start()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model[0](x)
    probe.stop()
    (out.float().sum() * 300.0).backward()
    assert all(ok for _, ok, _ in probe.grads)
    assert probe.first_grad_nonfinite() == {"module": "0.weight", "dtype": "parameter"}
    probe.remove()

"""Blocks, a zoo model, the monitor and enforcement under DDP and FSDP2 (gloo, CPU, 2 processes).

Each test spawns 2 processes (``torch.multiprocessing``, spawn) on a free localhost port; the workers are
in ``_cb_dist_workers.py`` (imported by name: the spawned processes receive this process's ``sys.path``).
A hang fails the test: the processes are joined with a deadline and killed, and pytest-timeout bounds
each test.

What is compared (the monitor's figures are computed on each rank from the weights it holds and the batch
it sees):

* weight figures (coefficients, margins, radii, ``kappa`` and operator-norm estimates): identical on all
  ranks, and identical to a single-process run with the same weights;
* batch figures (saturation, cosine, logits): identical on all ranks and to the single-process run when
  each rank sees the global batch; with a sharded batch they are per-rank figures, and the saturation's
  maximum over ranks (``all_reduce(MAX)``) is the global batch's figure.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Any, Dict, List

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
W = importlib.import_module("_cb_dist_workers")
import torch.distributed as dist  # noqa: E402
from _cb_launch import spawn_ranks  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend"),
]

BATCH_KEYS = ("/saturation", "/cosine", "/max_logit", "/state_norm", "/velocity_norm",
              # the on-data certificate (data/... and per update): figures of the batch a rank saw
              "/headroom", "/forward_headroom", "/backward_headroom", "/headroom_certified", "/log_grad_bound",
              "/log_grad_bound_certified", "/forward_max", "/head_norm", "/head_source", "/converged", "/worst_update",
              "/worst_quantity", "/jacobian_norm", "/jacobian_bound", "/jacobian_steps", "/peak", "/data_log_factor",
              "/data_state_norm", "/data_max_logit", "/alert_headroom", "/alert_basis", "/headroom_measured",
              "/forward_headroom_measured", "/backward_headroom_measured", "/log_grad_measured", "/data_costate_norm")


def _launch(scenario: str, tmp_path: Any, timeout: float = 100.0, **kwargs: Any) -> List[Dict[str, Any]]:
    """Run ``scenario`` on 2 spawned gloo processes; return each rank's result (fail on error or hang)."""
    out = str(tmp_path)
    return spawn_ranks(W.entry, lambda rank, port: (scenario, rank, port, out, kwargs), out, W.WORLD, timeout)


def _single(kind: str, steps: int = W.STEPS) -> Dict[str, Any]:
    """The single-process run: same seeded model, the global batch, the same optimizer and monitor."""
    from certblocks.monitor import CertificateMonitor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers
    try:
        model = W.build(kind)
        mon = CertificateMonitor(model, "fp32", every=1, threshold=-1e9, kappa_growth=None)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for s in range(steps):
            x, y = W.batch(kind, s)
            opt.zero_grad()
            loss = W.loss_of(kind, model, x, y)
            loss.backward()
            mon.step()
            opt.step()
            losses.append(float(loss.detach()))
        return {"records": mon.records, "weights": W.weights(model), "losses": losses}
    finally:
        torch.set_num_threads(threads)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _assert_records_equal(ra: List[Dict[str, Any]], rb: List[Dict[str, Any]], *, rel: float = 0.0,
                          skip_batch: bool = False, what: str = "") -> None:
    assert len(ra) == len(rb) == W.STEPS
    for a, b in zip(ra, rb):
        assert a.keys() == b.keys()
        for k in a:
            if skip_batch and k.endswith(BATCH_KEYS):
                continue
            if rel == 0.0 or not isinstance(a[k], float):
                assert _same(a[k], b[k]), f"{what} step {a['step']}: {k}: {a[k]!r} != {b[k]!r}"
            else:
                assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-12, nan_ok=True), \
                    f"{what} step {a['step']}: {k}: {a[k]!r} vs {b[k]!r}"


def _assert_weights_equal(wa: Dict[str, torch.Tensor], wb: Dict[str, torch.Tensor], rtol: float = 0.0) -> None:
    assert wa.keys() == wb.keys()
    for k in wa:
        if rtol == 0.0:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=1e-7, msg=k)


def _has_batch_figures(records: List[Dict[str, Any]]) -> None:
    """The batch figures were measured (not None) on every update, every step."""
    for r in records:
        sats = [v for k, v in r.items() if k.endswith("/saturation")]
        coss = [v for k, v in r.items() if k.endswith("/cosine")]
        assert sats and all(isinstance(v, float) and 0.0 <= v <= 1.0 + 1e-6 for v in sats), sats
        assert coss and all(isinstance(v, float) and -1.0 <= v <= 1.0 for v in coss), coss


# ------------------------------------------------------------------------------------------------ DDP
@pytest.mark.parametrize("kind", ["stack", "zoo"])
def test_ddp_monitor_same_batch_matches_single_process(kind: str, tmp_path: Any) -> None:
    """Each rank sees the global batch: DDP's averaged gradient is the single process's exactly, so every
    figure of every check, the losses and the final weights are bitwise those of the single-process run."""
    res = _launch("ddp_monitor", tmp_path, kind=kind, shard=False)
    ref = _single(kind)
    for r, out in enumerate(res):
        assert all(math.isfinite(v) for v in out["losses"])
        _has_batch_figures(out["records"])
        _assert_records_equal(out["records"], res[0]["records"], what=f"rank {r} vs rank 0")
        _assert_records_equal(out["records"], ref["records"], what=f"rank {r} vs single process")
        _assert_weights_equal(out["weights"], ref["weights"])
        assert out["losses"] == ref["losses"]
    # the run did train: the weights moved
    assert not torch.equal(ref["weights"][next(iter(ref["weights"]))], W.weights(W.build(kind))[
        next(iter(ref["weights"]))])


def test_ddp_monitor_sharded_batch(tmp_path: Any) -> None:
    """Each rank sees half of the global batch: weight figures identical on both ranks (exactly) and equal to
    the single-process run on the global batch (exactly at the first check, same weights; to rounding after
    steps); batch figures are per rank, and their saturation maximum over ranks is the global one."""
    res = _launch("ddp_monitor", tmp_path, kind="stack", shard=True)
    ref = _single("stack")
    _assert_records_equal(res[1]["records"], res[0]["records"], skip_batch=True, what="rank 1 vs rank 0")
    _assert_weights_equal(res[1]["weights"], res[0]["weights"])
    for k, v in res[0]["records"][0].items():
        if not k.endswith(BATCH_KEYS):
            assert _same(v, ref["records"][0][k]), k
    _assert_records_equal(res[0]["records"], ref["records"], rel=1e-5, skip_batch=True, what="DDP vs single")
    _assert_weights_equal(res[0]["weights"], ref["weights"], rtol=1e-5)
    # the batch figures differ between ranks (different samples) ...
    sat = [[r[k] for k in r if k.endswith("/saturation")] for r in res[0]["records"]]
    sat1 = [[r[k] for k in r if k.endswith("/saturation")] for r in res[1]["records"]]
    assert sat != sat1
    # ... and max over ranks reproduces the single-process (global batch) saturation
    ref_sat = torch.tensor([[r[k] for k in r if k.endswith("/saturation")] for r in ref["records"]],
                           dtype=torch.float64)
    torch.testing.assert_close(res[0]["saturation_max"], ref_sat, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(res[1]["saturation_max"], ref_sat, rtol=1e-5, atol=0.0)


def test_ddp_enforce_keeps_caps_and_certificate(tmp_path: Any) -> None:
    """``enforce`` then DDP (stack and zoo model), large-learning-rate steps with different data per rank:
    the caps hold, the certificate holds at every check and after, ranks agree, ``unenforce`` works."""
    res = _launch("ddp_enforce", tmp_path, lr=50.0)
    for kind in ("stack", "zoo"):
        a, b = res[0][kind], res[1][kind]
        assert a["ncaps"] > 0 and a["alpha"] == b["alpha"] > 0
        assert all(a["ok"]) and all(b["ok"]), (kind, a["ok"], b["ok"])
        assert a["recertified"] and b["recertified"], kind
        assert a["excess"] and max(a["excess"]) <= 1.0 and max(b["excess"]) <= 1.0, kind
        assert a["excess"] == b["excess"]
        # the large steps did push against the caps (otherwise the test would prove nothing)
        assert max(a["excess"]) > 0.9, (kind, max(a["excess"]))
        _assert_weights_equal(a["effective"], b["effective"])
        assert a["restored"] > 0
        # unenforce: plain parameters holding the effective values
        assert not any(".parametrizations." in k for k in a["plain"])
        for k, v in a["plain"].items():
            src = a["effective"].get(k)
            if src is not None:
                assert torch.equal(v, src), (kind, k)


# ------------------------------------------------------------------------------------------------ FSDP2
@pytest.mark.parametrize("kind", ["stack", "zoo"])
def test_fsdp2_monitor_matches_single_process(kind: str, tmp_path: Any) -> None:
    """``fully_shard`` (per GPT-2 block and root for the zoo model, root for the stack), same batch on each
    rank; the monitor is checked with the parameters unsharded (``FSDPModule.unshard()`` on every unit
    around ``monitor.step()``): its figures are identical on both ranks and equal the single-process run."""
    res = _launch("fsdp_monitor", tmp_path, kind=kind)
    ref = _single(kind)
    for r, out in enumerate(res):
        assert out["param_type"] == "DTensor"  # really sharded
        assert all(math.isfinite(v) for v in out["losses"])
        _has_batch_figures(out["records"])
        _assert_records_equal(out["records"], res[0]["records"], what=f"rank {r} vs rank 0")
        _assert_records_equal(out["records"], ref["records"], rel=1e-6, what=f"rank {r} vs single process")
        _assert_weights_equal(out["weights"], ref["weights"], rtol=1e-6)
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-6)


def test_fsdp2_enforce_keeps_caps_and_certificate(tmp_path: Any) -> None:
    """``enforce`` then ``fully_shard`` (zoo model): the parametrized weights are sharded and trained with large
    steps, different data per rank; the caps and the certificate hold, and both ranks agree."""
    res = _launch("fsdp_enforce", tmp_path, lr=50.0)
    a, b = res
    assert a["alpha"] == b["alpha"] > 0
    assert all(a["ok"]) and all(b["ok"]), (a["ok"], b["ok"])
    assert a["excess"] and max(a["excess"]) <= 1.0 and a["excess"] == b["excess"]
    assert max(a["excess"]) > 0.9
    _assert_weights_equal(a["weights"], b["weights"])

"""FSDP2-sharded models on 2 gloo ranks (``torch.multiprocessing``, spawn; issue 30 item 3): certified with at most one
unit unsharded at a time on a rank, to exactly the certificate one process returns for the unsharded model; the
monitor on an FSDP2 model without the user's ``unshard()`` / ``reshard()``, to the figures of one process."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Dict, List

import pytest

transformers = pytest.importorskip("transformers")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
W = importlib.import_module("_cb_fsdp_workers")
import torch.distributed as dist  # noqa: E402
from _cb_launch import spawn_ranks  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # 2 spawned ranks each: ~15-30 s a test on 2 busy cores
    pytest.mark.timeout(180),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend"),
]


def _run(scenario: str, out: str, timeout: float = 150.0, **kwargs: Any) -> List[Dict[str, Any]]:
    """``scenario`` on :data:`W.WORLD` spawned ranks; each rank's result (fail on an error or a hang)."""
    return spawn_ranks(W.entry, lambda rank, port: (scenario, rank, port, out, kwargs), out, W.WORLD, timeout)


@pytest.mark.parametrize("kind, layers", [("llama", 4), ("gpt2", 3)])
def test_fsdp2_model_certified_one_unit_at_a_time(tmp_path: Any, kind: str, layers: int) -> None:
    from certblocks.checkpoint import certify_ranks

    ref = certify_ranks(W.hf_model(kind, layers), W.example_ids())  # one process, the model unsharded
    ranks = _run("fsdp_certify", str(tmp_path), kind=kind, layers=layers)
    for r, res in enumerate(ranks):
        assert res["sharded"], f"rank {r}: the model was not sharded"
        assert res["segments"] == [(s.name, s.certificate) for s in ref.all_segments()], f"rank {r}"
        assert res["report"] == ref.to_dict(), f"rank {r}"
        for d in W.DTYPES:
            assert res["stacks"][d] == ref.stack(d), f"rank {r} {d}"
        # every unit was gathered (the blocks and the root), never two at once, and none is left unsharded
        assert res["seen"]["calls"] >= res["units"], f"rank {r}: {res['seen']}"
        assert res["seen"]["peak"] == 1, f"rank {r}: {res['seen']['peak']} units unsharded at once"
        assert res["after"] == 0 and res["after_stacks"] == 0, f"rank {r}"


@pytest.mark.parametrize("kind", ["zoo", "stack"])
def test_fsdp2_monitor_without_manual_unshard(tmp_path: Any, kind: str) -> None:
    """The monitor checks every step of an FSDP2 model on its own (no ``unshard()`` by the user): each figure equals
    the one-process run's (as with the manual unshard, tests/distributed/test_distributed.py), one unit unsharded at a
    time, every unit sharded again after each check."""
    D = importlib.import_module("test_distributed")
    ref = D._single(kind)
    ranks = _run("fsdp_monitor_unassisted", str(tmp_path), kind=kind)
    for r, out in enumerate(ranks):
        assert out["sharded"], f"rank {r}: the model was not sharded"
        D._has_batch_figures(out["records"])
        D._assert_records_equal(out["records"], ranks[0]["records"], what=f"rank {r} vs rank 0")
        D._assert_records_equal(out["records"], ref["records"], rel=1e-6, what=f"rank {r} vs single process")
        D._assert_weights_equal(out["weights"], ref["weights"], rtol=1e-6)
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert out["seen"]["calls"] >= W.STEPS * out["units"], f"rank {r}: {out['seen']}"
        assert out["seen"]["peak"] == 1, f"rank {r}: {out['seen']['peak']} units unsharded at once"
        assert out["after"] == [0] * W.STEPS, f"rank {r}"

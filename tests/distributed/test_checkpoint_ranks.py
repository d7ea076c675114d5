"""A checkpoint certified by 2 gloo ranks (``torch.multiprocessing``, spawn): each rank reads only its layers, and
every rank returns exactly the certificate one process returns; the model loaded in memory, its layers split across
the ranks (:func:`certblocks.checkpoint.certify_ranks`), gives the same (issue 30 item 3)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any, Dict, List

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
W = importlib.import_module("_cb_ckpt_workers")
import torch.distributed as dist  # noqa: E402
from _cb_fsdp_workers import hf_model  # noqa: E402
from _cb_launch import spawn_ranks  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # 2 spawned ranks, a checkpoint certified twice and a model once on each: ~30-60 s
    pytest.mark.timeout(180),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend"),
]


def _ranks(directory: str, out: str, timeout: float = 150.0) -> List[Dict[str, Any]]:
    """Certify ``directory`` on :data:`W.WORLD` spawned ranks; each rank's result (fail on an error or a hang)."""
    return spawn_ranks(W.entry, lambda rank, port: (rank, port, out, directory), out, W.WORLD, timeout)


def _layer(name: str) -> str:
    m = re.match(r"^(.*?\.\d+)\.", name)
    return m.group(1) if m else ""


@pytest.mark.parametrize("kind, layers", [("llama", 4), ("gpt2", 3)])
def test_two_ranks_return_the_one_process_certificate(tmp_path, kind, layers):
    model = hf_model(kind, layers)  # the FSDP tests' tiny seeded models
    directory = str(tmp_path / "ckpt")
    model.save_pretrained(directory, max_shard_size="20KB")
    single = W.certify_ranks(directory)  # one process (no process group in the test process)
    out = tmp_path / "out"
    out.mkdir()
    ranks = _ranks(directory, str(out))
    for r, res in enumerate(ranks):
        assert res["segments"] == single["segments"], f"rank {r}"
        assert res["report"] == single["report"], f"rank {r}"
        assert res["memory"] == single["report"], f"rank {r}: the in-memory model split across ranks"
        for d in W.DTYPES:
            assert res["stacks"][d] == single["stacks"][d], f"rank {r} {d}"
            assert res["memory_stacks"][d] == single["stacks"][d], f"rank {r} {d} (in memory)"
    # each rank read only its own layers: disjoint, contiguous halves that cover every layer
    mine = [{_layer(n) for n in res["read"]} - {""} for res in ranks]
    every = {_layer(n) for n in single["read"]} - {""}
    assert len(every) == layers
    assert mine[0] and mine[1] and not mine[0] & mine[1] and mine[0] | mine[1] == every
    index = [sorted(int(g.rsplit(".", 1)[1]) for g in m) for m in mine]
    assert max(index[0]) < min(index[1])
    # the stem's table is read by rank 0 and the final norm by the last rank only
    final_norm = "model.norm.weight" if kind == "llama" else "transformer.ln_f.weight"
    assert final_norm in ranks[1]["read"] and final_norm not in ranks[0]["read"]
    table = {"model.embed_tokens.weight", "lm_head.weight"} if kind == "llama" else {"transformer.wpe.weight"}
    assert table & set(ranks[0]["read"])  # the token table (tied to the output: the graph names it either way)

"""Worker of tests/distributed/test_checkpoint_ranks.py (run in spawned gloo processes; imported by name).

Each rank certifies the same checkpoint with :func:`certblocks.checkpoint.certify_checkpoint` under the process
group (its layers only), and the model loaded from it with :func:`certblocks.checkpoint.certify_ranks`, then returns
plain data: the certificates' ``to_dict()``, the stacks in fp16, bf16 and fp32, and the names of the tensors the
checkpoint's certification read.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

WORLD = 2
DTYPES = ("fp16", "bf16", "fp32")


def certify_ranks(directory: str) -> Dict[str, Any]:
    """This rank's certificate of ``directory`` and what it read."""
    from certblocks.checkpoint import CheckpointStats, certify_checkpoint

    stats = CheckpointStats()
    rep = certify_checkpoint(directory, stats=stats)
    import torch
    import transformers

    from certblocks.checkpoint import certify_ranks

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    mem = certify_ranks(model, ids)  # the loaded model, its layers split across the ranks too
    return {"report": rep.to_dict(), "stacks": {d: rep.stack(d) for d in DTYPES}, "read": sorted(stats.read),
            "segments": [(s.name, s.certificate) for s in rep.all_segments()],
            "memory": mem.to_dict(), "memory_stacks": {d: mem.stack(d) for d in DTYPES}}


def entry(rank: int, port: int, out_dir: str, directory: str) -> None:
    """Process entry: :func:`certify_ranks` as a scenario of tests/distributed's common entry point (it joins the
    gloo group of :data:`WORLD` ranks, writes ``<out_dir>/<rank>.pt``, or ``<rank>.err`` with a traceback)."""
    workers = importlib.import_module("_cb_dist_workers")
    workers.SCENARIOS["checkpoint"] = lambda rank, directory: certify_ranks(directory)
    workers.entry("checkpoint", rank, port, out_dir, {"directory": directory})

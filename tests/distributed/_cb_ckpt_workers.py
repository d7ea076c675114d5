"""Worker of tests/distributed/test_checkpoint_ranks.py (run in spawned gloo processes; imported by name).

Each rank certifies the same checkpoint with :func:`certblocks.checkpoint.certify_checkpoint` under the process
group (its layers only), then returns plain data: the certificate's ``to_dict()``, the stacks in fp16, bf16 and fp32,
and the names of the tensors it read while certifying.
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
    return {"report": rep.to_dict(), "stacks": {d: rep.stack(d) for d in DTYPES}, "read": sorted(stats.read),
            "segments": [(s.name, s.certificate) for s in rep.all_segments()]}


def entry(rank: int, port: int, out_dir: str, directory: str) -> None:
    """Process entry: :func:`certify_ranks` as a scenario of tests/distributed's common entry point (it joins the
    gloo group of :data:`WORLD` ranks, writes ``<out_dir>/<rank>.pt``, or ``<rank>.err`` with a traceback)."""
    workers = importlib.import_module("_cb_dist_workers")
    workers.SCENARIOS["checkpoint"] = lambda rank, directory: certify_ranks(directory)
    workers.entry("checkpoint", rank, port, out_dir, {"directory": directory})

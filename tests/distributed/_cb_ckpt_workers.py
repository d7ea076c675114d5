"""Worker of tests/distributed/test_checkpoint_ranks.py (run in spawned gloo processes; imported by name).

Each rank certifies the same checkpoint with :func:`certblocks.checkpoint.certify_checkpoint` under the process
group (its layers only), then saves plain data: the certificate's ``to_dict()``, the stacks in fp16, bf16 and fp32,
and the names of the tensors it read while certifying.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import traceback
from typing import Any, Dict

import torch
import torch.distributed as dist

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
    """Join the gloo group of :data:`WORLD` ranks, certify, write ``<out_dir>/<rank>.pkl`` (``<rank>.err``: a
    traceback)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=90))
        result = certify_ranks(directory)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as fh:
            pickle.dump(result, fh)
        dist.barrier()
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (gloo's threads can abort it after a complete run)

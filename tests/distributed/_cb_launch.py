"""Spawn a worker on every rank of a gloo group and collect each rank's result (the distributed tests' launcher).

A worker is called as ``entry(*args_of(rank, port))`` in a spawned process; it writes its result to
``<out>/<rank>.pt`` (``torch.save``) and, on an error, its traceback to ``<out>/<rank>.err``.  A hang fails the test:
the processes are joined with a deadline and killed.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, List, Sequence

import pytest
import torch


def free_port() -> int:
    """A free localhost port for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(entry: Callable[..., Any], args_of: Callable[[int, int], Sequence[Any]], out: str, world: int,
                timeout: float) -> List[Any]:
    """Run ``entry(*args_of(rank, port))`` on ``world`` spawned processes; each rank's saved result, in rank order
    (``pytest.fail`` with the ranks' tracebacks on an error, a non-zero exit or a hang past ``timeout`` seconds)."""
    port = free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=entry, args=tuple(args_of(r, port)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = []
    for r in range(world):
        err = os.path.join(out, f"{r}.err")
        if os.path.exists(err):
            with open(err) as fh:
                errors.append(f"rank {r}:\n{fh.read()}")
    if hung:
        pytest.fail(f"ranks {hung} still running after {timeout:g} s (killed)\n" + "\n".join(errors))
    if errors or any(p.exitcode != 0 for p in procs):
        pytest.fail(f"exit codes {[p.exitcode for p in procs]}\n" + "\n".join(errors))
    return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]

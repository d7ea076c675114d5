"""``certblocks trajectory MODEL``: the on-data certificate of one batch (:func:`certblocks.trajectory`).

MODEL is as for ``certblocks certify`` (a zoo name, ``hf:gpt2``, ``timm:<name>``, ``module:pkg.mod:factory``).
The batch is ``--batch FILE`` (``torch.save`` of a tensor, a tuple of positional arguments or a dict of keyword
arguments, read with ``weights_only=True``), else the model's example input (a zoo model's ``example_input``,
``--seq-len`` tokens).  ``--plot PNG`` draws the headroom per update (matplotlib).  Exit status: 0 when the batch
has headroom left in the dtype, 1 when it overflows (headroom <= 0), 2 on a bad argument or file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from ._common import (
    EXIT_NOT_CERTIFIED,
    EXIT_OK,
    UsageError,
    add_quiet,
    command,
    dtype_list,
    int_at_least,
    progress_of,
)
from .models import load_model

__all__ = ["add_arguments", "run_trajectory", "load_batch", "plot_headroom"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``certblocks trajectory``."""
    p.description = ("The on-data certificate of one batch: per residual update the state norm, the Jacobian's "
                     "spectral norm (Lanczos estimate and certified bound), the largest intermediate and attention "
                     "logit; the trajectory bound on the gradient and the headroom to the dtype's largest value.")
    p.add_argument("model", help="zoo name | hf:gpt2 | timm:<name> | module:pkg.mod:factory")
    p.add_argument("--batch", default=None, metavar="FILE",
                   help="torch.save'd input: a tensor, a tuple of positional arguments or a dict of keyword "
                        "arguments (default: the model's example input)")
    p.add_argument("--dtype", type=dtype_list, default=["fp16"],
                   help="the dtype whose limit is used, or a precision policy (amp-fp16: the batch runs under its "
                        "autocast, each value against its own dtype's limit; default fp16)")
    p.add_argument("--seq-len", type=int_at_least(1), default=8,
                   help="tokens of the example input when there is no --batch (default 8)")
    p.add_argument("--steps", type=int_at_least(1), default=12, help="Lanczos steps per Jacobian at most (default 12)")
    p.add_argument("--no-certified", action="store_true", help="skip the certified bounds (faster)")
    p.add_argument("--no-jacobians", action="store_true",
                   help="skip the Lanczos estimates: the measured costates only (a few forward+backward passes; "
                        "needs a batch with the model's targets, e.g. a dict with labels)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the headroom per update into PNG (matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_quiet(p)
    p.set_defaults(func=run_trajectory)


def load_batch(path: str) -> Any:
    """Read ``--batch FILE`` (``torch.load(weights_only=True)``): a tensor, a tuple/list or a dict of tensors."""
    import torch

    if not os.path.isfile(path):
        raise UsageError(f"--batch {path!r}: no such file")
    try:
        batch = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file torch cannot read: one line, no traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UsageError(f"--batch {path!r} is not a torch.save'd tensor, tuple or dict ({type(exc).__name__}: "
                         f"{first[:200]})") from None
    if not isinstance(batch, (torch.Tensor, tuple, list, dict)):
        raise UsageError(f"--batch {path!r} holds a {type(batch).__name__}; expected a tensor, a tuple of "
                         "positional arguments or a dict of keyword arguments")
    return batch


@command("trajectory")
def run_trajectory(args: argparse.Namespace) -> int:
    """Run ``certblocks trajectory``; 0 with headroom left, 1 when the batch overflows, 2 on a usage error."""
    if len(args.dtype) != 1:
        raise UsageError(f"--dtype takes one dtype, got {','.join(args.dtype)!r}")
    batch = load_batch(args.batch) if args.batch is not None else None
    progress = progress_of(args, "trajectory")
    progress("build", args.model)
    model, example = load_model(args.model, args.seq_len)
    from certblocks.ondata import trajectory
    from certblocks.trace import CaptureError

    progress("capture and measure the batch's trajectory")
    try:
        rep = trajectory(model, example if batch is None else batch, args.dtype[0], steps=args.steps,
                         certified=not args.no_certified, jacobians=not args.no_jacobians)
    except (CaptureError, ValueError, TypeError, RuntimeError) as exc:  # a batch the model refuses, no updates...
        progress.clear()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{args.model} on {'--batch ' + repr(args.batch) if batch is not None else 'its example'}: "
                         f"{first[:300]}") from None
    progress.clear()
    if args.json:
        from certblocks.trace.report import jsonable

        print(json.dumps(jsonable({"model": args.model, "trajectory": rep.to_dict()}), indent=2))
    else:
        print(rep.explain())
    if args.plot is not None:
        plot_headroom(rep, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return EXIT_OK if rep.ok else EXIT_NOT_CERTIFIED


def plot_headroom(rep: Any, path: str) -> None:
    """Headroom per update: forward (``log M - log`` of the update's largest state norm or intermediate) and
    backward (``log M`` minus the bound on ``log ||p_k||``, the costate entering the update)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [u.name for u in rep.updates]
    fwd = [rep.log_max - (math.log(u.forward_max) if u.forward_max > 0 else -math.inf) for u in rep.updates]
    clip = lambda v: [max(min(x, 1e3), -1e3) for x in v]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(names) + 2), 4))
    ax.plot(range(len(names)), clip(fwd), "o-", label="forward: log M - log max(|X_k+1|, peak)")
    if rep.estimated:
        bwd, acc = [], (math.log(rep.head.norm) if rep.head.norm > 0 else -math.inf)
        for u in reversed(rep.updates):  # the bound on ||p_k|| grows from the head down to the first update
            acc += u.log_factor
            bwd.append(rep.log_max - acc)
        bwd.reverse()
        ax.plot(range(len(names)), clip(bwd), "s-", label="backward: log M - bound on log ||p_k|| (estimate)")
    if rep.log_gradient_measured is not None:
        meas = [rep.log_max - (math.log(u.costate_norm) if u.costate_norm > 0 else -math.inf) for u in rep.updates]
        ax.plot(range(len(names)), clip(meas), "^:", label="backward: log M - log ||p_k|| (measured)")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("headroom (nats)")
    measured = "" if rep.headroom_measured is None else f" (measured {rep.headroom_measured:.3g})"
    estimate = "not estimated" if rep.headroom is None else f"{rep.headroom:.3g} nats"
    ax.set_title(f"{rep.model}, {rep.dtype}: headroom {estimate}{measured}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"--plot {path!r}: {exc}") from None
    finally:
        plt.close(fig)

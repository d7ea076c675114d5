"""``certblocks certify [MODEL]``: certify a model's residual updates from its graph.

MODEL is one of

* ``timm:<name>`` -- a timm model with random weights (``pretrained=False``), on a random image
  of its default input size;
* ``hf:gpt2`` (``hf:mamba``, ``hf:llama``) -- a Hugging Face model with random weights from the default
  config (GPT-2 124M; Mamba 130M; a GPT-2-small-sized Llama), on ``--seq-len`` random token ids; nothing is
  downloaded;
* ``module:pkg.mod:factory`` -- ``factory()`` returns a module and an example input
  (``(module, example_input)``), or a module with an ``example_input`` attribute;
* a zoo name (``certblocks.zoo``).

Without MODEL, every zoo model is certified (:func:`certblocks.cli.zoo.run_certify_zoo`, what
``make demo`` prints). Exit status: 0 certified, 1 not certified, 2 a bad argument or a MODEL that
cannot be built or captured.
"""

from __future__ import annotations

import argparse
import json
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
    nonnegative_float,
    positive_float,
    progress_of,
)
from .models import ModelSpecError, load_model

__all__ = ["ModelSpecError", "add_arguments", "add_certify_parser", "load_model", "run_certify"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``certblocks certify``."""
    p.description = ("Certify every residual update X + f(X) of MODEL from its graph and the depths it reaches in a "
                     "dtype. MODEL: timm:<name>, hf:gpt2, hf:mamba, hf:llama, module:pkg.mod:factory, or a zoo name.")
    p.add_argument("model", nargs="?", default=None,
                   help="timm:<name> | hf:gpt2 | hf:mamba | hf:llama | module:pkg.mod:factory | zoo name; "
                        "without MODEL, every zoo model is certified (fp16, bf16, fp32)")
    p.add_argument("--dtype", type=dtype_list, default=None,
                   help="fp16, bf16, fp32, fp64, fp8_e4m3, fp8_e5m2 (default bf16; comma-separated list "
                        "without MODEL, default fp16,bf16,fp32)")
    p.add_argument("--r0", type=nonnegative_float, default=None,
                   help="bound on the input norm ||X_0|| (default: a zoo model's input_radius(), else 1)")
    p.add_argument("--dt", type=positive_float, default=1.0, help="residual step size (default 1)")
    p.add_argument("--seq-len", type=int_at_least(1), default=8,
                   help="sequence length of the example input (default 8)")
    p.add_argument("--residual", default="auto",
                   help="'auto' (find residual updates), 'none' (whole model), or module path patterns "
                        "separated by commas (e.g. 'blocks.*.attn')")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--explain", action="store_true", help="also print the per-node table of each update")
    add_quiet(p)
    p.set_defaults(func=run_certify)


def add_certify_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``certify`` on another program's ``argparse`` sub-parsers object."""
    from . import add_command

    return add_command(subparsers, "certify")


@command("certify")
def run_certify(args: argparse.Namespace) -> int:
    """Run ``certblocks certify``; returns 0 when the stack is certified, 1 when not, 2 on a usage error."""
    if args.model is None:
        from .zoo import DEFAULT_DTYPES, run_certify_zoo

        return run_certify_zoo(args.dtype or list(DEFAULT_DTYPES), progress=progress_of(args, "certify"))
    if args.dtype is not None and len(args.dtype) != 1:
        raise UsageError(f"--dtype takes one dtype with a MODEL, got {','.join(args.dtype)!r}")
    dtype = "bf16" if args.dtype is None else args.dtype[0]
    progress = progress_of(args, "certify")
    progress("build", args.model)
    model, example = load_model(args.model, args.seq_len)
    progress("capture (torch.export) and certify")

    from certblocks.trace import CaptureError, ModelCertificate, certify

    residual: Any = args.residual
    if residual == "none":
        residual = None
    elif residual != "auto":
        residual = [p.strip() for p in residual.split(",") if p.strip()]
    try:
        cert = certify(model, example, residual=residual)
    except (CaptureError, ValueError) as exc:  # a model torch.export cannot capture, --residual matching nothing
        progress.clear()
        raise UsageError(str(exc)) from None
    updates = cert if isinstance(cert, ModelCertificate) else ModelCertificate([cert], type(model).__name__)
    try:
        r0 = args.r0
        if r0 is None:
            radius = getattr(model, "input_radius", None)
            r0 = float(radius()) if callable(radius) else 1.0
        stack = updates.stack(dtype, r0=r0, dt=args.dt)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    finally:
        progress.clear()
    _print(args, updates, stack)
    return EXIT_OK if stack.ok else EXIT_NOT_CERTIFIED


def _print(args: argparse.Namespace, updates: Any, stack: Any) -> None:
    out = sys.stdout
    if args.json:
        from certblocks.trace.report import jsonable

        doc = {"model": args.model, "certificates": updates.to_dict(), "stack": stack.to_dict()}
        if not args.explain:
            for u in doc["certificates"]["updates"]:
                u.pop("nodes", None)
        print(json.dumps(jsonable(doc), indent=2), file=out)
        return
    print(updates.explain(), file=out)
    if args.explain:
        for u in updates:
            print("", file=out)
            print(u.explain(), file=out)
    print("", file=out)
    print(stack.explain(), file=out)

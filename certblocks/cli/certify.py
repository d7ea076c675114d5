"""``certblocks certify [MODEL]``: certify a model's residual updates from its graph.

MODEL is one of

* ``timm:<name>`` -- a timm model with random weights (``pretrained=False``), on a random image
  of its default input size;
* ``hf:gpt2`` (``hf:mamba``, ``hf:llama``) -- a Hugging Face model with random weights from the default
  config (GPT-2 124M; Mamba 130M; a GPT-2-small-sized Llama), on ``--seq-len`` random token ids; nothing is
  downloaded;
* ``module:pkg.mod:factory`` -- ``factory()`` returns a module and an example input
  (``(module, example_input)``), or a module with an ``example_input`` attribute;
* a zoo name (``certblocks.zoo``);
* a Hugging Face checkpoint directory (``config.json`` and safetensors weights, sharded or not): its causal-LM model
  certified one layer at a time from the memory-mapped weights, never loaded whole
  (:func:`certblocks.checkpoint.certify_checkpoint`; the same certificate as the loaded model's), on ``--seq-len``
  token ids.

The model is read by :func:`certblocks.model.as_certified`: a zoo model is certified from its own blocks (as
``certblocks zoo`` shows it), any other from its graph captured on the example input (``--residual`` reads any model
from its graph); a refusal prints the model's computed fixes (``fixes(dtype)``: its levers, each certified again).
Without MODEL, every zoo model is certified (:func:`certblocks.cli.zoo.run_certify_zoo`, what
``make demo`` prints). Exit status: 0 certified, 1 not certified, 2 a bad argument or a MODEL that
cannot be built or captured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, List

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
                     "dtype. MODEL: timm:<name>, hf:gpt2, hf:mamba, hf:llama, module:pkg.mod:factory, a zoo name, or a "
                     "Hugging Face checkpoint directory (certified layer by layer).")
    p.add_argument("model", nargs="?", default=None,
                   help="timm:<name> | hf:gpt2 | hf:mamba | hf:llama | module:pkg.mod:factory | zoo name | DIR (a "
                        "Hugging Face checkpoint: config.json and safetensors); without MODEL, every zoo model is "
                        "certified (fp16, amp-fp16, bf16, fp8-e4m3, fp32)")
    p.add_argument("--dtype", type=dtype_list, default=None,
                   help="a dtype (fp16, bf16, fp32, fp64, fp8_e4m3, fp8_e5m2) or a precision policy (amp-fp16, "
                        "amp-bf16, fsdp-bf16, fp8-e4m3: each value against the dtype it is held in; a model read "
                        "from its graph is captured under it) (default bf16; comma-separated list without MODEL, "
                        "default fp16,amp-fp16,bf16,fp8-e4m3,fp32)")
    p.add_argument("--r0", type=nonnegative_float, default=None,
                   help="bound on the input norm ||X_0|| (default: a zoo model's input_radius(), else 1)")
    p.add_argument("--dt", type=positive_float, default=None,
                   help="residual step size of a model read from its graph (default 1; a zoo model's is its own)")
    p.add_argument("--seq-len", type=int_at_least(1), default=8,
                   help="sequence length of the example input (default 8): a graph's certificate holds at that "
                        "length; a zoo model is certified at its own")
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
    """Run ``certblocks certify``; returns 0 when the stack is certified, 1 when not, 2 on a usage error.

    The model is read by :func:`certblocks.model.as_certified` (the one place that knows what kind of model it is:
    a zoo model's own certificate, a converted model's blocks, any other module's graph captured on the example
    input); its ``certificate(dtype)`` is printed, and on a refusal its ``fixes(dtype)``: each lever the model has,
    certified again.
    """
    if args.model is None:
        from .zoo import DEFAULT_DTYPES, run_certify_zoo

        return run_certify_zoo(args.dtype or list(DEFAULT_DTYPES), progress=progress_of(args, "certify"))
    if args.dtype is not None and len(args.dtype) != 1:
        raise UsageError(f"--dtype takes one dtype with a MODEL, got {','.join(args.dtype)!r}")
    dtype = "bf16" if args.dtype is None else args.dtype[0]
    progress = progress_of(args, "certify")
    if os.path.isdir(args.model):
        return _run_checkpoint(args, dtype, progress)
    progress("build", args.model)
    model, example = load_model(args.model, args.seq_len)

    from certblocks.model import as_certified
    from certblocks.trace import CaptureError

    residual: Any = args.residual
    if residual == "none":
        residual = None
    elif residual != "auto":
        residual = [p.strip() for p in residual.split(",") if p.strip()]
    try:
        cm = as_certified(model, example_input=example, r0=args.r0, dt=args.dt, residual=residual)
        progress("certify (a model without certified blocks: captured with torch.export)")
        stack = cm.certificate(dtype)
        report = cm.graph_report(dtype)
        if not stack.ok:
            progress("fixes (each certified again)")
        fixes = [] if stack.ok else cm.fixes(dtype)
    except (CaptureError, ValueError, TypeError) as exc:  # a model torch.export cannot capture, --residual matching
        # nothing, a --dt the model does not have
        raise UsageError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    finally:
        progress.clear()
    _print(args, cm, report, stack, fixes)
    return EXIT_OK if stack.ok else EXIT_NOT_CERTIFIED


def _run_checkpoint(args: argparse.Namespace, dtype: str, progress: Any) -> int:
    """``certblocks certify DIR``: a Hugging Face checkpoint directory certified layer by layer."""
    from certblocks.checkpoint import certify_checkpoint, is_checkpoint
    from certblocks.precision import as_precision
    from certblocks.trace import CaptureError

    if not is_checkpoint(args.model):
        raise UsageError(f"{args.model!r} is a directory but not a Hugging Face checkpoint: it needs config.json and "
                         "model.safetensors or model.safetensors.index.json")
    if args.residual != "auto":
        raise UsageError(f"--residual {args.residual!r}: a checkpoint is read as its chain of residual updates "
                         "(--residual auto)")
    if not as_precision(dtype).pure:
        raise UsageError(f"--dtype {dtype}: a checkpoint is certified in a pure dtype (fp16, bf16, fp32, ...); a mixed "
                         "policy needs the loaded model (certblocks.certify(model, x, precision=...))")
    progress("certify layer by layer", args.model)
    try:
        report = certify_checkpoint(args.model, seq_len=args.seq_len)
        stack = report.stack(dtype, r0=1.0 if args.r0 is None else args.r0, dt=1.0 if args.dt is None else args.dt)
    except (CaptureError, ValueError, TypeError, KeyError) as exc:  # a model torch.export cannot capture, not one
        # chain, a non-finite weight (NonFiniteWeightError is a ValueError), a weight missing from the files
        raise UsageError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    finally:
        progress.clear()
    _print(args, None, report, stack, [], read_from="checkpoint")
    return EXIT_OK if stack.ok else EXIT_NOT_CERTIFIED


def _print(args: argparse.Namespace, cm: Any, report: Any, stack: Any, fixes: List[Any], *,
           read_from: str = "") -> None:
    """The certificate (and, read from the graph, the updates found there); on a refusal, the model's fixes."""
    out = sys.stdout
    if args.json:
        from certblocks.trace.report import jsonable

        if report is not None:
            updates = report.to_dict()
            if not args.explain:
                for u in updates["updates"]:
                    u.pop("nodes", None)
        else:  # certified blocks: their own certificates
            updates = {"model": type(cm.module).__name__, "updates": [u.to_dict() for u in stack.updates]}
        doc = {"model": args.model, "read_from": read_from or cm.kind, "certificates": updates,
               "stack": stack.to_dict(fixes=fixes)}
        print(json.dumps(jsonable(doc), indent=2), file=out)
        return
    if report is not None:
        print(report.explain(), file=out)
        if args.explain:
            for u in report:
                print("", file=out)
                print(u.explain(), file=out)
        print("", file=out)
    elif args.explain:
        for u in stack.updates:
            print(u, file=out)
        print("", file=out)
    print(stack.explain(fixes=fixes), file=out)

"""``certblocks convert MODEL``: a backbone's certificate before and after :func:`certblocks.convert`.

Exit status: 0 the conversion ran and was certified before and after (the table says in which dtypes the depth
changed); 1 refused (``--strict`` and the depth drops) or the model could not be captured and certified before or
after the conversion (one line on stderr says which and why); 2 a bad argument or a MODEL that cannot be built.
"""

from __future__ import annotations

import argparse
import sys

from ._common import (
    EXIT_NOT_CERTIFIED,
    add_quiet,
    command,
    dtype_list,
    int_at_least,
    nonnegative_float,
    progress_of,
)

#: The dtypes of the before/after table by default (mixed precision policies are accepted too).
DEFAULT_DTYPES = ("fp16", "bf16", "fp32")

__all__ = ["add_arguments", "run_convert"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``certblocks convert``."""
    p.add_argument("model",
                   help="timm:NAME (e.g. timm:vit_tiny_patch16_224), hf:gpt2, hf:llama or hf:mamba (random weights)")
    p.add_argument("--dtype", type=dtype_list, default=",".join(DEFAULT_DTYPES),
                   help="comma-separated dtypes and precision policies (amp-fp16, amp-bf16, fsdp-bf16, fp8-e4m3; "
                        "default fp16,bf16,fp32)")
    p.add_argument("--remove-norms", action="store_true", help="also replace the residual branches' norms")
    p.add_argument("--layers", type=int_at_least(1), default=None,
                   help="number of layers/blocks, >= 1 (default: the model's)")
    p.add_argument("--img-size", type=int_at_least(1), default=None,
                   help="image size of a timm model (default: the model's own input size)")
    p.add_argument("--r0", type=nonnegative_float, default=1.0, help="input radius of the certificates (default 1)")
    p.add_argument("--strict", action="store_true",
                   help="refuse (exit status 1) when the conversion lowers the certified depth in a dtype")
    p.add_argument("--markdown", action="store_true", help="Markdown table")
    add_quiet(p)
    p.set_defaults(func=run_convert)


@command("convert")
def run_convert(args: argparse.Namespace) -> int:
    """Convert MODEL and print the swaps and the certified depths before and after; returns the exit status."""
    import warnings

    from .models import load_backbone

    progress = progress_of(args, "convert")
    progress("build", args.model)
    model, example = load_backbone(args.model, img_size=args.img_size, layers=args.layers)

    from certblocks.conversion import ConversionError, ConversionWarning, convert

    dtypes = args.dtype
    from certblocks.precision import as_precision

    main = next((d for d in dtypes if as_precision(d).pure), "bf16")  # the before/after certificates' dtype
    try:
        with warnings.catch_warnings(), progress.logging_steps():  # the table below says it
            warnings.simplefilter("ignore", ConversionWarning)
            rep = convert(model, remove_norms=args.remove_norms, example_input=example, dtype=main,
                          r0=args.r0, dtypes=dtypes, strict=args.strict)
    except ConversionError as e:
        print(f"{args.model}: refused: {e}")
        return EXIT_NOT_CERTIFIED
    for when, cert, err in (("before", rep.certificate_before, rep.trace_error_before),
                            ("after", rep.certificate_after, rep.trace_error_after)):
        if cert is None:  # nothing to compare: one line, no table
            first = err.strip().splitlines()[0] if err.strip() else "no certificate"
            print(f"certblocks convert: error: {args.model}: the model could not be captured and certified {when} "
                  f"the conversion: {first[:300]}", file=sys.stderr)
            return EXIT_NOT_CERTIFIED
    print(f"{args.model}: {len(rep.swaps)} swaps")
    for s in rep.swaps:
        print(f"  {s}")
    for n in rep.notes:
        print(f"  note: {n}")
    print()
    print(rep.table(markdown=args.markdown))
    mq = [("?" if q is None else f"{q:g}") for q in (rep.max_q_before, rep.max_q_after)]
    print(f"\nlargest q of a residual update: before {mq[0]}, after {mq[1]}")
    if rep.lowered:
        print("the conversion lowers the certified depth in " + ", ".join(d.dtype for d in rep.lowered))
    return 0

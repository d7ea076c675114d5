"""``certblocks convert MODEL``: a backbone's certificate before and after :func:`certblocks.convert`."""

from __future__ import annotations

import argparse

from ._common import command, dtype_list, int_at_least, nonnegative_float
from .formatting import render_table, verdict
from .zoo import DEFAULT_DTYPES

__all__ = ["add_arguments", "run_convert"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``certblocks convert``."""
    p.add_argument("model", help="timm:NAME (e.g. timm:vit_tiny_patch16_224), hf:gpt2 or hf:mamba (random weights)")
    p.add_argument("--dtype", type=dtype_list, default=",".join(DEFAULT_DTYPES),
                   help="comma-separated dtypes (default fp16,bf16,fp32)")
    p.add_argument("--remove-norms", action="store_true", help="also replace the residual branches' norms")
    p.add_argument("--layers", type=int_at_least(1), default=None,
                   help="number of layers/blocks, >= 1 (default: the model's)")
    p.add_argument("--img-size", type=int_at_least(1), default=224, help="image size for timm models (default 224)")
    p.add_argument("--r0", type=nonnegative_float, default=1.0, help="input radius of the certificates (default 1)")
    p.add_argument("--markdown", action="store_true", help="Markdown table")
    p.set_defaults(func=run_convert)


@command("convert")
def run_convert(args: argparse.Namespace) -> int:
    """Convert MODEL and print the swaps and both certificates; returns the exit status."""
    from .models import load_backbone

    model, example = load_backbone(args.model, img_size=args.img_size, layers=args.layers)

    from certblocks.conversion import convert

    dtypes = args.dtype
    rep = convert(model, remove_norms=args.remove_norms, example_input=example, dtype=dtypes[0], r0=args.r0)
    print(f"{args.model}: {len(rep.swaps)} swaps")
    for s in rep.swaps:
        print(f"  {s}")
    rows = []
    for tag, cert, err in (("before", rep.certificate_before, rep.trace_error_before),
                           ("after", rep.certificate_after, rep.trace_error_after)):
        if cert is None:
            rows.append([tag, f"not available: {err.splitlines()[0][:100]}"] + [""] * (len(dtypes) - 1) + [""])
            continue
        cs = [cert.in_dtype(d) for d in dtypes]
        mq = max((u.q for u in cert.updates if u.q is not None), default=None)
        unknown = sum(u.q is None for u in cert.updates)
        rows.append([tag] + [verdict(c) for c in cs]
                    + [("?" if mq is None else f"{mq:g}") + (f" ({unknown} not derived)" if unknown else "")])
    print()
    print(render_table(["model"] + dtypes + ["max q"], rows, markdown=args.markdown))
    return 0

"""``certblocks zoo``: the zoo's models and their certificates; :func:`run_certify_zoo` for ``certblocks certify``.

Models are built with seed 0 and ``certify=False`` so that the ones past their budget are shown, not refused;
each is read by :func:`certblocks.model.as_certified` and certified at its default ``r0`` (from its embedding
weights) and ``seq_len``. The zoo (and with it
timm, which it registers models in) is imported when a command runs, never for ``--help``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, List, Optional, Sequence, TextIO

from ._common import Progress, UsageError, add_quiet, command, dtype_list, progress_of
from .formatting import format_exponents, format_number, render_table, verdict

__all__ = ["DEFAULT_DTYPES", "add_arguments", "model_table", "run_certify_zoo", "run_zoo", "zoo_table"]

#: The columns of the zoo tables: the pure dtypes and the precision policies people train with (docs/theory.md
#: section 7: ``amp-fp16`` is fp16 autocast with an fp32 stream, ``fp8-e4m3`` fp8 Linear inputs under bf16 autocast).
DEFAULT_DTYPES = ("fp16", "amp-fp16", "bf16", "fp8-e4m3", "fp32")


def _exponent_summary(cert: Any) -> str:
    seen: List[str] = []
    for u in cert.updates:
        e = format_exponents(u.q, u.sigma)
        if e not in seen:
            seen.append(e)
    return " ".join(seen)


def model_table(model: Any, dtypes: Sequence[str] = DEFAULT_DTYPES, *, markdown: bool = False) -> str:
    """A zoo model's certificate table.

    One row per residual update (exponents, coefficients), then one row per dtype or precision policy (certified
    depth, forward and backward depths, final radius, gradient bound, first failure), then what each policy assumed.
    """
    from certblocks.model import as_certified

    f3 = format_number
    cm = as_certified(model)
    certs = [cm.certificate(d) for d in dtypes]
    first = certs[0]
    segs = list(first.updates) + ([first.head] if first.head is not None else [])
    rows = [[u.name + ("" if u.kind == "update" else f" ({'head' if u is first.head else u.kind})"),
             format_exponents(u.q, u.sigma), f3(u.c), f3(u.b), f3(u.l1), f3(u.l0)] for u in segs]
    upd = render_table(["update", "(q, sigma)", "c", "b", "l1", "l0"], rows, markdown=markdown)
    drows = []
    for c in certs:
        f = c.first_failure
        drows.append([c.dtype, verdict(c), str(c.forward_depth), str(c.backward_depth), f3(c.radii[-1]),
                      f3(c.log_gradient_bound), "-" if f is None else f"{f.kind} at {f.segment} {f.index} ({f.name})"])
    dt = render_table(["dtype", "certified", "D_F", "D_grad", "R_D", "log grad bound", "first failure"], drows,
                      markdown=markdown)
    lip = "" if first.head is None else f" (head x loss gradient {first.loss_grad:.4g})"
    head = (f"r0 = {f3(first.r0)}, seq_len = {cm.seq_len}, dt = {first.dt:g}, "
            f"Lip(G) = {first.lip_g:g}{lip}")
    policies = [f"{c.precision.describe()}" + "".join(f"; {n}" for n in c.notes) for c in certs
                if c.precision is not None and not c.precision.pure]
    tail = "".join(f"\n\n{p}" if markdown else f"\n{p}" for p in policies)
    return (f"{head}\n\n{upd}\n\n{dt}" if markdown else f"{head}\n{upd}\n\n{dt}") + tail


def _build(name: str) -> Any:
    """A zoo model at its initialization with seed 0, built even when not certified."""
    import torch

    from certblocks.zoo import create_model

    torch.manual_seed(0)
    return create_model(name, certify=False)


def zoo_table(names: Sequence[str], dtypes: Sequence[str] = DEFAULT_DTYPES, *, markdown: bool = False,
              models: Optional[dict] = None, progress: Optional[Progress] = None) -> str:
    """One row per model: family, depth, exponents, certified depth per dtype."""
    from certblocks.model import as_certified
    from certblocks.zoo import model_entry

    rows = []
    for n in names:
        if progress is not None:
            progress("build and certify", n)
        m = models[n] if models and n in models else _build(n)
        cm = as_certified(m)
        certs = [cm.certificate(d) for d in dtypes]
        rows.append([n, model_entry(n).family, str(certs[0].depth), _exponent_summary(certs[0])]
                    + [verdict(c) for c in certs])
    if progress is not None:
        progress.clear()
    return render_table(["model", "family", "D", "(q, sigma)"] + list(dtypes), rows, markdown=markdown)


def run_certify_zoo(dtypes: Sequence[str] = DEFAULT_DTYPES, *, names: Optional[Sequence[str]] = None,
                    markdown: bool = False, include_test: bool = False, stream: Optional[TextIO] = None,
                    progress: Optional[Progress] = None) -> int:
    """Certify every zoo model and print its certificate table for each dtype, then a summary.

    Args:
        dtypes: dtype names and precision policies (default :data:`DEFAULT_DTYPES`).
        names: the models (default: every registered model, test sizes excluded).
        markdown: Markdown tables (for the README).
        include_test: also the small test configurations.
        stream: where to print (default stdout).
        progress: where to show which model is being built and certified (default: nowhere).

    Returns:
        0 (the exit status; a model that is not certified is a result, not an error).
    """
    from certblocks.precision import as_precision
    from certblocks.zoo import list_models, model_entry

    out = stream or sys.stdout
    dtypes = [as_precision(d).name for d in dtypes]
    names = list(names) if names else list_models(include_test=include_test)
    built = {}
    for n in names:
        t = time.perf_counter()
        if progress is not None:
            progress("build and certify", n)
        m = _build(n)
        built[n] = m
        table = model_table(m, dtypes, markdown=markdown)
        secs = time.perf_counter() - t
        if progress is not None:
            progress.clear()
        title = f"### {n}" if markdown else f"== {n} =="
        timing = "" if markdown else f" ({secs:.1f} s)"  # Markdown output is reproducible (for the README)
        print(f"{title}\n{model_entry(n).description}{timing}\n\n{table}\n", file=out, flush=True)
    print(("### Summary\n" if markdown else "== summary ==\n") + zoo_table(names, dtypes, markdown=markdown,
                                                                            models=built), file=out, flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``certblocks zoo``."""
    p.add_argument("pattern", nargs="?", default="*", help="glob over model names (default: all)")
    p.add_argument("--dtype", type=dtype_list, default=",".join(DEFAULT_DTYPES),
                   help=f"comma-separated dtypes and precision policies (amp-fp16, amp-bf16, fsdp-bf16, fp8-e4m3; "
                        f"default {','.join(DEFAULT_DTYPES)})")
    p.add_argument("--names-only", action="store_true", help="list the names and families, build nothing")
    p.add_argument("--detail", action="store_true", help="print each model's full certificate table")
    p.add_argument("--test", action="store_true", help="include the small test configurations")
    p.add_argument("--markdown", action="store_true", help="Markdown tables")
    add_quiet(p)
    p.set_defaults(func=run_zoo)


@command("zoo")
def run_zoo(args: argparse.Namespace) -> int:
    """List the zoo's models (``--names-only``) or print their certificates; returns the exit status."""
    from certblocks.zoo import list_models, model_entry

    names = list_models(args.pattern, include_test=args.test)
    if not names:
        hint = "" if args.test else " (add --test for the test sizes)"
        raise UsageError(f"no model matches {args.pattern!r}{hint}; 'certblocks zoo --names-only' lists them")
    if args.names_only:
        for n in names:
            print(f"{n:40s} {model_entry(n).family:18s} {model_entry(n).description}")
        return 0
    progress = progress_of(args, "zoo")
    if args.detail:
        return run_certify_zoo(args.dtype, names=names, markdown=args.markdown, include_test=args.test,
                               progress=progress)
    print(zoo_table(names, args.dtype, markdown=args.markdown, progress=progress))
    return 0

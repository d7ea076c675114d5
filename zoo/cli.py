"""Command-line pieces for the zoo, wired into ``certblocks/cli.py`` by the lead.

* :func:`add_zoo_commands` registers ``certblocks zoo`` (the registered models and their
  certificates) and ``certblocks convert MODEL --dtype ...`` (a backbone's certificate before and
  after :func:`certblocks.convert`).
* :func:`run_certify_zoo` certifies every zoo model and prints its certificate table per dtype
  (``certblocks certify`` without argument, ``make demo``).

Models are built with seed 0 and ``certify=False`` so that the ones past their budget are shown, not refused;
certificates use each model's default ``r0`` (from its embedding weights) and ``seq_len``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, List, Optional, Sequence, TextIO

from certblocks.budget import dtype_name
from certblocks.certificate import StackCertificate

__all__ = ["add_zoo_commands", "run_certify_zoo", "zoo_table", "model_table"]

DEFAULT_DTYPES = ("fp16", "bf16", "fp32")


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _render(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda r: "  ".join(s.ljust(w) if i == 0 else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _exponent_summary(cert: StackCertificate) -> str:
    seen: List[str] = []
    for u in cert.updates:
        e = f"({'?' if u.q is None else f'{u.q:g}'}, {'?' if u.sigma is None else f'{u.sigma:g}'})"
        if e not in seen:
            seen.append(e)
    return " ".join(seen)


def _verdict(cert: StackCertificate) -> str:
    return f"{'yes' if cert.ok else 'NO'} {cert.certified_depth}/{cert.depth}"


def model_table(model: Any, dtypes: Sequence[str] = DEFAULT_DTYPES, *, markdown: bool = False) -> str:
    """A model's certificate table: one row per residual update (exponents, coefficients), then one row
    per dtype (certified depth, forward and backward depths, final radius, gradient bound, first failure)."""
    certs = [model.certificate(d) for d in dtypes]
    first = certs[0]
    rows = [[u.name, f"({'?' if u.q is None else f'{u.q:g}'}, {'?' if u.sigma is None else f'{u.sigma:g}'})",
             _fmt(u.c), _fmt(u.b), _fmt(u.l1), _fmt(u.l0)] for u in first.updates]
    upd = _render(["update", "(q, sigma)", "c", "b", "l1", "l0"], rows, markdown)
    drows = []
    for c in certs:
        f = c.first_failure
        drows.append([c.dtype, _verdict(c), str(c.forward_depth), str(c.backward_depth), _fmt(c.radii[-1]),
                      _fmt(c.log_gradient_bound), "-" if f is None else f"{f.kind} at update {f.index} ({f.name})"])
    dt = _render(["dtype", "certified", "D_F", "D_grad", "R_D", "log grad bound", "first failure"], drows, markdown)
    head = (f"r0 = {_fmt(first.r0)}, seq_len = {model.certificate_seq_len()}, dt = {first.dt:g}, "
            f"Lip(G) = {first.lip_g:g}")
    return f"{head}\n\n{upd}\n\n{dt}" if markdown else f"{head}\n{upd}\n\n{dt}"


def _build(name: str) -> Any:
    """A zoo model at its initialization with seed 0, built even when not certified."""
    import torch

    from . import create_model

    torch.manual_seed(0)
    return create_model(name, certify=False)


def zoo_table(names: Sequence[str], dtypes: Sequence[str] = DEFAULT_DTYPES, *, markdown: bool = False,
              models: Optional[dict] = None) -> str:
    """One row per model: family, depth, exponents, certified depth per dtype."""
    from . import model_entry

    rows = []
    for n in names:
        m = models[n] if models and n in models else _build(n)
        certs = [m.certificate(d) for d in dtypes]
        rows.append([n, model_entry(n).family, str(certs[0].depth), _exponent_summary(certs[0])]
                    + [_verdict(c) for c in certs])
    return _render(["model", "family", "D", "(q, sigma)"] + list(dtypes), rows, markdown)


def run_certify_zoo(dtypes: Sequence[str] = DEFAULT_DTYPES, *, names: Optional[Sequence[str]] = None,
                    markdown: bool = False, include_test: bool = False, stream: Optional[TextIO] = None) -> int:
    """Certify every zoo model and print its certificate table for each dtype, then a summary.

    Args:
        dtypes: dtype names (default fp16, bf16, fp32).
        names: the models (default: every registered model, test sizes excluded).
        markdown: Markdown tables (for the README).
        include_test: also the small test configurations.
        stream: where to print (default stdout).

    Returns:
        0 (the exit status; a model that is not certified is a result, not an error).
    """
    from . import list_models, model_entry

    out = stream or sys.stdout
    dtypes = [dtype_name(d) for d in dtypes]
    names = list(names) if names else list_models(include_test=include_test)
    built = {}
    for n in names:
        t = time.perf_counter()
        m = _build(n)
        built[n] = m
        table = model_table(m, dtypes, markdown=markdown)
        secs = time.perf_counter() - t
        title = f"### {n}" if markdown else f"== {n} =="
        timing = "" if markdown else f" ({secs:.1f} s)"  # Markdown output is reproducible (for the README)
        print(f"{title}\n{model_entry(n).description}{timing}\n\n{table}\n", file=out, flush=True)
    print(("### Summary\n" if markdown else "== summary ==\n") + zoo_table(names, dtypes, markdown=markdown,
                                                                            models=built), file=out, flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------- argparse
def _dtypes(text: str) -> List[str]:
    return [dtype_name(t) for t in text.split(",") if t.strip()]


def _cmd_zoo(args: argparse.Namespace) -> int:
    from . import list_models, model_entry

    names = list_models(args.pattern, include_test=args.test)
    if not names:
        print(f"no model matches {args.pattern!r}", file=sys.stderr)
        return 2
    if args.names_only:
        for n in names:
            print(f"{n:40s} {model_entry(n).family:18s} {model_entry(n).description}")
        return 0
    if args.detail:
        return run_certify_zoo(_dtypes(args.dtype), names=names, markdown=args.markdown, include_test=args.test)
    print(zoo_table(names, _dtypes(args.dtype), markdown=args.markdown))
    return 0


def _build_source(spec: str, img_size: int, layers: int) -> Any:
    """``timm:NAME``, ``hf:gpt2``, ``hf:mamba`` or ``mamba_ssm`` -> (model, example_input); random weights."""
    import torch

    torch.manual_seed(0)
    if spec.startswith("timm:"):
        import timm

        kw = {"img_size": img_size}
        if layers:
            kw["depth"] = layers
        m = timm.create_model(spec[5:], pretrained=False, **kw).eval()
        return m, torch.randn(1, 3, img_size, img_size)
    if spec in ("hf:gpt2", "hf:mamba"):
        import transformers as tr

        if spec == "hf:gpt2":
            cfg = tr.GPT2Config(n_layer=layers or 12)
            m = tr.GPT2LMHeadModel(cfg).eval()
        else:
            cfg = tr.MambaConfig(num_hidden_layers=layers or 24, use_mambapy=False)
            m = tr.MambaForCausalLM(cfg).eval()
        return m, {"input_ids": torch.randint(0, 1000, (1, 64)), "use_cache": False}
    raise ValueError(f"MODEL must be timm:NAME (e.g. timm:vit_tiny_patch16_224), hf:gpt2 or hf:mamba, got {spec!r}")


def _cmd_convert(args: argparse.Namespace) -> int:
    from certblocks.conversion import convert

    try:
        model, example = _build_source(args.model, args.img_size, args.layers)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtypes = _dtypes(args.dtype)
    rep = convert(model, remove_norms=args.remove_norms, example_input=example, dtype=dtypes[0], r0=args.r0)
    print(f"{args.model}: {len(rep.swaps)} swaps")
    for s in rep.swaps:
        print(f"  {s}")
    rows = []
    from certblocks.certificate import certify_stack

    for tag, cert, err in (("before", rep.certificate_before, rep.trace_error_before),
                           ("after", rep.certificate_after, rep.trace_error_after)):
        if cert is None:
            rows.append([tag, f"not available: {err.splitlines()[0][:100]}"] + [""] * (len(dtypes) - 1) + [""])
            continue
        cs = [certify_stack(cert.updates, d, dt=cert.dt, r0=cert.r0, lip_g=cert.lip_g) for d in dtypes]
        mq = max((u.q for u in cert.updates if u.q is not None), default=None)
        unknown = sum(u.q is None for u in cert.updates)
        rows.append([tag] + [_verdict(c) for c in cs]
                    + [("?" if mq is None else f"{mq:g}") + (f" ({unknown} not derived)" if unknown else "")])
    print()
    print(_render(["model"] + dtypes + ["max q"], rows, args.markdown))
    return 0


def add_zoo_commands(subparsers: Any) -> None:
    """Register ``certblocks zoo`` and ``certblocks convert`` on an ``argparse`` sub-parsers object."""
    p = subparsers.add_parser("zoo", help="the zoo's models and their certificates")
    p.add_argument("pattern", nargs="?", default="*", help="glob over model names (default: all)")
    p.add_argument("--dtype", default=",".join(DEFAULT_DTYPES), help="comma-separated dtypes (default fp16,bf16,fp32)")
    p.add_argument("--names-only", action="store_true", help="list the names and families, build nothing")
    p.add_argument("--detail", action="store_true", help="print each model's full certificate table")
    p.add_argument("--test", action="store_true", help="include the small test configurations")
    p.add_argument("--markdown", action="store_true", help="Markdown tables")
    p.set_defaults(func=_cmd_zoo)

    p = subparsers.add_parser("convert", help="a backbone's certificate before and after certblocks.convert")
    p.add_argument("model", help="timm:NAME (e.g. timm:vit_tiny_patch16_224), hf:gpt2 or hf:mamba (random weights)")
    p.add_argument("--dtype", default=",".join(DEFAULT_DTYPES), help="comma-separated dtypes (default fp16,bf16,fp32)")
    p.add_argument("--remove-norms", action="store_true", help="also replace the residual branches' norms")
    p.add_argument("--layers", type=int, default=0, help="number of layers/blocks (default: the model's)")
    p.add_argument("--img-size", type=int, default=224, help="image size for timm models")
    p.add_argument("--r0", type=float, default=1.0, help="input radius of the certificates")
    p.add_argument("--markdown", action="store_true", help="Markdown table")
    p.set_defaults(func=_cmd_convert)

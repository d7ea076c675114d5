"""``certblocks certify MODEL``: certify a model from its graph on the command line.

MODEL is one of

* ``timm:<name>`` -- a timm model with random weights (``pretrained=False``), on a random image
  of its default input size;
* ``hf:gpt2`` (``hf:mamba``) -- a Hugging Face model with random weights from the default
  config (GPT-2 124M; Mamba 130M), on ``--seq-len`` random token ids; nothing is downloaded;
* ``module:pkg.mod:factory`` -- ``factory()`` returns a module and an example input
  (``(module, example_input)``), or a module with an ``example_input`` attribute;
* a zoo name (``certblocks.zoo``).

The lead wires :func:`add_certify_parser` and :func:`run_certify` into ``certblocks/cli.py``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Tuple

import torch

__all__ = ["add_certify_parser", "run_certify", "load_model"]

_HF = ("gpt2", "mamba")


class ModelSpecError(ValueError):
    """MODEL could not be resolved."""


def add_certify_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``certify`` sub-command to an ``argparse`` sub-parsers object."""
    p = subparsers.add_parser(
        "certify", help="certify a model's residual updates from its graph (torch.export)",
        description="Certify every residual update X + f(X) of MODEL from its graph and the depths it "
                    "reaches in a dtype. MODEL: timm:<name>, hf:gpt2, hf:mamba, module:pkg.mod:factory, "
                    "or a zoo name.")
    p.add_argument("model", nargs="?", default=None,
                   help="timm:<name> | hf:gpt2 | hf:mamba | module:pkg.mod:factory | zoo name; "
                        "without MODEL, every zoo model is certified (fp16, bf16, fp32)")
    p.add_argument("--dtype", default=None,
                   help="fp16, bf16, fp32, fp64, fp8_e4m3, fp8_e5m2 (default bf16; comma-separated list "
                        "without MODEL, default fp16,bf16,fp32)")
    p.add_argument("--r0", type=float, default=None,
                   help="bound on the input norm ||X_0|| (default: a zoo model's input_radius(), else 1)")
    p.add_argument("--dt", type=float, default=1.0, help="residual step size (default 1)")
    p.add_argument("--seq-len", type=int, default=8, help="sequence length of the example input (default 8)")
    p.add_argument("--residual", default="auto",
                   help="'auto' (find residual updates), 'none' (whole model), or module path patterns "
                        "separated by commas (e.g. 'blocks.*.attn')")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--explain", action="store_true", help="also print the per-node table of each update")
    p.set_defaults(func=run_certify)
    return p


def _example_ids(vocab: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, seq_len), generator=g)


def load_model(spec: str, seq_len: int = 8) -> Tuple[torch.nn.Module, Any]:
    """Resolve a MODEL string to ``(module, example_input)`` (random weights, nothing downloaded)."""
    if not isinstance(spec, str) or not spec:
        raise ModelSpecError(f"MODEL must be a non-empty string, got {spec!r}")
    if seq_len < 1:
        raise ModelSpecError(f"--seq-len must be >= 1, got {seq_len}")
    torch.manual_seed(0)
    if spec.startswith("timm:"):
        name = spec[5:]
        try:
            import timm
        except ImportError as exc:
            raise ModelSpecError("timm:<name> needs timm (pip install 'certblocks[timm]')") from exc
        try:
            model = timm.create_model(name, pretrained=False)
        except Exception as exc:
            raise ModelSpecError(f"timm could not create {name!r}: {exc}") from exc
        cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
        size = tuple(cfg.get("input_size", (3, 224, 224)))
        return model.eval(), torch.randn(1, *size)
    if spec.startswith("hf:"):
        name = spec[3:].lower()
        try:
            import transformers as tr
        except ImportError as exc:
            raise ModelSpecError("hf:<name> needs transformers (pip install 'certblocks[hf]')") from exc
        if name in ("gpt2", "gpt2-small", "gpt2-124m"):
            cfg = tr.GPT2Config()
            return tr.GPT2Model(cfg).eval(), _example_ids(cfg.vocab_size, seq_len)
        if name in ("mamba", "mamba-130m"):
            cfg = tr.MambaConfig()
            return tr.MambaModel(cfg).eval(), _example_ids(cfg.vocab_size, seq_len)
        raise ModelSpecError(f"hf:{name} is not supported; allowed: hf:gpt2, hf:mamba (random weights from the "
                             "default config)")
    if spec.startswith("module:"):
        rest = spec[7:]
        if rest.count(":") != 1:
            raise ModelSpecError(f"module:... must be module:pkg.mod:factory, got {spec!r}")
        mod_name, fn_name = rest.split(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            raise ModelSpecError(f"cannot import {mod_name!r}: {exc}") from exc
        fn = getattr(mod, fn_name, None)
        if fn is None or not callable(fn):
            raise ModelSpecError(f"{mod_name} has no callable {fn_name!r}")
        res = fn()
        if isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.nn.Module):
            return res[0].eval(), res[1]
        if isinstance(res, torch.nn.Module):
            ex = getattr(res, "example_input", None)
            ex = ex() if callable(ex) else ex
            if ex is None:
                raise ModelSpecError(f"{spec}: the factory returned a module without an example input; return "
                                     "(module, example_input) or give the module an `example_input` attribute")
            return res.eval(), ex
        raise ModelSpecError(f"{spec}: the factory must return a module or (module, example_input), got "
                             f"{type(res).__name__}")
    # a zoo name
    try:
        zoo = importlib.import_module("certblocks.zoo")
    except ImportError:
        zoo = None
    create = getattr(zoo, "create_model", None) if zoo is not None else None
    if create is None:
        raise ModelSpecError(f"{spec!r} is not timm:<name>, hf:gpt2, hf:mamba or module:pkg.mod:factory, and the "
                             "certblocks model zoo (certblocks.zoo.create_model) is not available")
    try:
        model = create(spec)
    except Exception as exc:
        raise ModelSpecError(f"{spec!r} is not timm:<name>, hf:gpt2, hf:mamba or module:pkg.mod:factory, and the "
                             f"zoo could not build it: {exc}") from exc
    return model.eval(), _zoo_example(model, spec, seq_len)


def _zoo_example(model: torch.nn.Module, spec: str, seq_len: int) -> Any:
    """An example input for a zoo model: its ``example_input(seq_len)``, else a guess from its attributes."""
    ex = getattr(model, "example_input", None)
    if ex is not None:
        return ex(seq_len) if callable(ex) else ex
    pe = getattr(model, "patch_embed", None)
    img = getattr(pe, "img_size", None)
    if img is not None:
        chans = getattr(getattr(pe, "proj", None), "in_channels", 3)
        h, w = (img, img) if isinstance(img, int) else tuple(img)
        return torch.randn(1, chans, h, w)
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    if isinstance(cfg, dict) and "input_size" in cfg:
        return torch.randn(1, *cfg["input_size"])
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return _example_ids(vocab, seq_len)
    raise ModelSpecError(f"zoo model {spec!r} has no example_input(seq_len) and its input cannot be guessed; use "
                         "module:pkg.mod:factory returning (module, example_input)")


def run_certify(args: argparse.Namespace) -> int:
    """Run ``certblocks certify``; returns 0 when the stack is certified, 1 when not, 2 on a usage error."""
    from .api import certify
    from .capture import CaptureError
    from .report import ModelCertificate

    out = sys.stdout
    if args.model is None:
        from ..budget import dtype_name
        from ..zoo.cli import run_certify_zoo

        try:
            dtypes = [dtype_name(d) for d in (args.dtype or "fp16,bf16,fp32").split(",") if d.strip()]
        except ValueError as exc:
            print(f"certblocks certify: error: {exc}", file=sys.stderr)
            return 2
        return run_certify_zoo(dtypes)
    if args.dtype is None:
        args.dtype = "bf16"
    try:
        model, example = load_model(args.model, args.seq_len)
    except ModelSpecError as exc:
        print(f"certblocks certify: error: {exc}", file=sys.stderr)
        return 2
    residual: Any = args.residual
    if residual == "none":
        residual = None
    elif residual != "auto":
        residual = [p.strip() for p in residual.split(",") if p.strip()]
    try:
        cert = certify(model, example, residual=residual)
    except CaptureError as exc:
        print(f"certblocks certify: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:
        print(f"certblocks certify: error: {exc}", file=sys.stderr)
        return 2
    updates = cert if isinstance(cert, ModelCertificate) else ModelCertificate([cert], type(model).__name__)
    try:
        r0 = args.r0
        if r0 is None:
            radius = getattr(model, "input_radius", None)
            r0 = float(radius()) if callable(radius) else 1.0
        stack = updates.stack(args.dtype, r0=r0, dt=args.dt)
    except (ValueError, TypeError) as exc:
        print(f"certblocks certify: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"model": args.model, "certificates": updates.to_dict(), "stack": stack.to_dict()}
        if not args.explain:
            for u in doc["certificates"]["updates"]:
                u.pop("nodes", None)
        from .report import _jsonable

        print(json.dumps(_jsonable(doc), indent=2), file=out)
    else:
        print(updates.explain(), file=out)
        if args.explain:
            for u in updates:
                print("", file=out)
                print(u.explain(), file=out)
        print("", file=out)
        print(stack.explain(), file=out)
    return 0 if stack.ok else 1

"""Certification time against a naive float32 SVD sweep over the same weights, in one process (issue 30 item 1).

Usage: python benchmarks/bench_norms.py [--models gpt2 llama4 llama16] [--threads 1 2] [--repeats 3]
       [--seq-len 8] [--json out.json]

For each model (random weights, ``torch.manual_seed(0)``) and each thread count (``torch.set_num_threads``), the
median of ``--repeats`` runs, interleaved, of:

* ``sweep``: ``torch.linalg.svdvals(p.float())`` for every 2-D parameter of the model (embeddings included): what
  reading each weight's spectral norm off an SVD costs;
* ``certify``: ``certblocks.trace.certify(model, ids)`` with the default (``"fast"``) norms, split into
  ``capture`` (``torch.export`` and one concrete run, timed on its own), ``bounds`` (the time spent computing
  spectral norms, measured inside the same call, summed over the threads: the chain's segments are certified side by
  side, so it can exceed the wall time, and the rest, ``certify - capture - bounds``, is then not shown);
* ``certify_tight``: the same under ``norm_precision("tight")`` (the float64 eigensolver on every matrix);
* ``certify_1t``: the default norms with each matrix's work kept on one thread (its Gram blocks and Cholesky
  updates not split between the threads; the segments still side by side), for the comparison in the same run.

It also checks that the fast certificate's coefficients are within the fast slack of the tight one's (the
largest relative difference over every segment's ``c, b, l1, l0``) and never below them.  Models: HF
``GPT2Model(GPT2Config())`` (124M); ``LlamaModel`` with the 1B width (hidden 2048, MLP 5632, 32 heads, 8 KV heads,
vocabulary 32000) and 4 or 16 layers.  Goal: ``certify / sweep <= 0.3`` for GPT-2 and the Llama.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

import torch


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        return GPT2Model(GPT2Config()).eval()
    if name.startswith("llama"):
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8,
                          num_hidden_layers=int(name[len("llama"):]), vocab_size=32000)
        return LlamaModel(cfg).eval()
    raise ValueError(f"unknown model {name!r}: gpt2, llama4, llama16")


@contextmanager
def timed_bounds(into: List[float]) -> Iterator[None]:
    """Add the seconds spent in the spectral norms (fast and tight paths) to ``into[0]`` while inside."""
    from certblocks.bounds import norms

    names = ("_fast_op_norms", "_op_norm_uncached", "_tight_op_norms")
    saved = {n: getattr(norms, n) for n in names}

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                into[0] += time.perf_counter() - t0
        return inner

    for n in names:
        setattr(norms, n, wrap(saved[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(norms, n, saved[n])


@contextmanager
def norms_on_one_thread() -> Iterator[None]:
    """Keep each norm's float64 work on one thread while inside (no split between the workers of ``_split_work``)."""
    from certblocks.bounds import _fast

    saved = _fast._split_work
    _fast._split_work = lambda workers: saved(1)
    try:
        yield
    finally:
        _fast._split_work = saved


def coefficients(cert: Any) -> List[float]:
    segs = list(getattr(cert, "segments", None) or getattr(cert, "updates", []))
    for extra in (getattr(cert, "stem", None), getattr(cert, "head", None)):
        if extra is not None:
            segs.append(extra)
    out = []
    for tc in segs:
        c = tc.certificate
        out += [float(getattr(c, f)) for f in ("c", "b", "l1", "l0")]
    return out


def run_model(name: str, threads: List[int], repeats: int, seq_len: int) -> Dict[str, Any]:
    from certblocks.bounds import norm_precision
    from certblocks.trace import certify
    from certblocks.trace.capture import capture

    model = build(name)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(1))
    mats = [p for p in model.parameters() if p.ndim == 2]
    res: Dict[str, Any] = {"model": name, "params": sum(p.numel() for p in model.parameters()),
                           "matrices": len(mats), "by_threads": {}}
    certify(model, ids)  # warm-up: torch.export's first call initializes its machinery
    fast_cert = certify(model, ids)
    with norm_precision("tight"):
        tight_cert = certify(model, ids)
    f, t = coefficients(fast_cert), coefficients(tight_cert)
    ratios = [a / b for a, b in zip(f, t) if b > 0]
    res["coefficients"] = len(f)
    res["fast_over_tight_max"] = max(ratios, default=1.0)
    res["fast_over_tight_min"] = min(ratios, default=1.0)
    for n in threads:
        torch.set_num_threads(n)
        rows: Dict[str, List[float]] = {k: [] for k in ("sweep", "certify", "capture", "bounds", "certify_tight",
                                                        "certify_1t", "bounds_1t")}
        for _ in range(repeats):
            t0 = time.perf_counter()
            for p in mats:
                torch.linalg.svdvals(p.detach().float())
            rows["sweep"].append(time.perf_counter() - t0)
            spent = [0.0]
            with timed_bounds(spent):
                t0 = time.perf_counter()
                certify(model, ids)
                rows["certify"].append(time.perf_counter() - t0)
            rows["bounds"].append(spent[0])
            t0 = time.perf_counter()
            capture(model, (ids,), {})
            rows["capture"].append(time.perf_counter() - t0)
            with norm_precision("tight"):
                t0 = time.perf_counter()
                certify(model, ids)
                rows["certify_tight"].append(time.perf_counter() - t0)
            spent = [0.0]
            with timed_bounds(spent), norms_on_one_thread():
                t0 = time.perf_counter()
                certify(model, ids)
                rows["certify_1t"].append(time.perf_counter() - t0)
            rows["bounds_1t"].append(spent[0])
        med = {k: statistics.median(v) for k, v in rows.items()}
        rest = med["certify"] - med["capture"] - med["bounds"]
        med["rest"] = rest if rest >= 0 else None  # the norms overlapped on the threads: not derivable
        med["ratio"] = med["certify"] / med["sweep"]
        med["ratio_tight"] = med["certify_tight"] / med["sweep"]
        med["ratio_1t"] = med["certify_1t"] / med["sweep"]
        res["by_threads"][n] = {"median_s": {k: None if v is None else round(v, 3) for k, v in med.items()},
                                "runs_s": {k: [round(x, 3) for x in v] for k, v in rows.items()}}
        rest_text = "" if med["rest"] is None else f", rest {med['rest']:.2f}"
        print(f"{name:8s} threads {n}: sweep {med['sweep']:.2f} s | certify {med['certify']:.2f} s "
              f"(capture {med['capture']:.2f}, bounds {med['bounds']:.2f} summed over threads{rest_text}) "
              f"ratio {med['ratio']:.3f} | tight {med['certify_tight']:.2f} s ratio {med['ratio_tight']:.3f} | "
              f"norms on one thread {med['certify_1t']:.2f} s (bounds {med['bounds_1t']:.2f}) "
              f"ratio {med['ratio_1t']:.3f}",
              flush=True)
    print(f"{name:8s} fast / tight coefficients: max {res['fast_over_tight_max']:.7f}, "
          f"min {res['fast_over_tight_min']:.7f} over {res['coefficients']}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama4"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = {"command": "python benchmarks/bench_norms.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v not in ("", None)),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
           "load_average_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d"), "models": []}
    for name in args.models:
        out["models"].append(run_model(name, args.threads, args.repeats, args.seq_len))
    out["load_average_end"] = os.getloadavg()
    print(f"load average: {out['load_average_start'][0]:.1f} at the start, {out['load_average_end'][0]:.1f} at the end")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()

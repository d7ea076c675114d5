"""Peak memory and wall time of certifying a Hugging Face checkpoint: loaded whole vs layer by layer (issue 30 item 2).

    python benchmarks/bench_checkpoint.py [--shape llama-1b] [--dtype float32] [--layers-only] [--dir DIR]
                                          [--seq-len 8] [--keep]

Writes a random checkpoint of a Llama shape (float32 or bfloat16, shards of at most 1 GB, one tensor at a time: the
model is never built, so an 8B shape is written with a tensor's memory) to DIR (default a temporary directory), then
runs each mode in a fresh subprocess (one BLAS thread) and reads its peak resident memory: ``VmHWM`` of
``/proc/self/status`` (the high-water mark of the process's own memory since its ``exec``; ``ru_maxrss`` of
``resource.getrusage`` is recorded too, but Linux carries it over from the parent across ``fork``/``exec``, which is
why the checkpoint is written by a subprocess of its own and the parent stays small):

* ``whole``: ``AutoModelForCausalLM.from_pretrained(DIR)`` then ``certblocks.certify(model, ids)`` and its bf16 stack;
* ``layers``: :func:`certblocks.checkpoint.certify_checkpoint` (DIR) and its bf16 stack.

Both certify on the same token ids; the script checks that every segment's certificate and the bf16 verdict are
identical, prints a Markdown table and deletes the checkpoint (unless ``--keep``).  ``--layers-only`` runs the
second mode alone (a shape too large to load whole here: llama-8b).  Each mode records the load average at its start
and end.  Writes benchmarks/out/bench_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

ROOT = Path(__file__).resolve().parent.parent

#: Llama shapes (the public configurations' widths, random weights).  llama-1b: Llama 3.2 1B (hidden 2048, MLP 8192,
#: 16 layers, GQA 32/8, vocabulary 128256, tied embeddings; 1.24 B parameters, 4.9 GB in float32).  llama-3b: Llama
#: 3.2 3B (hidden 3072, MLP 8192, 28 layers, GQA 24/8; 3.2 B parameters, 12.8 GB in float32).  llama-8b: Llama 3.1
#: 8B (hidden 4096, MLP 14336, 32 layers, GQA 32/8, untied; 8.0 B parameters, 16.1 GB in bfloat16).
SHAPES: Dict[str, Dict[str, Any]] = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=131072),
    "llama-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=131072),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0,
                     max_position_embeddings=131072),
    "llama-tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def write_checkpoint(shape: str, directory: str, dtype: str = "float32", shard_bytes: int = 10**9) -> Dict[str, Any]:
    """A random Llama of ``shape`` saved to ``directory`` as ``save_pretrained`` lays it out (``config.json``, shards
    of at most ``shard_bytes`` unless one tensor is larger, ``model.safetensors.index.json``), one tensor at a time.

    The parameters' names and shapes come from the model built on the meta device (tied weights stored once); their
    values are drawn as the model's initialization draws them: matrices normal with standard deviation
    ``initializer_range`` (drawn in float32 by blocks of rows, then cast), vectors (the RMS norms' weights) ones.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(**SHAPES[shape], dtype=dtype)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    out_dtype = getattr(torch, dtype)
    os.makedirs(directory, exist_ok=True)
    cfg.save_pretrained(directory)
    shards: list = [{}]
    files: list = []
    params = size = tensor_bytes = 0

    def flush() -> None:
        files.append((f"part-{len(files):05d}.safetensors", list(shards[-1])))
        save_file(shards[-1], os.path.join(directory, files[-1][0]), metadata={"format": "pt"})
        shards[-1] = {}

    for name, p in model.named_parameters():  # tied parameters once
        if p.dim() == 1:
            value = torch.ones(p.shape, dtype=out_dtype)
        else:
            value = torch.empty(p.shape, dtype=out_dtype)
            for rows in value.split(max(1, (1 << 24) // p.shape[1:].numel())):
                rows.copy_(torch.randn(rows.shape, generator=gen).mul_(cfg.initializer_range))
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][name] = value
        size += nbytes
        tensor_bytes += nbytes
        params += value.numel()
    if shards[-1]:
        flush()
    weight_map = {}
    for i, (tmp, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(os.path.join(directory, tmp), os.path.join(directory, final))
        weight_map.update({n: final for n in names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map}, fh, indent=2)
    size = sum(f.stat().st_size for f in Path(directory).iterdir())
    return {"parameters": params, "dtype": dtype, "bytes_on_disk": size, "shards": len(files),
            "write_s": time.perf_counter() - t}


def _hwm() -> int:
    """The process's peak resident memory in bytes (``VmHWM``; ``ru_maxrss`` where /proc is not there)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def digest(rep: Any, dtype: str) -> Dict[str, Any]:
    """What the two modes must agree on: every segment's name and coefficients, the stack's verdict and depths."""
    segs = [[s.name, repr(s.certificate)] for s in rep.all_segments()]
    st = rep.stack(dtype)
    return {"segments": segs, "ok": st.ok, "certified_depth": st.certified_depth, "notes": [str(n) for n in rep.notes]}


def run_mode(mode: str, directory: str, seq_len: int) -> Dict[str, Any]:
    """One mode in this process: load + certify (``whole``) or certify layer by layer (``layers``)."""
    import torch
    import transformers

    import certblocks
    from certblocks.checkpoint import CheckpointStats, certify_checkpoint

    ids = torch.randint(0, _vocab(directory), (1, seq_len), generator=torch.Generator().manual_seed(0))
    base = _hwm()
    t0 = time.perf_counter()
    out: Dict[str, Any] = {"mode": mode, "rss_after_imports": base, "load_average_start": os.getloadavg()[0]}
    if mode == "whole":
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        out["load_s"] = time.perf_counter() - t0
        rep = certblocks.certify(model, ids)
    else:
        stats = CheckpointStats()
        rep = certify_checkpoint(directory, example_input=ids, stats=stats)
        out.update(reads=stats.reads, bytes_read=stats.bytes_read, cache_peak_bytes=stats.peak_bytes)
    out.update(digest(rep, "bf16"))
    out["wall_s"] = time.perf_counter() - t0
    out["peak_rss"] = _hwm()
    out["load_average_end"] = os.getloadavg()[0]
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _vocab(directory: str) -> int:
    """The checkpoint's vocabulary size (its config)."""
    with open(os.path.join(directory, "config.json")) as fh:
        return int(json.load(fh)["vocab_size"])


def _child(argv: list, env: Dict[str, str]) -> Dict[str, Any]:
    """Run this script with ``argv`` in a fresh interpreter; its last line of output, as JSON."""
    proc = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the checkpoint's dtype (its config's: both modes certify in it)")
    parser.add_argument("--layers-only", action="store_true", help="run the layer-by-layer mode alone")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    parser.add_argument("--mode", choices=("write", "whole", "layers"), help=argparse.SUPPRESS)  # the subprocesses
    args = parser.parse_args()
    if args.mode == "write":
        print(json.dumps(write_checkpoint(args.shape, args.dir, args.dtype)))
        return
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.dir, args.seq_len)))
        return
    directory = args.dir or tempfile.mkdtemp(prefix="cb_ckpt_")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    modes = ("layers",) if args.layers_only else ("whole", "layers")
    try:
        info = _child(["--mode", "write", "--shape", args.shape, "--dtype", args.dtype, "--dir", directory], env)
        print(f"checkpoint {args.shape}: {info['parameters'] / 1e9:.2f} B parameters, {args.dtype}, "
              f"{info['bytes_on_disk'] / 1e9:.2f} GB on disk in {info['shards']} shards, written in "
              f"{info['write_s']:.0f} s", flush=True)
        results = {}
        for mode in modes:
            results[mode] = r = _child(["--mode", mode, "--dir", directory, "--seq-len", str(args.seq_len)], env)
            print(f"{mode}: peak RSS {r['peak_rss'] / 2**30:.2f} GiB, {r['wall_s']:.0f} s, load average "
                  f"{r['load_average_start']:.1f} -> {r['load_average_end']:.1f}", flush=True)
    finally:
        if not args.keep and os.path.isdir(directory):
            shutil.rmtree(directory)
    lay = results["layers"]
    w = results.get("whole")
    same = w is not None and all(w[k] == lay[k] for k in ("segments", "ok", "certified_depth", "notes"))
    print()
    print(f"- Shape: {args.shape} ({info['parameters'] / 1e9:.2f} B parameters, {args.dtype}, "
          f"{info['bytes_on_disk'] / 1e9:.2f} GB on disk), seq_len {args.seq_len}")
    print(f"- Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          "one BLAS thread")
    if w is None:
        print("- Layer by layer only (--layers-only): not compared with the model loaded whole")
    else:
        print(f"- Same segments, coefficients and bf16 verdict in both modes: {'yes' if same else 'NO'}")
    print(f"- bf16 stack: ok {lay['ok']}, certified depth {lay['certified_depth']}")
    print()
    print("| mode | peak RSS (VmHWM) | after imports | wall time | load average (start, end) |")
    print("|---|---|---|---|---|")
    for name, r in (("load whole + certify", w), ("layer by layer", lay)):
        if r is not None:
            print(f"| {name} | {r['peak_rss'] / 2**30:.2f} GiB | {r['rss_after_imports'] / 2**30:.2f} GiB | "
                  f"{r['wall_s']:.0f} s | {r['load_average_start']:.1f}, {r['load_average_end']:.1f} |")
    print("\nru_maxrss (carried from the parent across exec): " + ", ".join(
        f"{k} {v['ru_maxrss'] / 2**30:.2f} GiB" for k, v in results.items()))
    ratio = f"ratio of peak RSS (layers / whole): {lay['peak_rss'] / w['peak_rss']:.2f}; " if w is not None else ""
    print(f"\n{ratio}layer-by-layer cache peak {lay['cache_peak_bytes'] / 2**30:.2f} GiB, {lay['reads']} tensor reads "
          f"({lay['bytes_read'] / 1e9:.1f} GB)")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_checkpoint.json").write_text(json.dumps({"shape": args.shape, "checkpoint": info,
                                                           "identical": same if w is not None else None,
                                                           **{k: {x: y for x, y in v.items() if x != "segments"}
                                                              for k, v in results.items()}}, indent=2))
    if w is not None and not same:
        raise SystemExit("the two modes disagree")


if __name__ == "__main__":
    main()

"""Peak memory and wall time of certifying a Hugging Face checkpoint: loaded whole vs layer by layer (issue 30 item 2).

    python benchmarks/bench_checkpoint.py [--shape llama-1b] [--dir DIR] [--seq-len 8] [--keep]

Writes a random checkpoint of a Llama shape (``save_pretrained``, float32, sharded) to DIR (default a temporary
directory), then runs each mode in a fresh subprocess (one BLAS thread) and reads its peak resident memory: ``VmHWM`` of
``/proc/self/status`` (the high-water mark of the process's own memory since its ``exec``; ``ru_maxrss`` of
``resource.getrusage`` is recorded too, but Linux carries it over from the parent across ``fork``/``exec``, which is
why the checkpoint is written by a subprocess of its own and the parent stays small):

* ``whole``: ``AutoModelForCausalLM.from_pretrained(DIR)`` then ``certblocks.certify(model, ids)`` and its bf16 stack;
* ``layers``: :func:`certblocks.checkpoint.certify_checkpoint` (DIR) and its bf16 stack.

Both certify on the same token ids; the script checks that every segment's certificate and the bf16 verdict are
identical, prints a Markdown table and deletes the checkpoint (unless ``--keep``).  Writes
benchmarks/out/bench_checkpoint.json.
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
#: 3.2 3B (hidden 3072, MLP 8192, 28 layers, GQA 24/8; 3.2 B parameters, 12.8 GB in float32).
SHAPES: Dict[str, Dict[str, Any]] = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=131072),
    "llama-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=131072),
    "llama-tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def write_checkpoint(shape: str, directory: str) -> Dict[str, Any]:
    """A random float32 Llama of ``shape`` saved to ``directory`` (shards of at most 1 GB)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SHAPES[shape], dtype="float32")
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size="1GB")
    size = sum(f.stat().st_size for f in Path(directory).iterdir())
    return {"parameters": params, "bytes_on_disk": size, "write_s": time.perf_counter() - t}


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
    out: Dict[str, Any] = {"mode": mode, "rss_after_imports": base}
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
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    parser.add_argument("--mode", choices=("write", "whole", "layers"), help=argparse.SUPPRESS)  # the subprocesses
    args = parser.parse_args()
    if args.mode == "write":
        print(json.dumps(write_checkpoint(args.shape, args.dir)))
        return
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.dir, args.seq_len)))
        return
    directory = args.dir or tempfile.mkdtemp(prefix="cb_ckpt_")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    try:
        info = _child(["--mode", "write", "--shape", args.shape, "--dir", directory], env)
        print(f"checkpoint {args.shape}: {info['parameters'] / 1e9:.2f} B parameters, "
              f"{info['bytes_on_disk'] / 1e9:.2f} GB on disk, written in {info['write_s']:.0f} s", flush=True)
        results = {}
        for mode in ("whole", "layers"):
            results[mode] = r = _child(["--mode", mode, "--dir", directory, "--seq-len", str(args.seq_len)], env)
            print(f"{mode}: peak RSS {r['peak_rss'] / 2**30:.2f} GiB, {r['wall_s']:.0f} s", flush=True)
    finally:
        if not args.keep and os.path.isdir(directory):
            shutil.rmtree(directory)
    w, lay = results["whole"], results["layers"]
    same = all(w[k] == lay[k] for k in ("segments", "ok", "certified_depth", "notes"))
    print()
    print(f"- Shape: {args.shape} ({info['parameters'] / 1e9:.2f} B parameters, float32, "
          f"{info['bytes_on_disk'] / 1e9:.2f} GB on disk), seq_len {args.seq_len}")
    print(f"- Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          "one BLAS thread")
    print(f"- Same segments, coefficients and bf16 verdict in both modes: {'yes' if same else 'NO'}")
    print()
    print("| mode | peak RSS (VmHWM) | after imports | wall time |")
    print("|---|---|---|---|")
    for name, r in (("load whole + certify", w), ("layer by layer", lay)):
        print(f"| {name} | {r['peak_rss'] / 2**30:.2f} GiB | {r['rss_after_imports'] / 2**30:.2f} GiB | "
              f"{r['wall_s']:.0f} s |")
    print(f"\nru_maxrss (carried from the parent across exec): whole {w['ru_maxrss'] / 2**30:.2f} GiB, layers "
          f"{lay['ru_maxrss'] / 2**30:.2f} GiB; load average at the end {os.getloadavg()[0]:.1f}")
    print(f"\nratio of peak RSS (layers / whole): {lay['peak_rss'] / w['peak_rss']:.2f}; layer-by-layer cache peak "
          f"{lay['cache_peak_bytes'] / 2**30:.2f} GiB, {lay['reads']} tensor reads ({lay['bytes_read'] / 1e9:.1f} GB)")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_checkpoint.json").write_text(json.dumps({"shape": args.shape, "checkpoint": info, "identical": same,
                                                           **{k: {x: y for x, y in v.items() if x != "segments"}
                                                              for k, v in results.items()}}, indent=2))
    if not same:
        raise SystemExit("the two modes disagree")


if __name__ == "__main__":
    main()

"""Forward+backward time of the certified transformer blocks against their timm peers (CPU).

    python benchmarks/bench_blocks.py [--repeats 15] [--warmup 3] [--threads N] [--out benchmarks/out]

Rows (ratio = certblocks median / peer median; targets from issue 4):

* ``QKNormAttention`` vs timm ``Attention(qk_norm=False)`` at B=4, T=256, dim 768, 12 heads
  (bidirectional, both with q/k/v and output biases; also a causal row), target <= 1.10;
* ``GatedMLP(gate="sigmoid")`` vs timm ``SwiGLU(768, 2048)`` (both with biases), target <= 1.05;
* ``RotaryQKNormAttention`` vs HF ``LlamaAttention`` (sdpa) at B=2, T=512, dim 768, 12 heads, 4 key/value heads,
  causal, both given the same HF ``(cos, sin)`` (a model computes them once for all layers), target <= 1.10.

Runs alternate between the block and its peer so that drift affects both; each timing is one
forward plus one backward (parameter and input gradients).  Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch import nn


def _step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, call: Callable) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = call(module, x)
    y.backward(grad)


def _time_pair(a: nn.Module, b: nn.Module, x: torch.Tensor, call_a: Callable, call_b: Callable, repeats: int,
               warmup: int) -> Dict[str, List[float]]:
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    grad = torch.randn_like(x)
    for _ in range(warmup):
        _step(a, xa, grad, call_a)
        _step(b, xb, grad, call_b)
    ta: List[float] = []
    tb: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _step(a, xa, grad, call_a)
        t1 = time.perf_counter()
        _step(b, xb, grad, call_b)
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return {"block": ta, "peer": tb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from timm.layers import Attention as TimmAttention
    from timm.layers import SwiGLU

    from certblocks.blocks.attention import QKNormAttention
    from certblocks.blocks.mlp import GatedMLP

    torch.manual_seed(0)
    B, T, dim, heads, hidden = 4, 256, 768, 12, 2048
    x = torch.randn(B, T, dim)
    rows = []

    def plain(m, t):
        return m(t)

    def timm_causal(m, t):
        return m(t, is_causal=True)

    cases = [
        ("QKNormAttention (bidirectional)", "timm Attention(qk_norm=False)",
         QKNormAttention(dim, heads, causal=False), TimmAttention(dim, heads, qkv_bias=True), plain, plain, 1.10),
        ("QKNormAttention (causal)", "timm Attention(qk_norm=False, is_causal)",
         QKNormAttention(dim, heads, causal=True), TimmAttention(dim, heads, qkv_bias=True), plain, timm_causal,
         1.10),
        ("GatedMLP(sigmoid, bias)", "timm SwiGLU(768, 2048)", GatedMLP(dim, hidden, bias=True), SwiGLU(dim, hidden),
         plain, plain, 1.05),
    ]
    cases = [(*c, x) for c in cases]
    try:  # the Llama-family row needs transformers
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    except ImportError:
        print("transformers is not installed: no RotaryQKNormAttention row")
    else:
        from certblocks.blocks.rotary import RotaryQKNormAttention

        cfg = LlamaConfig(hidden_size=dim, num_attention_heads=heads, num_key_value_heads=4, intermediate_size=hidden,
                          num_hidden_layers=1)
        cfg._attn_implementation = "sdpa"
        llama = LlamaAttention(cfg, 0)
        rotary = RotaryQKNormAttention.from_module(llama)
        xl = torch.randn(2, 512, dim)
        cos_sin = LlamaRotaryEmbedding(cfg)(xl, torch.arange(512)[None])

        def ours(m, t):
            return m(t, position_embeddings=cos_sin)

        def hf(m, t):
            return m(t, cos_sin, None)[0]

        cases.append(("RotaryQKNormAttention (GQA 12/4, T=512)", "HF LlamaAttention (sdpa)", rotary, llama, ours, hf,
                      1.10, xl))
    for name, peer_name, block, peer, call_a, call_b, target, x in cases:
        times = _time_pair(block, peer, x, call_a, call_b, args.repeats, args.warmup)
        mb, mp = statistics.median(times["block"]), statistics.median(times["peer"])
        rows.append({"block": name, "peer": peer_name, "block_ms": 1e3 * mb, "peer_ms": 1e3 * mp, "ratio": mb / mp,
                     "target": target, "meets_target": mb / mp <= target,
                     "block_times_ms": [1e3 * t for t in times["block"]],
                     "peer_times_ms": [1e3 * t for t in times["peer"]]})

    header = f"{'block':40s} {'peer':42s} {'block ms':>9s} {'peer ms':>9s} {'ratio':>6s} {'target':>7s}"
    print(f"forward+backward, CPU, B={B}, T={T}, dim={dim}, heads={heads}, hidden={hidden}, "
          f"threads={torch.get_num_threads()}, median of {args.repeats}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ok = "ok" if r["meets_target"] else "MISS"
        print(f"{r['block']:40s} {r['peer']:42s} {r['block_ms']:9.1f} {r['peer_ms']:9.1f} {r['ratio']:6.3f} "
              f"<={r['target']:.2f} {ok}")

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
            "warmup": args.warmup, "shape": {"B": B, "T": T, "dim": dim, "heads": heads, "hidden": hidden}}
    path = args.out / "bench_blocks.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""An HF Llama converted by certblocks and trained under enforce, against the Llama itself: byte-level LM.

The corpus is ``benchmarks/experiments/monitor_gpt.py``'s (the Python standard library's sources, bytes).  Three
forms of one small random Llama (``--layers`` layers, width ``--width``, ``--heads`` query heads, ``--kv-heads``
key/value heads, SwiGLU, RMSNorm, RoPE), the same seed, data and AdamW learning rate, under CPU autocast in ``--amp``:

* ``llama``: HF's ``LlamaForCausalLM`` as it is (Pre-RMSNorm, SwiGLU);
* ``converted``: ``certblocks.convert(llama, remove_norms=True)``: ``RotaryQKNormAttention``, sigmoid ``GatedMLP``,
  no norms in the residual branches (the final norm and the head are kept);
* ``enforced``: the converted model under ``certblocks.enforce(model, amp, r0=...)``, the embedding rows kept
  within ``r0 / 2`` (renormed after each step), as in ``monitor_gpt.py``'s enforced form.

Reports per form and seed: the held-out loss in bits per byte after the last step, whether a loss was
non-finite, and the median time per training step (forward, backward, optimizer step; the caps' cost is the
``enforced`` / ``converted`` ratio).  JSON: ``benchmarks/out/enforced_llama.json``.

Usage::

    python benchmarks/experiments/enforced_llama.py --quick    # 3 seeds x 300 steps, width 128, 4 layers
    python benchmarks/experiments/enforced_llama.py            # 3 seeds x 1500 steps, width 256, 6 layers
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")
FORMS = ("llama", "converted", "enforced")


def build(form: str, args: argparse.Namespace) -> Any:
    """The form's model (seeded: every form starts from the same Llama weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import certblocks

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.block, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    if form == "llama":
        return model, None
    model = certblocks.convert(model, remove_norms=True, inplace=True).model
    if form == "converted":
        return model, None
    emb = model.model.embed_tokens.weight
    cap = float(emb.detach().norm(dim=1).max())
    rep = certblocks.enforce(model, args.amp, r0=2.0 * cap)
    print(f"enforced: alpha = {rep.alpha:.4g}, {len(rep.caps)} capped tensors, r0 = {2 * cap:.4g}", flush=True)
    return model, cap


def bits_per_byte(model: Any, data: torch.Tensor, args: argparse.Namespace, amp: torch.dtype) -> float:
    """Mean next-byte loss (bits) on ``--eval-batches`` fixed held-out windows."""
    g = torch.Generator().manual_seed(1234)
    model.eval()
    total = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=amp):
        for _ in range(args.eval_batches):
            ix = torch.randint(0, data.numel() - args.block - 1, (args.batch,), generator=g)
            x = torch.stack([data[i:i + args.block] for i in ix])
            y = torch.stack([data[i + 1:i + 1 + args.block] for i in ix])
            logits = model(x, use_cache=False).logits.float()
            total += float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    model.train()
    return total / args.eval_batches / math.log(2.0)


def train(form: str, train_data: torch.Tensor, eval_data: torch.Tensor, args: argparse.Namespace) -> Dict[str, Any]:
    model, emb_cap = build(form, args)
    model.train()
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.amp]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    times: List[float] = []
    nonfinite = None
    loss_v = math.nan
    for step in range(args.steps):
        ix = torch.randint(0, train_data.numel() - args.block - 1, (args.batch,), generator=g)
        x = torch.stack([train_data[i:i + args.block] for i in ix])
        y = torch.stack([train_data[i + 1:i + 1 + args.block] for i in ix])
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=amp):
            logits = model(x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss_v = float(loss.detach())
        if not math.isfinite(loss_v):
            nonfinite = step
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if emb_cap is not None:
            with torch.no_grad():
                w = model.model.embed_tokens.weight
                w.copy_(torch.renorm(w, 2, 0, emb_cap))
        times.append(time.perf_counter() - t0)
        if step % 100 == 0:
            print(f"{form} seed {args.seed} step {step} loss {loss_v / math.log(2):.3f} bits/byte", flush=True)
    bpb = bits_per_byte(model, eval_data, args, amp) if nonfinite is None else math.nan
    return {"form": form, "seed": args.seed, "eval_bits_per_byte": bpb, "last_train_bits_per_byte":
            loss_v / math.log(2.0), "first_nonfinite": nonfinite,
            "ms_per_step": 1e3 * statistics.median(times[5:] or times)}


def main(argv: Any = None) -> Dict[str, Any]:
    from monitor_gpt import stdlib_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="width 128, 4 layers, 300 steps")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--amp", default="bf16", choices=["fp16", "bf16"])
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=os.path.join(OUT, "enforced_llama.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.heads, args.steps, args.block = 4, 128, 4, min(args.steps, 300), 64
    if args.threads:
        torch.set_num_threads(args.threads)
    forms = [f for f in args.forms.split(",") if f]
    bad = [f for f in forms if f not in FORMS]
    if bad:
        p.error(f"--forms: unknown {bad}; allowed: {', '.join(FORMS)}")
    data = stdlib_bytes(args.corpus_bytes)
    split = int(0.9 * data.numel())
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed = seed
        for form in forms:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                runs.append(train(form, data[:split], data[split:], args))
    summary: Dict[str, Any] = {}
    for form in forms:
        rs = [r for r in runs if r["form"] == form]
        bpb = [r["eval_bits_per_byte"] for r in rs if math.isfinite(r["eval_bits_per_byte"])]
        summary[form] = {"eval_bits_per_byte_mean": statistics.fmean(bpb) if bpb else math.nan,
                         "eval_bits_per_byte_std": statistics.stdev(bpb) if len(bpb) > 1 else 0.0,
                         "diverged": sum(r["first_nonfinite"] is not None for r in rs), "runs": len(rs),
                         "ms_per_step": statistics.median(r["ms_per_step"] for r in rs)}
    print(f"\n{args.layers} layers, width {args.width}, {args.heads}/{args.kv_heads} heads, {args.steps} steps, "
          f"{args.amp} autocast, lr {args.lr}, threads {torch.get_num_threads()}")
    print(f"{'form':10s} {'bits/byte':>18s} {'diverged':>9s} {'ms/step':>8s}")
    for form, s in summary.items():
        print(f"{form:10s} {s['eval_bits_per_byte_mean']:9.3f} +- {s['eval_bits_per_byte_std']:5.3f} "
              f"{s['diverged']:>5d}/{s['runs']:<3d} {s['ms_per_step']:8.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {"args": vars(args), "summary": summary, "runs": runs}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()

"""Cost of ``certblocks.trajectory`` in forward+backward passes of the same model on the same batch (CPU).

Three kinds of model: a zoo GPT-2 given its targets (its own loss: the exact costate), a ``CertifiedStack`` of
8 updates with a loss, and a Hugging Face GPT-2 through its graph (``torch.export`` included) with its labels.
For each, the median time of a plain forward+backward, and the median time of a cold ``trajectory`` (no warm
start) at ``steps`` Lanczos steps at most, default settings otherwise; the ratio is the cost in passes.

Usage::

    python benchmarks/trajectory_cost.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (allocations, export caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cases() -> List[Tuple[str, torch.nn.Module, Any, Callable[[], None], Dict[str, Any]]]:
    """``(name, model, batch, forward+backward, trajectory keywords)``."""
    from certblocks.zoo import create_model

    import certblocks
    from certblocks.blocks import MLP, Attention, GatedMLP, QKNormAttention

    out = []
    torch.manual_seed(0)
    gpt = create_model("gpt2_qknorm_test").eval()
    idx = torch.randint(0, gpt.vocab_size, (4, gpt.block_size))

    def gpt_fb() -> None:
        gpt.zero_grad(set_to_none=True)
        gpt(idx, idx)[1].backward()
    out.append((f"zoo gpt2_qknorm_test, targets (4 x {gpt.block_size})", gpt, (idx, idx), gpt_fb, {}))

    dim = 64
    blocks = [b for _ in range(2) for b in (Attention(dim, 4), MLP(dim, 4 * dim), QKNormAttention(dim, 4),
                                            GatedMLP(dim, 4 * dim))]
    st = certblocks.build_stack(blocks, "fp32", certify=False).eval()
    x = torch.randn(4, 32, dim)
    target = torch.randn(4, 32, dim)
    loss = lambda y: (y - target).square().mean()  # noqa: E731

    def st_fb() -> None:
        st.zero_grad(set_to_none=True)
        loss(st(x)).backward()
    out.append(("CertifiedStack, 8 updates, width 64 (4 x 32)", st, x, st_fb, {"loss": loss}))

    try:
        import transformers
    except ImportError:
        return out
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=64)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 256, (4, 32))

    def hf_fb() -> None:
        hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, labels=ids).loss.backward()
    out.append(("HF GPT-2, 4 layers, width 128, its graph (4 x 32)", hf, {"input_ids": ids, "labels": ids}, hf_fb,
                {}))
    return out


def main(argv: Any = None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, nargs="*", default=[12, 4])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import certblocks

    rows = []
    warnings.simplefilter("ignore")
    for name, model, batch, fb, kw in cases():
        base = _median_seconds(fb, args.repeats)
        row: Dict[str, Any] = {"model": name, "forward_backward_s": base}
        for steps in args.steps:
            run = lambda m=model, b=batch, s=steps, k=kw: certblocks.trajectory(m, b, "fp16", steps=s, **k)  # noqa: E731
            t = _median_seconds(run, max(1, args.repeats // 2))
            rep = certblocks.trajectory(model, batch, "fp16", steps=steps, **kw)
            row[f"steps_{steps}"] = {"seconds": t, "passes": t / base, "converged": rep.converged,
                                     "log_gradient_bound": rep.log_gradient_bound,
                                     "headroom_measured": rep.headroom_measured}
        rows.append(row)
        cells = ", ".join(f"steps {s}: {row[f'steps_{s}']['passes']:.1f} passes "
                          f"(converged {row[f'steps_{s}']['converged']}, log bound "
                          f"{row[f'steps_{s}']['log_gradient_bound']:.3f})" for s in args.steps)
        print(f"{name}: forward+backward {1e3 * base:.1f} ms; {cells}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()

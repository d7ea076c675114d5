"""Cost of ``certblocks.trajectory`` in forward+backward passes of the same model on the same batch (CPU).

Four models: a zoo GPT-2 given its targets (its own loss: the exact costate) at test size and at nanoGPT's
"mini" size on bytes (6 layers, width 384, 8 x 128 tokens: compute-bound, the others are bound by per-call
overhead), a ``CertifiedStack`` of 8 updates with a loss, and a Hugging Face GPT-2 through its graph
(``torch.export`` included) with its labels.  For each, the median time of a plain forward+backward, and the
median time of a cold ``trajectory`` (no warm start) per setting; the ratio is the cost in passes.  Settings:
the default, ``certified=False``, ``steps=4`` and ``jacobians=False, certified=False`` (measured figures only).
``--monitor``: the cost of one ``CertificateMonitor`` check on the mini GPT in training against a training step
(:func:`monitor_check_cost`): measured in the training step (the default on the measured basis), by separate
passes (``measure_in_step=False``) and with ``estimate_every=1``; ``--run-steps N``: a run with ``every=50``.

Usage::

    python benchmarks/trajectory_cost.py [--repeats 5] [--threads 1] [--monitor [--monitor-only] [--run-steps N]]
        [--out FILE]
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


def _mini() -> Tuple[torch.nn.Module, torch.Tensor]:
    """nanoGPT's mini GPT-2 (6 layers, width 384) on a byte vocabulary, and a batch of 8 x 128 tokens."""
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_mini", vocab_size=256, block_size=128).eval()
    return model, torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))


SETTINGS: Dict[str, Dict[str, Any]] = {
    "default": {}, "certified=False": {"certified": False}, "steps=4": {"steps": 4},
    "jacobians=False": {"jacobians": False, "certified": False}}


def cases(mini: bool = True) -> List[Tuple[str, torch.nn.Module, Any, Callable[[], None], Dict[str, Any]]]:
    """``(name, model, batch, forward+backward, trajectory keywords)`` (``mini``: with the mini GPT)."""
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
    if mini:
        big, big_idx = _mini()

        def mini_fb() -> None:
            big.zero_grad(set_to_none=True)
            big(big_idx, big_idx)[1].backward()
        out.append(("zoo gpt2_qknorm_mini on bytes, targets (8 x 128)", big, (big_idx, big_idx), mini_fb, {}))

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


#: ``(name, CertificateMonitor keywords)`` of the modes :func:`monitor_check_cost` times.
MONITOR_MODES: List[Tuple[str, Dict[str, Any]]] = [
    ("in step", {}), ("in step, no certificate", {"certificate_every": 10**9}),
    ("separate passes", {"measure_in_step": False}), ("estimate_every=1", {"estimate_every": 1})]


def _cpu_median(fn: Callable[[], Any], repeats: int) -> float:
    """Median CPU seconds of this process over ``repeats`` calls of ``fn`` after a warm-up (one thread: the work,
    whatever else the machine runs)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def monitor_check_cost(repeats: int, run_steps: int = 0) -> Dict[str, Any]:
    """A ``CertificateMonitor`` check on the mini GPT in training against a training step, in the same run.

    A training step is ``zero_grad``, forward, backward, ``monitor.step()``, ``optimizer.step()``, timed in CPU
    seconds of this process (one thread: the work, robust to the other jobs of a shared machine; the wall times are
    kept too).  Each mode runs ``every=2`` after a first (cold) check: a checked step and an unchecked one alternate,
    and the cost of a check is the median over ``repeats`` pairs of (checked step - unchecked step), in training
    steps (the unchecked steps' median): the hooks' work in the forward and backward included.  Modes
    (:data:`MONITOR_MODES`): ``"in step"`` (the default: measured in the training step), ``"in step, no
    certificate"`` (the checks after the first without the worst-case certificate: ``certificate_every=N`` costs
    this plus the certificates over ``N``), ``"separate passes"`` (``measure_in_step=False``) and
    ``"estimate_every=1"``.  Also: a step without a monitor, the worst-case certificates alone
    (``certificates(cached=False)``, part of every check), and with ``run_steps`` a run of that many steps with
    ``every=50``: its CPU time over ``run_steps`` unchecked steps (their median), minus 1."""
    from certblocks import CertificateMonitor
    from certblocks.bounds import one_thread

    model, idx = _mini()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(mon: Any = None) -> Dict[str, float]:
        """CPU seconds of the step (``cpu``), of ``monitor.step()`` in it (``check``), and wall seconds (``wall``)."""
        w0, t0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        model(idx, idx)[1].backward()
        t1 = time.process_time()
        if mon is not None:
            mon.step()
        t2 = time.process_time()
        opt.step()
        return {"cpu": time.process_time() - t0, "check": t2 - t1, "wall": time.perf_counter() - w0}

    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    out: Dict[str, Any] = {"plain_step_s": _cpu_median(train_step, repeats)}
    for name, kw in MONITOR_MODES:
        mon = CertificateMonitor(model, "bf16", every=2, **kw)
        cold = train_step(mon)["check"]
        train_step(mon)
        checked, unchecked = [], []
        for _ in range(repeats):
            checked.append(train_step(mon))
            unchecked.append(train_step(mon))
        in_step = mon.records[-1].get("data/measured_in_step")
        mon.remove()
        step = med(unchecked, "cpu")
        extra = statistics.median(c["cpu"] - u["cpu"] for c, u in zip(checked, unchecked))
        out[name] = {"cold_check_s": cold, "step_s": step, "checked_step_s": med(checked, "cpu"), "check_s": extra,
                     "steps_per_check": extra / step, "monitor_step_s": med(checked, "check"),
                     "step_wall_s": med(unchecked, "wall"), "checked_step_wall_s": med(checked, "wall"),
                     "measured_in_step": in_step}
    ups = CertificateMonitor(model, "bf16", on_data=False).updates
    assert ups is not None

    def certs() -> None:
        with one_thread():
            ups.certificates(cached=False)
    out["certificates_s"] = _cpu_median(certs, max(1, repeats // 2))
    if run_steps:
        mon = CertificateMonitor(model, "bf16", every=50)
        rows = [train_step(mon) for _ in range(run_steps)]
        mon.remove()
        base = statistics.median(r["cpu"] for k, r in enumerate(rows) if k % 50)
        total = sum(r["cpu"] for r in rows)
        out["every=50"] = {"steps": run_steps, "checks": len(mon.records), "run_cpu_s": total,
                           "run_wall_s": sum(r["wall"] for r in rows), "overhead": total / (run_steps * base) - 1.0}
    return out


def main(argv: Any = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--monitor", action="store_true", help="also time a monitor check on the mini GPT")
    p.add_argument("--run-steps", type=int, default=0, help="with --monitor: a run of this many steps, every=50")
    p.add_argument("--monitor-only", action="store_true", help="with --monitor: no trajectory() table")
    p.add_argument("--no-mini", action="store_true", help="leave the mini GPT out (the small models only)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import certblocks

    rows = []
    warnings.simplefilter("ignore")
    for name, model, batch, fb, kw in ([] if args.monitor_only else cases(mini=not args.no_mini)):
        base = _median_seconds(fb, args.repeats)
        row: Dict[str, Any] = {"model": name, "forward_backward_s": base}
        for setting in args.settings:
            opts = {**kw, **SETTINGS[setting]}
            run = lambda m=model, b=batch, o=opts: certblocks.trajectory(m, b, "fp16", **o)  # noqa: E731
            t = _median_seconds(run, max(1, args.repeats // 2))
            rep = run()
            row[setting] = {"seconds": t, "passes": t / base, "converged": rep.converged,
                            "log_gradient_bound": rep.log_gradient_bound,
                            "headroom_measured": rep.headroom_measured}
        rows.append(row)
        cells = ", ".join(f"{s}: {row[s]['passes']:.1f}" for s in args.settings)
        print(f"{name}: forward+backward {1e3 * base:.1f} ms; passes: {cells}", flush=True)
    result: Dict[str, Any] = {"trajectory": rows}
    if args.monitor:
        result["monitor"] = mon = monitor_check_cost(args.repeats, args.run_steps)
        print(f"monitor on the mini GPT (CPU seconds): a training step without a monitor {mon['plain_step_s']:.3f} s; "
              f"the worst-case certificates alone {mon['certificates_s']:.3f} s", flush=True)
        for mode, _ in MONITOR_MODES:
            m = mon[mode]
            print(f"  {mode}: unchecked step {m['step_s']:.3f} s, checked {m['checked_step_s']:.3f} s: a check costs "
                  f"{m['check_s']:.3f} s = {m['steps_per_check']:.2f} steps (monitor.step() {m['monitor_step_s']:.3f} "
                  f"s; cold {m['cold_check_s']:.3f} s; measured in the step: {m['measured_in_step']})", flush=True)
        if "every=50" in mon:
            r = mon["every=50"]
            print(f"  every=50: {r['steps']} steps, {r['checks']} checks, {r['run_cpu_s']:.1f} s: overhead "
                  f"{100 * r['overhead']:.2f}% over unchecked steps", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()

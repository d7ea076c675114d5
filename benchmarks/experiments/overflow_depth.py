"""Empirical overflow depth of residual stacks of each block, against the certificate's D_F.

For each block type (MLP, GatedMLP sigmoid and SiLU, Attention, QKNormAttention,
LinearGrowthMamba, Mamba) a stack ``X_{k+1} = X_k + v_k(X_k)`` of ``depth`` independently
initialized blocks (seeded) is certified with :func:`certblocks.certificate.certify_stack` (the blocks'
``certificate()`` from their current weights, ``r0`` the input radius) and then run in fp16, bf16
and fp32 from adversarial inputs with ``||X_0|| <= r0`` (per-token ball):

* scaled inputs: random directions, every token scaled to norm ``r0`` (several draws; one with all
  tokens equal);
* gradient-searched inputs: ``log ||X_K||`` maximized over ``X_0`` by projected gradient ascent
  in float32 (each token projected back to norm ``r0``), for several target depths ``K``.

For each dtype:

* empirical overflow depth ``k_emp``: the first ``k`` at which ``X_k`` (computed in that dtype)
  has a non-finite entry or a per-token norm ``>= M``, minimized over the inputs; ``None`` when no
  input overflows within the stack (censored: ``k_emp > depth``);
* certified overflow depth ``D*_F = D_F + 1`` from the stack's certificate in that dtype
  (``None`` when the certificate holds over the whole stack, i.e. ``D*_F > depth``);
* soundness: the certificate is beaten when ``k_emp <= D_F`` or when a measured ``||X_k||``
  exceeds the certified radius ``R_k`` (beyond a rounding tolerance); both are reported loudly
  (``BEATEN`` on stderr, ``"beaten": true`` in the JSON) and the script exits with status 1;
* tightness ``k_emp / D*_F`` (>= 1 when sound; 1 is tight).

Outputs ``benchmarks/out/overflow_depth.json`` and ``benchmarks/out/overflow_depth.png`` (``||X_k||``
against ``k`` per block, worst input, one line per dtype, with the certified radius ``R_k``).

Usage::

    python benchmarks/experiments/overflow_depth.py            # quick (< 5 min on 2 CPU cores)
    python benchmarks/experiments/overflow_depth.py --full     # deeper stacks, more inputs, more search steps
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from certblocks.budget import float_max
from certblocks.certificate import certify_stack
from certblocks.stack import block_certificate

OUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

#: Relative tolerance on ``||X_k|| <= R_k`` for rounding in the run dtype (the certified radius is
#: an exact-arithmetic bound; bf16 rounds at 2^-8 relative per operation).
RADIUS_TOL = 0.05


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def block_factories(dim: int, seq_len: int) -> Dict[str, Callable[[], nn.Module]]:
    """Constructors of one block (velocity) of each type at width ``dim``."""
    from certblocks.blocks import MLP, Attention, GatedMLP, LinearGrowthMamba, Mamba, QKNormAttention

    heads = max(1, dim // 16)
    return {
        "MLP": lambda: MLP(dim, 4 * dim, "gelu"),
        "GatedMLP-sigmoid": lambda: GatedMLP(dim, 2 * dim, gate="sigmoid"),
        "GatedMLP-silu": lambda: GatedMLP(dim, 2 * dim, gate="silu"),
        "Attention": lambda: Attention(dim, heads, causal=True),
        "QKNormAttention": lambda: QKNormAttention(dim, heads, causal=True),
        "LinearGrowthMamba": lambda: LinearGrowthMamba(dim, d_state=8, expand=2),
        "Mamba": lambda: Mamba(dim, d_state=8, expand=2),
    }


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """Per-sample state norm ``max_t ||x_t||_2`` in float64, ``x (B, T, d)`` -> ``(B,)``; inf if non-finite."""
    xf = x.detach().to(torch.float64)
    n = xf.norm(dim=-1).amax(dim=-1)
    bad = ~torch.isfinite(xf).all(dim=-1).all(dim=-1)
    return torch.where(bad, torch.full_like(n, math.inf), n)


def run_stack(blocks: Sequence[nn.Module], x0: torch.Tensor, dt: float = 1.0) -> torch.Tensor:
    """Norms ``||X_k||`` for ``k = 0..D`` of every sample, ``(D + 1, B)`` float64 (inf after an overflow).

    The blocks and ``x0`` must already be in the run dtype; a sample keeps ``inf`` once it overflowed.
    """
    x = x0
    out = [token_norms(x)]
    with torch.no_grad():
        for blk in blocks:
            x = x + dt * blk(x)
            n = token_norms(x)
            out.append(torch.where(torch.isinf(out[-1]), out[-1], n))
    return torch.stack(out)


#: Inputs are put at norm ``r0 * INPUT_SHRINK`` so that rounding them to fp16/bf16 (relative error
#: <= 2^-8 per entry) keeps every token inside the certified ball ``||X_0|| <= r0``.
INPUT_SHRINK = 1.0 - 2.0**-6


def project(x: torch.Tensor, r0: float) -> torch.Tensor:
    """Every token scaled to norm ``r0 * INPUT_SHRINK`` (the boundary of the per-token ball, less rounding room)."""
    return x * (r0 * INPUT_SHRINK / x.norm(dim=-1, keepdim=True).clamp_min(1e-30))


def scaled_inputs(n: int, seq_len: int, dim: int, r0: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` random inputs on the ball's boundary; the first has all tokens equal."""
    x = torch.randn(n, seq_len, dim, generator=gen, dtype=torch.float64)
    x[0] = x[0, :1].expand(seq_len, dim)
    return project(x, r0)


def gradient_search(blocks: Sequence[nn.Module], x0: torch.Tensor, r0: float, target: int, steps: int,
                    lr: float = 0.1, dt: float = 1.0) -> torch.Tensor:
    """Projected gradient ascent on ``sum_samples log ||X_target||`` (float32 copies of the blocks).

    Only samples with a finite ``X_target`` contribute; the search stops at a non-finite gradient.
    """
    x = x0.clone().requires_grad_(True)
    best = x0.clone()
    opt = torch.optim.Adam([x], lr=lr * r0)
    for _ in range(steps):
        h = x
        for blk in blocks[:target]:
            h = h + dt * blk(h)
        n = h.norm(dim=-1).amax(dim=-1)  # (B,)
        ok = torch.isfinite(n)
        if not bool(ok.any()):
            break
        loss = -torch.log(n[ok].clamp_min(1e-300)).sum()
        opt.zero_grad()
        loss.backward()
        if x.grad is None or not bool(torch.isfinite(x.grad).all()):
            break
        opt.step()
        with torch.no_grad():
            x.copy_(project(x, r0))
            best = x.detach().clone()
    return best


def scale_weights(block: nn.Module, gain: float) -> None:
    """Multiply the weight of every ``nn.Linear`` in ``block`` by ``gain`` (adversarial weights)."""
    if gain == 1.0:
        return
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, nn.Linear):
                m.weight.mul_(gain)


@dataclass
class DtypeResult:
    dtype: str
    max_value: float
    certified_forward_depth: Optional[int]  # D_F (None: certified over the whole stack, D_F >= depth)
    certified_overflow_depth: Optional[int]  # D*_F = D_F + 1
    empirical_overflow_depth: Optional[int]  # k_emp (None: no overflow within the stack)
    tightness: Optional[float]
    max_norm_over_radius: float  # max over k, inputs of ||X_k|| / R_k (finite states)
    norm_before_overflow: Optional[float]  # worst input's ||X_{k_emp - 1}||
    beaten: bool
    beaten_reason: str
    worst_norms: List[float] = field(default_factory=list)
    radii: List[float] = field(default_factory=list)


def evaluate_block(name: str, make: Callable[[], nn.Module], *, depth: int, dim: int, seq_len: int, r0: float,
                   n_random: int, search_steps: int, search_targets: Sequence[int], seed: int, gain: float = 1.0,
                   dtypes: Sequence[str] = tuple(DTYPES)) -> Dict:
    """Certify a stack of ``depth`` blocks of one type and measure its overflow depth per dtype."""
    torch.manual_seed(seed)
    blocks = [make() for _ in range(depth)]
    for b in blocks:
        b.eval()
        scale_weights(b, gain)
    t0 = time.time()
    certs = [block_certificate(b, seq_len=seq_len) for b in blocks]
    t_cert = time.time() - t0
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = [scaled_inputs(n_random, seq_len, dim, r0, gen)]
    b32 = [copy.deepcopy(b).to(torch.float32) for b in blocks]  # the selective scan has no float64
    t0 = time.time()
    for K in search_targets:
        K = max(1, min(depth, K))
        start = scaled_inputs(max(2, n_random // 2), seq_len, dim, r0, gen)
        inputs.append(gradient_search(b32, start.float(), r0, K, search_steps).double())
    t_search = time.time() - t0
    x_all = torch.cat(inputs)  # (B, T, d) float64
    res: Dict = {"block": name, "gain": gain, "q": certs[0].q, "sigma": certs[0].sigma, "depth": depth, "dim": dim,
                 "seq_len": seq_len, "r0": r0, "n_inputs": int(x_all.shape[0]), "cert_seconds": round(t_cert, 3),
                 "search_seconds": round(t_search, 3), "certificate_first_block": certs[0].to_dict(), "dtypes": {}}
    for dn in dtypes:
        dt_ = DTYPES[dn]
        M = float_max(dn)
        sc = certify_stack(certs, dn, r0=r0)
        fwd = sc.forward_depth
        d_f = fwd if fwd < depth else None
        radii = [float(r) for r in sc.radii]
        blocks_d = [copy.deepcopy(b).to(dt_) for b in blocks]
        norms = run_stack(blocks_d, x_all.to(dt_))  # (D+1, B)
        over = (norms >= M) | torch.isinf(norms)
        first = []
        for j in range(norms.shape[1]):
            idx = torch.nonzero(over[:, j])
            first.append(int(idx[0]) if idx.numel() else None)
        overflowing = [f for f in first if f is not None]
        k_emp = min(overflowing) if overflowing else None
        # worst input: the earliest overflow, else the largest final norm
        if k_emp is not None:
            w = first.index(k_emp)
        else:
            w = int(torch.argmax(norms[-1]))
        ratio = 0.0
        for k in range(depth + 1):
            fin = torch.isfinite(norms[k])
            if bool(fin.any()) and math.isfinite(radii[k]) and radii[k] > 0:
                ratio = max(ratio, float(norms[k][fin].max()) / radii[k])
        beaten, why = False, ""
        before = None  # the worst input's finite state norm just before its overflow
        if k_emp is not None and k_emp >= 1:
            before = float(norms[k_emp - 1, w])
        if k_emp is not None and (d_f is None or k_emp <= d_f):
            beaten, why = True, (f"state overflowed at k={k_emp} but the certificate holds to D_F="
                                 f"{d_f if d_f is not None else '>= ' + str(depth)}")
            if before is not None and before < M:
                why += (f" (||X_{k_emp - 1}|| = {before:.3g} < M = {M:.3g}: an intermediate inside update "
                        f"{k_emp - 1} overflowed, not the state)")
        if ratio > 1 + RADIUS_TOL:
            beaten = True
            why += ("; " if why else "") + f"measured ||X_k|| / R_k = {ratio:.4g} > 1"
        d_star = None if d_f is None else d_f + 1
        tight = None if (k_emp is None or d_star is None) else k_emp / d_star
        r = DtypeResult(dn, M, d_f, d_star, k_emp, tight, ratio, before, beaten, why,
                        [float(v) for v in norms[:, w]], radii)
        res["dtypes"][dn] = r.__dict__
        tag = "BEATEN: " + why if beaten else "ok"
        _log(f"  {name:18s} gain {gain:g} r0 {r0:g} {dn}: D_F={d_f if d_f is not None else '>=' + str(depth):>6}  "
             f"k_emp={k_emp if k_emp is not None else '>' + str(depth):>6}  "
             f"tightness={'-' if tight is None else f'{tight:.3g}':>6}  max ||X_k||/R_k={ratio:.3g}  {tag}")
        if beaten:
            _log(f"!!!!! CERTIFICATE BEATEN for {name} in {dn}: {why} -- this is a bug, report it !!!!!")
    return res


def plot(results: List[Dict], path: str) -> Optional[str]:
    """``||X_k||`` against ``k``: one panel per block (columns) and configuration (rows), worst input,
    one line per dtype, certified ``R_k`` dashed, the dtype's max dotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed: no plot (pip install matplotlib)")
        return None
    blocks = list(dict.fromkeys(r["block"] for r in results))
    configs = list(dict.fromkeys((r["gain"], r["r0"]) for r in results))
    fig, axes = plt.subplots(len(configs), len(blocks), figsize=(3.2 * len(blocks), 2.8 * len(configs)),
                             squeeze=False)
    colors = {"fp16": "tab:red", "bf16": "tab:blue", "fp32": "tab:green"}
    for r in results:
        ax = axes[configs.index((r["gain"], r["r0"])), blocks.index(r["block"])]
        for dn, d in r["dtypes"].items():
            ks = [k for k, v in enumerate(d["worst_norms"]) if math.isfinite(v) and v > 0]
            ax.semilogy(ks, [d["worst_norms"][k] for k in ks], color=colors[dn], label=f"{dn}")
            kr = [k for k, v in enumerate(d["radii"]) if math.isfinite(v) and 0 < v < 1e300]
            ax.semilogy(kr, [d["radii"][k] for k in kr], color=colors[dn], ls="--", lw=0.8)
            ax.axhline(d["max_value"], color=colors[dn], ls=":", lw=0.8)
        ax.set_title(f"{r['block']} ({r['q']:g},{r['sigma']:g}) gain {r['gain']:g} r0 {r['r0']:g}", fontsize=7)
        ax.set_xlabel("k", fontsize=7)
        ax.set_ylim(bottom=max(1e-2, r["r0"] / 10), top=1e45)
        ax.tick_params(labelsize=6)
    axes[0, 0].set_ylabel("||X_k||", fontsize=7)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle("||X_k|| of the worst input (solid), certified R_k (dashed), dtype max (dotted)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="deeper stacks, more inputs and search steps")
    p.add_argument("--blocks", nargs="*", default=None, help="subset of block names")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=8)
    p.add_argument("--r0", type=float, nargs="+", default=[1.0, 100.0], help="input radii (default: 1 100)")
    p.add_argument("--gains", type=float, nargs="+", default=[1.0, 3.0],
                   help="multipliers of every Linear weight (adversarial weights; default: 1 3)")
    p.add_argument("--depth", type=int, default=None, help="stack depth (default 64 quick, 256 full)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=OUT_DIR)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    depth = a.depth or (256 if a.full else 64)
    n_random = 32 if a.full else 6
    steps = 60 if a.full else 8
    targets = (2, 4, 8, 16, 32) if a.full else (2, 8)
    facs = block_factories(a.dim, a.seq_len)
    names = a.blocks or list(facs)
    for n in names:
        if n not in facs:
            p.error(f"unknown block {n!r}; choose from {list(facs)}")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    results = []
    configs = [(g, r) for g in a.gains for r in a.r0]
    for i, n in enumerate(names):
        for g, r0 in configs:
            _log(f"[{i + 1}/{len(names)}] {n}: stack of {depth}, dim {a.dim}, {a.seq_len} tokens, gain {g:g}, "
                 f"r0 {r0:g}")
            results.append(evaluate_block(n, facs[n], depth=depth, dim=a.dim, seq_len=a.seq_len, r0=r0, gain=g,
                                          n_random=n_random, search_steps=steps, search_targets=targets,
                                          seed=a.seed))
    elapsed = time.time() - t0
    beaten = [f"{r['block']}/gain {r['gain']:g}/r0 {r['r0']:g}/{dn}"
              for r in results for dn, d in r["dtypes"].items() if d["beaten"]]
    cmd = "python benchmarks/experiments/overflow_depth.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": cmd,
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seconds": round(elapsed, 1), "beaten": beaten}
    json_path = os.path.join(a.out, "overflow_depth.json")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    png = plot(results, os.path.join(a.out, "overflow_depth.png"))
    print(f"\nOverflow depth, stacks of {depth} blocks (dim {a.dim}, {a.seq_len} tokens); "
          f"D_F certified, k_emp measured (first non-finite state), tightness = k_emp / (D_F + 1)")
    print("| block | (q, sigma) | gain | r0 | dtype | D_F | k_emp | tightness | max ‖X_k‖/R_k |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for dn, d in r["dtypes"].items():
            df = d["certified_forward_depth"]
            ke = d["empirical_overflow_depth"]
            t = d["tightness"]
            print(f"| {r['block']} | ({r['q']:g}, {r['sigma']:g}) | {r['gain']:g} | {r['r0']:g} | {dn} "
                  f"| {df if df is not None else f'>= {depth}'} | {ke if ke is not None else f'> {depth}'} "
                  f"| {'-' if t is None else f'{t:.3g}'} "
                  f"| {d['max_norm_over_radius']:.3g} |")
    print(f"\n{elapsed:.0f} s; JSON {json_path}" + (f"; plot {png}" if png else ""))
    if beaten:
        print(f"CERTIFICATE BEATEN (bug): {beaten}", file=sys.stderr)
        return 1
    print("certificate never beaten")
    return 0


if __name__ == "__main__":
    sys.exit(main())

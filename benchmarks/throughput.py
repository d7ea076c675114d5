"""Throughput (tokens/s) of every certified block and zoo model against its uncertified counterpart.

    python benchmarks/throughput.py [--quick | --smoke] [--device cpu|cuda|auto | --gpu] [--dtype fp32|bf16|fp16]
                                    [--repeats N] [--warmup N] [--threads N] [--clock auto|wall|cpu]
                                    [--only PATTERN] [--out PATH] [--list]

Each row times a certified module and its peer at the same shapes, forward (``eval()``, no grad) and
forward+backward (``train()``, parameter gradients, plus the input gradient for blocks), and reports
``tokens/s = tokens / median seconds`` for both and the time ratio ``certified / peer`` (below 1: the
certified module is faster).  Rows:

blocks (certblocks.blocks):
  ``block/attention``, ``block/attention_causal``  QKNormAttention vs timm ``Attention(qk_norm=False)``;
  ``block/gated_mlp``                            GatedMLP(gate="sigmoid", bias) vs timm ``SwiGLU``;
  ``block/mamba_lg_vs_hf``                       LinearGrowthMamba vs HF transformers ``MambaMixer`` (its torch
                                                 path: one Python step per token; fewer repeats, see the note);
  ``block/mamba_lg_vs_free``                     LinearGrowthMamba vs certblocks ``Mamba`` (q = 5, same kernels);
  ``block/mamba_lg_vs_mamba_ssm``                LinearGrowthMamba vs ``mamba_ssm.Mamba`` (CUDA only);
  ``block/patchtst_vs_preln``                    PatchTSTBlock (no norm) vs the same block with pre-LayerNorm;
  ``block/patchtst_vs_hf``                       PatchTSTBlock (no norm) vs HF ``PatchTSTEncoderLayer``
                                                 (post-BatchNorm, PatchTST's default);
zoo models (certblocks.zoo, built with ``certify=False`` so that any size builds):
  ``model/gpt2``                                 gpt2_qknorm_* vs a nanoGPT-style GPT-2 (pre-LN, causal SDPA,
                                                 GELU MLP, tied embedding) of the same configuration;
  ``model/mamba_forecaster_vs_preln``, ``_vs_free``  mamba_forecaster_lg vs mamba_forecaster_preln / _free;
  ``model/patchtst_vs_preln``                    patchtst_noln vs patchtst_preln;
  ``model/vit``                                  certblocks_vit_* vs timm ``vit_*`` of the same size;
  ``model/toto_vs_rmsnorm``                      toto_style vs the same model with a pre-RMSNorm on each branch
                                                 (Toto 2.0's layout; the zoo has no such knob, built here).

A token is one position of the residual stream: ``batch * seq_len`` for blocks and GPT-2, one patch of one
series for the forecasters (``batch * n_vars * patches``), one patch or class token for the ViT.

Method: warm-up runs, then the certified module and its peer alternate (order swapped every repeat, so
drift affects both); the median of ``--repeats`` runs (default 7, ``--quick`` 5) is reported.  On CUDA
each run is synchronized and timed with CUDA events; ``--dtype bf16|fp16`` runs under autocast.
Every CPU run is timed twice, wall time and the process's CPU time (``time.process_time``, all threads).
The table uses ``--clock``; ``auto`` (default) picks CPU time on CPU with one thread, where it equals the
wall time of an idle machine but leaves out the time the process waits for a core on a shared one (there,
wall-time ratios of millisecond runs were seen to swing by +-50% between runs, CPU-time ratios by a few
percent), and wall time otherwise.  The JSON keeps both clocks.

Profiles: default (full, under ~15 min on one CPU thread), ``--quick`` (``make bench``; about 1-2 min on
one thread), ``--smoke`` (tiny sizes, for the tests).  A markdown table goes to stdout, progress to
stderr, JSON to ``benchmarks/out/throughput[_quick|_smoke][_cuda].json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script from anywhere; an installed certblocks comes first
    sys.path.append(str(_ROOT))

PROFILES = ("smoke", "quick", "full")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("fwd", "fwd+bwd")

# Sizes per profile.  Blocks: (batch, seq_len, width, ...); models: registry name and input sizes.
SIZES: Dict[str, Dict[str, Dict[str, Any]]] = {
    "smoke": {
        "attention": dict(B=2, T=16, dim=32, heads=2),
        "gated_mlp": dict(B=2, T=16, dim=32, hidden=64),
        "mamba_hf": dict(B=1, T=8, dim=16, d_state=4),
        "mamba": dict(B=1, T=16, dim=16, d_state=4),
        "patchtst_block": dict(B=4, T=6, dim=16, heads=2, d_ff=32),
        "gpt2": dict(name="gpt2_qknorm_test", B=2, T=16),
        "mamba_forecaster": dict(suffix="_test", B=2),
        "patchtst": dict(suffix="_test", B=2),
        "vit": dict(name="certblocks_vit_test", peer="vit_tiny_patch16_224", B=2,
                    kw=dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)),
        "toto": dict(name="toto_style_test", B=1, V=2),
    },
    "quick": {
        "attention": dict(B=4, T=256, dim=384, heads=6),
        "gated_mlp": dict(B=4, T=256, dim=384, hidden=1024),
        "mamba_hf": dict(B=2, T=128, dim=64, d_state=16),
        "mamba": dict(B=2, T=512, dim=128, d_state=16),
        "patchtst_block": dict(B=128, T=12, dim=128, heads=16, d_ff=256),
        "gpt2": dict(name="gpt2_qknorm_mini", B=2, T=256),
        "mamba_forecaster": dict(suffix="", B=16),
        "patchtst": dict(suffix="", B=16),
        "vit": dict(name="certblocks_vit_tiny_patch16_224", peer="vit_tiny_patch16_224", B=2, kw={}),
        "toto": dict(name="toto_style", B=2, V=4),
    },
    "full": {
        "attention": dict(B=4, T=256, dim=768, heads=12),
        "gated_mlp": dict(B=4, T=256, dim=768, hidden=2048),
        "mamba_hf": dict(B=2, T=512, dim=128, d_state=16),
        "mamba": dict(B=2, T=1024, dim=128, d_state=16),
        "patchtst_block": dict(B=256, T=12, dim=128, heads=16, d_ff=256),
        "gpt2": dict(name="gpt2_qknorm_124m", B=1, T=512),
        "mamba_forecaster": dict(suffix="", B=32),
        "patchtst": dict(suffix="", B=32),
        "vit": dict(name="certblocks_vit_small_patch16_224", peer="vit_small_patch16_224", B=4, kw={}),
        "toto": dict(name="toto_style", B=4, V=8),
    },
}
# The HF MambaMixer torch path steps through the sequence in Python and is slow in backward: cap its repeats.
HF_MAMBA_REPEATS = {"smoke": 1, "quick": 3, "full": 3}


class Skip(Exception):
    """A row that cannot run here (missing optional peer, CUDA-only peer on CPU); its reason is reported."""


@dataclass
class Pair:
    """A certified module and its peer, with one input shared by both."""

    cert_label: str
    peer_label: str
    cert: nn.Module
    peer: nn.Module
    inputs: Tuple[Any, ...]
    tokens: int
    shape: str
    input_grad: bool = False  # blocks: also the gradient of the (floating) input
    call_cert: Optional[Callable[..., torch.Tensor]] = None
    call_peer: Optional[Callable[..., torch.Tensor]] = None
    note: str = ""


@dataclass
class Case:
    name: str
    build: Callable[[Dict[str, Any], torch.device], Pair]
    size_key: str
    max_repeats: Optional[Dict[str, int]] = None


@dataclass
class Row:
    name: str
    status: str = "ok"  # "ok", "skipped", "error"
    reason: str = ""
    cert: str = ""
    peer: str = ""
    shape: str = ""
    tokens: int = 0
    repeats: int = 0
    note: str = ""
    clock: str = "wall"  # the clock of the table: "wall" or "cpu"
    times: Dict[str, Dict[str, Dict[str, List[float]]]] = field(default_factory=dict)  # clock -> mode -> side -> s

    def median(self, mode: str, side: str, clock: Optional[str] = None) -> float:
        return statistics.median(self.times[clock or self.clock][mode][side])

    def tokens_per_s(self, mode: str, side: str) -> float:
        return self.tokens / self.median(mode, side)

    def ratio(self, mode: str) -> float:
        return self.median(mode, "cert") / self.median(mode, "peer")

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"name": self.name, "status": self.status, "reason": self.reason, "certified": self.cert,
                             "peer": self.peer, "shape": self.shape, "tokens": self.tokens, "repeats": self.repeats,
                             "note": self.note, "clock": self.clock}
        if self.status == "ok":
            for mode in MODES:
                d[mode] = {"cert_tokens_per_s": self.tokens_per_s(mode, "cert"),
                           "peer_tokens_per_s": self.tokens_per_s(mode, "peer"),
                           "cert_median_s": self.median(mode, "cert"), "peer_median_s": self.median(mode, "peer"),
                           "ratio_cert_over_peer": self.ratio(mode)}
                for clock, t in self.times.items():
                    d[mode][f"cert_{clock}_s"] = t[mode]["cert"]
                    d[mode][f"peer_{clock}_s"] = t[mode]["peer"]
                    if clock != self.clock:
                        d[mode][f"ratio_{clock}"] = (statistics.median(t[mode]["cert"])
                                                     / statistics.median(t[mode]["peer"]))
        return d


# ----------------------------------------------------------------------------------------------- peers
class _NanoGPTBlock(nn.Module):
    """Pre-LN GPT-2 block: ``x + proj(attn(LN x))`` then ``x + mlp(LN x)`` (causal SDPA, GELU)."""

    def __init__(self, n_embd: int, n_head: int, bias: bool, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.attn_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.attn_proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class NanoGPT(nn.Module):
    """A nanoGPT-equivalent GPT-2 (the uncertified peer of ``gpt2_qknorm_*``): learned positions, pre-LN
    blocks, final LayerNorm, LM head tied to the token embedding; ``forward(idx, targets)`` as the zoo's."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int, bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([_NanoGPTBlock(n_embd, n_head, bias, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 2:
                    p.normal_(0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss


def _hf_mamba_mixer(d_model: int, d_state: int) -> nn.Module:
    import transformers
    import transformers.models.mamba.modeling_mamba as mm

    # Pin HF's own torch functions: its hub/package lookup may have bound mamba_ssm's CUDA kernels.
    for fname in ("mamba_inner_fn", "mamba_selective_scan", "mamba_selective_state_update", "causal_conv1d_fn",
                  "causal_conv1d_update"):
        f = getattr(mm, fname, None)
        if f is not None and hasattr(f, "__wrapped__"):
            setattr(mm, fname, f.__wrapped__)
    cfg = transformers.MambaConfig(hidden_size=d_model, state_size=d_state, conv_kernel=4, expand=2,
                                   num_hidden_layers=1)
    return mm.MambaMixer(cfg, layer_idx=0)


# ----------------------------------------------------------------------------------------------- cases
def _block_input(s: Dict[str, Any], device: torch.device) -> torch.Tensor:
    return torch.randn(s["B"], s["T"], s["dim"], device=device)


def _shape_btd(s: Dict[str, Any]) -> str:
    return f"B={s['B']} T={s['T']} d={s['dim']}"


def _attention(causal: bool) -> Callable[[Dict[str, Any], torch.device], Pair]:
    def build(s: Dict[str, Any], device: torch.device) -> Pair:
        from timm.layers import Attention as TimmAttention

        from certblocks.blocks import QKNormAttention
        cert = QKNormAttention(s["dim"], s["heads"], causal=causal)
        peer = TimmAttention(s["dim"], s["heads"], qkv_bias=True, qk_norm=False)
        call_peer = (lambda m, x: m(x, is_causal=True)) if causal else None
        return Pair(f"QKNormAttention({'causal' if causal else 'bidirectional'})",
                    "timm Attention(qk_norm=False" + (", is_causal)" if causal else ")"), cert, peer,
                    (_block_input(s, device),), s["B"] * s["T"], _shape_btd(s) + f" h={s['heads']}",
                    input_grad=True, call_peer=call_peer)
    return build


def _gated_mlp(s: Dict[str, Any], device: torch.device) -> Pair:
    from timm.layers import SwiGLU

    from certblocks.blocks import GatedMLP
    return Pair(f"GatedMLP(sigmoid, {s['hidden']})", f"timm SwiGLU({s['dim']}, {s['hidden']})",
                GatedMLP(s["dim"], s["hidden"], gate="sigmoid", bias=True), SwiGLU(s["dim"], s["hidden"]),
                (_block_input(s, device),), s["B"] * s["T"], _shape_btd(s), input_grad=True)


def _mamba_vs_hf(s: Dict[str, Any], device: torch.device) -> Pair:
    try:
        hf = _hf_mamba_mixer(s["dim"], s["d_state"])
    except Exception as e:  # optional peer
        raise Skip(f"transformers MambaMixer unavailable: {type(e).__name__}: {e}") from None
    from certblocks.blocks import LinearGrowthMamba
    return Pair("LinearGrowthMamba", "HF MambaMixer (torch path)", LinearGrowthMamba(s["dim"], d_state=s["d_state"]),
                hf, (_block_input(s, device),), s["B"] * s["T"], _shape_btd(s) + f" N={s['d_state']}",
                input_grad=True, note="HF steps through the sequence in Python: short T, fewer repeats")


def _mamba_vs_free(s: Dict[str, Any], device: torch.device) -> Pair:
    from certblocks.blocks import LinearGrowthMamba, Mamba
    lg = LinearGrowthMamba(s["dim"], d_state=s["d_state"])
    return Pair("LinearGrowthMamba", "certblocks Mamba (free, q=5)", lg, Mamba.from_module(lg),
                (_block_input(s, device),), s["B"] * s["T"], _shape_btd(s) + f" N={s['d_state']}", input_grad=True)


def _mamba_vs_mamba_ssm(s: Dict[str, Any], device: torch.device) -> Pair:
    if device.type != "cuda":
        raise Skip("mamba_ssm.Mamba runs only on CUDA (its selective-scan kernel); the CPU peer is HF MambaMixer")
    try:
        import selective_scan_cuda  # noqa: F401  (mamba_ssm's compiled kernel)
        from mamba_ssm import Mamba as RefMamba
    except Exception as e:
        raise Skip(f"mamba_ssm with its CUDA kernel is not importable: {type(e).__name__}: {e}") from None
    from certblocks.blocks import LinearGrowthMamba
    ref = RefMamba(s["dim"], d_state=s["d_state"])
    return Pair("LinearGrowthMamba", "mamba_ssm.Mamba (CUDA)", LinearGrowthMamba.from_module(ref), ref,
                (_block_input(s, device),), s["B"] * s["T"], _shape_btd(s) + f" N={s['d_state']}", input_grad=True)


def _patchtst_vs_preln(s: Dict[str, Any], device: torch.device) -> Pair:
    from certblocks.blocks import PatchTSTBlock
    kw = dict(dropout=0.0)
    return Pair("PatchTSTBlock(norm=None)", "PatchTSTBlock(norm='layer', pre)",
                PatchTSTBlock(s["dim"], s["heads"], s["d_ff"], norm=None, **kw),
                PatchTSTBlock(s["dim"], s["heads"], s["d_ff"], norm="layer", placement="pre", **kw),
                (_block_input(s, device),), s["B"] * s["T"], _shape_btd(s) + f" h={s['heads']}", input_grad=True)


def _patchtst_vs_hf(s: Dict[str, Any], device: torch.device) -> Pair:
    try:
        from transformers import PatchTSTConfig
        from transformers.models.patchtst.modeling_patchtst import PatchTSTEncoderLayer
    except Exception as e:  # optional peer
        raise Skip(f"transformers PatchTSTEncoderLayer unavailable: {type(e).__name__}: {e}") from None
    from certblocks.blocks import PatchTSTBlock
    cfg = PatchTSTConfig(d_model=s["dim"], num_attention_heads=s["heads"], ffn_dim=s["d_ff"], dropout=0.0,
                         attention_dropout=0.0, ff_dropout=0.0, path_dropout=0.0, norm_type="batchnorm",
                         pre_norm=False, channel_attention=False)
    cfg._attn_implementation = "sdpa"  # as the certified block (F.scaled_dot_product_attention)
    hf = PatchTSTEncoderLayer(cfg)

    def call_peer(m: nn.Module, x: torch.Tensor) -> torch.Tensor:  # HF wants (batch, n_vars, patches, d)
        return m(x.unsqueeze(0))[0].squeeze(0)
    return Pair("PatchTSTBlock(norm=None)", "HF PatchTSTEncoderLayer (post-BatchNorm)",
                PatchTSTBlock(s["dim"], s["heads"], s["d_ff"], norm=None, dropout=0.0), hf,
                (_block_input(s, device),), s["B"] * s["T"], _shape_btd(s) + f" h={s['heads']}", input_grad=True,
                call_peer=call_peer)


def _zoo(name: str, **kw: Any) -> nn.Module:
    from certblocks.zoo import create_model
    return create_model(name, certify=False, **kw)


def _lm_call(m: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return m(idx, targets)[1]


def _gpt2(s: Dict[str, Any], device: torch.device) -> Pair:
    cert = _zoo(s["name"])
    cfg = {k: getattr(cert, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
    if s["T"] > cfg["block_size"]:
        raise ValueError(f"gpt2 size: T={s['T']} exceeds block_size={cfg['block_size']} of {s['name']}")
    peer = NanoGPT(**cfg, bias=cert.transformer.ln_f.bias is not None)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg["vocab_size"], (s["B"], s["T"] + 1), generator=g).to(device)
    return Pair(s["name"], "nanoGPT-style GPT-2 (pre-LN)", cert, peer, (idx[:, :-1], idx[:, 1:]), s["B"] * s["T"],
                f"B={s['B']} T={s['T']} L={cfg['n_layer']} d={cfg['n_embd']} V={cfg['vocab_size']}",
                call_cert=_lm_call, call_peer=_lm_call, note="loss over all positions (LM head included)")


def _series(model: nn.Module, B: int, device: torch.device) -> Tuple[torch.Tensor, int, str]:
    x = torch.randn(B, model.seq_len, model.n_vars, device=device)
    n = model.patch.num_patches
    return x, B * model.n_vars * n, f"B={B} C={model.n_vars} L={model.seq_len} P={n}"


def _forecaster(family: str, cert_variant: str, peer_variant: str) -> Callable[[Dict[str, Any], torch.device], Pair]:
    def build(s: Dict[str, Any], device: torch.device) -> Pair:
        cn, pn = f"{family}_{cert_variant}{s['suffix']}", f"{family}_{peer_variant}{s['suffix']}"
        torch.manual_seed(0)
        cert = _zoo(cn)
        torch.manual_seed(0)
        peer = _zoo(pn)
        x, tokens, shape = _series(cert, s["B"], device)
        return Pair(cn, pn, cert, peer, (x,), tokens, shape, note="zoo default dropout in fwd+bwd (train mode)")
    return build


def _vit(s: Dict[str, Any], device: torch.device) -> Pair:
    import timm
    cert = _zoo(s["name"], **s["kw"])
    peer = timm.create_model(s["peer"], pretrained=False, **s["kw"])
    x = torch.randn(s["B"], 3, *cert.patch_embed.img_size, device=device)
    n = int(cert.patch_embed.num_patches) + int(cert.num_prefix_tokens)
    over = " (same overrides)" if s["kw"] else ""
    return Pair(s["name"] + over, f"timm {s['peer']}" + over, cert, peer, (x,), s["B"] * n,
                f"B={s['B']} img={cert.patch_embed.img_size[0]} tokens={n} d={cert.embed_dim} L={len(cert.blocks)}")


def _toto(s: Dict[str, Any], device: torch.device) -> Pair:
    torch.manual_seed(0)
    cert = _zoo(s["name"])
    torch.manual_seed(0)
    peer = _zoo(s["name"])
    d = peer.embed.out_features
    for layer in peer.layers:  # Toto 2.0: an RMSNorm on each branch input
        layer.attention = nn.Sequential(nn.RMSNorm(d, eps=1e-6), layer.attention)
        layer.mlp = nn.Sequential(nn.RMSNorm(d, eps=1e-6), layer.mlp)
    x = torch.randn(s["B"], s["V"], cert.context, device=device)
    n = cert.context // cert.patch_len
    return Pair(s["name"], s["name"] + " + pre-RMSNorm branches (built here)", cert, peer, (x,), s["B"] * s["V"] * n,
                f"B={s['B']} V={s['V']} context={cert.context} P={n} d={d}",
                note="the zoo has no normalized toto variant: the peer wraps each branch in nn.RMSNorm")


CASES: List[Case] = [
    Case("block/attention", _attention(False), "attention"),
    Case("block/attention_causal", _attention(True), "attention"),
    Case("block/gated_mlp", _gated_mlp, "gated_mlp"),
    Case("block/mamba_lg_vs_hf", _mamba_vs_hf, "mamba_hf", HF_MAMBA_REPEATS),
    Case("block/mamba_lg_vs_free", _mamba_vs_free, "mamba"),
    Case("block/mamba_lg_vs_mamba_ssm", _mamba_vs_mamba_ssm, "mamba"),
    Case("block/patchtst_vs_preln", _patchtst_vs_preln, "patchtst_block"),
    Case("block/patchtst_vs_hf", _patchtst_vs_hf, "patchtst_block"),
    Case("model/gpt2", _gpt2, "gpt2"),
    Case("model/mamba_forecaster_vs_preln", _forecaster("mamba_forecaster", "lg", "preln"), "mamba_forecaster"),
    Case("model/mamba_forecaster_vs_free", _forecaster("mamba_forecaster", "lg", "free"), "mamba_forecaster"),
    Case("model/patchtst_vs_preln", _forecaster("patchtst", "noln", "preln"), "patchtst"),
    Case("model/vit", _vit, "vit"),
    Case("model/toto_vs_rmsnorm", _toto, "toto"),
]
ROW_NAMES = [c.name for c in CASES]


# ----------------------------------------------------------------------------------------------- timing
class Progress:
    """One stderr line: ``[done/total] row mode  elapsed  ETA`` (redrawn in place on a terminal)."""

    def __init__(self, total: int, stream: Any = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.t0 = time.perf_counter()
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0

    def advance(self, n: int, label: str) -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty or self.done == self.total or now - self._last > 5.0:
            self._last = now
            el = now - self.t0
            eta = el / self.done * (self.total - self.done) if self.done else float("nan")
            line = f"[{self.done}/{self.total}] {label:<46} elapsed {el:6.1f}s  ETA {eta:6.1f}s"
            self.stream.write(("\r" + line) if self.tty else (line + "\n"))
            self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _objective(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out if out.dim() == 0 else out.float().square().mean()


class _Runner:
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def _autocast(self) -> Any:
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def run(self, module: nn.Module, pair: Pair, call: Callable[..., Any], mode: str) -> Dict[str, float]:
        """One timed forward (``eval``, no grad) or forward+backward (``train``): ``{"wall": s, "cpu": s}``
        (on CUDA only ``"wall"``, from CUDA events)."""
        args = pair.inputs
        if mode == "fwd":
            module.eval()
        else:
            module.train()
            module.zero_grad(set_to_none=True)
            if pair.input_grad:
                args = tuple(a.detach().requires_grad_(True) if a.is_floating_point() else a for a in args)
        cuda = self.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
        c0, t0 = time.process_time(), time.perf_counter()
        if mode == "fwd":
            with torch.no_grad(), self._autocast():
                call(module, *args)
        else:
            with self._autocast():
                loss = _objective(call(module, *args))
            loss.backward()
        if cuda:
            end.record()
            end.synchronize()
            return {"wall": start.elapsed_time(end) / 1e3}
        t1, c1 = time.perf_counter(), time.process_time()
        return {"wall": t1 - t0, "cpu": c1 - c0}


def _default_call(m: nn.Module, *args: Any) -> Any:
    return m(*args)


def time_pair(pair: Pair, runner: _Runner, repeats: int, warmup: int, progress: Progress, name: str
              ) -> Dict[str, Dict[str, Dict[str, List[float]]]]:
    """``{clock: {mode: {"cert": [s, ...], "peer": [s, ...]}}}``: the two sides alternate, order swapped each round."""
    sides = {"cert": (pair.cert, pair.call_cert or _default_call), "peer": (pair.peer, pair.call_peer or _default_call)}
    out: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    for mode in MODES:
        for i in range(warmup + repeats):
            order = ("cert", "peer") if i % 2 == 0 else ("peer", "cert")
            for side in order:
                module, call = sides[side]
                t = runner.run(module, pair, call, mode)
                if i >= warmup:
                    for clock, v in t.items():
                        out.setdefault(clock, {}).setdefault(mode, {"cert": [], "peer": []})[side].append(v)
            progress.advance(2, f"{name} {mode}")
    return out


# ----------------------------------------------------------------------------------------------- CLI
def _positive(kind: str, minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{kind} must be >= {minimum}, got {v}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    prof = ap.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="small sizes, 5 repeats (make bench; ~1-2 min, 1 thread)")
    prof.add_argument("--smoke", action="store_true", help="tiny sizes for the tests (1 repeat unless --repeats)")
    dev = ap.add_mutually_exclusive_group()
    dev.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                     help="cpu (default), cuda, or auto (cuda when available)")
    dev.add_argument("--gpu", action="store_true", help="same as --device cuda")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="fp32 (CPU default) or autocast to bf16 (CUDA default) / fp16")
    ap.add_argument("--repeats", type=_positive("--repeats", 1), default=None,
                    help="timed runs per side and mode (default 7; --quick 5; --smoke 1)")
    ap.add_argument("--warmup", type=_positive("--warmup", 0), default=None,
                    help="untimed runs first (default 2; --quick 1; --smoke 0)")
    ap.add_argument("--threads", type=_positive("--threads", 1), default=None, help="torch.set_num_threads")
    ap.add_argument("--clock", default="auto", choices=["auto", "wall", "cpu"],
                    help="seconds of the table: wall time, or the process's CPU time (robust on a shared CPU; "
                         "all threads summed); auto: cpu on CPU with one thread, else wall (both go to the JSON)")
    ap.add_argument("--only", default=None, metavar="PATTERN",
                    help="comma-separated globs or substrings of row names (see --list)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/out/throughput*.json)")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    return ap


def select_cases(only: Optional[str]) -> List[Case]:
    """The cases whose name matches one of the comma-separated patterns (glob, else substring)."""
    if only is None:
        return list(CASES)
    pats = [p.strip() for p in only.split(",") if p.strip()]
    if not pats:
        raise ValueError(f"--only {only!r} has no pattern")

    def hit(name: str, p: str) -> bool:
        return fnmatch.fnmatchcase(name, p) if any(ch in p for ch in "*?[") else p in name
    chosen = [c for c in CASES if any(hit(c.name, p) for p in pats)]
    if not chosen:
        raise ValueError(f"--only {only!r} matches no row; rows: {', '.join(ROW_NAMES)}")
    return chosen


def _resolve(args: argparse.Namespace, ap: argparse.ArgumentParser) -> Tuple[str, torch.device, torch.dtype]:
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    want = "cuda" if args.gpu else args.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda / --gpu: no CUDA device is available (torch.cuda.is_available() is False)")
    device = torch.device(want)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if dtype == torch.float16 and device.type == "cpu":
        ap.error("--dtype fp16 needs CUDA (CPU autocast supports bf16)")
    return profile, device, dtype


def _fmt_rate(v: float) -> str:
    return f"{v / 1e3:,.1f}k" if v >= 1e4 else f"{v:,.0f}"


def format_table(rows: Sequence[Row]) -> str:
    head = ("| row | certified | peer | shape | fwd cert tok/s | fwd peer tok/s | fwd ratio | "
            "f+b cert tok/s | f+b peer tok/s | f+b ratio |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.name} | {r.cert or '-'} | {r.peer or '-'} | {r.shape or '-'} | "
                         f"{r.status}: {r.reason} | | | | | |")
            continue
        cells = [r.name, r.cert, r.peer, r.shape]
        for mode in MODES:
            cells += [_fmt_rate(r.tokens_per_s(mode, "cert")), _fmt_rate(r.tokens_per_s(mode, "peer")),
                      f"{r.ratio(mode):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_benchmark(profile: str, device: torch.device, dtype: torch.dtype, cases: Sequence[Case], repeats: int,
                  warmup: int, progress_enabled: bool = True, clock: str = "wall") -> List[Row]:
    """Time every case; skipped or failing cases become rows with a reason (never dropped)."""
    runner = _Runner(device, dtype)
    sizes = SIZES[profile]
    plan = [(c, min(repeats, c.max_repeats[profile]) if c.max_repeats else repeats) for c in cases]
    progress = Progress(sum(2 * 2 * (warmup + n) for _, n in plan), enabled=progress_enabled)
    rows: List[Row] = []
    for case, n in plan:
        row = Row(case.name, repeats=n, clock=clock)
        runs, start = 2 * 2 * (warmup + n), progress.done
        try:
            torch.manual_seed(0)
            pair = case.build(dict(sizes[case.size_key]), device)
            pair.cert.to(device)
            pair.peer.to(device)
            row.cert, row.peer, row.shape, row.tokens, row.note = (pair.cert_label, pair.peer_label, pair.shape,
                                                                   pair.tokens, pair.note)
            if n < repeats:
                row.note = (row.note + "; " if row.note else "") + f"{n} repeats (capped)"
            row.times = time_pair(pair, runner, n, warmup, progress, case.name)
            for mode in MODES:
                for side in ("cert", "peer"):
                    bad = [t for t in row.times[clock][mode][side] if not (math.isfinite(t) and t > 0)]
                    if bad:
                        raise RuntimeError(f"non-positive or non-finite {clock} time {bad[0]!r} ({mode}, {side}): "
                                           "the run is shorter than the clock's resolution; use larger sizes")
        except Skip as e:
            row.status, row.reason = "skipped", str(e)
            progress.advance(runs, f"{case.name} skipped")
            progress.message(f"skipped {case.name}: {e}")
        except Exception as e:  # report and go on: one broken peer must not hide the other rows
            row.status, row.reason = "error", f"{type(e).__name__}: {e}"
            row.times = {}
            progress.advance(start + runs - progress.done, f"{case.name} error")
            progress.message(f"error in {case.name}: {row.reason}")
        finally:
            pair = None  # type: ignore[assignment]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    progress.close()
    return rows


def _meta(argv: Sequence[str], profile: str, device: torch.device, dtype: torch.dtype, repeats: int, warmup: int,
          wall_s: float) -> Dict[str, Any]:
    versions: Dict[str, Optional[str]] = {"torch": torch.__version__}
    for mod in ("timm", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    return {
        "benchmark": "throughput",
        "command": " ".join(["python", "benchmarks/throughput.py", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "versions": versions, "threads": torch.get_num_threads(), "device": str(device), "dtype": str(dtype),
        "profile": profile, "repeats": repeats, "warmup": warmup, "wall_s": wall_s,
        "ratio": "certified median time / peer median time (< 1: certified faster)",
    }


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the benchmark; returns ``{"meta": ..., "rows": [...]}`` (also written as JSON)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(ROW_NAMES))
        return {"meta": {}, "rows": []}
    try:
        cases = select_cases(args.only)
    except ValueError as e:
        ap.error(str(e))
    profile, device, dtype = _resolve(args, ap)
    repeats = args.repeats or {"smoke": 1, "quick": 5, "full": 7}[profile]
    warmup = args.warmup if args.warmup is not None else {"smoke": 0, "quick": 1, "full": 2}[profile]
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = args.clock
    if clock == "cpu" and device.type == "cuda":
        ap.error("--clock cpu measures CPU time; on CUDA the runs are timed with CUDA events (use wall or auto)")
    if clock == "auto":
        clock = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"

    t0 = time.perf_counter()
    rows = run_benchmark(profile, device, dtype, cases, repeats, warmup, not args.no_progress, clock)
    wall = time.perf_counter() - t0
    meta = _meta(argv, profile, device, dtype, repeats, warmup, wall)
    meta["clock"] = clock
    what = {"cpu": "process CPU time", "wall": "CUDA events" if device.type == "cuda" else "wall time"}[clock]
    print(f"throughput ({profile}): device={device}, dtype={str(dtype).replace('torch.', '')}, "
          f"threads={meta['threads']}, median of {repeats} (warm-up {warmup}), clock={clock} ({what}), "
          f"torch {torch.__version__}; ratio = certified time / peer time")
    print()
    print(format_table(rows))
    notes = [f"- {r.name}: {r.note}" for r in rows if r.note]
    if notes:
        print("\nnotes:\n" + "\n".join(notes))
    print(f"\nwall time {wall:.1f} s")
    result = {"meta": meta, "rows": [r.to_json() for r in rows]}
    out = args.out
    if out is None:
        suffix = ("" if profile == "full" else f"_{profile}") + ("_cuda" if device.type == "cuda" else "")
        out = Path(__file__).resolve().parent / "out" / f"throughput{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

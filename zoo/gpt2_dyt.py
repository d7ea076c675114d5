"""``gpt2_dyt``: a nanoGPT-compatible GPT-2 whose normalizers saturate (DyT), certified in pure fp16.

Each of the ``n_layer`` blocks is two pre-normalized residual updates (D = 2 n_layer)::

    x = x + ls1(attn(ln_1(x)))     # ln_1 a DyT; attn: QKDyTAttention (a DyT on each head's queries and keys)
    x = x + ls2(mlp(ln_2(x)))      # ln_2 a DyT; MLP(GELU)

and the head is ``lm_head(ln_f(x))`` with ``ln_f`` a DyT and ``lm_head`` tied to ``wte``.  The embedded tokens are
multiplied by a learnable scalar ``emb_scale`` initialized to ``sqrt(n_embd)`` (the DyT paper's recipe for language
models): a DyT does not rescale its input as a LayerNorm does, and nanoGPT's embeddings (``N(0, 0.02)`` entries) would
reach the first DyTs at a scale far below the one their ``alpha`` is set for.  A DyT
``gamma * tanh(alpha x) + beta`` has no ``eps`` (:mod:`certblocks.blocks.dyt`): every update is (0, 0) with a Jacobian
bound ``g L_f(B) max |alpha gamma|`` that does not depend on the radius, the head's ``Lip(G)`` is
``||W_lm|| max |alpha gamma| sqrt(2)``, and the backward budget ``log(M / Lip(G))`` of fp16 (about 10 nats) covers
every size of the zoo at its default branch gains (``init_values``; docs/dyt.md, "The zoo models").
Module names follow nanoGPT's (``transformer.h.{i}.ln_1``, ``.attn.c_attn``, ``.attn.c_proj``, ``.ln_2``,
``transformer.ln_f``), with the MLP's ``mlp.fc1`` / ``mlp.fc2`` as :class:`~certblocks.zoo.GPT2QKNorm`.

``norm="layer"`` and ``qk_norm=None`` build the same architecture with LayerNorms and plain attention: the Pre-LN
GPT-2 the accuracy comparison trains against (``benchmarks/experiments/dyt_accuracy.py``; not certified in fp16).

Certificate defaults: ``r0 = |emb_scale| (max_i ||wte_i|| + max_j ||wpe_j||)``, ``seq_len = block_size``,
``cert_dtype = "fp16"``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from certblocks._validation import check_choice, check_real
from certblocks.blocks.attention import Attention
from certblocks.blocks.dyt import ALPHA_INIT, DyT, PreNormed, QKDyTAttention, dyt_linear_head
from certblocks.blocks.gain import LayerScale, check_init_values
from certblocks.blocks.mlp import MLP
from certblocks.certificate import BlockCertificate

from ._base import normed_linear_head
from ._registry import register_model
from .gpt2 import GPT2QKNorm, gpt_config

__all__ = ["EmbeddingScale", "GPT2DyT", "GPT2DyTBlock"]

#: The branch gains' initial value of the class, GPT-2 124M's (at the class's ``alpha_init`` 0.5, ``qk_alpha_init`` 1):
#: the largest round value that certifies it in pure fp16 at initialization (docs/dyt.md); the smaller sizes register
#: sharper DyTs (``SHARP``) with the largest round gains that certify them.
INIT_VALUES = 0.05
#: The initial ``alpha`` of the query and key DyTs.
QK_ALPHA_INIT = 1.0
#: The saturation of the small sizes (tiny, mini; ViT-Ti, ViT-S): ``alpha_init`` 3 and ``qk_alpha_init`` 10, the best
#: of the pilot on the digits ViT (docs/dyt.md).  The attention's Jacobian bound grows with ``qk_alpha`` and the width:
#: at ViT-B these leave no round branch gain >= 5e-4 that certifies in fp16, so the base sizes (ViT-B, 124M) keep the
#: DyT paper's 0.5 and 1.
SHARP = {"alpha_init": 3.0, "qk_alpha_init": 10.0}
#: The certification dtype of the family.
CERT_DTYPE = "fp16"
_NORMS = ("dyt", "layer")


class GPT2DyTBlock(nn.Module):
    """One pre-normalized GPT-2 block: ``x + ls1(attn(ln_1(x)))`` then ``x + ls2(mlp(ln_2(x)))``.

    ``norm="dyt"``: ``ln_1``, ``ln_2`` are :class:`~certblocks.blocks.DyT` (``alpha_init``); ``"layer"``: LayerNorms.
    ``qk_norm="dyt"``: :class:`~certblocks.blocks.QKDyTAttention`; ``None``: plain attention (1, 2).
    """

    def __init__(self, n_embd: int, n_head: int, *, bias: bool, dropout: float, act: str, norm: str,
                 qk_norm: Optional[str], alpha_init: float, qk_alpha_init: float, init_values: Optional[float],
                 device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        make = (lambda: DyT(n_embd, alpha_init, **dd)) if norm == "dyt" else \
            (lambda: nn.LayerNorm(n_embd, bias=bias, **dd))
        attn_kw = dict(causal=True, bias=bias, attn_dropout=dropout, resid_dropout=dropout, **dd)
        self.ln_1 = make()
        self.attn = QKDyTAttention(n_embd, n_head, qk_alpha_init=qk_alpha_init, **attn_kw) if qk_norm == "dyt" \
            else Attention(n_embd, n_head, **attn_kw)
        self.ls1 = LayerScale(n_embd, init_values, **dd) if init_values else nn.Identity()
        self.ln_2 = make()
        self.mlp = MLP(n_embd, 4 * n_embd, act, bias=bias, dropout=dropout, **dd)
        self.ls2 = LayerScale(n_embd, init_values, **dd) if init_values else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.ls1(self.attn(self.ln_1(x)))
        return x + self.ls2(self.mlp(self.ln_2(x)))

    def velocities(self, prefix: str) -> List[Tuple[str, nn.Module]]:
        """``(path, velocity)`` of the two updates, each a :class:`~certblocks.blocks.PreNormed` view."""
        return pre_normed_velocities(self, prefix, (("ln_1", "attn", "ls1"), ("ln_2", "mlp", "ls2")))


def pre_normed_velocities(block: nn.Module, prefix: str, triples: Tuple[Tuple[str, str, str], ...]
                          ) -> List[Tuple[str, nn.Module]]:
    """``(path, view)`` of a block's pre-normalized updates, each ``(norm, branch, gain)`` a triple of its children's
    names (the gain an ``nn.Identity`` when there is none); the path is the branch's, as the tracer names it."""
    out: List[Tuple[str, nn.Module]] = []
    for norm, branch, ls in triples:
        gain = getattr(block, ls)
        view = PreNormed(getattr(block, norm), getattr(block, branch), gain if isinstance(gain, LayerScale) else None,
                         (norm, branch, ls))
        out.append((f"{prefix}{branch}", view))
    return out


class EmbeddingScale(nn.Module):
    """A learnable scalar ``x -> scale * x`` (parameter ``scale``, 0-dimensional), initialized to ``init_value``.

    Args:
        init_value: the initial scale (finite, > 0).
        device, dtype: as for torch layers.
    """

    def __init__(self, init_value: float, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.init_value = check_real("init_value", init_value, gt=0.0)
        self.scale = nn.Parameter(torch.empty((), device=device, dtype=dtype))
        if self.scale.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``scale`` back to ``init_value``."""
        with torch.no_grad():
            self.scale.fill_(self.init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"init_value={self.init_value:.4g}"


class GPT2DyT(GPT2QKNorm):
    """GPT-2 with DyT normalizers (pre-DyT updates, DyT on queries and keys, a DyT head), certified in pure fp16.

    Args:
        n_layer, n_head, n_embd, block_size, vocab_size, bias, dropout, act: as :class:`~certblocks.zoo.GPT2QKNorm`
            (nanoGPT's configuration).
        norm: ``"dyt"`` (default) or ``"layer"`` (the Pre-LN baseline: ``ln_1``, ``ln_2``, ``ln_f`` LayerNorms).
        qk_norm: ``"dyt"`` (default: :class:`~certblocks.blocks.QKDyTAttention`) or ``None`` (plain attention).
        alpha_init: the initial ``alpha`` of ``ln_1``, ``ln_2`` and ``ln_f`` (a scalar per DyT).
        qk_alpha_init: the initial ``alpha`` of the query and key DyTs.
        init_values: the initial value of the branch gains ``ls1.gamma`` / ``ls2.gamma`` (``None``: no gains).
        emb_scale: the initial value of the learnable scalar on the embedded tokens (:class:`EmbeddingScale`,
            ``emb_scale.scale``); ``"auto"`` (default): ``sqrt(n_embd)`` with DyT normalizers, none with LayerNorms (the
            Pre-LN baseline is nanoGPT's); ``None``: none.
        certify: refuse (``CertificationError``) a configuration not certified in ``cert_dtype``.
        cert_dtype: the certification dtype (default ``"fp16"``).
        device, dtype: as for torch layers.
    """

    _self_initialized = (DyT, EmbeddingScale)  # _init_weights: each at its own initial values

    def __init__(self, n_layer: int = 12, n_head: int = 12, n_embd: int = 768, block_size: int = 1024,
                 vocab_size: int = 50304, bias: bool = True, dropout: float = 0.0, *, act: str = "gelu",
                 norm: str = "dyt", qk_norm: Optional[str] = "dyt", alpha_init: float = ALPHA_INIT,
                 qk_alpha_init: float = QK_ALPHA_INIT, init_values: Optional[float] = INIT_VALUES,
                 emb_scale: Union[float, str, None] = "auto", certify: bool = True, cert_dtype: Any = None,
                 device=None, dtype=None) -> None:
        nn.Module.__init__(self)
        dropout = gpt_config(self, n_layer, n_head, n_embd, block_size, vocab_size, bias, dropout)
        self.norm_kind = check_choice("norm", norm, _NORMS)
        self.qk_norm = check_choice("qk_norm", qk_norm, ("dyt", None))
        self.alpha_init = check_real("alpha_init", alpha_init, gt=0.0)
        self.qk_alpha_init = check_real("qk_alpha_init", qk_alpha_init, gt=0.0)
        self.init_values = check_init_values(init_values) if init_values else None  # None or 0: no gains
        scale: Optional[float] = None
        if isinstance(emb_scale, str):
            check_choice("emb_scale", emb_scale, ("auto",))
            scale = math.sqrt(n_embd) if norm == "dyt" else None
        elif emb_scale is not None:
            scale = check_real("emb_scale", emb_scale, gt=0.0)
        dd = {"device": "meta", "dtype": dtype}  # built without values, then materialized and initialized once
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd, **dd),
            wpe=nn.Embedding(block_size, n_embd, **dd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([GPT2DyTBlock(n_embd, n_head, bias=bias, dropout=dropout, act=act, norm=norm,
                                          qk_norm=qk_norm, alpha_init=alpha_init, qk_alpha_init=qk_alpha_init,
                                          init_values=init_values, **dd) for _ in range(n_layer)]),
            ln_f=DyT(n_embd, alpha_init, **dd) if norm == "dyt" else nn.LayerNorm(n_embd, bias=bias, **dd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False, **dd)
        self.emb_scale = None if scale is None else EmbeddingScale(scale, **dd)
        self.to_empty(device=torch.get_default_device() if device is None else device)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT (after to_empty, which unties)
        self._init_weights()
        self._certify_or_refuse(certify, CERT_DTYPE if cert_dtype is None else cert_dtype)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """``emb_scale * drop(wte[idx] + wpe[0:T])`` (without a scale: nanoGPT's embedded tokens)."""
        x = super().embed(idx)
        return x if self.emb_scale is None else self.emb_scale(x)

    def input_radius(self) -> float:
        """``|emb_scale| (max_i ||wte_i|| + max_j ||wpe_j||)``: bound on every embedded token's norm."""
        r = super().input_radius()
        return r if self.emb_scale is None else abs(float(self.emb_scale.scale.detach())) * r

    def head_certificate(self) -> BlockCertificate:
        """``lm_head(ln_f(x))``: ``Lip(G) = ||W_lm|| max |alpha gamma|`` (DyT) or ``||W_lm|| G(ln_f)`` (LayerNorm)."""
        if isinstance(self.transformer.ln_f, DyT):
            return dyt_linear_head([self.transformer.ln_f], self.lm_head, "transformer.ln_f+lm_head")
        return normed_linear_head([self.transformer.ln_f], self.lm_head, "transformer.ln_f+lm_head")

    def load_gpt2_state_dict(self, state_dict: Mapping[str, torch.Tensor], **kwargs: Any) -> Any:
        """Not for this model: a GPT-2 checkpoint's LayerNorms become DyTs by conversion,
        ``certblocks.convert(hf_or_nanogpt_model, norm="dyt")`` (the weights kept, ``alpha`` initialized).

        Raises:
            TypeError: always, naming the conversion to use.
        """
        raise TypeError("GPT2DyT does not load GPT-2 checkpoints directly: convert the pretrained model with "
                        "certblocks.convert(model, norm='dyt') (its LayerNorms' weights become the DyTs' gamma/beta)")


def _gpt2(size: Tuple[int, int, int, int, int], defaults: Dict[str, Any], overrides: Dict[str, Any]) -> GPT2DyT:
    cfg: Dict[str, Any] = dict(zip(("n_layer", "n_head", "n_embd", "block_size", "vocab_size"), size))
    cfg.update(defaults)
    cfg.update(overrides)
    return GPT2DyT(**cfg)


@register_model(family="gpt2_dyt", test=True)
def gpt2_dyt_test(**overrides: Any) -> GPT2DyT:
    """GPT-2 DyT, certified in pure fp16: test size (2 layers, 2 heads, width 32, 16 tokens, vocab 64)."""
    return _gpt2((2, 2, 32, 16, 64), {"init_values": 0.1}, overrides)


@register_model(family="gpt2_dyt")
def gpt2_dyt_tiny(**overrides: Any) -> GPT2DyT:
    """GPT-2 DyT, certified in pure fp16: tiny (4 layers, 4 heads, width 128, 256 tokens, vocab 50304)."""
    return _gpt2((4, 4, 128, 256, 50304), {**SHARP, "init_values": 0.2}, overrides)


@register_model(family="gpt2_dyt")
def gpt2_dyt_mini(**overrides: Any) -> GPT2DyT:
    """GPT-2 DyT, certified in pure fp16: nanoGPT's shakespeare-char size (6 layers, 6 heads, width 384)."""
    return _gpt2((6, 6, 384, 256, 50304), {**SHARP, "init_values": 0.01}, overrides)


@register_model(family="gpt2_dyt")
def gpt2_dyt_124m(**overrides: Any) -> GPT2DyT:
    """GPT-2 DyT, certified in pure fp16: GPT-2 small, 124M (12 layers, 12 heads, width 768, 1024 tokens)."""
    return _gpt2((12, 12, 768, 1024, 50304), {}, overrides)

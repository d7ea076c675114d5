"""``gpt2_qknorm``: a nanoGPT-compatible GPT-2 with no LayerNorm in its residual updates.

Each of the ``n_layer`` blocks is two residual updates (D = 2 n_layer)::

    x = x + attn(x)     # QKNormAttention: causal, per-head RMS QK-norm, exponents (1, 1)
    x = x + mlp(x)      # MLP(GELU), exponents (1, 0)

The input of the updates is NOT normalized (no ``ln_1``/``ln_2``); the final ``ln_f`` before
the tied ``lm_head`` is kept (it is part of the head, not of a residual update).  The
configuration follows nanoGPT's ``GPTConfig`` (``n_layer, n_head, n_embd, block_size,
vocab_size, bias, dropout``) and so do the module names (``transformer.wte``, ``.wpe``,
``.h.{i}.attn.c_attn``, ``.attn.c_proj``, ``.ln_f``, ``lm_head``), except the MLP's layers,
``mlp.fc1`` / ``mlp.fc2`` (nanoGPT's ``c_fc`` / ``c_proj``, mapped by
:meth:`GPT2QKNorm.load_gpt2_state_dict`).

Pretrained GPT-2 weights: :meth:`GPT2QKNorm.load_gpt2_state_dict` takes a nanoGPT or HF
``GPT2LMHeadModel`` state_dict (HF's ``Conv1D`` weights are transposed), drops the residual
LayerNorms ``ln_1``/``ln_2`` and reports them, and initializes the QK-norm scales
``q_norm.weight``/``k_norm.weight`` to ``qk_scale_init`` (default **1.0**: each normalized
query and key has RMS 1, so a head's logits are at most ``sqrt(head_dim)`` in absolute value) and
the branch gains ``ls1.gamma``/``ls2.gamma`` to ``gain_init`` (default 1.0: the checkpoint's branches
were trained without a gain).  HF GPT-2 uses the tanh GELU: build with ``act="gelu_tanh"`` to reproduce its MLP exactly.

Certificate defaults: ``r0 = max_i ||wte_i|| + max_j ||wpe_j||`` (every token of the embedded
input has at most that norm, dropout inactive), ``seq_len = block_size``, ``cert_dtype = "bf16"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from certblocks._validation import check_bool, check_int, check_prob, check_real
from certblocks.blocks.attention import QKNormAttention
from certblocks.blocks.gain import LayerScale, check_init_values, gained_velocities
from certblocks.blocks.mlp import MLP
from certblocks.bounds import row_norm_max
from certblocks.certificate import BlockCertificate, cross_entropy_gradient

from ._base import ZooModel, normed_linear_head
from ._hub import ZooOutput
from ._registry import register_model

__all__ = ["GPT2QKNorm", "GPT2LoadReport"]

#: The QK-norm's ``eps``.
QK_NORM_EPS = 1e-6
#: The branch gains' initial value of the class, GPT-2 124M's: the largest of 1, 0.3, 0.1, ... that certifies it in
#: bf16 at initialization (it certifies up to 0.18).  The smaller sizes certify with unit gains and register 1.0,
#: which trains as the gain-free model does (benchmarks/RESULTS.md, "Certified defaults").
INIT_VALUES = 0.1


class GPT2QKNormBlock(nn.Module):
    """One GPT-2 block without LayerNorm: ``x + ls1(attn(x))`` then ``+ ls2(mlp(x))`` (gains: ``init_values``)."""

    def __init__(self, n_embd: int, n_head: int, *, bias: bool, dropout: float, act: str, qk_norm: str,
                 qk_norm_eps: float, init_values: Optional[float], device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.attn = QKNormAttention(n_embd, n_head, causal=True, bias=bias, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
                                    attn_dropout=dropout, resid_dropout=dropout, **dd)
        self.ls1 = LayerScale(n_embd, init_values, **dd) if init_values else nn.Identity()
        self.mlp = MLP(n_embd, 4 * n_embd, act, bias=bias, dropout=dropout, **dd)
        self.ls2 = LayerScale(n_embd, init_values, **dd) if init_values else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.ls1(self.attn(x))
        return x + self.ls2(self.mlp(x))

    def velocities(self, prefix: str) -> List[Tuple[str, nn.Module]]:
        """``(path, velocity)`` of the two updates; a branch with a gain is a :class:`ScaledBranch`."""
        return gained_velocities(self, prefix)


@dataclass
class GPT2LoadReport:
    """What :meth:`GPT2QKNorm.load_gpt2_state_dict` did.

    Attributes:
        source: ``"nanogpt"`` or ``"hf"``.
        loaded: the model's keys filled from the checkpoint.
        dropped: checkpoint keys not used (the residual LayerNorms ``ln_1``/``ln_2``, attention masks).
        initialized: the model's keys not in the checkpoint and set to their documented value
            (the QK-norm scales, ``qk_scale_init``; the branch gains, ``gain_init``).
    """

    source: str
    loaded: List[str] = field(default_factory=list)
    dropped: List[str] = field(default_factory=list)
    initialized: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"GPT-2 {self.source} checkpoint: {len(self.loaded)} tensors loaded, {len(self.dropped)} dropped "
                f"({', '.join(sorted({k.split('.')[-2] for k in self.dropped if '.' in k})) or '-'}), "
                f"{len(self.initialized)} initialized (QK-norm scales, branch gains)")


def gpt_config(model: nn.Module, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int,
               bias: bool, dropout: float) -> float:
    """Check and set the nanoGPT configuration the GPT-2 zoo models share (``n_layer``, ``n_head``, ``n_embd``,
    ``block_size``, ``vocab_size`` as attributes of ``model``); returns the checked ``dropout``."""
    model.n_layer = check_int("n_layer", n_layer)
    model.n_head = check_int("n_head", n_head)
    model.n_embd = check_int("n_embd", n_embd)
    model.block_size = check_int("block_size", block_size)
    model.vocab_size = check_int("vocab_size", vocab_size)
    check_bool("bias", bias)
    if n_embd % n_head:
        raise ValueError(f"n_head={n_head} must divide n_embd={n_embd}")
    return check_prob("dropout", dropout)


class GPT2QKNorm(ZooModel):
    """GPT-2 without LayerNorm in its residual updates, QK-normalized attention and a GELU MLP.

    Args:
        n_layer: number of blocks (2 residual updates each).
        n_head: attention heads.
        n_embd: width.
        block_size: longest sequence (learned positions).
        vocab_size: vocabulary (nanoGPT pads GPT-2's 50257 to 50304).
        bias: biases in the linear layers (nanoGPT's ``bias``).
        dropout: attention, residual and MLP dropout (training only; certificates are for eval).
        act: MLP activation, ``"gelu"`` (nanoGPT) or ``"gelu_tanh"`` (HF GPT-2).
        qk_norm: ``"rms"`` (default), ``"l2"`` or ``"layer"``.
        qk_norm_eps: the QK-norm's ``eps``.
        init_values: the initial value of the branch gains ``ls1.gamma`` / ``ls2.gamma`` (learnable, per channel;
            ``None``: no gains, the update is ``x + v(x)``).  The default certifies every size of the zoo in bf16 at
            initialization (docs/zoo.md, "Certified by default").
        certify: refuse (``CertificationError``) a configuration not certified in ``cert_dtype``.
        cert_dtype: the certification dtype (default ``"bf16"``).
        device, dtype: as for torch layers.
    """

    transformer: Any  # nn.ModuleDict(wte, wpe, drop, h, ln_f), nanoGPT's layout, read by attribute
    #: module types :meth:`_init_weights` initializes by their own ``reset_parameters()`` (a subclass's normalizers)
    _self_initialized: Tuple[Type[nn.Module], ...] = ()
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int

    def __init__(self, n_layer: int = 12, n_head: int = 12, n_embd: int = 768, block_size: int = 1024,
                 vocab_size: int = 50304, bias: bool = True, dropout: float = 0.0, *, act: str = "gelu",
                 qk_norm: str = "rms", qk_norm_eps: float = QK_NORM_EPS, init_values: Optional[float] = INIT_VALUES,
                 certify: bool = True,
                 cert_dtype: Any = None, device=None, dtype=None) -> None:
        super().__init__()
        dropout = gpt_config(self, n_layer, n_head, n_embd, block_size, vocab_size, bias, dropout)
        check_real("qk_norm_eps", qk_norm_eps, positive=True)
        self.init_values = check_init_values(init_values) if init_values else None  # None or 0: no gains
        dd = {"device": "meta", "dtype": dtype}  # built without values, then materialized and initialized once
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd, **dd),
            wpe=nn.Embedding(block_size, n_embd, **dd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([GPT2QKNormBlock(n_embd, n_head, bias=bias, dropout=dropout, act=act, qk_norm=qk_norm,
                                             qk_norm_eps=qk_norm_eps, init_values=init_values, **dd)
                              for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias, **dd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False, **dd)
        self.to_empty(device=torch.get_default_device() if device is None else device)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT (after to_empty, which unties)
        self._init_weights()
        self._certify_or_refuse(certify, cert_dtype)

    def _init_weights(self) -> None:
        """nanoGPT's initialization, every parameter set once (the layers are built on the meta device).

        Linear and embedding weights N(0, 0.02), the residual projections (``attn.c_proj``, ``mlp.fc2``)
        N(0, 0.02 / sqrt(2 n_layer)), biases 0; the layers' own defaults for the rest: QK-norm and ``ln_f`` scales 1,
        branch gains ``init_values``.  The same distributions as the layers' default initialization overwritten by
        nanoGPT's, drawn once: a seed gives other weights than before the layers were built on the meta device
        (the default initialization no longer draws from the generator first).  A parameter that no rule covers
        raises (it would hold uninitialized memory).
        """
        std_proj = 0.02 / (2 * self.n_layer) ** 0.5
        seen: Set[int] = set()
        with torch.no_grad():
            for mname, mod in self.named_modules():
                if isinstance(mod, self._self_initialized):  # a module with its own initialization (a DyT)
                    mod.reset_parameters()  # type: ignore[operator]  # nn.Module types it as a Tensor | Module
                    seen.update(id(p) for p in mod.parameters())
                    continue
                for pname, p in mod.named_parameters(recurse=False):
                    if id(p) in seen:  # the tied lm_head / wte weight, drawn once (as wte)
                        continue
                    seen.add(id(p))
                    name = f"{mname}.{pname}"
                    if isinstance(mod, LayerScale) and pname == "gamma":
                        p.fill_(mod.init_values)
                    elif pname == "bias":
                        p.zero_()
                    elif pname == "weight" and (isinstance(mod, nn.LayerNorm)
                                                or mname.endswith(("q_norm", "k_norm"))):
                        p.fill_(1.0)
                    elif pname == "weight" and isinstance(mod, (nn.Linear, nn.Embedding)):
                        p.normal_(0.0, std_proj if name.endswith(("attn.c_proj.weight", "mlp.fc2.weight")) else 0.02)
                    else:
                        raise RuntimeError(f"{type(self).__name__}._init_weights has no rule for {name!r} "
                                           f"({type(mod).__name__}): it would stay uninitialized")

    # -- ZooModel ------------------------------------------------------------------------------------------
    def residual_updates(self) -> List[Tuple[str, nn.Module]]:
        out: List[Tuple[str, nn.Module]] = []
        for i, blk in enumerate(self.transformer.h):
            out += blk.velocities(f"transformer.h.{i}.")
        return out

    branch_gains = True  # the constructor takes init_values
    loss_gradient = cross_entropy_gradient  # trained with cross-entropy (mean reduction)

    def head_certificate(self) -> BlockCertificate:
        """``lm_head(ln_f(x))``: ``Lip(G) = ||W_lm|| G(ln_f)``, logits below ``max_i ||w_i|| A(ln_f)``."""
        return normed_linear_head([self.transformer.ln_f], self.lm_head, "transformer.ln_f+lm_head")

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The residual stream's input ``drop(wte[idx] + wpe[0:T])``, ``(B, T, C)``, for token ids ``(B, T)``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def input_radius(self) -> float:
        """``max_i ||wte_i|| + max_j ||wpe_j||``: bound on every embedded token's norm."""
        return row_norm_max(self.transformer.wte.weight) + row_norm_max(self.transformer.wpe.weight)

    def example_input(self, seq_len: Optional[int] = None) -> torch.Tensor:
        """Random token ids ``(1, seq_len)`` (default ``block_size``), for tracing and smoke tests."""
        n = self.block_size if seq_len is None else min(check_int("seq_len", seq_len), self.block_size)
        return torch.randint(0, self.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))

    def certificate_seq_len(self) -> int:
        return self.block_size

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, idx: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None, *,
                input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> Any:
        """nanoGPT's call, or Hugging Face's (what ``transformers.Trainer`` makes).

        * ``model(idx, targets)``: ``idx (B, T) -> (logits (B, T, vocab), loss or None)``, as nanoGPT: ``targets``
          are the next tokens (already shifted), ``-1`` is ignored.
        * ``model(input_ids=..., labels=..., attention_mask=...)``: a :class:`~certblocks.zoo.ZooOutput`
          ``{"loss": ..., "logits": ...}`` (``loss`` with labels only), as an HF causal LM: ``labels`` are the input
          ids (shifted here: position ``t`` predicts ``labels[t + 1]``), ``-100`` is ignored.  ``attention_mask``
          may only mark right padding (ones, then zeros): the model is causal, so padding after a sequence does not
          change it (label the padding ``-100``).
        """
        hf = input_ids is not None or labels is not None
        if hf:
            if idx is not None or targets is not None:
                raise TypeError("pass idx/targets (nanoGPT) or input_ids/labels (Hugging Face), not both")
            if input_ids is None:
                raise TypeError("labels= needs input_ids=")
            idx = input_ids
        elif attention_mask is not None:
            raise TypeError("attention_mask= goes with input_ids= (the Hugging Face call)")
        if idx is None:
            raise TypeError("forward() needs idx (or input_ids=)")
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.ndim != 2:
            raise TypeError(f"idx must be an integer tensor of shape (batch, seq_len), got "
                            f"{getattr(idx, 'dtype', type(idx).__name__)} {tuple(getattr(idx, 'shape', ()))}")
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        if attention_mask is not None:
            _check_right_padding(attention_mask, idx)
        x = self.embed(idx)  # (B, T, C)
        for blk in self.transformer.h:
            x = blk(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        if hf:
            if labels is None:
                return ZooOutput(logits=logits)
            loss: Optional[torch.Tensor] = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                           labels[:, 1:].reshape(-1), ignore_index=-100)
            return ZooOutput(loss=loss, logits=logits)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # -- pretrained checkpoints ----------------------------------------------------------------------------
    def load_gpt2_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, qk_scale_init: float = 1.0,
                             gain_init: float = 1.0) -> GPT2LoadReport:
        """Load a nanoGPT ``GPT`` or HF ``GPT2LMHeadModel`` / ``GPT2Model`` state_dict.

        The residual LayerNorms (``ln_1``, ``ln_2``) have no place in this model: their weights are
        dropped and listed in the report; the QK-norm scales, absent from GPT-2 checkpoints, are set to
        ``qk_scale_init`` (default 1.0) and the branch gains to ``gain_init`` (default 1.0).  HF ``Conv1D``
        weights (``(in, out)``) are transposed.  The
        vocabulary and block size of the checkpoint must match the model's (build it with the
        checkpoint's ``vocab_size``, e.g. 50257 for HF GPT-2).

        Raises:
            ValueError: a needed tensor is missing or has the wrong shape.
        """
        sd = dict(state_dict)
        # HF Conv1D c_attn.weight is (C, 3C); nanoGPT's nn.Linear is (3C, C)
        key = next((k for k in sd if k.endswith("h.0.attn.c_attn.weight")), None)
        if key is None:
            raise ValueError("state_dict has no '...h.0.attn.c_attn.weight': not a GPT-2 checkpoint")
        hf = tuple(sd[key].shape) == (self.n_embd, 3 * self.n_embd) and self.n_embd != 3 * self.n_embd
        prefix = "transformer." if any(k.startswith("transformer.") for k in sd) else ""
        report = GPT2LoadReport("hf" if hf else "nanogpt")
        new: Dict[str, torch.Tensor] = {}
        used = set()

        def take(src: str, dst: str, transpose: bool = False) -> None:
            k = prefix + src
            if k not in sd:
                raise ValueError(f"checkpoint lacks {k!r} (needed for {dst!r})")
            t = sd[k].detach()
            if transpose:
                t = t.T
            new[dst] = t
            used.add(k)

        take("wte.weight", "transformer.wte.weight")
        take("wpe.weight", "transformer.wpe.weight")
        take("ln_f.weight", "transformer.ln_f.weight")
        if self.transformer.ln_f.bias is not None:
            take("ln_f.bias", "transformer.ln_f.bias")
        names = (("attn.c_attn", "attn.c_attn"), ("attn.c_proj", "attn.c_proj"), ("mlp.c_fc", "mlp.fc1"),
                 ("mlp.c_proj", "mlp.fc2"))
        for i in range(self.n_layer):
            for src, dst in names:
                take(f"h.{i}.{src}.weight", f"transformer.h.{i}.{dst}.weight", transpose=hf)
                if getattr(self.transformer.h[i].get_submodule(dst), "bias", None) is not None:
                    take(f"h.{i}.{src}.bias", f"transformer.h.{i}.{dst}.bias")
        own = self.state_dict()
        for k, v in own.items():
            if k not in new and k.endswith(("q_norm.weight", "k_norm.weight")):
                new[k] = torch.full_like(v, float(qk_scale_init))
                report.initialized.append(k)
            elif k not in new and k.endswith((".ls1.gamma", ".ls2.gamma")):
                new[k] = torch.full_like(v, float(gain_init))
                report.initialized.append(k)
            elif k not in new and k.endswith(("q_norm.bias", "k_norm.bias")):
                new[k] = torch.zeros_like(v)
                report.initialized.append(k)
        if "lm_head.weight" not in new:
            new["lm_head.weight"] = new["transformer.wte.weight"]
        used.add("lm_head.weight")
        for k, v in new.items():
            if k in own and tuple(own[k].shape) != tuple(v.shape):
                raise ValueError(f"{k}: checkpoint shape {tuple(v.shape)} does not match the model's "
                                 f"{tuple(own[k].shape)} (check n_layer, n_embd, vocab_size, block_size)")
        self.load_state_dict(new, strict=True)
        report.loaded = sorted(k for k in new if k not in report.initialized)
        report.dropped = sorted(k for k in sd if k not in used)
        return report


def _check_right_padding(mask: torch.Tensor, idx: torch.Tensor) -> None:
    """``attention_mask`` of ``idx``'s shape that marks right padding only (each row ones, then zeros)."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(idx.shape):
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(idx.shape)}, got "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    m = mask.to(torch.int64)
    if bool(((m != 0) & (m != 1)).any()) or bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("attention_mask must mark right padding only (each row ones, then zeros): a causal model "
                         "without a mask in its attention cannot skip tokens before the sequence; pad on the right")


def _gpt2(size: Tuple[int, int, int, int, int], overrides: Dict[str, Any]) -> GPT2QKNorm:
    cfg: Dict[str, Any] = dict(zip(("n_layer", "n_head", "n_embd", "block_size", "vocab_size"), size))
    cfg.update(overrides)
    return GPT2QKNorm(**cfg)


@register_model(family="gpt2_qknorm", test=True)
def gpt2_qknorm_test(**overrides: Any) -> GPT2QKNorm:
    """GPT-2 QK-norm, no LN in the updates: test size (2 layers, 2 heads, width 32, 16 tokens, vocab 64)."""
    return _gpt2((2, 2, 32, 16, 64), overrides)


@register_model(family="gpt2_qknorm")
def gpt2_qknorm_tiny(**overrides: Any) -> GPT2QKNorm:
    """GPT-2 QK-norm, no LN in the updates: tiny (4 layers, 4 heads, width 128, 256 tokens, vocab 50304)."""
    return _gpt2((4, 4, 128, 256, 50304), {"init_values": 1.0, **overrides})


@register_model(family="gpt2_qknorm")
def gpt2_qknorm_mini(**overrides: Any) -> GPT2QKNorm:
    """GPT-2 QK-norm, no LN in the updates: nanoGPT's shakespeare-char size (6 layers, 6 heads, width 384)."""
    return _gpt2((6, 6, 384, 256, 50304), {"init_values": 1.0, **overrides})


@register_model(family="gpt2_qknorm")
def gpt2_qknorm_124m(**overrides: Any) -> GPT2QKNorm:
    """GPT-2 QK-norm, no LN in the updates: GPT-2 small, 124M (12 layers, 12 heads, width 768, 1024 tokens)."""
    return _gpt2((12, 12, 768, 1024, 50304), overrides)

"""The harder third-party set: 39 models from Hugging Face transformers and timm, chosen for the constructs that are
hard for the tracer, and what it takes for one of them to be covered (docs/third_party.md shows the outcome).

Every model is built with random weights (``pretrained=False``; tiny configurations for transformers, small widths
and images for timm), on the CPU, in eval mode, from a fixed seed, with its library's default attention (fused
``scaled_dot_product_attention`` where it has one) except where noted, and with **no degenerate parameter**:
initializations that make a branch vanish or a norm trivial (zero-initialized last gains, layer scales of 1e-5, unit
norm gains, zero biases) would let a search pass whatever a segment's bound, so every floating parameter whose entries
are all equal is redrawn (:func:`nondegenerate`): uniformly between 0.5 and 1.5 times its value (a value below 0.1
in magnitude is raised to 0.1 first), or with a random sign and a magnitude in ``[0.1, 0.5]`` where it is 0.

Mixtral, Falcon, OLMo, T5 and MaxViT use the attention written out (``attn_implementation="eager"``, timm's
``fused_attn = False``): the model search (:func:`certblocks.testing.search_model`) runs the exported graph under the
math attention backend, whose output strides break a ``view`` that their export recorded after the fused attention
(``view size is not compatible with input tensor's size and stride``).  RWKV is built with ``rescale_every=0``: at
inference it otherwise divides two weights in place inside its forward, which the export records as parameter
mutations that come before the logits among the graph's outputs; its WKV loop writes ``output[:, t]`` at every step,
which the capture functionalizes into ``aten.copy``, which PyTorch cannot differentiate: the search runs with a
derivative registered for it (:func:`differentiable_copy`).  Mixtral runs its experts with
``experts_implementation="batched_mm"`` (its default, ``grouped_mm``, is an opaque custom op on the CPU, and
``eager`` loops over the experts the routing selects: data-dependent shapes).

**Covered** (:func:`assess`): ``certblocks.certify(model, example)`` gives a chained ``ModelCertificate`` with no
unbounded value (``unbounded()`` empty) in which every certificate the stack uses -- the stem, each update, block and
map, the head, and every other output of the model -- has known exponents ``(q, sigma)``, finite coefficients
``c, b, l1, l0`` and a derived peak; ``rep.stack(dtype, r0=...)`` gives the depths in fp32, bf16 and fp16; and the
whole-model counterexample search (:func:`certblocks.testing.search_model`: random inputs on the sphere of ``r0``, or
random token ids, then gradient ascents or id hill-climbs, with the cross-entropy loss; every check: the output, every
intermediate, each segment's peak, the gradient, the state and the costate at each segment boundary) does not beat
the fp32 certificate.  **Refused**: the tracer names a value it does not bound (the first segment whose certificate
fails, with its culprit).  **Capture failure**: ``torch.export`` cannot capture the model.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

Built = Tuple[nn.Module, torch.Tensor]

#: The vocabulary and sequence length of the transformers models (token ids ``(1, SEQ)``).
VOCAB, SEQ = 64, 8
#: The whole-model search of :func:`assess` (the budget of tests/trace/test_whole_models.py).
SEARCH = dict(count=6, restarts=1, from_best=1, steps=6, rtol=1e-6)
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class ThirdParty:
    """One model of the set.

    Attributes:
        name: its name in the set.
        library: ``"transformers"`` or ``"timm"``.
        construct: what it exercises, in a few words.
        build: returns the model and an example input (random weights, before :func:`nondegenerate`).
        slow: its certificate and search take more than a few seconds.
        written_out: set timm's ``fused_attn`` to False (the attention as matmul and softmax).
        refusal: for a model that is not covered, what its refusal names (the culprit), checked by the tests.
    """

    name: str
    library: str
    construct: str
    build: Callable[[], Built]
    slow: bool = True
    written_out: bool = False
    refusal: str = ""


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ))


def _timm(name: str, size: int, **kw) -> Callable[[], Built]:
    """A timm model by name with small widths (``kw``) on a ``size x size`` image, attention written out."""

    def build() -> Built:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kw), torch.randn(1, 3, size, size)

    return build


def _timm_class(make: Callable[[], nn.Module], size: int) -> Callable[[], Built]:
    """A timm model built from its class (its registered names fix the widths the set shrinks)."""
    return lambda: (make(), torch.randn(1, 3, size, size))


def _resmlp() -> nn.Module:
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock

    return MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=32, block_layer=ResBlock,
                    norm_layer=Affine, mlp_ratio=4)


def _poolformer() -> nn.Module:
    from timm.models.metaformer import GroupNorm1, MetaFormer

    return MetaFormer(num_classes=10, depths=(1, 1, 1, 1), dims=(16, 16, 32, 32), downsample_norm=None,
                      mlp_act=nn.GELU, mlp_bias=True, norm_layers=GroupNorm1, layer_scale_init_values=1e-5,
                      res_scale_init_values=None, use_mlp_head=False)


def _efficientnet() -> nn.Module:
    from timm.models.efficientnet import _gen_efficientnet  # the b0 recipe at a quarter of its widths

    return _gen_efficientnet("efficientnet_b0", channel_multiplier=0.25, depth_multiplier=0.34, num_classes=10)


def _maxvit() -> nn.Module:
    from dataclasses import replace

    from timm.models.maxxvit import MaxxVit, model_cfgs  # maxvit_pico_rw at smaller widths, one block a stage

    pico = model_cfgs["maxvit_pico_rw"]
    cfg = replace(pico, embed_dim=(16, 32, 32, 64), depths=(1, 1, 1, 1), stem_width=(8, 16),
                  transformer_cfg=replace(pico.transformer_cfg, dim_head=8))
    return MaxxVit(cfg, img_size=64, num_classes=10)


def _focalnet() -> nn.Module:
    from timm.models.focalnet import FocalNet

    return FocalNet(num_classes=10, depths=(1, 1, 1, 1), embed_dim=16, focal_levels=(2, 2, 2, 2),
                    focal_windows=(3, 3, 3, 3))


def _rwkv() -> Built:
    import transformers as tr

    # rescale_every=0: at inference RWKV otherwise divides weights in place inside its forward, which the export
    # records as parameter mutations ahead of the logits among the graph's outputs
    cfg = tr.RwkvConfig(vocab_size=VOCAB, context_length=16, hidden_size=32,
                        num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64, rescale_every=0)
    return tr.RwkvForCausalLM(cfg), _ids()


def _model(cls: str, config: str, eager: bool = False, **kw) -> Callable[[], Built]:
    """A transformers model from its configuration's own size arguments (``eager``: the attention written out)."""

    def build() -> Built:
        import transformers as tr

        extra = {"attn_implementation": "eager"} if eager else {}
        return getattr(tr, cls)(getattr(tr, config)(**dict(dict(vocab_size=VOCAB), **kw, **extra))), _ids()

    return build


def _hf(config: str, model: str, eager: bool = False, **kw) -> Callable[[], Built]:
    """A transformers model from a tiny configuration (width 32, 2 layers, 2 heads)."""
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=32)
    return _model(model, config, eager, **dict(base, **kw))


_MODELS: List[ThirdParty] = [
    # ------------------------------------------------------------------------------------------ the named three
    ThirdParty("mixtral", "transformers",
               "MoE routing: softmax, top-2 of 4 experts, the top-k weights divided by their sum (>= k/E); experts "
               "by batched_mm (expert weights indexed by the routing); piecewise (the choice of experts jumps)",
               _hf("MixtralConfig", "MixtralForCausalLM", eager=True, num_key_value_heads=1, num_local_experts=4,
                   num_experts_per_tok=2, experts_implementation="batched_mm"), slow=False),
    ThirdParty("rwkv", "transformers",
               "WKV recurrence: exp(a - maximum(a, b)) <= 1, running sums num/den with den >= 1; token shift, "
               "squared ReLU", _rwkv),
    ThirdParty("efficientvit_b0", "timm",
               "ReLU linear attention: Q (K^T [V, 1]) divided by its last column + eps; multi-scale depthwise "
               "aggregation, MBConv, hardswish, BN", _timm("efficientvit_b0", 64, widths=(8, 16, 32, 64, 64),
                                                           depths=(1, 1, 1, 2, 2), head_dim=8, head_widths=(64, 80))),
    # ------------------------------------------------------------------------------------------ transformers
    ThirdParty("llama", "transformers",
               "RMSNorm written out (x * rsqrt(mean(x^2) + eps)), rotary positions, SwiGLU, grouped-query attention",
               _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1), slow=False),
    ThirdParty("mistral", "transformers", "sliding-window causal mask",
               _hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=1, sliding_window=4)),
    ThirdParty("qwen3", "transformers", "per-head RMSNorm of queries and keys (QK-norm)",
               _hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=1, head_dim=16)),
    ThirdParty("phi", "transformers",
               "partial rotary, attention and MLP in parallel from one LayerNorm, gelu_new (tanh)",
               _hf("PhiConfig", "PhiForCausalLM")),
    ThirdParty("phi3", "transformers", "fused qkv and gate_up projections split by slicing",
               _hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
                   bos_token_id=1)),
    ThirdParty("gemma2", "transformers",
               "tanh soft-capping of attention logits and final logits, sandwich norms, RMSNorm (1 + w), "
               "embedding times sqrt(d), GeGLU",
               _hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=1, head_dim=16, sliding_window=4)),
    ThirdParty("falcon", "transformers", "multi-query attention, attention and MLP in parallel",
               _hf("FalconConfig", "FalconForCausalLM", eager=True, num_kv_heads=1, multi_query=True,
                   new_decoder_architecture=False)),
    ThirdParty("bloom", "transformers", "ALiBi position biases (baddbmm), LayerNorm of the embeddings",
               _model("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=2, n_head=2)),
    ThirdParty("gpt_neo", "transformers", "alternating global and local (windowed) attention, unscaled logits",
               _model("GPTNeoForCausalLM", "GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=2,
                      attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=32,
                      intermediate_size=64, bos_token_id=0, eos_token_id=0)),
    ThirdParty("gptj", "transformers", "interleaved rotary on part of each head, attention and MLP in parallel",
               _model("GPTJForCausalLM", "GPTJConfig", n_embd=32, n_layer=2, n_head=2, rotary_dim=8, n_positions=32,
                      n_inner=64, bos_token_id=0, eos_token_id=0)),
    ThirdParty("opt", "transformers", "learned positions with an offset, ReLU MLP, final LayerNorm",
               _model("OPTForCausalLM", "OPTConfig", hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                      num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32)),
    ThirdParty("gpt_bigcode", "transformers", "multi-query attention from one fused projection",
               _model("GPTBigCodeForCausalLM", "GPTBigCodeConfig", n_embd=32, n_layer=2, n_head=2, n_positions=32,
                      multi_query=True, bos_token_id=0, eos_token_id=0)),
    ThirdParty("stablelm", "transformers", "partial rotary, per-head LayerNorm of queries and keys",
               _hf("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=1, qk_layernorm=True)),
    ThirdParty("olmo", "transformers", "LayerNorm without parameters, clip_qkv (clamp of q, k, v)",
               _hf("OlmoConfig", "OlmoForCausalLM", eager=True, num_key_value_heads=1, clip_qkv=8.0, eos_token_id=0)),
    ThirdParty("bert", "transformers", "post-LayerNorm, token types and positions, tanh pooler (a second output)",
               _model("BertModel", "BertConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=32), slow=False),
    ThirdParty("t5_encoder", "transformers",
               "relative position buckets (log-spaced, from the positions), RMS T5LayerNorm, unscaled attention",
               _model("T5EncoderModel", "T5Config", eager=True, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16), slow=False),
    ThirdParty("modernbert", "transformers",
               "alternating global and sliding-window attention, GeGLU, no biases, LayerNorm of the embeddings",
               _model("ModernBertModel", "ModernBertConfig", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32,
                      global_attn_every_n_layers=2, local_attention=4, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    ThirdParty("falcon_mamba", "transformers",
               "selective scan (the sequential reference path), RMSNorm of dt, B and C, causal conv1d",
               _model("FalconMambaForCausalLM", "FalconMambaConfig", hidden_size=16, state_size=4,
                      num_hidden_layers=2, expand=2, conv_kernel=3)),
    ThirdParty("deberta_v2", "transformers",
               "disentangled attention: content-to-position and position-to-content terms gathered by relative "
               "position (log buckets)",
               _model("DebertaV2Model", "DebertaV2Config", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=32, relative_attention=True, position_buckets=8,
                      pos_att_type=["p2c", "c2p"])),
    ThirdParty("cohere", "transformers",
               "LayerNorm without bias written out (the centring computed twice), parallel block, logit scale",
               _hf("CohereConfig", "CohereForCausalLM", num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)),
    ThirdParty("granite", "transformers", "embedding, residual and attention multipliers, logits scaling",
               _hf("GraniteConfig", "GraniteForCausalLM", num_key_value_heads=1, embedding_multiplier=2.0,
                   residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=4.0)),
    # ------------------------------------------------------------------------------------------ timm
    ThirdParty("resnet18", "timm", "BatchNorm (eval: affine), projection shortcuts, max pooling",
               _timm("resnet18", 32, channels=(8, 16, 16, 32), stem_width=8)),
    ThirdParty("convnext_atto", "timm", "depthwise 7x7 convolutions, LayerNorm over channels (permuted), layer scale",
               _timm("convnext_atto", 32, dims=(8, 16, 32, 32), depths=(1, 1, 1, 1))),
    ThirdParty("swin", "timm",
               "window attention with a relative position bias, shifted windows with a mask, patch merging",
               _timm("swin_tiny_patch4_window7_224", 28, depths=(1, 1), num_heads=(1, 2), embed_dim=16, img_size=28,
                     window_size=7)),
    ThirdParty("deit_distilled", "timm", "class and distillation tokens, two heads averaged",
               _timm("deit_tiny_distilled_patch16_224", 32, img_size=32, patch_size=8, depth=2, embed_dim=32,
                     num_heads=2)),
    ThirdParty("beit", "timm", "relative position bias table, layer scale, mean pooling",
               _timm("beit_base_patch16_224", 32, img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)),
    ThirdParty("levit", "timm", "attention biases, hardswish, Linear + BatchNorm, attention that subsamples",
               _timm("levit_128s", 64, img_size=64, embed_dim=(16, 32, 48), key_dim=8, num_heads=(2, 2, 2),
                     depth=(1, 1, 1))),
    ThirdParty("resmlp", "timm", "Affine instead of norms, token-mixing linear across patches, layer scale",
               _timm_class(_resmlp, 32), slow=False),
    ThirdParty("poolformer", "timm", "average pooling token mixer (pool(x) - x), GroupNorm, layer scale",
               _timm_class(_poolformer, 32)),
    ThirdParty("efficientnet_b0", "timm", "squeeze-excitation (sigmoid gate of pooled features), SiLU, MBConv",
               _timm_class(_efficientnet, 32)),
    ThirdParty("xcit", "timm",
               "cross-covariance attention of l2-normalized queries and keys with a learned temperature, local "
               "patch interaction (depthwise conv + BN), class attention",
               _timm("xcit_nano_12_p16_224", 32, img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)),
    ThirdParty("eva02", "timm", "2D rotary positions, SwiGLU with a LayerNorm inside (sub-LN)",
               _timm("eva02_tiny_patch14_224", 28, img_size=28, patch_size=7, depth=2, embed_dim=32, num_heads=2,
                     ref_feat_shape=(4, 4))),
    ThirdParty("maxvit", "timm", "MBConv with squeeze-excitation, block and grid attention, relative position bias",
               _timm_class(_maxvit, 64), written_out=True),
    ThirdParty("focalnet", "timm", "focal modulation: gated depthwise context levels multiplying a projection",
               _timm_class(_focalnet, 32)),
    ThirdParty("hiera", "timm", "mask-unit attention, unroll and reroll of tokens, query pooling",
               _timm("hiera_tiny_224", 64, img_size=(64, 64), embed_dim=16, stages=(1, 1, 1, 1))),
    ThirdParty("davit", "timm", "channel attention (softmax over channels), window attention, conv position encoding",
               _timm("davit_tiny", 32, depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 4, 4))),
]

#: The set by name.
MODELS: Dict[str, ThirdParty] = {m.name: m for m in _MODELS}


def nondegenerate(model: nn.Module, seed: int = 0) -> nn.Module:
    """Redraw every floating parameter whose entries are all equal (module docstring), in place; returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or p.numel() < 1:
                continue
            flat = p.detach().reshape(-1)
            if not bool((flat == flat[0]).all()):
                continue
            v = float(flat[0])
            u = torch.rand(p.shape, generator=gen, dtype=torch.float64)
            if v == 0:  # a random sign, a magnitude in [0.1, 0.5]
                new = (u - 0.5).sign() * (0.1 + 0.8 * (u - 0.5).abs())
            else:  # 0.5 to 1.5 times the value, raised to 0.1 first
                new = math.copysign(max(abs(v), 0.1), v) * (0.5 + u)
            p.copy_(new.to(p.dtype))
    return model


def _written_out_attention(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False


def build(name: str) -> Built:
    """The model ``name`` (eval mode, seeded, :func:`nondegenerate`) and its example input.

    Raises:
        KeyError: ``name`` is not in the set.
    """
    if name not in MODELS:
        raise KeyError(f"no third-party model {name!r}; the set: {sorted(MODELS)}")
    torch.manual_seed(0)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        model, example = MODELS[name].build()
    if MODELS[name].written_out:
        _written_out_attention(model)
    return nondegenerate(model).eval(), example


def r0_of(example: torch.Tensor) -> Optional[float]:
    """The per-token norm of a float example (the radius its certificate is stated at); ``None`` for token ids."""
    if not example.is_floating_point():
        return None
    return float(example.double().norm(dim=-1).max())


@dataclass
class Outcome:
    """What :func:`assess` found for one model.

    Attributes:
        name: the model.
        status: ``"covered"``, ``"refused"`` or ``"capture failure"``.
        reason: why it is not covered (``""`` when it is).
        r0: the radius of the float inputs (``None``: token ids).
        verdicts: dtype -> ``(certified, certified depth, first failure or "")``.
        certify_seconds: the time ``certify`` took (this machine, this run).
        search_ratio: the largest ratio value / bound the search found (``None`` without a search).
        search_failures: the checks the search beat, with their ratios.
        updates: the number of residual updates and blocks the chain holds.
    """

    name: str
    status: str
    reason: str = ""
    r0: Optional[float] = None
    verdicts: Dict[str, Tuple[bool, int, str]] = field(default_factory=dict)
    certify_seconds: float = math.nan
    search_ratio: Optional[float] = None
    search_failures: List[str] = field(default_factory=list)
    updates: int = 0


def unknown_in(rep) -> str:
    """Why a model certificate is not covered (``""`` when every certificate of its chain is derived)."""
    from certblocks.trace import ModelCertificate
    from certblocks.trace.report import NOT_DERIVED

    if not isinstance(rep, ModelCertificate):
        return f"certify gave a {type(rep).__name__}, not a model certificate"
    if not rep.chained:
        return f"not one chain: {rep.notes[0] if rep.notes else 'no segments'}"
    standing = rep.unbounded()
    if standing:
        return f"unbounded: {standing[0]}"
    traced = ([rep.stem] if rep.stem is not None else []) + list(rep.segments)
    pairs = list(zip(traced, rep.chain()))
    if rep.head is not None:
        pairs.append((rep.head, rep.head_certificate()))
    pairs += [(o, o.certificate) for o in rep.outputs]
    for tc, cert in pairs:
        if cert.q is None or cert.sigma is None:
            return f"{tc.name}: exponents {cert.exponents} ({cert.culprit or tc.culprit})"
        if not all(math.isfinite(v) and v < NOT_DERIVED for v in (cert.c, cert.b, cert.l1, cert.l0)):
            return f"{tc.name}: coefficients not derived ({cert.culprit or tc.culprit})"
        if cert.peak is None or not cert.peak.derived:
            return f"{tc.name}: peak not derived ({cert.peak.what if cert.peak is not None else 'none stated'})"
    return ""


@contextlib.contextmanager
def differentiable_copy() -> Iterator[None]:
    """A derivative for ``aten.copy`` while the search runs, removed after.

    A write into a slice (RWKV writes ``output[:, t]`` at every step) is functionalized by the capture into
    ``aten.copy`` and a scatter; PyTorch gives the functional ``aten.copy`` no derivative, and the model search
    differentiates the exported graph (the costate and gradient checks).  The copy's values are its source's,
    broadcast to the destination's shape and cast to its dtype: the derivative sums the gradient over the broadcast
    dimensions and casts it back.
    """

    class _Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dst, src, non_blocking=False):  # type: ignore[override]
            ctx.shape, ctx.dtype = src.shape, src.dtype
            with torch._C._AutoDispatchBelowAutograd():
                return torch.ops.aten.copy.default(dst, src, non_blocking)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return None, grad.sum_to_size(ctx.shape).to(ctx.dtype), None

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the one that raises
        lib.impl("copy", lambda dst, src, non_blocking=False: _Copy.apply(dst, src, non_blocking), "Autograd")
    try:
        yield
    finally:
        lib._destroy()


def _verdict(st) -> Tuple[bool, int, str]:
    f = st.first_failure
    why = "" if f is None else f"{f.kind} at {f.segment} {f.index} ({f.name})"
    return st.ok, st.certified_depth, why


def assess(name: str, search: bool = True) -> Outcome:
    """Certify the model ``name``, decide whether it is covered (module docstring) and search its fp32 certificate.

    A refused model is searched too, on the bounds its stack states (a refused segment states its growth; the
    checks of an unbounded value have an infinite bound and cannot fail).
    """
    import certblocks.testing as cbt
    from certblocks.trace import CaptureError, certify

    model, example = build(name)
    r0 = r0_of(example)
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = certify(model, example)
    except CaptureError as exc:
        return Outcome(name, "capture failure", str(exc).split(";")[-1].strip()[:300], r0)
    seconds = time.perf_counter() - t
    why = unknown_in(rep)
    out = Outcome(name, "refused" if why else "covered", why, r0, certify_seconds=seconds,
                  updates=sum(1 for c in rep.chain() if c.is_update) if getattr(rep, "chained", False) else 0)
    radius = 1.0 if r0 is None else r0
    for dtype in DTYPES:
        out.verdicts[dtype] = _verdict(rep.stack(dtype, r0=radius, loss="cross_entropy"))
    if search and getattr(rep, "chained", False):
        st = rep.stack("fp32", r0=radius, loss="cross_entropy")
        with warnings.catch_warnings(), differentiable_copy():
            warnings.simplefilter("ignore")
            report = cbt.search_model(model, st, example, model_certificate=rep, loss="cross_entropy", **SEARCH)
        out.search_ratio = max(r.ratio for r in report.checks)
        out.search_failures = [f"{r.check} x{r.ratio:.4g} at {r.where}" for r in report.failures]
    return out


# ---------------------------------------------------------------------------------------------- the document


def _cell(v: Tuple[bool, int, str]) -> str:
    ok, depth, why = v
    return f"certified (depth {depth})" if ok else f"refused: {why}"


def table(outcomes: Dict[str, Outcome]) -> str:
    """The markdown table of docs/third_party.md (one row per model of the set, in the set's order; no cell holds a
    ``|``)."""
    head = ("| model | library | construct | covered | fp32 | bf16 | fp16 | r0 | certify (s) |\n"
            "|---|---|---|---|---|---|---|---|---|")
    rows = []
    for m in _MODELS:
        o = outcomes[m.name]
        covered = "yes" if o.status == "covered" else ("no: capture failure" if o.status == "capture failure"
                                                       else "no: refused")
        cells = [_cell(o.verdicts[d]) if d in o.verdicts else "-" for d in DTYPES]
        r0 = "ids" if o.r0 is None else f"{o.r0:.3g}"
        rows.append(f"| {m.name} | {m.library} | {m.construct} | {covered} | {' | '.join(cells)} | {r0} | "
                    f"{o.certify_seconds:.1f} |")
    return "\n".join([head] + rows)


def read_table(text: str) -> Dict[str, str]:
    """The ``covered`` column of the table in ``text``: model name -> ``"yes"``, ``"no: refused"``, ..."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] in MODELS:
            out[cells[0]] = cells[3]
    return out


#: The markers of the generated table in docs/third_party.md.
BEGIN, END = "<!-- table: generated by tests/trace/third_party/registry.py -->", "<!-- end of table -->"


def with_table(text: str, outcomes: Dict[str, Outcome]) -> str:
    """``text`` (docs/third_party.md) with the table between its markers replaced by :func:`table`."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the document has no table markers {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{table(outcomes)}\n{END}{rest.split(END, 1)[1]}"


if __name__ == "__main__":  # regenerate the table: python tests/trace/third_party/registry.py [docs/third_party.md]
    import sys
    from pathlib import Path

    results = {}
    start = time.perf_counter()
    for m in _MODELS:
        results[m.name] = assess(m.name)
        print(m.name, results[m.name], file=sys.stderr, flush=True)
    print(f"the set assessed in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
        path.write_text(with_table(path.read_text(), results))
    else:
        print(table(results))

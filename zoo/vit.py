"""timm registration: ``certblocks_vit_{tiny,small,base}_patch16_224``.

Importing :mod:`certblocks.zoo` (with timm installed) registers three models through timm's own
``register_model`` / ``generate_default_cfgs``, so that::

    import certblocks.zoo, timm
    m = timm.create_model("certblocks_vit_small_patch16_224", num_classes=10)

works with timm's conventions (``pretrained_cfg``, ``num_classes``, ``forward_features``,
``forward_head``, ``reset_classifier``, ``features_only=True`` / ``forward_intermediates``, torch.fx feature
extraction, TorchScript): they pass timm's own model tests (``tests/zoo/test_timm_conformance.py``).  They are
ViT-Ti/S/B (patch 16, 224 px) whose blocks are :class:`CertifiedViTBlock`: no LayerNorm in the residual updates,
QK-normalized bidirectional attention (timm names ``qkv``, ``q_norm``, ``k_norm``, ``proj``; (1, 1)) and MLP(GELU)
(``fc1``, ``fc2``; (1, 0)), each branch with a learnable gain (timm's LayerScale ``ls1`` / ``ls2``, ``init_values``
1e-2 for ViT-Ti/S, 1e-3 for ViT-B: what certifies each size in bf16 at initialization, see the README).  timm arguments
that would change the certified structure (``norm_layer``, ``mlp_layer``, ``qk_norm=False``, ...) are
refused with an error naming them.  The final ``norm`` before the head is kept (it is part of the head).  No weights
are downloaded: the pretrained config has no URL (``pretrained=True`` raises in timm).

Certificate defaults: ``r0`` bounds every token after the patch embedding and positions for
pixels in ``[0, 1]`` normalized with the config's mean and std; ``seq_len`` = 197 tokens;
``cert_dtype = "bf16"``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Iterable, List, Optional, Tuple, cast

import torch
from timm.layers import DropPath, is_scriptable
from timm.models import VisionTransformer, build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from certblocks._validation import check_real
from certblocks.blocks.attention import QKNormAttention
from certblocks.blocks.gain import LayerScale, check_init_values, gained_velocities
from certblocks.blocks.mlp import MLP, activation_name
from certblocks.bounds import op_norm, row_norm_max, vec_norm
from certblocks.certificate import BlockCertificate, cross_entropy_gradient

from ._base import ZooModel, normed_linear_head
from ._registry import register_model as zoo_register

__all__ = ["CertifiedViTBlock", "CertifiedVisionTransformer"]


#: The branch gains' initial value (timm's ``init_values``) of the class, ViT-B's: the largest power of ten that
#: certifies ViT-B in bf16 at initialization (it certifies up to 3.2e-3); ViT-Ti and ViT-S register 1e-2 (they
#: certify up to 0.07 and 0.016), which trains better (docs/zoo.md, "Certified by default").
INIT_VALUES = 1e-3
#: The QK-norm's ``eps`` (timm's RMSNorm default).
QK_NORM_EPS = 1e-6

# timm VisionTransformer arguments a certified ViT takes as timm does (its constructor receives them unchanged)
_TIMM_ACCEPTED = frozenset({
    "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
    "mlp_ratio", "qkv_bias", "proj_bias", "class_token", "pos_embed", "no_embed_class", "reg_tokens", "fc_norm",
    "pool_include_prefix", "dynamic_img_pad", "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate",
    "attn_drop_rate", "drop_path_rate", "weight_init", "fix_init", "act_layer", "device", "dtype",
    "pretrained_cfg", "pretrained_cfg_overlay", "pretrained_strict", "feature_cfg", "features_only",
})
# arguments accepted only at the value that leaves the certified structure as it is: (allowed values, why)
_TIMM_FIXED = {
    "qk_norm": ((True,), "the attention always normalizes queries and keys"),
    "scale_attn_norm": ((False,), "there is no norm in the updates"),
    "scale_mlp_norm": ((False,), "there is no norm in the updates"),
    "pre_norm": ((False,), "a norm after the embedding is not in the input radius r0"),
    "final_norm": ((True,), "the head's norm bounds the logits and Lip(G)"),
    "dynamic_img_size": ((False,), "r0 is computed from the fixed position table"),
    "norm_layer": ((None,), "there is no norm in the updates; the head's norm is LayerNorm"),
    "embed_norm_layer": ((None,), "a norm in the embedding is not in the input radius r0"),
}
_GLOBAL_POOLS = ("", "token", "avg")


def _check_timm_kwargs(kwargs: dict) -> None:
    """Refuse (``TypeError`` / ``ValueError`` naming it) a timm argument a certified ViT would otherwise drop."""
    for key, value in kwargs.items():
        if key in _TIMM_ACCEPTED:
            continue
        if key in _TIMM_FIXED:
            allowed, why = _TIMM_FIXED[key]
            if any(value is a or (a is not None and value == a) for a in allowed):
                continue
            raise ValueError(f"{key}={value!r} is not supported by a certified ViT ({why}); allowed: "
                             f"{', '.join(repr(a) for a in allowed)}")
        if key in ("mlp_layer", "attn_layer", "block_fn", "embed_layer"):
            raise TypeError(f"{key} is not supported by a certified ViT: its blocks are CertifiedViTBlock "
                            "(QKNormAttention + MLP); convert a timm ViT with certblocks.convert instead")
        raise TypeError(f"unexpected keyword argument {key!r} for a certified ViT; it takes timm's "
                        f"VisionTransformer arguments {sorted(_TIMM_ACCEPTED)}, init_values, qk_norm_eps, "
                        "certify and cert_dtype")
    pool = kwargs.get("global_pool", "token")
    if pool not in _GLOBAL_POOLS:
        raise ValueError(f"global_pool={pool!r} is not supported by a certified ViT (its head bound needs a pooling "
                         f"of norm 1 per token); allowed: {_GLOBAL_POOLS}")


class CertifiedViTBlock(nn.Module):
    """A ViT block without LayerNorm in its updates: ``x + ls1(attn(x))`` then ``x + ls2(mlp(x))``.

    Takes timm ``Block``'s constructor arguments.  ``init_values`` gives each branch a learnable gain
    (:class:`~certblocks.LayerScale`, timm's ``ls1`` / ``ls2``; ``None``: no gains); ``qk_norm_eps`` is the
    QK-norm's ``eps``.  The norm, MLP and attention layers are fixed (there is no norm in the updates and the
    attention always normalizes queries and keys): :class:`CertifiedVisionTransformer` refuses arguments that
    would change them, and timm's own defaults for them are ignored here.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False,
                 proj_bias: bool = True, proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 act_layer: Any = nn.GELU, init_values: Optional[float] = None, qk_norm_eps: float = QK_NORM_EPS,
                 device=None, dtype=None, **_timm_defaults: Any) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.attn = QKNormAttention(dim, num_heads, causal=False, qkv_bias=bool(qkv_bias), proj_bias=bool(proj_bias),
                                    qk_norm_eps=qk_norm_eps, attn_dropout=attn_drop, resid_dropout=proj_drop,
                                    naming="timm", **dd)
        # the fused QK-norm is an autograd.Function, which TorchScript cannot compile: timm's scriptable mode
        # (set_scriptable(True), e.g. to script a torch.fx-traced graph) builds the plain composition
        self.attn.fused_qk_norm = not is_scriptable()
        self.ls1 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        act = activation_name(act_layer() if isinstance(act_layer, type) else act_layer)
        self.mlp = MLP(dim, int(dim * mlp_ratio), act, bias=bool(proj_bias), dropout=proj_drop, **dd)
        self.ls2 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
                ) -> torch.Tensor:
        if isinstance(is_causal, bool) and is_causal:  # a torch.fx-traced flag is not a bool: not checked
            raise ValueError("CertifiedViTBlock is bidirectional; is_causal=True is not supported")
        x = x + self.drop_path1(self.ls1(self.attn(x, attn_mask=attn_mask)))
        return x + self.drop_path2(self.ls2(self.mlp(x)))

    def velocities(self, prefix: str) -> List[Tuple[str, nn.Module]]:
        """``(path, velocity)`` of the two updates; a branch with a gain is a :class:`ScaledBranch`."""
        return gained_velocities(self, prefix)


class CertifiedVisionTransformer(VisionTransformer, ZooModel):
    """timm ``VisionTransformer`` built from :class:`CertifiedViTBlock`, with a certificate.

    Args:
        certify: refuse a configuration not certified in ``cert_dtype``.
        cert_dtype: certification dtype (default ``"bf16"``).
        *args, **kwargs: timm ``VisionTransformer``'s.
    """

    def __init__(self, *args: Any, init_values: Optional[float] = INIT_VALUES, qk_norm_eps: float = QK_NORM_EPS,
                 certify: bool = True, cert_dtype: Any = None, **kwargs: Any) -> None:
        if args:
            raise TypeError("CertifiedVisionTransformer takes keyword arguments only (timm's names)")
        _check_timm_kwargs(kwargs)
        if init_values:  # None or 0: no gains (timm's convention; timm.create_model drops None arguments)
            check_init_values(init_values)
        check_real("qk_norm_eps", qk_norm_eps, positive=True)
        kwargs.pop("qk_norm", None)
        kwargs["block_fn"] = partial(CertifiedViTBlock, qk_norm_eps=float(qk_norm_eps))
        super().__init__(init_values=init_values, **kwargs)
        self.init_values = init_values
        self.qk_norm_eps = float(qk_norm_eps)
        self._certify_or_refuse(certify, cert_dtype)

    def residual_updates(self) -> List[Tuple[str, nn.Module]]:
        out: List[Tuple[str, nn.Module]] = []
        for i, blk in enumerate(cast(Iterable[CertifiedViTBlock], self.blocks)):
            out += blk.velocities(f"blocks.{i}.")
        return out

    branch_gains = True  # the constructor takes init_values
    loss_gradient = cross_entropy_gradient  # a classifier trained with cross-entropy (mean reduction)

    def head_certificate(self) -> Optional[BlockCertificate]:
        """``head(fc_norm(pool(norm(x))))``; ``None`` when a part is not a LayerNorm/RMSNorm, a Linear or an
        identity (an attention pool: ``lip_g`` stands in)."""
        norms = [m for m in (self.norm, self.fc_norm) if not isinstance(m, nn.Identity)]
        head = None if isinstance(self.head, nn.Identity) else self.head
        if (getattr(self, "attn_pool", None) is not None or not norms
                or not all(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in norms)
                or (head is not None and not isinstance(head, nn.Linear))):
            return None
        return normed_linear_head(norms, head, "norm+head")

    def input_radius(self) -> float:
        cfg = getattr(self, "pretrained_cfg", None) or {}
        mean, std = cfg.get("mean", (0.5, 0.5, 0.5)), cfg.get("std", (0.5, 0.5, 0.5))
        pix = max(max(abs(m) / s, abs(1 - m) / s) for m, s in zip(mean, std))
        w = self.patch_embed.proj.weight
        patch = pix * math.sqrt(w[0].numel())
        tok = op_norm(w.reshape(w.shape[0], -1)) * patch + vec_norm(self.patch_embed.proj.bias)
        pos = row_norm_max(self.pos_embed[0]) if self.pos_embed is not None else 0.0
        r = tok + pos
        if self.cls_token is not None:
            r = max(r, vec_norm(self.cls_token.reshape(-1)) + pos)
        reg = getattr(self, "reg_token", None)
        if reg is not None:
            r = max(r, row_norm_max(reg[0]) + pos)
        return r

    def example_input(self, seq_len: Optional[int] = None) -> torch.Tensor:
        """A random image ``(1, C, H, W)`` of the model's input size; ``seq_len`` is ignored."""
        img = self.patch_embed.img_size
        h, w = (img, img) if isinstance(img, int) else tuple(img)
        c = self.patch_embed.proj.in_channels
        return torch.randn(1, c, h, w, generator=torch.Generator().manual_seed(0))

    def certificate_seq_len(self) -> int:
        return int(self.patch_embed.num_patches) + int(self.num_prefix_tokens)


def _cfg(**kwargs: Any) -> dict:
    return {"url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None, "crop_pct": 0.9,
            "interpolation": "bicubic", "fixed_input_size": True, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
            "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0", **kwargs}


default_cfgs = generate_default_cfgs({
    "certblocks_vit_tiny_patch16_224.untrained": _cfg(),
    "certblocks_vit_small_patch16_224.untrained": _cfg(),
    "certblocks_vit_base_patch16_224.untrained": _cfg(),
})


def _create(variant: str, pretrained: bool, **kwargs: Any) -> CertifiedVisionTransformer:
    if pretrained:
        raise ValueError(f"{variant} has no pretrained weights (certblocks downloads nothing); build it with "
                         "pretrained=False and load a checkpoint yourself, or convert a timm ViT with "
                         "certblocks.convert")
    # features_only=True: timm's FeatureGetterNet over forward_intermediates(), the last 3 blocks by default (as timm's
    # ViTs); out_indices picks others
    feature_cfg = {"out_indices": kwargs.pop("out_indices", 3), "feature_cls": "getter",
                   **kwargs.pop("feature_cfg", {})}
    return build_model_with_cfg(CertifiedVisionTransformer, variant, pretrained, feature_cfg=feature_cfg, **kwargs)


@register_model
def certblocks_vit_tiny_patch16_224(pretrained: bool = False, **kwargs: Any) -> CertifiedVisionTransformer:
    """ViT-Ti/16 without LayerNorm in its updates, QK-norm attention (certblocks)."""
    args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, init_values=1e-2)
    return _create("certblocks_vit_tiny_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def certblocks_vit_small_patch16_224(pretrained: bool = False, **kwargs: Any) -> CertifiedVisionTransformer:
    """ViT-S/16 without LayerNorm in its updates, QK-norm attention (certblocks)."""
    args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, init_values=1e-2)
    return _create("certblocks_vit_small_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def certblocks_vit_base_patch16_224(pretrained: bool = False, **kwargs: Any) -> CertifiedVisionTransformer:
    """ViT-B/16 without LayerNorm in its updates, QK-norm attention (certblocks)."""
    args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create("certblocks_vit_base_patch16_224", pretrained, **dict(args, **kwargs))


for _fn in (certblocks_vit_tiny_patch16_224, certblocks_vit_small_patch16_224, certblocks_vit_base_patch16_224):
    zoo_register(_fn, family="vit")


@zoo_register(family="vit", test=True)
def certblocks_vit_test(**overrides: Any) -> CertifiedVisionTransformer:
    """Certified ViT, test size (32 px, patch 8, width 32, 2 blocks, 2 heads, 10 classes)."""
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
    return _create("certblocks_vit_tiny_patch16_224", False, **dict(args, **overrides))

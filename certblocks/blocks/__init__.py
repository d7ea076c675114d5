"""Certified blocks: velocities ``v`` whose certificate is computed from their current weights.

Each block is a velocity (the stack adds the residual ``X + dt * v(X)``) and keeps the protocol of
:mod:`certblocks.protocol`: a class-level ``exponents``, ``certificate(*, seq_len=None, r0=None)``
from its current weights, and (every block) ``cap_slots()`` /
``certificate_from_caps()``, the same bound read from caps, for :func:`certblocks.enforce`.  Blocks that
replace a module have a ``from_module`` classmethod that builds them from it and copies the weights.
"""

from .attention import Attention, QKNorm, QKNormAttention
from .dyt import DyT, PreNormed, QKDyTAttention
from .gain import LayerScale, ScaledBranch, gain_param_groups
from .mamba import LinearGrowthMamba, Mamba
from .mlp import MLP, GatedMLP
from .normed import NormedUpdate
from .patchtst import PatchTSTBlock, PatchTSTUpdate, TokenBatchNorm
from .rotary import RotaryQKNormAttention

__all__ = [
    "Attention",
    "DyT",
    "GatedMLP",
    "LayerScale",
    "LinearGrowthMamba",
    "MLP",
    "Mamba",
    "NormedUpdate",
    "PatchTSTBlock",
    "PatchTSTUpdate",
    "PreNormed",
    "QKDyTAttention",
    "QKNorm",
    "QKNormAttention",
    "RotaryQKNormAttention",
    "ScaledBranch",
    "TokenBatchNorm",
    "gain_param_groups",
]

"""Certified blocks: velocities ``v`` whose certificate is computed from their current weights.

Each block is a velocity (the stack adds the residual ``X + dt * v(X)``), has a class-level
``exponents`` and a ``certificate(*, seq_len=None, r0=None)`` method, and a ``from_module``
classmethod that builds it from the module it replaces and copies the weights.
"""

from .attention import Attention, QKNorm, QKNormAttention
from .mamba import LinearGrowthMamba, Mamba
from .mlp import MLP, GatedMLP
from .patchtst import PatchTSTBlock, PatchTSTUpdate, TokenBatchNorm

__all__ = [
    "Attention",
    "GatedMLP",
    "LinearGrowthMamba",
    "MLP",
    "Mamba",
    "PatchTSTBlock",
    "PatchTSTUpdate",
    "QKNorm",
    "QKNormAttention",
    "TokenBatchNorm",
]

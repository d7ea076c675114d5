"""What ``make demo`` prints: certificate tables and a stack that is refused."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from . import exponents as ex
from .certificate import BlockCertificate
from .cli import format_depth, forward_table_text, render_table
from .stack import CertificationError, build_stack

__all__ = ["run_demo", "REFERENCE_BLOCKS"]

#: THEORY.md's derived block exponents.
REFERENCE_BLOCKS = (
    ("MLP, Lipschitz activation, no norm", ex.Exponents(1, 0)),
    ("any block with a normalized input (Pre-LN)", ex.compose(ex.Exponents(1, 2), ex.NORM)),
    ("SwiGLU W2((Wg x) * SiLU(Wu x))", ex.product(ex.AFFINE, ex.compose(ex.LIPSCHITZ, ex.AFFINE))),
    ("sigmoid GLU W2((Wg x) * sigmoid(Wu x))", ex.product(ex.AFFINE, ex.compose(ex.SATURATING, ex.AFFINE))),
    ("self-attention, no norm", ex.ATTENTION),
    ("self-attention with QK-norm", ex.QK_NORM_ATTENTION),
    ("Mamba block, no norm (sigma <= 5)", ex.MAMBA_SSM),
    ("linear-growth Mamba", ex.LINEAR_GROWTH_MAMBA),
)


class _ScaledLinear(nn.Module):
    """A linear velocity ``v(x) = W x`` whose certificate is read off ``||W||_op``."""

    def __init__(self, dim: int, norm: float, generator: torch.Generator) -> None:
        super().__init__()
        w = torch.randn(dim, dim, generator=generator)
        self.weight = nn.Parameter(w * (norm / torch.linalg.matrix_norm(w, ord=2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def certificate(self) -> BlockCertificate:
        op = float(torch.linalg.matrix_norm(self.weight.detach().double(), ord=2))
        return BlockCertificate(1, 0, c=op, l1=0.0, l0=op)


def run_demo(dtypes: Sequence[str] = ("fp16", "bf16", "fp32")) -> int:
    """Print the demo tables; returns a process exit code."""
    print("== Forward overflow depth D*_F (first depth at which the radius bound reaches M), c = dt = r0 = 1, b = 0")
    print(forward_table_text())
    print()
    print("== Reference blocks (THEORY.md): exponents and certified depth D_cert of a homogeneous stack")
    print("   at unit coefficients c = l1 = l0 = 1, b = 0, dt = r0 = Lip(G) = 1")
    header = ["block", "(q, sigma)"] + [f"D_cert {d}" for d in dtypes]
    rows = []
    for label, e in REFERENCE_BLOCKS:
        cert = BlockCertificate(e.q, e.sigma, c=1.0, l1=1.0, l0=1.0, name=label)
        depths = [cert.depths(d) for d in dtypes]
        rows.append([label, f"({e.q:g}, {e.sigma:g})"] + [format_depth(x.certified, x.exact) for x in depths])
    print(render_table(header, rows))
    print()
    gen = torch.Generator().manual_seed(0)
    blocks = [_ScaledLinear(32, 0.4, gen) for _ in range(24)]
    stack = build_stack(blocks, torch.float16)
    print("== build_stack: 24 linear velocities with ||W||_op = 0.4 in fp16")
    print(stack.certificate.explain())
    print()
    print("== build_stack refuses: 10 such updates followed by 4 SwiGLU-like updates (q = 2) in fp16")
    swiglu = BlockCertificate(2, 1, c=1.0, l1=1.0, l0=1.0, culprit="SiLU(W_u x) * (W_g x)")
    specs = [_ScaledLinear(32, 0.4, gen) for _ in range(10)] + [(_ScaledLinear(32, 0.4, gen), swiglu) for _ in range(4)]
    try:
        build_stack(specs, "fp16")
    except CertificationError as err:
        print(f"CertificationError: {err}")
    else:  # pragma: no cover - the demo is wrong if this happens
        print("unexpected: the stack was certified")
        return 1
    return 0

"""``certblocks demo``: what ``make demo`` prints first: certificate tables and a stack that is refused."""

from __future__ import annotations

import argparse
from typing import Sequence

from certblocks import exponents as ex

from ._common import command, pure_dtype_list
from .formatting import format_depth, render_table

__all__ = ["REFERENCE_BLOCKS", "add_arguments", "run_demo"]

#: The derived block exponents of docs/theory.md section 2.6.
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``certblocks demo``."""
    p.add_argument("--dtype", type=pure_dtype_list, default="fp16,bf16,fp32",
                   help="comma-separated dtypes (default fp16,bf16,fp32)")
    p.set_defaults(func=_run_command)


@command("demo")
def _run_command(args: argparse.Namespace) -> int:
    return run_demo(args.dtype)


def run_demo(dtypes: Sequence[str] = ("fp16", "bf16", "fp32")) -> int:
    """Print the demo tables; returns the exit status (0).

    Raises:
        RuntimeError: the stack the demo shows refused was certified (a bug in the budgets).
    """
    import torch

    from certblocks.certificate import BlockCertificate
    from certblocks.stack import CertificationError, build_stack

    from ._scaled_linear import ScaledLinear
    from .table import forward_table_text

    print("== Forward overflow depth D*_F (first depth at which the radius bound reaches M), c = dt = r0 = 1, b = 0")
    print(forward_table_text())
    print()
    print("== Reference blocks (docs/theory.md section 2.6): exponents and certified depth D_cert of a "
          "homogeneous stack")
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
    stack = build_stack([ScaledLinear(32, 0.4, gen) for _ in range(24)], torch.float16)
    print("== build_stack: 24 linear velocities with ||W||_op = 0.4 in fp16")
    print(stack.certificate().explain())
    print()
    print("== build_stack refuses: 10 such updates followed by 4 SwiGLU-like updates (q = 2) in fp16")
    swiglu = BlockCertificate(2, 1, c=1.0, l1=1.0, l0=1.0, culprit="SiLU(W_u x) * (W_g x)")
    specs = [ScaledLinear(32, 0.4, gen) for _ in range(10)] + [(ScaledLinear(32, 0.4, gen), swiglu) for _ in range(4)]
    try:
        build_stack(specs, "fp16")
    except CertificationError as err:
        print(f"CertificationError: {err}")
    else:  # pragma: no cover - the budgets are wrong if this happens
        raise RuntimeError("build_stack certified 10 linear updates followed by 4 q = 2 updates in fp16")
    return 0

"""``certblocks budget``: the certified depths of a homogeneous stack of one block, per dtype.

Pure Python: never imports torch.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Sequence

from ._common import UsageError, command, pure_dtype_list
from .formatting import format_depth, render_table

if TYPE_CHECKING:
    from certblocks.certificate import Depths

__all__ = ["add_arguments", "run_budget", "depths_table"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``certblocks budget``."""
    p.add_argument("--q", type=float, required=True, help="forward growth exponent q >= 0")
    p.add_argument("--sigma", type=float, default=0.0, help="Jacobian growth exponent sigma >= 0 (default 0)")
    p.add_argument("--c", type=float, default=1.0, help="growth coefficient c (default 1)")
    p.add_argument("--b", type=float, default=0.0, help="growth offset b (default 0)")
    p.add_argument("--l1", type=float, default=0.0, help="Jacobian coefficient l1 (default 0)")
    p.add_argument("--l0", type=float, default=1.0, help="Jacobian offset l0 (default 1)")
    p.add_argument("--peak", type=float, nargs=3, metavar=("Q", "C", "B"), default=None,
                   help="bound C ||x||^Q + B on the block's largest intermediate (e.g. 2 0.5 0 for logits)")
    p.add_argument("--dt", type=float, default=1.0, help="residual step size (default 1)")
    p.add_argument("--r0", type=float, default=1.0, help="input radius (default 1)")
    p.add_argument("--lip-g", type=float, default=1.0, help="Lipschitz constant of the loss head (default 1)")
    p.add_argument("--dtype", type=pure_dtype_list, default="fp16,bf16,fp32",
                   help="comma-separated dtypes (default fp16,bf16,fp32)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_budget)


def depths_table(depths: Sequence[Depths]) -> str:
    """One row per dtype: ``M``, ``D_F``, ``D_grad``, ``D_cert`` of :class:`~certblocks.Depths`."""
    header = ["dtype", "M", "D_F", "D_grad", "D_cert"]
    rows = [[d.dtype, f"{d.max_value:.3g}", format_depth(d.forward, d.exact), format_depth(d.backward, d.exact),
             format_depth(d.certified, d.exact)] for d in depths]
    return render_table(header, rows)


@command("budget")
def run_budget(args: argparse.Namespace) -> int:
    """Print the depths (or JSON); returns the exit status."""
    from certblocks.certificate import BlockCertificate, Peak

    try:
        peak = None if args.peak is None else Peak(*args.peak)
        cert = BlockCertificate(args.q, args.sigma, c=args.c, b=args.b, l1=args.l1, l0=args.l0, peak=peak)
        depths = [cert.depths(d, dt=args.dt, r0=args.r0, lip_g=args.lip_g) for d in args.dtype]
    except (ValueError, TypeError) as exc:  # the block's numbers are the arguments themselves
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"block": cert.to_dict(), "dt": args.dt, "r0": args.r0, "lip_g": args.lip_g,
                          "depths": [d.to_dict() for d in depths]}, indent=2))
        return 0
    print(f"block {cert.exponents}: ||v(x)|| <= {args.c:g} ||x||^{args.q:g} + {args.b:g}, "
          f"L(R) <= {args.l1:g} R^{args.sigma:g} + {args.l0:g}; dt = {args.dt:g}, r0 = {args.r0:g}, "
          f"Lip(G) = {args.lip_g:g}" + ("" if cert.peak is None else f"; {cert.peak}"))
    print(depths_table(depths))
    if not all(d.exact for d in depths):
        print("(>= : sound lower bound from the closed forms; the recursion was too long to run)")
    return 0

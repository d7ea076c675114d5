"""Every sound numeric bound certblocks computes, in one place (knows tensors, not modules' structure).

* :mod:`.norms` -- operator norms of weights: ``"fast"`` (a Cholesky-verified Krylov estimate, the default) or
  ``"tight"`` (the eigensolver, exact below a size, a rigorous bound above), each with its float64 rounding
  accounted;
* :mod:`.activations` -- the activation constants (derivative and ratio ranges, saturation levels);
* :mod:`.poly` -- upper-bound polynomials in the radius and the peak algebra;
* :mod:`.normalization` -- output and Jacobian bounds of LayerNorm, RMSNorm and l2 normalization.

Everything else (the blocks, the tracer, ``enforce``, the zoo) imports these; nothing re-derives them.
"""

from .activations import ACTIVATIONS, SIGMOID_DERIVATIVE_MAX, Activation, activation, lipschitz
from .normalization import NORM_KINDS, module_norm_bounds, norm_bounds, prenorm_jacobian, scalar_norm_bounds
from .norms import (
    EXACT_LIMIT,
    FAST_MIN,
    FAST_STEPS,
    PRECISIONS,
    UNIT_ROUNDOFF,
    concurrent_calls,
    get_norm_precision,
    inf_norm,
    margin,
    norm_precision,
    one_thread,
    op_norm,
    op_norm_tensor,
    op_norms,
    product_norm,
    product_norms,
    rounded_up,
    row_norm_max,
    sandwich_norm,
    vec_inf_norm,
    vec_norm,
)
from .poly import Poly, fold_peak, normalized_peak, peak_poly, psum

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "EXACT_LIMIT",
    "FAST_MIN",
    "FAST_STEPS",
    "NORM_KINDS",
    "PRECISIONS",
    "Poly",
    "SIGMOID_DERIVATIVE_MAX",
    "UNIT_ROUNDOFF",
    "activation",
    "concurrent_calls",
    "fold_peak",
    "get_norm_precision",
    "inf_norm",
    "lipschitz",
    "margin",
    "module_norm_bounds",
    "norm_bounds",
    "norm_precision",
    "normalized_peak",
    "one_thread",
    "op_norm",
    "op_norm_tensor",
    "op_norms",
    "peak_poly",
    "product_norm",
    "product_norms",
    "psum",
    "prenorm_jacobian",
    "rounded_up",
    "row_norm_max",
    "sandwich_norm",
    "scalar_norm_bounds",
    "vec_inf_norm",
    "vec_norm",
]

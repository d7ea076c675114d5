"""Every sound numeric bound certblocks computes, in one place (knows tensors, not modules' structure).

* :mod:`.norms` -- operator norms of weights (exact below a size, a rigorous bound above) with one stated
  safety margin derived from the float64 rounding of the computation;
* :mod:`.activations` -- the activation constants (derivative and ratio ranges, saturation levels);
* :mod:`.poly` -- upper-bound polynomials in the radius and the peak algebra;
* :mod:`.normalization` -- output and Jacobian bounds of LayerNorm, RMSNorm and l2 normalization.

Everything else (the blocks, the tracer, ``enforce``, the zoo) imports these; nothing re-derives them.
"""

from .activations import ACTIVATIONS, SIGMOID_DERIVATIVE_MAX, Activation, activation, lipschitz
from .normalization import NORM_KINDS, module_norm_bounds, norm_bounds, prenorm_jacobian, scalar_norm_bounds
from .norms import (
    EXACT_LIMIT,
    UNIT_ROUNDOFF,
    concurrent_calls,
    inf_norm,
    margin,
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
    "NORM_KINDS",
    "Poly",
    "SIGMOID_DERIVATIVE_MAX",
    "UNIT_ROUNDOFF",
    "activation",
    "concurrent_calls",
    "fold_peak",
    "inf_norm",
    "lipschitz",
    "margin",
    "module_norm_bounds",
    "norm_bounds",
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

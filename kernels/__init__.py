"""Selective-scan kernels (installed as ``certblocks.kernels``).

* :func:`selective_scan` -- the S6 scan with mamba-ssm's ``selective_scan_fn`` semantics, plus a choice of
  gate (``"silu"``, ``"sigmoid"``, ``None``) and packed variable-length batches (``cu_seqlens``).
  Backends: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (fast CPU path) and
  ``"reference"`` (plain loop, the twin the tests trust).
* :func:`selective_state_update` -- one decode step, state updated in place.
* Reference twins: :func:`selective_scan_reference`, :func:`selective_state_update_reference`.

The fast paths are the torch custom ops ``torch.ops.certblocks.selective_scan`` (its schema mirrors
:func:`selective_scan`; it returns ``(out, last_state, checkpoints)``), ``certblocks::selective_scan_bwd``
and ``torch.ops.certblocks.selective_state_update``, registered when this package is imported; they
compile with ``torch.compile(fullgraph=True)``.
Triton is imported lazily: this package imports on a CPU-only machine without triton.
"""

from . import ops  # noqa: F401  (registers the torch custom ops)
from ._checks import FLOAT_DTYPES
from .reference import selective_scan_reference, selective_state_update_reference
from .scan import selective_scan, selective_state_update

__all__ = [
    "FLOAT_DTYPES",
    "selective_scan",
    "selective_state_update",
    "selective_scan_reference",
    "selective_state_update_reference",
]

"""Shared test set-up.

The tracer runs in strict mode (``CERTBLOCKS_STRICT_RULES=1``): a rule that raises fails the test instead of
giving an unknown value.

mamba-ssm imports its CUDA extension eagerly; on a CPU-only machine the tests put
a stand-in module named ``selective_scan_cuda`` in ``sys.modules`` so that its
pure-torch references (``selective_scan_ref``, ``mamba_ssm.Mamba``'s slow path)
can be imported: :func:`certblocks.testing.install_selective_scan_stub`, the helper
users call too (:mod:`certblocks.testing.mamba_cpu`).  Only the tests and that helper
do this; certblocks never relies on it.
"""

from __future__ import annotations

import os

import torch

from certblocks.testing.mamba_cpu import install_selective_scan_stub

# A rule that raises is a bug: the tracer re-raises instead of reporting "unknown" (certblocks.trace.interp).
os.environ.setdefault("CERTBLOCKS_STRICT_RULES", "1")

# Triton kernels run in the interpreter on a machine without a GPU (set before triton compiles anything).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

install_selective_scan_stub()  # only where mamba-ssm's CUDA extension is missing

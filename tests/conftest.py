"""Shared test set-up.

The tracer runs in strict mode (``CERTBLOCKS_STRICT_RULES=1``): a rule that raises fails the test instead of
giving an unknown value.

mamba-ssm imports its CUDA extension eagerly; on a CPU-only machine the tests put
a stand-in module named ``selective_scan_cuda`` in ``sys.modules`` so that its
pure-torch references (``selective_scan_ref``, ``mamba_ssm.Mamba``'s slow path)
can be imported.  Only the tests do this; certblocks never relies on it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

# A rule that raises is a bug: the tracer re-raises instead of reporting "unknown" (certblocks.trace.interp).
os.environ.setdefault("CERTBLOCKS_STRICT_RULES", "1")

# Triton kernels run in the interpreter on a machine without a GPU (set before triton compiles anything).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "selective_scan_cuda" not in sys.modules and importlib.util.find_spec("selective_scan_cuda") is None:
    sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")

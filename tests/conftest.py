"""Shared test set-up.

The tracer runs in strict mode (``CERTBLOCKS_STRICT_RULES=1``): a rule that raises fails the test instead of
giving an unknown value.

One BLAS/OpenMP thread per test process: the thread variables are set before torch is imported (subprocesses
and spawned workers inherit them) and ``torch.set_num_threads(1)`` covers a torch imported earlier.  The tests
run many small float64 operations, for which one thread is faster than several on a small shared machine, and
``pytest -n 2`` runs two processes on two cores.

mamba-ssm imports its CUDA extension eagerly; on a CPU-only machine the tests put
a stand-in module named ``selective_scan_cuda`` in ``sys.modules`` so that its
pure-torch references (``selective_scan_ref``, ``mamba_ssm.Mamba``'s slow path)
can be imported: :func:`certblocks.testing.install_selective_scan_stub`, the helper
users call too (:mod:`certblocks.testing.mamba_cpu`).  Only the tests and that helper
do this; certblocks never relies on it.

Suites (markers registered in ``pyproject.toml``): ``make test`` deselects ``slow``, ``interpreter``,
``subprocess``, ``bench`` and ``peer``; ``make test-all`` runs everything.  :func:`pytest_collection_modifyitems`
assigns the markers that follow from a test's place or parameters; the others are written on the tests.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest
import torch

from certblocks.testing.mamba_cpu import install_selective_scan_stub

torch.set_num_threads(1)

# A rule that raises is a bug: the tracer re-raises instead of reporting "unknown" (certblocks.trace.interp).
os.environ.setdefault("CERTBLOCKS_STRICT_RULES", "1")

# Triton kernels run in the interpreter on a machine without a GPU (set before triton compiles anything).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

install_selective_scan_stub()  # only where mamba-ssm's CUDA extension is missing

#: (path prefix relative to the repository, marker): every test under the prefix gets the marker
PATH_MARKERS = (
    ("tests/benchmarks/", "bench"),  # the scripts of benchmarks/ and benchmarks/experiments/
    ("tests/distributed/", "subprocess"),  # gloo process groups of 2 spawned processes
    ("tests/test_cli_light.py", "subprocess"),  # the command line in fresh interpreters
    ("tests/kernels/test_triton_", "interpreter"),  # the Triton kernels (interpreted on a machine without a GPU)
    ("tests/zoo/test_timm_conformance.py", "peer"),  # timm's own model tests from ../shared/peer-tests
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Mark by path (:data:`PATH_MARKERS`) and by parameters: a ``backend="triton"`` case runs the Triton
    interpreter; a documentation block marked ``<!-- doctest: subprocess -->`` runs in a fresh interpreter."""
    for item in items:
        rel = os.path.relpath(str(item.path), _ROOT).replace(os.sep, "/")
        for prefix, marker in PATH_MARKERS:
            if rel.startswith(prefix):
                item.add_marker(marker)
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if params.get("backend") == "triton":
            item.add_marker("interpreter")
        if getattr(params.get("block"), "subprocess", False) is True:
            item.add_marker("subprocess")

"""Shared test set-up.

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
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode

# Triton kernels run in the interpreter on a machine without a GPU (set before triton compiles anything).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "selective_scan_cuda" not in sys.modules and importlib.util.find_spec("selective_scan_cuda") is None:
    sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")


# ----------------------------------------------------------------------------- intermediates

class _LargestValue(TorchFunctionMode):
    """Records ``max |entry|`` of every floating tensor computed from the searched input (``requires_grad``).

    Masked attention logits carry the sentinel ``finfo.min / 2`` on purpose (their exponential is 0); entries
    at or below ``finfo.min / 4`` are therefore not counted.
    """

    active: list = []  # the recording modes (innermost last)

    def __init__(self) -> None:
        super().__init__()
        self.values: list = []
        self.paused = 0

    def __enter__(self):
        _LargestValue.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _LargestValue.active.pop()
        return super().__exit__(*exc)

    def record(self, out) -> None:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad and t.numel():
                sentinel = torch.finfo(t.dtype).min / 4
                self.values.append(t.masked_fill(t <= sentinel, 0.0).abs().amax().to(torch.float64))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.record(out)
        return out


def as_atom(fn: Callable) -> Callable:
    """``fn`` seen as one primitive by :func:`largest_value`: its output counts, its internals do not.

    For normalizations, whose sum of squares and ``rsqrt`` run in float32 whatever the dtype (an overflow
    there turns the normalized value into 0, not into inf or NaN), as for ``layer_norm``.
    """
    def wrapped(*args, **kwargs):
        mode = _LargestValue.active[-1] if _LargestValue.active else None
        if mode is None:
            return fn(*args, **kwargs)
        mode.paused += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            mode.paused -= 1
        mode.record(out)
        return out
    return wrapped


def largest_value(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The largest ``|entry|`` over every tensor ``f`` computes from ``x`` (differentiable in ``x``)."""
    if not x.requires_grad:
        x = x.detach().requires_grad_(True)
    with torch.enable_grad(), _LargestValue() as mode:
        f(x)
    return torch.stack(mode.values).amax()



@pytest.fixture
def intermediates() -> SimpleNamespace:
    """``largest_value(f, x)``: the largest entry of every tensor ``f`` computes from ``x``; ``as_atom``."""
    return SimpleNamespace(largest_value=largest_value, as_atom=as_atom)

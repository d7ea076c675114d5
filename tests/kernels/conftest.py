"""Helpers shared by the selective-scan kernel tests (exposed as fixtures)."""

from __future__ import annotations

import importlib.util
from typing import Callable, Dict, Optional

import pytest
import torch
from certblocks.kernels import selective_scan
from certblocks.kernels._interpreter import vectorize_interpreter_scan

TOL = {
    torch.float32: dict(rtol=6e-4, atol=2e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=5e-2),
    torch.float16: dict(rtol=3e-2, atol=5e-2),
}


def make_scan_inputs(
    batch: int = 2,
    dim: int = 8,
    dstate: int = 4,
    seqlen: int = 16,
    ngroups: Optional[int] = None,
    has_D: bool = True,
    has_z: bool = True,
    has_bias: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Dict[str, torch.Tensor]:
    """Random inputs in mamba's regime (A < 0, delta around softplus range). ngroups=None: 3-D B and C."""
    g = torch.Generator().manual_seed(seed)
    bc_shape = (batch, dstate, seqlen) if ngroups is None else (batch, ngroups, dstate, seqlen)
    x = dict(
        u=torch.randn(batch, dim, seqlen, generator=g),
        delta=torch.rand(batch, dim, seqlen, generator=g) * 0.5 + 0.05,
        A=-(torch.rand(dim, dstate, generator=g) * 2.0 + 0.1),
        B=torch.randn(*bc_shape, generator=g),
        C=torch.randn(*bc_shape, generator=g),
    )
    if has_D:
        x["D"] = torch.randn(dim, generator=g)
    if has_z:
        x["z"] = torch.randn(batch, dim, seqlen, generator=g)
    if has_bias:
        x["delta_bias"] = torch.rand(dim, generator=g) * 0.1
    # u, delta, z, B, C in the requested dtype; A, D, delta_bias stay float32 (mamba's convention)
    for k in ("u", "delta", "z", "B", "C"):
        if k in x:
            x[k] = x[k].to(dtype)
    return x


def run_scan(
    fn: Callable,
    inputs: Dict[str, torch.Tensor],
    seed: int = 1,
    use_last: bool = True,
    round_to: Optional[torch.dtype] = None,
    **kw,
):
    """Run ``fn(**inputs, return_last_state=True, **kw)``, backprop a random projection of out and
    last_state, return a dict of out, last and every input's gradient.  The projection is rounded to
    ``round_to`` (default: out's dtype) so that runs in different dtypes see the same projection."""
    xs = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    out, last = fn(**xs, return_last_state=True, **kw)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g).to(round_to or out.dtype).to(device=out.device, dtype=out.dtype)
    loss = (out * go).float().sum()
    if use_last:
        gl = torch.randn(last.shape, generator=g).to(device=last.device, dtype=last.dtype)
        loss = loss + (last * gl).float().sum()
    loss.backward()
    res = {"out": out.detach(), "last": last.detach()}
    res.update({"d" + k: v.grad for k, v in xs.items()})
    return res


def assert_all_close(got: dict, want: dict, dtype: torch.dtype, what: str = "", check_dtype: bool = True) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k] is not None and want[k] is not None, f"{what}: {k} missing"
        assert got[k].shape == want[k].shape, f"{what}: {k} shape {got[k].shape} vs {want[k].shape}"
        assert not check_dtype or got[k].dtype == want[k].dtype, (
            f"{what}: {k} dtype {got[k].dtype} vs {want[k].dtype}"
        )
        torch.testing.assert_close(
            got[k].float(), want[k].float(), **TOL[dtype], msg=lambda m, k=k: f"{what}: {k}: {m}"
        )


def upcast(inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The same values in float32 (exact for bf16/fp16)."""
    return {k: v.float() for k, v in inputs.items()}


def mamba_ref():
    if importlib.util.find_spec("mamba_ssm") is None:
        pytest.skip("mamba-ssm is not installed")
    from mamba_ssm.ops.selective_scan_interface import selective_scan_ref

    return selective_scan_ref


vectorize_interpreter_scan()  # the chunked kernels scan with tl.associative_scan


@pytest.fixture(autouse=True)
def _one_thread():
    """The kernel tests run many small ops (per-step loops): one intra-op thread avoids OpenMP
    synchronisation costs that dominate on a small, shared machine.  Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def scan_tools():
    """Namespace of helpers: make_inputs, run, assert_close, TOL, mamba_ref, backend(name)."""

    class Tools:
        make_inputs = staticmethod(make_scan_inputs)
        run = staticmethod(run_scan)
        assert_close = staticmethod(assert_all_close)
        tol = TOL
        upcast = staticmethod(upcast)

        @staticmethod
        def backend(name: str) -> Callable:
            return lambda **kw: selective_scan(**kw, backend=name)

        @staticmethod
        def mamba_ref() -> Callable:
            return mamba_ref()

    return Tools

"""The Triton kernels compiled on a CUDA device at realistic shapes (marker ``gpu``; skipped without CUDA).

The other kernel tests run the same kernels in Triton's interpreter at tiny shapes.  These run them compiled, at
the shapes of a Mamba layer of width 1024 (L=2048, D=2048, N=16), against the reference loop on the same device,
with the CPU tests' tolerances (conftest.py ``TOL``):

* the forward for every dtype x gate at batch 8; the forward+backward at batch 2 for every dtype, gate and B/C
  layout once (3-D, grouped 4-D, a packed batch with ``cu_seqlens``: a Latin square of the three factors);
* the chunked kernels' paths: dstate 1, 12, 16 and 64 with D not a multiple of 32 and L not of the chunk,
  channel-last inputs, a packed batch with empty and length-1 sequences, bit-identical reruns;
* the decode step for every dtype x gate x B/C layout, prefill + decode chains, permuted decode inputs;
* ``LinearGrowthMamba`` under ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (CUDA graphs);
* mamba-ssm's CUDA ``selective_scan_fn`` and Triton ``selective_state_update`` where its extension imports.

``python -m pytest -m gpu tests/kernels`` on a GPU machine; ``benchmarks/gpu_validate.py`` runs it, then the
benchmarks' GPU modes.  Inputs are drawn on the CPU (conftest.py's generators) and moved to the device; the
results are compared on the CPU, on all its cores.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable, Dict, Optional

import pytest
import torch
from certblocks.kernels import (
    selective_scan,
    selective_scan_reference,
    selective_state_update,
    selective_state_update_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (the compiled kernels at realistic shapes; the CPU tests run them "
                              "in Triton's interpreter at tiny shapes)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

DEV = "cuda"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GATES = ("silu", "sigmoid", None)
B, D, N, L, G = 8, 2048, 16, 2048, 4  # batch, channels (d_model 1024, expand 2), states, length, B/C groups
B_GRAD = 2  # the batch of the forward+backward cases (the reference's autograd graph and the CPU comparisons)
PACKED = (0, 1500, 1500, 3600, 4096)  # 4 packed sequences, one of them empty
PATH_B, PATH_D, PATH_L = 2, 264, 1041  # D not a multiple of 32, L not a multiple of the chunk
# forward+backward: each dtype, gate and layout once, each pair of them once (a Latin square)
LATIN = [(DTYPES[i], GATES[j], ("variable", "grouped", "cu_seqlens")[(i + j) % 3]) for i in range(3) for j in range(3)]


@pytest.fixture(autouse=True)
def _all_cores():
    """The comparisons of tensors of 8M-33M elements run on the CPU: every core (conftest.py sets one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(n)


def on_device(fn: Callable) -> Callable:
    """``fn`` on the GPU for CPU arguments: every tensor moved there, ``(out, last)`` moved back.  The moves are
    differentiable, so conftest's ``run_scan`` gets its gradients on the CPU leaves it made."""

    def call(**kw):
        res = fn(**{k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
        return tuple(t.cpu() for t in res) if isinstance(res, tuple) else res.cpu()

    return call


TRITON = on_device(lambda **kw: selective_scan(**kw, backend="triton"))
REFERENCE = on_device(selective_scan_reference)


def forward(fn: Callable, x: Dict[str, torch.Tensor], **kw) -> Dict[str, torch.Tensor]:
    with torch.no_grad():
        out, last = fn(**x, return_last_state=True, **kw)
    return {"out": out, "last": last}


def case(scan_tools, dtype: torch.dtype, gate: Optional[str], layout: str, seed: int = 0, batch: int = B):
    """Inputs (CPU) and keyword arguments of one realistic-shape case; ``layout``: variable (3-D B/C), grouped
    (4-D B/C) or cu_seqlens (a packed batch of one row, grouped B/C)."""
    kw = dict(delta_softplus=True, gate=gate)
    if layout == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor(PACKED, dtype=torch.int32)
        shape = dict(batch=1, seqlen=PACKED[-1], ngroups=G)
    else:
        shape = dict(batch=batch, seqlen=L, ngroups=G if layout == "grouped" else None)
    x = scan_tools.make_inputs(dim=D, dstate=N, has_z=gate is not None, dtype=dtype, seed=seed, **shape)
    return x, kw


@pytest.mark.parametrize("gate", GATES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_every_dtype_and_gate(scan_tools, dtype, gate):
    x, kw = case(scan_tools, dtype, gate, "variable")
    scan_tools.assert_close(forward(TRITON, x, **kw), forward(REFERENCE, x, **kw), dtype,
                            f"forward {dtype} gate={gate} (B={B} D={D} N={N} L={L})")


@pytest.mark.parametrize("dtype, gate, layout", LATIN, ids=lambda v: str(v).replace("torch.", ""))
def test_forward_backward_latin_square(scan_tools, dtype, gate, layout):
    x, kw = case(scan_tools, dtype, gate, layout, batch=B_GRAD)
    scan_tools.assert_close(scan_tools.run(TRITON, x, **kw), scan_tools.run(REFERENCE, x, **kw), dtype,
                            f"forward+backward {dtype} gate={gate} {layout}")


@pytest.mark.parametrize("dstate", [1, 12, 16, 64])
def test_chunked_paths_every_dstate(scan_tools, dstate):
    x = scan_tools.make_inputs(batch=PATH_B, dim=PATH_D, dstate=dstate, seqlen=PATH_L, seed=dstate)
    scan_tools.assert_close(scan_tools.run(TRITON, x, delta_softplus=True), scan_tools.run(REFERENCE, x,
                            delta_softplus=True), torch.float32, f"N={dstate} D={PATH_D} L={PATH_L}")


def _channel_last(v: torch.Tensor) -> torch.Tensor:
    """The same values stored time-major along the last two axes (stride 1 along channels / states)."""
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_channel_last_inputs(scan_tools):
    x = scan_tools.make_inputs(batch=PATH_B, dim=PATH_D, dstate=N, seqlen=PATH_L, dtype=torch.bfloat16, seed=5)
    cl = {k: _channel_last(v) if k in ("u", "delta", "z", "B", "C") else v for k, v in x.items()}
    assert not cl["u"].is_contiguous() and cl["u"].stride(1) == 1
    scan_tools.assert_close(scan_tools.run(TRITON, cl, delta_softplus=True),
                            scan_tools.run(REFERENCE, x, delta_softplus=True), torch.bfloat16, "channel-last")


def test_packed_batch_with_empty_and_length_one_sequences(scan_tools):
    cu = torch.tensor([0, 0, 1, 1, PATH_L // 2, PATH_L // 2 + 1, PATH_L, PATH_L], dtype=torch.int32)
    x = scan_tools.make_inputs(batch=1, dim=PATH_D, dstate=N, seqlen=PATH_L, ngroups=2, seed=6)
    kw = dict(delta_softplus=True, gate="sigmoid", cu_seqlens=cu)
    got, want = scan_tools.run(TRITON, x, **kw), scan_tools.run(REFERENCE, x, **kw)
    assert got["last"].shape == (len(cu) - 1, PATH_D, N)
    scan_tools.assert_close(got, want, torch.float32, f"packed cu_seqlens={cu.tolist()}")


def test_reruns_are_bit_identical(scan_tools):
    x, kw = case(scan_tools, torch.bfloat16, "silu", "grouped", seed=7, batch=B_GRAD)
    a, b = scan_tools.run(TRITON, x, **kw), scan_tools.run(TRITON, x, **kw)
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"two runs on the same inputs differ bit for bit in {differ}"


def _decode_inputs(dtype: torch.dtype, gate: Optional[str], grouped: bool, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g)
    bc = (B, G, N) if grouped else (B, N)
    fixed = dict(A=-(torch.rand(D, N, generator=g) * 2.0 + 0.1), D=randn(D), dt_bias=torch.rand(D, generator=g) * 0.1)
    xs = [dict(x=randn(B, D).to(dtype), dt=(torch.rand(B, D, generator=g) * 0.5 + 0.05).to(dtype),
               B=randn(*bc).to(dtype), C=randn(*bc).to(dtype), z=randn(B, D).to(dtype) if gate else None)
          for _ in range(steps)]
    return randn(B, D, N), fixed, xs


@pytest.mark.parametrize("grouped", [False, True], ids=["variable", "grouped"])
@pytest.mark.parametrize("gate", GATES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_steps(scan_tools, dtype, gate, grouped):
    """Four consecutive decode steps from a float32 state, in place, against the reference twin."""
    state, fixed, xs = _decode_inputs(dtype, gate, grouped, steps=4, seed=2)
    fixed = {k: v.to(DEV) for k, v in fixed.items()}
    s_t, s_r = state.to(DEV), state.to(DEV).clone()
    ptr = s_t.data_ptr()
    got, want = {}, {}
    for i, a in enumerate(xs):
        a = {k: v.to(DEV) if v is not None else None for k, v in a.items()}
        got[f"out{i}"] = selective_state_update(s_t, **a, **fixed, dt_softplus=True, gate=gate, backend="triton")
        want[f"out{i}"] = selective_state_update_reference(s_r, **a, **fixed, dt_softplus=True, gate=gate)
    assert s_t.data_ptr() == ptr  # updated in place
    got["state"], want["state"] = s_t, s_r
    scan_tools.assert_close({k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()}, dtype,
                            f"decode {dtype} gate={gate} grouped={grouped}")


@pytest.mark.parametrize("dtype, gate, grouped", [(torch.float32, "silu", False), (torch.bfloat16, "sigmoid", True),
                                                  (torch.float16, None, False)], ids=str)
def test_prefill_then_decode_equals_the_full_scan(scan_tools, dtype, gate, grouped):
    total, prefill = 80, 72
    x = scan_tools.make_inputs(batch=B, dim=D, dstate=N, seqlen=total, ngroups=G if grouped else None,
                               has_z=gate is not None, dtype=dtype, seed=4)
    kw = dict(delta_softplus=True, gate=gate)
    full, last = forward(REFERENCE, x, **kw).values()
    pre = {k: (v[..., :prefill] if k in ("u", "delta", "z", "B", "C") else v) for k, v in x.items()}
    got, want = forward(TRITON, pre, **kw), {"out": full[..., :prefill], "last": last}
    state = got.pop("last").to(DEV)
    dx = {k: v.to(DEV) for k, v in x.items()}
    with torch.no_grad():
        for t in range(prefill, total):
            got[f"step{t}"] = selective_state_update(
                state, dx["u"][..., t], dx["delta"][..., t], dx["A"], dx["B"][..., t], dx["C"][..., t], dx["D"],
                dx["z"][..., t] if "z" in dx else None, dx["delta_bias"], dt_softplus=True, gate=gate,
                backend="triton").cpu()
            want[f"step{t}"] = full[..., t]
    got["last"] = state.cpu()
    scan_tools.assert_close(got, want, dtype, f"prefill {prefill} + decode {total - prefill}")


def test_decode_permuted_inputs():
    g = torch.Generator().manual_seed(8)
    b, n = 4, 12
    randn = lambda *s: torch.randn(*s, generator=g).to(DEV)
    args = dict(A=-torch.rand(PATH_D, n, generator=g).to(DEV), B=randn(b, n), C=randn(b, n), D=randn(PATH_D),
                dt_bias=randn(PATH_D), dt_softplus=True, gate="silu")
    x, dt, z = (randn(PATH_D, b).t() for _ in range(3))  # (batch, dim) views of (dim, batch) storage
    state = randn(b, n, PATH_D).transpose(1, 2)
    s_ref = state.contiguous()
    want = selective_state_update_reference(s_ref, x.contiguous(), dt.contiguous(), z=z.contiguous(), **args)
    got = selective_state_update(state, x, dt, z=z, **args, backend="triton")
    torch.testing.assert_close(got, want, rtol=6e-4, atol=2e-3)
    torch.testing.assert_close(state, s_ref, rtol=6e-4, atol=2e-3)


def test_linear_growth_mamba_compiled_with_cuda_graphs(scan_tools):
    """``torch.compile(fullgraph=True, mode="reduce-overhead")`` against eager, outputs and input gradients, on the
    third call (CUDA graphs record on a later call than the first)."""
    from certblocks.blocks.mamba import LinearGrowthMamba
    from certblocks.blocks.mixer import SelectiveScanMixer

    torch.manual_seed(0)
    block = LinearGrowthMamba(512, d_state=N, device=DEV, dtype=torch.bfloat16)
    for m in block.modules():
        if isinstance(m, SelectiveScanMixer):
            m.backend = "triton"
    x = torch.randn(B, L, 512, device=DEV, dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    res = {}
    for name, m in (("eager", block), ("compiled", compiled)):
        for _ in range(3):
            xr = x.detach().clone().requires_grad_(True)
            y = m(xr)
            y.float().square().mean().backward()
            res[name] = dict(out=y.detach().cpu(), dx=xr.grad.cpu())
            block.zero_grad(set_to_none=True)
    scan_tools.assert_close(res["compiled"], res["eager"], torch.bfloat16, "compiled (CUDA graphs) vs eager")


def _mamba_cuda():
    """mamba-ssm's CUDA selective scan and Triton decode step, or a skip naming why they are unavailable."""
    if importlib.util.find_spec("mamba_ssm") is None:
        pytest.skip("mamba-ssm is not installed")
    try:
        ext = importlib.import_module("selective_scan_cuda")
    except Exception as exc:
        pytest.skip(f"mamba-ssm's CUDA extension does not import: {type(exc).__name__}: {exc}")
    if not hasattr(ext, "fwd"):
        pytest.skip("selective_scan_cuda is tests/conftest.py's stand-in (mamba-ssm built without CUDA)")
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ssu

    return selective_scan_fn, ssu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scan_against_mamba_ssm_cuda(scan_tools, dtype):
    """Gate silu against mamba-ssm's CUDA kernel (its backward ignores last_state's gradient: out only)."""
    scan_fn, _ = _mamba_cuda()
    x, kw = case(scan_tools, dtype, "silu", "variable", batch=B_GRAD)
    got = scan_tools.run(TRITON, x, use_last=False, **kw)
    want = scan_tools.run(on_device(scan_fn), x, use_last=False, delta_softplus=True)
    scan_tools.assert_close(got, want, dtype, f"triton vs mamba-ssm selective_scan_fn {dtype}")


def test_decode_against_mamba_ssm():
    _, ssu = _mamba_cuda()
    state, fixed, xs = _decode_inputs(torch.bfloat16, "silu", False, steps=4, seed=3)
    fixed = {k: v.to(DEV) for k, v in fixed.items()}
    s_t, s_p = state.to(DEV), state.to(DEV).clone()
    for a in xs:
        a = {k: v.to(DEV) for k, v in a.items()}
        got = selective_state_update(s_t, **a, **fixed, dt_softplus=True, gate="silu", backend="triton")
        want = ssu(s_p, a["x"], a["dt"], fixed["A"], a["B"], a["C"], D=fixed["D"], z=a["z"], dt_bias=fixed["dt_bias"],
                   dt_softplus=True)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=5e-2)
    torch.testing.assert_close(s_t, s_p, rtol=3e-2, atol=5e-2)

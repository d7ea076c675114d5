"""torch.compile(fullgraph=True) through the custom ops (no graph break), forward and backward."""

from __future__ import annotations

import torch
from certblocks.kernels import selective_scan, selective_state_update


def test_compile_fullgraph_scan_forward_backward(scan_tools):
    x = scan_tools.make_inputs(batch=2, dim=8, dstate=4, seqlen=20, ngroups=2)

    def f(u, delta, A, B, C, D, z, delta_bias):
        out, last = selective_scan(
            u * 2.0, delta, A, B, C, D, z, delta_bias, delta_softplus=True, gate="sigmoid",
            return_last_state=True, backend="torch",
        )
        return (out * out).sum() + last.sum()

    xs = {k: v.clone().requires_grad_() for k, v in x.items()}
    cf = torch.compile(f, fullgraph=True)
    r = cf(**xs)
    r.backward()
    got = {k: v.grad.clone() for k, v in xs.items()}
    for v in xs.values():
        v.grad = None
    r0 = f(**xs)
    r0.backward()
    torch.testing.assert_close(r, r0, rtol=6e-4, atol=2e-3)
    for k, v in xs.items():
        torch.testing.assert_close(got[k], v.grad, rtol=6e-4, atol=2e-3)


def test_op_is_visible_in_exported_graph(scan_tools):
    """The scan is one node ``certblocks.selective_scan`` (the tracer recognizes it by name)."""
    x = scan_tools.make_inputs(batch=1, dim=8, dstate=4, seqlen=6)

    class M(torch.nn.Module):
        def forward(self, u, delta, A, B, C, D, z, delta_bias):
            return selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True, backend="torch")

    ep = torch.export.export(M(), tuple(x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.certblocks.selective_scan.default in targets


def test_compile_fullgraph_decode_step():
    g = torch.Generator().manual_seed(0)
    state = torch.randn(2, 8, 4, generator=g)
    x, dt, z = (torch.randn(2, 8, generator=g) for _ in range(3))
    A, B, C = -torch.rand(8, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)

    def step(state, x, dt, z):
        return selective_state_update(state, x, dt, A, B, C, z=z, dt_softplus=True, backend="torch")

    s1, s2 = state.clone(), state.clone()
    y1 = torch.compile(step, fullgraph=True)(s1, x, dt, z)
    y2 = step(s2, x, dt, z)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(s1, s2)
    assert not torch.equal(s1, state)

"""build_stack and CertifiedStack on small modules whose certificates are known."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from certblocks import BlockCertificate, CertificationError, build_stack
from certblocks.stack import CertifiedStack


class Aligned(nn.Module):
    """v(x) = c ||x||^(q-1) x per token: attains ||v(x)|| = c ||x||^q, the worst case of the forward bound."""

    def __init__(self, q: float = 1.0, c: float = 1.0) -> None:
        super().__init__()
        self.q, self.c = q, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.norm(dim=-1, keepdim=True)
        return self.c * norm ** (self.q - 1) * x

    def certificate(self, *, seq_len=None, r0=None) -> BlockCertificate:
        # Jacobian of c r^(q-1) x: eigenvalues c r^(q-1) and c q r^(q-1), so L(R) = c q R^(q-1).
        return BlockCertificate(self.q, max(self.q - 1, 0.0), c=self.c, l1=self.c * self.q, l0=0.0)


class Linear(nn.Module):
    def __init__(self, dim: int, scale: float, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(dim, dim, generator=g)
        self.weight = nn.Parameter(w * scale / torch.linalg.matrix_norm(w, ord=2))

    def forward(self, x):
        return x @ self.weight.T

    def certificate(self, seq_len: int | None = None) -> BlockCertificate:
        self.seen_seq_len = seq_len
        op = float(torch.linalg.matrix_norm(self.weight.detach(), ord=2))
        return BlockCertificate(1, 0, c=op, l1=0.0, l0=op)


def unit_tokens(n: int = 4, d: int = 8) -> torch.Tensor:
    x = torch.zeros(n, d)
    x[:, 0] = 1.0  # every token has norm 1 and sits on one axis: entries equal norms
    return x


def test_certified_depth_is_exact_in_real_fp16_arithmetic():
    # q = 1, c = 1: the state doubles; D_F = 15 in fp16, and 16 updates overflow for real.
    blocks = [Aligned() for _ in range(15)]
    stack = build_stack(blocks, torch.float16)
    assert stack.certificate().ok and stack.certificate().certified_depth == 15
    y = stack.to(torch.float16)(unit_tokens().half())
    assert torch.isfinite(y).all() and y.max().item() == 2.0**15
    with pytest.raises(CertificationError):
        build_stack([Aligned() for _ in range(16)], torch.float16)
    over = build_stack([Aligned() for _ in range(16)], torch.float16, certify=False)
    assert not over.certificate().ok
    assert not torch.isfinite(over(unit_tokens().half())).all()  # the refusal was not a false alarm


def test_q2_stack_overflows_where_refused():
    blocks = [Aligned(q=2.0, c=1.0) for _ in range(4)]
    stack = build_stack(blocks, "fp16")  # 1 -> 2 -> 6 -> 42 -> 1806
    assert torch.isfinite(stack(unit_tokens().half())).all()
    with pytest.raises(CertificationError, match=r"q = 2 > 1"):
        build_stack([Aligned(q=2.0) for _ in range(5)], "fp16")
    over = build_stack([Aligned(q=2.0) for _ in range(5)], "fp16", certify=False)
    assert not torch.isfinite(over(unit_tokens().half())).all()


def test_forward_computes_the_residual_updates():
    blocks = [Linear(8, 0.5, seed) for seed in range(3)]
    stack = build_stack(blocks, "fp32", dt=0.5)
    x = torch.randn(2, 5, 8)
    want = x
    for b in blocks:
        want = want + 0.5 * b(want)
    torch.testing.assert_close(stack(x), want)
    assert isinstance(stack, CertifiedStack) and stack.dtype == "fp32" and stack.dt == 0.5
    assert "certified=3/3" in repr(stack)


def test_error_message_names_update_exponents_depth_and_fix():
    blocks = [Linear(8, 0.4, s) for s in range(6)]
    gated = [BlockCertificate(2, 1, c=1.0, name=f"gated_mlp.{k}", culprit="SiLU gate") for k in (6, 7)]
    specs = blocks + [(Linear(8, 0.4, 90 + k), cert) for k, cert in enumerate(gated)]
    specs += [Linear(8, 0.4, s) for s in range(100, 110)]
    with pytest.raises(CertificationError) as info:
        build_stack(specs, "fp16")
    msg = str(info.value)
    assert "not certified in fp16" in msg and "certified depth" in msg
    assert "gated_mlp.6" in msg and "(q=2, sigma=1)" in msg and "SiLU gate" in msg and "Culprit's fix:" in msg
    assert "Fixes (each certified again): dt <= " in msg and "at most 16 residual updates" in msg
    cert = info.value.certificate
    assert cert is not None and not cert.ok and f"certified depth {cert.certified_depth} of 18" in msg


def test_backward_failure_message_points_at_sigma():
    attn = BlockCertificate(1, 2, c=1.0, l1=1.0, l0=1.0, name="attn")
    specs = [(nn.Identity(), attn) for _ in range(13)]
    with pytest.raises(CertificationError, match="QK-norm") as info:
        build_stack(specs, "fp32")
    assert "backward" in str(info.value)


def test_same_module_twice_is_an_error():
    block = Linear(8, 0.5, 0)
    with pytest.raises(ValueError, match=r"blocks\[2\] is the same module instance as blocks\[0\]"):
        build_stack([block, Linear(8, 0.5, 1), block], "fp32")


def test_bad_blocks_are_type_errors():
    with pytest.raises(TypeError, match="has no certificate"):
        build_stack([nn.Linear(4, 4)], "fp32")
    with pytest.raises(TypeError, match=r"blocks\[0\] must be"):
        build_stack([(nn.Linear(4, 4), (1, 0))], "fp32")  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"blocks\[0\] must be"):
        build_stack(["mlp"], "fp32")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one block"):
        build_stack([], "fp32")
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        build_stack([Linear(4, 0.5, 0)], "int8")


def test_seq_len_is_offered_to_blocks_that_take_it():
    blocks = [Linear(8, 0.5, 0), Aligned()]
    build_stack(blocks, "fp32", seq_len=128)
    assert blocks[0].seen_seq_len == 128


def test_recertify_follows_the_weights():
    blocks = [Linear(8, 0.5, s) for s in range(12)]
    stack = build_stack(blocks, "fp16")
    assert stack.certificate().ok
    with torch.no_grad():
        blocks[3].weight.mul_(4000.0)
    cert = stack.recertify()
    assert not cert.ok and stack.certificate() is cert
    with pytest.raises(CertificationError):
        stack.recertify(strict=True)


def test_explicit_certificates_survive_recertify():
    fixed = BlockCertificate(1, 0, c=0.25, l0=0.25, name="fixed")
    stack = build_stack([(nn.Identity(), fixed), Linear(4, 0.5, 0)], "fp32")
    assert stack.recertify().updates[0] is fixed
    assert stack.certificate().updates[1].name == "1:Linear"

"""The certified envelope at run time, ``certificate()`` as a method, and no computation in ``repr``.

A certificate is for a dtype, a sequence length and an input radius (:class:`certblocks.model.Envelope`).  A forward
outside them warns once (:class:`~certblocks.model.EnvelopeWarning`, a ``CertificateWarning``) or raises with
``strict``, and ``certificate()`` is then computed at the envelope actually used: a stack certified at
``seq_len=64`` run on 4,096 tokens reports the certificate at 4,096, refused as ``build_stack`` refuses it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import certblocks
from certblocks import CertificationError, build_stack
from certblocks.blocks import MLP, LinearGrowthMamba
from certblocks.model import CertificateWarning, EnvelopeWarning
from certblocks.monitor import CertificateWarning as MonitorCertificateWarning
from certblocks.stack import CertifiedStack


def _mambas() -> list:
    """Two scans: certified in fp16 at 64 tokens, refused at 4,096 (their bound sums over time)."""
    torch.manual_seed(0)
    blocks = [LinearGrowthMamba(8) for _ in range(2)]
    with torch.no_grad():
        for b in blocks:
            b.out_proj.weight.mul_(0.1)
    return blocks


def _tokens(n: int, norm: float = 0.5, d: int = 8) -> torch.Tensor:
    x = torch.randn(1, n, d, generator=torch.Generator().manual_seed(n))
    return x / x.norm(dim=-1, keepdim=True) * norm


@pytest.fixture
def no_envelope_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvelopeWarning)
        yield


def test_the_warning_classes() -> None:
    assert issubclass(EnvelopeWarning, CertificateWarning) and issubclass(CertificateWarning, UserWarning)
    assert MonitorCertificateWarning is CertificateWarning  # the old import path
    assert certblocks.CertificateWarning is CertificateWarning


def test_a_longer_sequence_is_certified_where_it_ran() -> None:
    blocks = _mambas()
    stack = build_stack(blocks, "fp16", seq_len=64)
    assert stack.certificate().ok
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvelopeWarning)
        stack(_tokens(64))  # inside the envelope
    assert stack.certificate().ok
    with pytest.raises(CertificationError):
        build_stack(blocks, "fp16", seq_len=4096)  # what build_stack says at 4,096 tokens
    with pytest.warns(EnvelopeWarning, match=r"sequence length 4096 > the certified seq_len 64"):
        stack(_tokens(4096))
    cert = stack.certificate()
    at_4096 = build_stack(blocks, "fp16", seq_len=4096, certify=False).certificate()
    assert not cert.ok and cert.certified_depth == at_4096.certified_depth
    assert [u.c for u in cert.updates] == [u.c for u in at_4096.updates]
    assert stack.envelope.used() == ("fp16", 4096, 1.0) and stack.seq_len == 64  # what it was certified at
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvelopeWarning)  # once per model and quantity
        stack(_tokens(4096))
    assert stack.certificate(seq_len=64).ok  # the certificate at 64 tokens is still available by asking


def test_strict_raises_at_the_forward() -> None:
    stack = build_stack(_mambas(), "fp16", seq_len=64, strict=True)
    with pytest.raises(CertificationError, match=r"sequence length 128 > the certified seq_len 64"):
        stack(_tokens(128))
    with pytest.raises(TypeError, match="strict must be a bool"):
        build_stack(_mambas(), "fp16", seq_len=64, strict=1)


def test_an_input_beyond_r0_widens_the_radius() -> None:
    torch.manual_seed(0)
    stack = build_stack([MLP(8, 16) for _ in range(2)], "fp32", r0=1.0)
    before = stack.certificate()
    stack(_tokens(5, norm=0.9))  # inside
    with pytest.warns(EnvelopeWarning, match=r"input per-token norm 3 > the certified r0 1"):
        stack(_tokens(5, norm=3.0))
    cert = stack.certificate()
    assert cert.r0 == pytest.approx(3.0, rel=1e-6) and cert.radii[-1] > before.radii[-1]
    assert stack.certificate(r0=1.0).radii == before.radii


def test_a_narrower_dtype_is_certified_in_that_dtype(no_envelope_warning) -> None:
    torch.manual_seed(0)
    stack = build_stack([MLP(8, 16) for _ in range(2)], "bf16", r0=1.0)
    stack(_tokens(5))  # float32 is wider than bf16: inside
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stack(_tokens(5))  # bf16 itself: inside
    assert stack.certificate().dtype == "bf16"
    with pytest.warns(EnvelopeWarning, match=r"dtype fp16 is narrower than the certified bf16"):
        stack.half()(_tokens(5).half())
    assert stack.certificate().dtype == "fp16" and not stack.envelope.seen_seq_len


def test_zoo_model_checks_its_compute_dtype() -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test").eval()
    assert model.envelope.dtype == model.cert_dtype == "bf16"
    idx = torch.randint(0, 64, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvelopeWarning)
        model(idx)  # fp32 parameters: wider than bf16
    assert model.certificate().dtype == "bf16"
    with pytest.warns(EnvelopeWarning, match=r"GPT2QKNorm ran outside .* dtype fp16 is narrower than .* bf16"):
        model.half()(idx)
    assert model.certificate().dtype == "fp16" and model.certificate("bf16").dtype == "bf16"
    model.envelope.strict = True
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(CertificationError, match="dtype fp16"):
        model.float()(idx)


def test_compile_export_and_fx_trace_skip_the_check(no_envelope_warning) -> None:
    torch.manual_seed(0)
    stack = build_stack([MLP(8, 16) for _ in range(2)], "fp32", r0=1.0).eval()
    x = _tokens(5, norm=4.0)  # outside r0: only an eager forward may see it
    exported = torch.export.export(stack, (x,))
    compiled = torch.compile(stack, backend="eager", fullgraph=True)
    traced = torch.fx.symbolic_trace(stack)
    want = exported.module()(x)
    torch.testing.assert_close(compiled(x), want)
    torch.testing.assert_close(traced(x), want)
    assert not stack.envelope.exceeded  # nothing seen while tracing, nor by the traced programs
    with pytest.warns(EnvelopeWarning):
        stack(x)
    assert stack.envelope.exceeded


# ------------------------------------------------------------------------------------ the method and its shim
def test_certificate_is_a_method_with_a_deprecated_attribute_shim() -> None:
    torch.manual_seed(0)
    stack = build_stack([MLP(8, 16) for _ in range(3)], "fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cert = stack.certificate()  # the method: no warning
        assert stack.certificate() is cert and stack.certificate("fp16") is cert
        assert CertifiedStack.certificate(stack) is cert  # through the class, like any method
        assert stack.certificate("fp32").dtype == "fp32"
        assert "bound method CertifiedStack.certificate" in repr(stack.certificate)
    with pytest.warns(DeprecationWarning, match=r"call stack\.certificate\(\)"):
        assert stack.certificate.ok == cert.ok
    with pytest.warns(DeprecationWarning):
        assert stack.certificate.certified_depth == cert.certified_depth
    with pytest.warns(DeprecationWarning):
        assert stack.certificate.explain() == cert.explain()
    with pytest.warns(DeprecationWarning):
        assert str(stack.certificate) == str(cert)
    with pytest.warns(DeprecationWarning):
        assert stack.certificate == cert
    with pytest.raises(AttributeError, match="is a method"):
        stack.certificate.ok = False
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError):
        stack.certificate.no_such_field  # noqa: B018


def _count_certifications(monkeypatch) -> list:
    """Count every block certificate and every chain certified (the norms a certificate computes)."""
    import certblocks.stack as stack_mod
    from certblocks import blocks as blk

    calls: list = []
    for cls in (blk.MLP, blk.GatedMLP, blk.Attention, blk.QKNormAttention, blk.ScaledBranch, blk.LinearGrowthMamba):
        real = cls.certificate

        def counted(self, *a, _real=real, **k):
            calls.append(type(self).__name__)
            return _real(self, *a, **k)
        monkeypatch.setattr(cls, "certificate", counted)
    real_chain = stack_mod.certify_stack
    monkeypatch.setattr(stack_mod, "certify_stack", lambda *a, **k: calls.append("chain") or real_chain(*a, **k))
    return calls


def test_repr_computes_nothing(monkeypatch) -> None:
    torch.manual_seed(0)
    stack = build_stack([MLP(8, 16) for _ in range(2)], "fp32", r0=4.0)
    calls = _count_certifications(monkeypatch)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    stack(_tokens(5)).square().sum().backward()
    opt.step()  # the weights changed: the certificate shown is the last computed one
    text = repr(stack) + str(stack)
    print(stack)
    assert calls == [] and "certified=2/2 (as last computed: weights or envelope changed since)" in text
    stack.certificate()
    assert calls and "changed since" not in repr(stack)


def test_zoo_repr_computes_nothing(monkeypatch) -> None:
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    model = create_model("gpt2_qknorm_test")
    calls = _count_certifications(monkeypatch)
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx)[1].backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    repr(model)
    assert calls == []
    model.certificate()
    assert calls


def test_conversion_swapped_blocks_and_module_repr_compute_nothing(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8, 16), MLP(8, 16))
    cm = certblocks.model.as_certified(model, r0=2.0)
    calls = _count_certifications(monkeypatch)
    repr(model), repr(cm)  # noqa: B018
    assert calls == []


def test_uncertified_models_record_without_warning() -> None:
    """A stack refused at construction (``certify=False``) and a zoo model built with ``certify=False`` claim no
    certificate: a forward outside the envelope is recorded (``certificate()`` follows it) but does not warn; a
    certified stack still warns; ``strict`` still raises."""
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    refused = build_stack([MLP(8, 16) for _ in range(40)], "fp16", r0=1.0, certify=False)
    assert not refused.certificate().ok and refused.envelope.quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvelopeWarning)
        refused(_tokens(5, norm=4.0))
    assert refused.envelope.seen_r0 is not None and refused.certificate().r0 > 1.0
    refused.envelope.strict = True
    with pytest.raises(CertificationError, match="r0"):
        refused(_tokens(5, norm=4.0))

    ok = build_stack([MLP(8, 16) for _ in range(2)], "fp32", r0=1.0, certify=False)
    assert ok.certificate().ok and not ok.envelope.quiet
    with pytest.warns(EnvelopeWarning, match="r0"):
        ok(_tokens(5, norm=4.0))

    model = create_model("gpt2_qknorm_test", certify=False).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvelopeWarning)
        model.half()(torch.randint(0, 64, (1, 8)))
    assert model.certificate().dtype == "fp16"

"""The zoo: every small configuration runs forward and backward, round-trips its state_dict, has a
certificate equal (update by update) to what the tracer derives, and refuses a configuration
past its budget."""

from __future__ import annotations

import pytest
import torch
from certblocks.zoo import create_model, list_models, register_model

from certblocks import CertificationError, StackCertificate
from certblocks.trace import ModelCertificate, certify
from certblocks.trace.own import rules_only

TEST_MODELS = sorted(n for n in list_models(include_test=True) if n.endswith("_test"))
#: test-size configurations not certified in bf16 (built with certify=False): the q = 5 baseline.
UNCERTIFIED = {"mamba_forecaster_free_test"}


def _input(name: str, model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if name.startswith("gpt2"):
        return torch.randint(0, model.vocab_size, (2, model.block_size), generator=g)
    if name.startswith(("patchtst", "mamba_forecaster")):
        return torch.randn(2, model.seq_len, model.n_vars, generator=g)
    if name.startswith("toto"):
        return torch.randn(2, 3, model.context, generator=g)
    return torch.randn(2, 3, 32, 32, generator=g)


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_model(name, certify=name not in UNCERTIFIED)


def test_registry_lists_families():
    names = list_models()
    for n in ("gpt2_qknorm_tiny", "gpt2_qknorm_124m", "patchtst_noln", "patchtst_rms", "patchtst_preln",
              "patchtst_periln", "mamba_forecaster_lg", "mamba_forecaster_free", "mamba_forecaster_rms",
              "mamba_forecaster_preln", "mamba_forecaster_periln", "toto_style",
              "certblocks_vit_small_patch16_224"):
        assert n in names
    assert not any(n.endswith("_test") for n in names)
    assert "patchtst_noln_test" in list_models("patchtst_*", include_test=True)
    with pytest.raises(KeyError, match="unknown model"):
        create_model("gpt3_qknorm")


def test_register_decorator_rejects_duplicates():
    @register_model(family="tmp", test=True)
    def tmp_zoo_model_for_test(**kw):
        """A linear layer."""
        return torch.nn.Linear(2, 2)

    assert isinstance(create_model("tmp_zoo_model_for_test"), torch.nn.Linear)
    with pytest.raises(ValueError, match="already registered"):
        register_model(lambda **kw: None, name="tmp_zoo_model_for_test")


@pytest.mark.parametrize("name", TEST_MODELS)
def test_forward_backward_roundtrip(name):
    m = _build(name)
    x = _input(name, m)
    y = _out(m(x))
    assert torch.isfinite(y).all()
    y.float().square().mean().backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads), name
    # state_dict round trip into a differently initialized twin
    m2 = _build(name, seed=1)
    m2.load_state_dict(m.state_dict(), strict=True)
    m.eval(), m2.eval()
    with torch.no_grad():
        torch.testing.assert_close(_out(m2(x)), _out(m(x)))


@pytest.mark.parametrize("name", TEST_MODELS)
def test_certificate_matches_tracer(name):
    m = _build(name).eval()
    cert = m.certificate("bf16")
    assert isinstance(cert, StackCertificate)
    assert cert.ok == (name not in UNCERTIFIED)
    names = [u.name for u in cert.updates]
    assert names == [p for p, _ in m.residual_updates()]
    with rules_only():  # exponents derived from the graph, not read back from the blocks
        traced = certify(m, _input(name, m)[:1])
    assert isinstance(traced, ModelCertificate)
    assert len(traced) == cert.depth, traced.explain()
    for u, t in zip(cert.updates, traced):  # same module paths
        if name == "patchtst_periln_test":  # the tracer names a Peri-LN update after its output norm
            assert t.name.rsplit(".", 1)[0] == u.name.rsplit(".", 1)[0], (t.name, u.name)
        else:
            assert t.name == u.name
    mismatched = [(u.name, u.exponents, t.name, t.exponents) for u, t in zip(cert.updates, traced)
                  if u.exponents != t.exponents]
    assert not mismatched, mismatched
    # every update bounds its intermediates, and the forward depth respects them
    assert all(u.peak is not None for u in cert.updates), [u.name for u in cert.updates if u.peak is None]
    for k, u in enumerate(cert.updates[:cert.forward_depth]):
        assert u.peak_bound(cert.radii[k]) < cert.max_value, (u.name, u.peak)


@pytest.mark.parametrize("name,overrides", [
    ("patchtst_noln_test", dict(e_layers=12, cert_dtype="fp16")),
    ("gpt2_qknorm_test", dict(n_layer=8, cert_dtype=torch.float16, init_values=None)),
    ("mamba_forecaster_free_test", dict(certify=True)),  # a baseline: refused only when asked to certify
])
def test_refuses_past_budget(name, overrides):
    with pytest.raises(CertificationError) as e:
        create_model(name, **overrides)
    msg = str(e.value)
    assert "not certified in" in msg and "certified depth" in msg and "certify=False" in msg
    assert e.value.certificate is not None and not e.value.certificate.ok
    m = create_model(name, **{**overrides, "certify": False})  # built anyway, and its certificate tells
    assert not m.certificate().ok


def test_certificate_dtypes_order():
    m = _build("patchtst_noln_test")
    fp16, bf16 = m.certificate("fp16"), m.certificate("bf16")
    assert fp16.certified_depth <= bf16.certified_depth
    assert m.certificate("bf16", r0=1e30).certified_depth < bf16.certified_depth


def _spiky_inputs(name: str, m: torch.nn.Module) -> list:
    """Inputs that concentrate the energy of a series (a spike at the last step, repeated by the end padding)."""
    if name.startswith(("patchtst", "mamba_forecaster")):
        x = torch.zeros(3, m.seq_len, m.n_vars)
        x[0, -1] = 100.0
        x[1, 0] = -3.0
        x[2] = torch.randn(m.seq_len, m.n_vars).cumsum(0)
        return [x]
    if name.startswith("toto"):
        x = torch.zeros(2, 3, m.context)
        x[0, :, -1] = 7.0
        x[1] = torch.randn(3, m.context)
        return [x]
    if name.startswith("certblocks_vit"):
        return [torch.randint(0, 2, (2, 3, 32, 32)).float() * 2 - 1, torch.ones(1, 3, 32, 32)]  # pixels in [-1, 1]
    return [torch.randint(0, m.vocab_size, (4, m.block_size))]


@pytest.mark.parametrize("name", ["gpt2_qknorm_test", "patchtst_noln_test", "mamba_forecaster_lg_test",
                                  "toto_style_test", "certblocks_vit_test"])
def test_input_radius_bounds_the_embedded_input(name):
    """r0 (the default of .certificate) is above the per-token norm of the first update's input."""
    m = _build(name).eval()
    with torch.no_grad():  # make RevIN's affine map non-trivial
        for mod in m.modules():
            if hasattr(mod, "affine_weight"):
                mod.affine_weight.fill_(-1.7)
                mod.affine_bias.fill_(0.4)
    seen = []
    first = m.residual_updates()[0][1]
    first = getattr(first, "branch", first)  # a gained update: its branch module receives the input
    h = first.register_forward_pre_hook(lambda mod, args: seen.append(args[0].norm(dim=-1).max().item()))
    with torch.no_grad():
        for x in _spiky_inputs(name, m):
            m(x)
    h.remove()
    assert seen and max(seen) <= m.input_radius()
    assert max(seen) >= 0.05 * m.input_radius()  # and not absurdly loose

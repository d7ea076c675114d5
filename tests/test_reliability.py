"""What a new user runs into first: non-finite weights, stale certificates, edge-case inputs, depth types."""

import itertools
import math
import warnings

import pytest
import torch

from certblocks import MLP, BlockCertificate, CertificateMonitor, GatedMLP, QKNormAttention, build_stack
from certblocks._validation import NonFiniteWeightError
from certblocks.blocks import LinearGrowthMamba, Mamba


def _poison(module: torch.nn.Module, where=(0, 0), value=math.nan) -> None:
    with torch.no_grad():
        module.weight[where] = value


def test_block_certificate_names_the_non_finite_parameter():
    mlp = MLP(8, 16)
    _poison(mlp.fc1)
    with pytest.raises(NonFiniteWeightError, match=r"^fc1\.weight has 1 non-finite entry"):
        mlp.certificate()


def test_build_stack_names_the_parameter_in_the_stack():
    blocks = [MLP(8, 16), QKNormAttention(8, 2), GatedMLP(8, 16), MLP(8, 16)]
    with torch.no_grad():
        blocks[3].fc1.weight[0, :3] = math.inf
    with pytest.raises(NonFiniteWeightError, match=r"blocks\.3\.fc1\.weight has 3 non-finite entries"):
        build_stack(blocks, "bf16", seq_len=4)


def test_zoo_model_names_the_parameter_by_its_path():
    from certblocks.zoo import create_model

    model = create_model("gpt2_qknorm_tiny", certify=False)
    _poison(model.transformer.h[1].mlp.fc2)
    with pytest.raises(NonFiniteWeightError, match=r"transformer\.h\.1\.mlp\.fc2\.weight has 1 non-finite entry"):
        model.certificate()


def test_monitor_records_and_alerts_on_non_finite_weights_without_raising():
    stack = build_stack([MLP(8, 16) for _ in range(3)], "bf16", seq_len=4)
    monitor = CertificateMonitor(stack, "bf16", every=1)
    monitor.step()
    _poison(stack.blocks[2].fc2, value=-math.inf)
    with pytest.warns(Warning, match=r"blocks\.2\.fc2\.weight has 1 non-finite entry"):
        rec = monitor.step()
    assert rec is not None and rec["stack/ok"] is False and "blocks.2.fc2.weight" in rec["nonfinite"]
    alert = monitor.alerts[-1]
    assert alert["quantity"] == "non-finite weights" and alert["update"] == "blocks.2.fc2.weight"
    monitor.remove()


def test_stack_certificate_is_recomputed_when_weights_change():
    torch.manual_seed(0)
    stack = build_stack([MLP(8, 16) for _ in range(2)], "fp32", seq_len=4)
    before = stack.certificate()
    assert stack.certificate() is before  # unchanged weights: the same object, no recomputation
    with torch.no_grad():
        stack.blocks[0].fc1.weight.mul_(3.0)
    after = stack.certificate()
    assert after is not before and math.isclose(after.updates[0].c, 3 * before.updates[0].c, rel_tol=1e-6)
    opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    stack(torch.randn(2, 4, 8)).square().sum().backward()
    opt.step()  # an optimizer step bumps the version counters too
    assert stack.certificate() is not after
    stack.load_state_dict({k: torch.zeros_like(v) for k, v in stack.state_dict().items()})
    assert stack.certificate().updates[1].c == 0.0


@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
def test_mamba_length_zero_and_dtypes_are_clear(cls):
    blk = cls(16)
    out = blk(torch.randn(2, 0, 16))
    assert out.shape == (2, 0, 16) and out.dtype == torch.float32
    with pytest.raises(TypeError, match=r"hidden_states has dtype torch.float64; allowed"):
        blk(torch.randn(2, 5, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"dtype must be one of .*got torch.float64"):
        cls(16, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"hidden_states.dtype torch.bfloat16 differs from the block's parameters"):
        blk(torch.randn(2, 5, 16, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert blk(torch.randn(2, 5, 16, dtype=torch.bfloat16)).shape == (2, 5, 16)
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.certificate\(\) needs seq_len"):
        blk.certificate()


def test_depths_are_ints_inf_or_none():
    for q, s, c, b, l1, l0, r0, dt in itertools.product((0, 0.5, 1, 2), (0, 1, 2), (0.0, 1.0), (0.0, 0.5),
                                                        (0.0, 1.0), (0.0, 1.0), (0, 0.0, 1, 1e-3, 5.0),
                                                        ("fp16", "bf16")):
        d = BlockCertificate(q, s, c=c, b=b, l1=l1, l0=l0).depths(dt, r0=r0)
        for k in ("forward", "backward", "certified", "forward_overflow", "backward_overflow"):
            v = getattr(d, k)
            assert v is None or v == math.inf or (isinstance(v, int) and not isinstance(v, bool)), (q, s, r0, k, v)


def test_block_without_the_protocol_gets_a_clear_error():
    class Old(torch.nn.Module):
        def forward(self, x):
            return x

        def certificate(self):
            return BlockCertificate(1, 0, c=1.0, l0=1.0)

    with pytest.raises(TypeError, match=r"certificate\(\*, seq_len=None, r0=None\)"):
        build_stack([Old()], "fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_stack([(Old(), BlockCertificate(1, 0, c=1.0, l0=1.0))], "fp32")  # an explicit certificate is fine


def test_certify_names_the_non_finite_parameter():
    from certblocks import certify

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    _poison(model[2], where=(1, 2))
    with pytest.raises(NonFiniteWeightError, match=r"^2\.weight has 1 non-finite entry"):
        certify(model, torch.randn(2, 3, 4))


def test_failed_capture_is_one_clean_error(capfd):
    from certblocks import certify
    from certblocks.trace import CaptureError

    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.export refuses it
                return x + torch.tanh(x)
            return x

    with pytest.raises(CaptureError, match="torch.export could not capture Branchy") as err:
        certify(Branchy(), torch.randn(2, 3, 4))
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""  # no pages of torch logs
    assert "\n" not in str(err.value)

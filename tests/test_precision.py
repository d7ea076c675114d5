"""Precision policies (docs/theory.md section 7): ``as_precision``, per-dtype peaks in ``certify_stack``, the policy
everywhere a dtype goes (stack, spine, zoo, monitor, trajectory, enforce, CLI) and the graph captured under autocast."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

import certblocks
from certblocks import MLP, CertificateMonitor, build_stack, enforce
from certblocks.certificate import BlockCertificate, Peak, certify_stack
from certblocks.model import Envelope, EnvelopeWarning, as_certified
from certblocks.precision import POLICIES, Fp8Recipe, Precision, as_precision
from certblocks.trace.capture import capture, held_dtype

# ------------------------------------------------------------------------------------------------ as_precision


@pytest.mark.parametrize("spelling", ["fp16", "FP16 ", "float16", "half", "f16", torch.float16])
def test_every_dtype_spelling_is_the_pure_policy(spelling):
    p = as_precision(spelling)
    assert p.name == "fp16" and p.pure
    assert (p.param_dtype, p.stream_dtype, p.autocast_dtype, p.reduce_dtype) == ("fp16", "fp16", None, "fp16")
    assert p.narrowest == p.grad_dtype == "fp16"


@pytest.mark.parametrize("name", ["bf16", "fp32", "fp64", "fp8_e4m3", "fp8_e5m2"])
def test_pure_dtypes_keep_their_canonical_names(name):
    assert as_precision(name).name == name and as_precision(name).pure


def test_named_policies():
    amp = as_precision("amp-fp16")
    assert (amp.param_dtype, amp.stream_dtype, amp.autocast_dtype, amp.reduce_dtype) == ("fp32", "fp32", "fp16",
                                                                                          "fp32")
    assert amp.loss_scale == 65536.0 and not amp.pure and amp.narrowest == amp.grad_dtype == "fp16"
    bf = as_precision("AMP-BF16")
    assert bf.autocast_dtype == "bf16" and bf.loss_scale is None and bf.stream_dtype == "fp32"
    fsdp = as_precision("fsdp-bf16")
    assert (fsdp.param_dtype, fsdp.stream_dtype, fsdp.autocast_dtype, fsdp.reduce_dtype) == ("bf16", "bf16", None,
                                                                                             "fp32")
    assert not fsdp.pure and fsdp.grad_dtype == "bf16"
    fp8 = as_precision("fp8-e4m3")
    assert fp8.fp8 == Fp8Recipe(("aten.linear",), "fp8_e4m3", "fp8_e5m2", "dynamic")
    assert fp8.autocast_dtype == "bf16" and fp8.narrowest == "bf16"  # fp8 values carry their own scale
    assert set(POLICIES) == {"amp-fp16", "amp-bf16", "fsdp-bf16", "fp8-e4m3"}
    assert "fp8_e4m3" in fp8.describe() and "GradScaler from 65536" in amp.describe()


def test_a_precision_object_is_returned_and_read_back_by_name():
    mine = Precision("my-amp", autocast_dtype=torch.float16, stream_dtype="float32")
    assert as_precision(mine) is mine and mine.autocast_dtype == "fp16"
    assert as_precision("my-amp") is mine  # a certificate's dtype reads back to its policy
    with pytest.raises(ValueError, match="another name"):
        as_precision(Precision("amp-fp16", autocast_dtype="bf16"))
    with pytest.raises(ValueError, match="another name"):
        as_precision(Precision("fp16"))  # fp16's name with fp32 parameters: not the pure fp16 policy


def test_errors_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"'amp-fp17'.*amp-fp16.*fsdp-bf16.*fp8-e4m3") as err:
        as_precision("amp-fp17")
    assert "fp16" in str(err.value) and "Precision" in str(err.value)
    with pytest.raises(TypeError, match="dtype must be"):
        as_precision(16)
    with pytest.raises(ValueError, match="loss_scale"):
        Precision("x", loss_scale=0.0)
    with pytest.raises(ValueError, match="autocast_dtype"):
        Precision("x", autocast_dtype="fp12")
    with pytest.raises(ValueError, match="fp8 format"):
        Fp8Recipe(forward="bf16")
    with pytest.raises(TypeError, match="name"):
        Precision("")


# ------------------------------------------------------------------------------------------------ certify_stack

def _update(b: float, peaks=None, state: str = "", what: str = "", lever: str = "", peak=None) -> BlockCertificate:
    """A bounded update ``||v|| <= b`` whose values are stated per dtype (read under amp-fp16)."""
    kw = {} if peaks is None else dict(peaks=peaks, precision="amp-fp16", state_dtype=state or "fp32")
    return BlockCertificate(0.0, 0.0, c=0.0, b=b, l1=0.0, l0=0.01, name="u",
                            peak=peak or Peak(1.0, 1.0, b, what), **kw)


def test_pure_dtypes_certify_exactly_as_before():
    certs = [MLP(8, 16).certificate() for _ in range(3)]
    by_name = certify_stack(certs, "fp16", r0=3.0)
    for spelling in (torch.float16, "float16", as_precision("fp16")):
        other = certify_stack(certs, spelling, r0=3.0)
        assert (other.dtype, other.max_value, other.radii, other.log_factors, other.ok) == (
            "fp16", 65504.0, by_name.radii, by_name.log_factors, by_name.ok)
    assert by_name.precision == as_precision("fp16") and by_name.max_loss_scale is None and by_name.notes == ()
    assert "precision" not in by_name.to_dict()


def test_fp32_stream_past_65504_is_certified_in_amp_fp16_and_refused_in_fp16():
    small = {"fp16": Peak(0.0, 0.0, 3000.0, "fc2 output"), "fp32": Peak(1.0, 1.0, 3000.0, "the stream")}
    certs = [_update(3000.0, small) for _ in range(2)]
    amp = certify_stack(certs, "amp-fp16", r0=6e4)
    assert amp.ok and amp.radii[-1] > 65504 and amp.dtype == "amp-fp16"
    assert amp.max_value == 65504.0 and amp.state_max_value == torch.finfo(torch.float32).max
    pure = certify_stack(certs, "fp16", r0=6e4)
    assert not pure.ok and pure.first_failure.kind == "forward"
    # the same certificates without per-dtype peaks: their input (which autocast may cast) counts in fp16
    blind = certify_stack([dataclasses.replace(c, peaks=None) for c in certs], "amp-fp16", r0=6e4)
    assert not blind.ok and "fp16" in blind.notes[0] and "narrowest" in blind.notes[0]


def test_each_value_against_its_dtype_names_the_tensor_and_a_lever():
    what, lever = "node linear_1 (aten.linear of module blocks.0.fc2), held in fp16", "keep blocks.0.fc2 in fp32"
    big = {"fp16": Peak(1.0, 2.0, 0.0, what, lever), "fp32": Peak(1.0, 1.0, 0.0)}
    cert = certify_stack([_update(0.0, big)], "amp-fp16", r0=4e4)  # 2 * 4e4 >= 65504
    f = cert.first_failure
    assert not cert.ok and f.kind == "forward" and f.index == 0
    assert "blocks.0.fc2" in f.reason and "fp16's M = 6.55e+04" in f.reason and f.fix == lever
    assert certify_stack([_update(0.0, big)], "amp-fp16", r0=3e4).ok  # 6e4 < 65504
    assert certify_stack([_update(0.0, big)], "amp-bf16", r0=4e4).ok  # read under amp-fp16: bf16 bounds all


def test_the_largest_value_at_the_failing_radius_is_named():
    parts = (((1, 1.0),), "the cast of x", "lever cast"), (((0, 7e4),), "the fc2 output", "lever fc2")
    fp16 = Peak(1.0, 1.0, 7e4, "the cast of x", "lever cast", parts=parts)
    f = certify_stack([_update(0.0, {"fp16": fp16})], "amp-fp16", r0=10.0).first_failure
    assert "the fc2 output" in f.reason and f.fix == "lever fc2"


def test_boundaries_are_decided_exactly():
    # the state reaches fp16's M exactly (an fp16 stream: a custom policy) -> refused; one ulp below -> certified
    stream16 = Precision("fp16-stream", param_dtype="fp16", stream_dtype="fp16", autocast_dtype="fp16")
    at = _update(65504.0 - 60000.0, {"fp16": Peak(0.0, 0.0, 1.0)}, state="fp16")
    at = dataclasses.replace(at, precision="fp16-stream")
    assert not certify_stack([at], stream16, r0=60000.0).ok
    below = dataclasses.replace(at, b=math.nextafter(5504.0, 0.0))
    assert certify_stack([below], stream16, r0=60000.0).ok
    # a peak whose bound is exactly M at the radius
    exact = _update(0.0, {"fp16": Peak(2.0, 1.0, 65504.0 - 65025.0)})  # 255^2 + 479 = 65504
    assert not certify_stack([exact], "amp-fp16", r0=255.0).ok
    assert certify_stack([exact], "amp-fp16", r0=math.nextafter(255.0, 0.0)).ok


def test_stale_per_dtype_peaks_are_not_used():
    c = _update(0.0, {"fp16": Peak(0.0, 0.0, 1.0)})
    assert c.held_peaks("amp-fp16") == {"fp16": Peak(0.0, 0.0, 1.0)} and c.held_peaks("amp-bf16") is None
    scaled = dataclasses.replace(c, peak=Peak(1.0, 10.0, 0.0))  # a gain replaced the peak: the dtypes are unknown
    assert scaled.held_peaks("amp-fp16") is None
    assert dataclasses.replace(c, name="v").held_peaks("amp-fp16") is not None


def test_block_certificate_peaks_are_validated_and_serialized():
    c = BlockCertificate(1.0, 0.0, peak=Peak(1.0, 1.0), peaks={"float16": Peak(1.0, 1.0)}, precision="amp-fp16",
                         state_dtype=torch.float32)
    assert list(c.peaks) == ["fp16"] and c.state_dtype == "fp32"
    d = c.to_dict()
    assert d["peaks"]["fp16"]["c"] == 1.0 and d["precision"] == "amp-fp16"
    assert "peaks" not in BlockCertificate(1.0, 0.0).to_dict()
    hash(c)  # the peaks do not enter the hash
    with pytest.raises(TypeError, match=r"peaks\['fp16'\] must be a Peak"):
        BlockCertificate(1.0, 0.0, peaks={"fp16": 3.0})


def test_explain_and_json_say_which_policy():
    cert = certify_stack([MLP(8, 16).certificate()], "amp-fp16", r0=2.0)
    text = cert.explain()
    assert "amp-fp16 (stream fp32" in text and "precision: amp-fp16: parameters fp32" in text
    assert "loss scale: not computed" in text and " fp16" in text.split("\n")[2 + 1]  # the peak column's dtype
    d = cert.to_dict()
    assert d["precision"]["autocast_dtype"] == "fp16" and d["max_loss_scale"] is None and d["notes"]
    assert cert.in_dtype("bf16").dtype == "bf16" and cert.in_dtype("amp-bf16").dtype == "amp-bf16"


# ------------------------------------------------------------------------------------------------ capture


class _Pre(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


def test_capture_under_autocast_writes_the_casts_into_the_graph():
    m = _Pre().eval()
    x = torch.randn(2, 3, 8)
    g = capture(m, (x,), precision="amp-fp16")
    by_op = {}
    for n in g.nodes:
        if n.op == "call_function":
            by_op.setdefault(str(n.target).split(".")[1], []).append(n)
    casts = by_op["_to_copy"]
    assert casts and all(held_dtype(g, n) == "fp16" for n in casts)
    assert {g.module_path(n) for n in casts} == {"fc1", "fc2"}  # each cast carries the module that reads it
    assert [held_dtype(g, n) for n in by_op["linear"]] == ["fp16", "fp16"]
    assert held_dtype(g, by_op["add"][0]) == "fp32"  # fp32 stream + fp16 branch
    with torch.autocast("cpu", dtype=torch.float16):  # the graph says what eager autocast does on this device
        eager = m.ln(x).dtype
    assert held_dtype(g, by_op["layer_norm"][0]) == as_precision(eager).name
    assert g.precision == as_precision("amp-fp16") and g.dtype_of(g.user_inputs[0]) == "fp32"
    assert capture(m, (x,)).precision is None
    assert not any(str(n.target).startswith("aten._to_copy") for n in capture(m, (x,)).nodes)


def test_capture_under_fsdp_casts_a_copy_of_the_parameters():
    m = _Pre().eval()
    g = capture(m, (torch.randn(2, 3, 8),), precision="fsdp-bf16")
    assert g.root is not m and m.fc1.weight.dtype == torch.float32
    assert g.dtype_of(g.user_inputs[0]) == "bf16"
    assert {held_dtype(g, n) for n in g.nodes if n.op == "call_function" and "linear" in str(n.target)} == {"bf16"}


def test_certify_under_a_policy_reads_each_dtype_from_the_graph():
    rep = certblocks.certify(_Pre().eval(), torch.randn(2, 3, 8), precision="amp-fp16")
    tc = rep if isinstance(rep, certblocks.trace.TraceCertificate) else rep.updates[0]
    cert = tc.certificate
    assert cert.precision == "amp-fp16" and cert.state_dtype == "fp32" and set(cert.peaks) == {"fp16", "fp32"}
    assert "fc" in cert.peaks["fp16"].what and cert.peaks["fp16"].lever.startswith("keep")
    plain = certblocks.certify(_Pre().eval(), torch.randn(2, 3, 8))
    plain = plain if isinstance(plain, certblocks.trace.TraceCertificate) else plain.updates[0]
    assert plain.certificate.peaks is None


# ------------------------------------------------------------------------------------------------ everywhere


def test_build_stack_stack_certificate_and_the_spine_take_a_policy():
    torch.manual_seed(0)
    st = build_stack([MLP(16, 32) for _ in range(3)], "amp-fp16", r0=2.0)
    assert st.dtype == "amp-fp16" and st.certificate().dtype == "amp-fp16" and st.certificate().notes
    assert st.certificate("bf16").dtype == "bf16"
    assert as_certified(st).certificate("amp-bf16").dtype == "amp-bf16"
    mine = Precision("mine-amp", autocast_dtype="fp16")
    assert st.certificate(mine).dtype == "mine-amp" and st.certificate(mine).fixes() == []


def test_a_graph_model_is_captured_under_the_policy():
    cm = as_certified(_Pre().eval(), example_input=torch.randn(2, 3, 8))
    cert = cm.certificate("amp-fp16")
    assert cert.dtype == "amp-fp16" and cert.notes == () and cm.graph_report("amp-fp16").precision == "amp-fp16"
    assert cm.graph_report().precision == ""


def test_envelope_of_a_policy():
    env = Envelope("m", "amp-fp16")
    assert env.dtype == "fp16" and env.used()[0] == "amp-fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.float16):
            env.check(torch.randn(2, 3, 8))  # fp16 autocast is inside an amp-fp16 envelope
    with pytest.warns(EnvelopeWarning, match="fp8_e4m3 is narrower"):
        env.check(torch.randn(2, 3, 8).to(torch.float8_e4m3fn))


def test_zoo_models_take_a_policy():
    from certblocks.zoo import create_model

    torch.manual_seed(0)
    m = create_model("gpt2_qknorm_tiny", certify=False, cert_dtype="amp-fp16")
    assert m.cert_dtype == "amp-fp16" and m.certificate().dtype == "amp-fp16"
    assert m.certificate("fp8-e4m3").dtype == "fp8-e4m3" and m.envelope.used()[0] == "amp-fp16"


def test_monitor_trajectory_and_enforce_take_a_policy():
    torch.manual_seed(0)
    st = build_stack([MLP(16, 32) for _ in range(3)], "fp32", r0=8.0)
    x = torch.randn(2, 6, 16)
    rep = certblocks.trajectory(st, x, "amp-fp16")
    assert rep.dtype == "fp16" and any("autocast('cpu', torch.float16)" in n for n in rep.notes)
    # the fp32 stream is read against fp32's M (log M = 88.7 nats), the fp16 matmul outputs against 65504
    states = [h for h, _, qty, _ in rep.measured_forward_items() if qty == "state"]
    inter = [h for h, _, qty, _ in rep.measured_forward_items() if qty == "intermediate"]
    assert min(states) > 80.0 and max(inter) < math.log(65504.0) + 1e-9
    mon = CertificateMonitor(st, "amp-fp16", every=1, on_data=False)
    rec = mon.step()
    assert mon.dtype == "amp-fp16" and rec["stack/ok"] and rec["stack/log_budget"] == pytest.approx(
        math.log(65504.0) - math.log(st.lip_g))
    er = enforce(build_stack([MLP(16, 32) for _ in range(3)], "fp32", r0=2.0), "amp-fp16")
    assert er.dtype == "amp-fp16" and er.worst_case.ok and er.worst_case.dtype == "amp-fp16"


def test_cli_dtype_lists():
    import argparse

    from certblocks.cli._common import dtype_list, pure_dtype_list
    from certblocks.cli.zoo import DEFAULT_DTYPES

    assert dtype_list("fp16,amp-fp16,float32,fp8-e4m3") == ["fp16", "amp-fp16", "fp32", "fp8-e4m3"]
    assert DEFAULT_DTYPES == ("fp16", "amp-fp16", "bf16", "fp8-e4m3", "fp32")
    with pytest.raises(argparse.ArgumentTypeError, match="amp-fp16"):
        dtype_list("amp-fp17")
    with pytest.raises(argparse.ArgumentTypeError, match="not supported"):
        pure_dtype_list("amp-fp16")


class _TwoOutputs(nn.Module):
    """Two updates and a second output ``aux`` (weights x 1e5) computed from the state between them."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head, self.aux = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3), nn.Linear(d, 3)
        with torch.no_grad():
            self.aux.weight.mul_(1e5)

    def forward(self, x: torch.Tensor):
        x = x + self.fc1(torch.tanh(x))
        y = self.aux(torch.tanh(x))
        x = x + self.fc2(torch.tanh(x))
        return self.head(torch.tanh(x)), y


def test_a_second_output_counts_in_its_dtype_and_another_policy_falls_back():
    torch.manual_seed(0)
    rep = certblocks.certify(_TwoOutputs().eval(), torch.randn(2, 4, 8), precision="amp-fp16")
    amp = rep.stack("amp-fp16", r0=1.0)
    assert not amp.ok and "output" in amp.first_failure.reason and "fp16" in amp.first_failure.reason
    assert rep.stack("bf16", r0=1.0).ok  # the same values in bf16's range
    other = rep.stack("amp-bf16", r0=1.0)  # captured under amp-fp16: the dtypes are not known for amp-bf16
    assert other.ok and other.notes and "captured without the policy" in other.notes[0]

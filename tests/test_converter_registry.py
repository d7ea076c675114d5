"""register_converter: convert() finds its swaps in a registry that a user extends for their own modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from certblocks.blocks.mlp import MLP
from certblocks.conversion import (
    ConversionReport,
    Converter,
    convert,
    converter_for,
    register_converter,
    registered_converters,
    unregister_converter,
)
from certblocks.exponents import Exponents

D, HID = 8, 16


class SquaredReLUMLP(nn.Module):
    """A user's MLP with a squared ReLU (grows like ||x||^2: q = 2), written for this test."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, HID)
        self.fc2 = nn.Linear(HID, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)) ** 2)


class Net(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SquaredReLUMLP() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def to_gelu_mlp(src: SquaredReLUMLP, model: nn.Module) -> MLP:
    """The certified replacement: a GELU MLP (1, 0) with the source's weights."""
    new = MLP(D, HID, "gelu", bias=True)
    new.load_state_dict(src.state_dict(), strict=True)
    return new


@pytest.fixture
def registered():
    conv = register_converter(SquaredReLUMLP, to_gelu_mlp, kind="mlp", exponents_before=(2, 1), name="sqrelu")
    yield conv
    unregister_converter("sqrelu")


def test_a_user_converter_swaps_its_module_and_reports_it(registered):
    assert isinstance(registered, Converter) and registered.before(SquaredReLUMLP()) == Exponents(2, 1)
    torch.manual_seed(0)
    src = Net().eval()
    x = torch.randn(1, 5, D)
    rep = convert(src, example_input=x, dtypes=("fp32",))
    assert isinstance(rep, ConversionReport) and [s.path for s in rep.swaps] == ["blocks.0", "blocks.1"]
    assert all((s.before, s.after, s.exponents_before, s.exponents_after) ==
               ("SquaredReLUMLP", "MLP", Exponents(2, 1), Exponents(1, 0)) for s in rep.swaps)
    assert rep.max_q_before == 2 and rep.max_q_after == 1  # traced before and after
    new = rep.model.blocks[0]
    assert isinstance(new, MLP) and torch.equal(new.fc1.weight, src.blocks[0].fc1.weight)
    assert type(src.blocks[0]) is SquaredReLUMLP  # the source is untouched
    rep.revert()
    assert type(rep.model.blocks[1]) is SquaredReLUMLP


def test_a_replacement_with_the_sources_keys_is_marked_so_the_source_refuses_its_checkpoint(registered):
    torch.manual_seed(1)
    src = Net()
    conv = convert(src).model
    sd = conv.state_dict()
    assert "blocks.0.certblocks_converted" in sd  # same names and shapes as the source, another function
    with pytest.raises(RuntimeError, match="certblocks_converted"):
        Net().load_state_dict(sd, strict=True)
    other = convert(Net()).model
    other.load_state_dict(src.state_dict(), strict=True)  # the source's own checkpoint still loads strictly
    x = torch.randn(2, 3, D)
    torch.testing.assert_close(other(x), conv(x))


def test_match_by_name_or_predicate_and_user_converters_come_first(registered):
    assert converter_for(SquaredReLUMLP()) is registered
    names = [c.name for c in registered_converters()]
    assert names[0] == "sqrelu"
    assert {"hf_gpt2_attention", "timm_attention", "hf_rotary_attention", "gated_mlp", "hf_mamba_mixer", "mamba",
            "hf_patchtst_attention", "gpt_attention"} <= set(names)
    with pytest.raises(ValueError, match="already registered"):
        register_converter("SquaredReLUMLP", to_gelu_mlp, kind="mlp", exponents_before=(2, 1), name="sqrelu")
    by_name = register_converter("SquaredReLUMLP", to_gelu_mlp, kind="mlp", exponents_before=(2, 1),
                                 name="sqrelu", replace=True)
    assert converter_for(SquaredReLUMLP()) is by_name and converter_for(nn.Linear(2, 2)) is None
    pred = register_converter(lambda m: isinstance(m, nn.Linear) and m.in_features == 3, lambda m, model: nn.Identity(),
                              kind="linear", exponents_before=Exponents(1, 0), name="lin3")
    try:
        assert converter_for(nn.Linear(3, 3)) is pred and converter_for(nn.Linear(4, 4)) is None
    finally:
        unregister_converter("lin3")


def test_a_user_converter_overrides_a_builtin_one():
    from certblocks.blocks.attention import Attention, QKNormAttention

    seen = []

    def keep(src: nn.Module, model: nn.Module) -> nn.Module:
        seen.append(src)
        return QKNormAttention.from_module(src, qk_norm_eps=1e-2)

    register_converter(Attention, keep, kind="attention", exponents_before=(1, 2), name="mine")
    try:
        rep = convert(nn.Sequential(Attention(16, 2)))
    finally:
        unregister_converter("mine")
    assert len(seen) == 1 and rep.model[0].q_norm.eps == 1e-2
    assert convert(nn.Sequential(Attention(16, 2))).model[0].q_norm.eps == 1e-6  # the built-in one again


def test_registration_errors():
    with pytest.raises(TypeError, match="build must be callable"):
        register_converter(SquaredReLUMLP, 3, kind="mlp", exponents_before=(2, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kind must be"):
        register_converter(SquaredReLUMLP, to_gelu_mlp, kind="", exponents_before=(2, 1))
    with pytest.raises(TypeError, match="exponents_before"):
        register_converter(SquaredReLUMLP, to_gelu_mlp, kind="mlp", exponents_before="2,1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="match must be"):
        register_converter(int, to_gelu_mlp, kind="mlp", exponents_before=(2, 1))
    with pytest.raises(ValueError, match="already registered"):
        register_converter(SquaredReLUMLP, to_gelu_mlp, kind="mlp", exponents_before=(2, 1), name="gated_mlp")
    with pytest.raises(KeyError, match="no converter named 'nope'"):
        unregister_converter("nope")


def test_a_builder_that_returns_no_module_is_named():
    register_converter(SquaredReLUMLP, lambda m, model: "oops", kind="mlp", exponents_before=(2, 1), name="bad")
    try:
        with pytest.raises(TypeError, match="converter 'bad' returned a str for blocks.0"):
            convert(Net())
    finally:
        unregister_converter("bad")

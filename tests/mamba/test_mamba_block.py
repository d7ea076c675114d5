"""LinearGrowthMamba / Mamba: construction, state_dict compatibility, equivalence, decoding, errors."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from certblocks.blocks.mamba import DEFAULT_EPS, LinearGrowthMamba, Mamba
from certblocks.blocks.mixer import normalize_tokens
from certblocks.exponents import Exponents

D_MODEL, D_STATE, L = 16, 8, 12
KW = dict(d_state=D_STATE, d_conv=4, expand=2)


def _randomize(mod: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter generic values (a freshly built block has D = 1, A = 1..N, ...)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() < 2 else 1.0 / math.sqrt(p.shape[-1])))


def _hf_cpu_path(monkeypatch) -> None:
    """Force HF MambaMixer onto its CPU torch path.

    transformers picks mamba_ssm's CUDA functions at import time when ``import mamba_ssm`` works (here it
    does, through the conftest's stand-in); the torch fallbacks stay reachable as ``__wrapped__``.
    """
    import transformers.models.mamba.modeling_mamba as mm

    for name in ("mamba_selective_scan", "mamba_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"):
        f = getattr(mm, name)
        monkeypatch.setattr(mm, name, getattr(f, "__wrapped__", f))


def _hf_mixer(monkeypatch, d_model=D_MODEL, bias=False, conv_bias=True, seed=0):
    tr = pytest.importorskip("transformers")
    from transformers.models.mamba.modeling_mamba import MambaMixer

    _hf_cpu_path(monkeypatch)

    cfg = tr.MambaConfig(hidden_size=d_model, state_size=D_STATE, conv_kernel=4, expand=2, use_bias=bias,
                         use_conv_bias=conv_bias, num_hidden_layers=1, time_step_rank=3)
    torch.manual_seed(seed)
    m = MambaMixer(cfg, layer_idx=0).eval()
    _randomize(m, seed)
    return m


def _lg_reference(blk: LinearGrowthMamba, x: torch.Tensor) -> torch.Tensor:
    """LinearGrowthMamba written out as a plain per-token loop from its definition (independent twin)."""
    Bsz, Ln, _ = x.shape
    xz = x @ blk.in_proj.weight.T
    if blk.in_proj.bias is not None:
        xz = xz + blk.in_proj.bias
    xi, z = xz[..., : blk.d_inner], xz[..., blk.d_inner:]
    w = blk.conv1d.weight[:, 0, :]  # (d_inner, K)
    K = w.shape[1]
    pad = torch.cat([xi.new_zeros(Bsz, K - 1, blk.d_inner), xi], 1)
    conv = torch.stack([(pad[:, t: t + K, :] * w.T).sum(1) for t in range(Ln)], 1)
    if blk.conv1d.bias is not None:
        conv = conv + blk.conv1d.bias
    u = F.silu(conv)
    p = u / torch.sqrt((u * u).sum(-1, keepdim=True) + blk.eps)  # normalized per token
    dbl = p @ blk.x_proj.weight.T
    dtl, Bm, Cm = dbl.split([blk.dt_rank, blk.d_state, blk.d_state], -1)
    delta = F.softplus(dtl @ blk.dt_proj.weight.T + blk.dt_proj.bias)
    A = -torch.exp(blk.A_log)
    h = x.new_zeros(Bsz, blk.d_inner, blk.d_state)
    ys = []
    for t in range(Ln):
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * Bm[:, t, None, :] * u[:, t, :, None]
        ys.append((h * Cm[:, t, None, :]).sum(-1) + blk.D * u[:, t])
    y = torch.stack(ys, 1) * torch.sigmoid(z)
    out = y @ blk.out_proj.weight.T
    return out if blk.out_proj.bias is None else out + blk.out_proj.bias


# --------------------------------------------------------------------------- construction / state_dict

@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
@pytest.mark.parametrize("opts", [{}, {"bias": True, "conv_bias": False, "dt_init": "constant", "dt_rank": 3}])
def test_same_init_and_state_dict_as_mamba_ssm(cls, opts, mamba_ssm_ref):
    torch.manual_seed(1)
    ref = mamba_ssm_ref.Mamba(D_MODEL, **KW, **opts)
    torch.manual_seed(1)
    blk = cls(D_MODEL, **KW, **opts)
    sd_r, sd_b = ref.state_dict(), blk.state_dict()
    assert list(sd_r) == list(sd_b)
    for k in sd_r:
        assert sd_r[k].dtype == sd_b[k].dtype and sd_r[k].shape == sd_b[k].shape, k
        torch.testing.assert_close(sd_b[k], sd_r[k], rtol=0, atol=0, msg=k)
    assert blk.A_log._no_weight_decay and blk.D._no_weight_decay
    assert (blk.d_inner, blk.dt_rank) == (ref.d_inner, ref.dt_rank)


def test_dtype_and_device_factory_kwargs():
    blk = LinearGrowthMamba(D_MODEL, **KW, dtype=torch.bfloat16)
    assert blk.in_proj.weight.dtype == torch.bfloat16 and blk.dt_proj.bias.dtype == torch.bfloat16
    assert blk.A_log.dtype == torch.float32 and blk.D.dtype == torch.float32  # kept in fp32 like mamba_ssm
    m = LinearGrowthMamba(D_MODEL, **KW, device="meta")
    assert m.in_proj.weight.is_meta


@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
def test_loads_mamba_ssm_state_dict_strict(cls, mamba_ssm_ref):
    ref = mamba_ssm_ref.Mamba(D_MODEL, **KW, bias=True, layer_idx=3)
    _randomize(ref, 2)
    blk = cls(D_MODEL, **KW, bias=True)
    blk.load_state_dict(ref.state_dict(), strict=True)
    conv = cls.from_module(ref)
    assert type(conv) is cls and conv.layer_idx == 3 and conv.backend == "auto"
    for k, v in ref.state_dict().items():
        assert torch.equal(conv.state_dict()[k], v) and torch.equal(blk.state_dict()[k], v)
        assert conv.state_dict()[k].data_ptr() != v.data_ptr()  # copied, not shared
    assert conv.A_log._no_weight_decay and conv.D._no_weight_decay and conv.A_log.requires_grad


@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
@pytest.mark.parametrize("bias", [False, True])
def test_loads_hf_mixer_state_dict_strict(cls, bias, monkeypatch):
    hf = _hf_mixer(monkeypatch, bias=bias, conv_bias=not bias)
    blk = cls(D_MODEL, **KW, dt_rank=3, bias=bias, conv_bias=not bias)
    blk.load_state_dict(hf.state_dict(), strict=True)
    conv = cls.from_module(hf)
    assert conv.dt_rank == 3 and conv.d_inner == 2 * D_MODEL and conv.layer_idx == 0
    assert (conv.in_proj.bias is not None) == bias and (conv.conv1d.bias is None) == bias
    for k, v in hf.state_dict().items():
        assert torch.equal(conv.state_dict()[k], v)


def test_from_module_non_integer_expand_and_between_blocks():
    src = Mamba(10, d_state=4, expand=1.5)
    assert src.d_inner == 15
    lg = LinearGrowthMamba.from_module(src, eps=1e-3)
    assert lg.d_inner == 15 and lg.eps == 1e-3
    back = Mamba.from_module(lg)
    for k, v in src.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


# --------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("bias", [False, True])
def test_free_mamba_reproduces_mamba_ssm(bias, mamba_ssm_ref):
    torch.manual_seed(0)
    ref = mamba_ssm_ref.Mamba(D_MODEL, **KW, bias=bias, use_fast_path=False)
    _randomize(ref, 3)
    blk = Mamba.from_module(ref)
    x = torch.randn(2, L, D_MODEL)
    torch.testing.assert_close(blk(x), ref(x), rtol=1e-4, atol=1e-5)


def test_free_mamba_reproduces_hf_mixer(monkeypatch):
    hf = _hf_mixer(monkeypatch)
    blk = Mamba.from_module(hf)
    x = torch.randn(2, L, D_MODEL)
    with torch.no_grad():
        torch.testing.assert_close(blk(x), hf(x), rtol=1e-4, atol=1e-5)


def test_free_mamba_reproduces_hf_mixer_with_padding_mask(monkeypatch):
    hf = _hf_mixer(monkeypatch)
    blk = Mamba.from_module(hf)
    x = torch.randn(2, L, D_MODEL)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        want = hf(x, attention_mask=mask)
        torch.testing.assert_close(blk(x, attention_mask=mask), want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(blk(x), want, atol=1e-4)
    lg = LinearGrowthMamba.from_module(hf)
    y = lg(x, attention_mask=mask)
    assert torch.isfinite(y).all() and torch.equal(y[0, :4], torch.zeros_like(y[0, :4]))  # no bias: zeros


def test_swapped_into_hf_mamba_model(monkeypatch):
    """Mixers of an HF MambaModel replaced by certblocks blocks: Mamba reproduces it, LinearGrowthMamba runs."""
    tr = pytest.importorskip("transformers")
    _hf_cpu_path(monkeypatch)
    cfg = tr.MambaConfig(vocab_size=50, hidden_size=D_MODEL, state_size=D_STATE, num_hidden_layers=2,
                         use_cache=False)
    torch.manual_seed(0)
    model = tr.MambaModel(cfg).eval()
    ids = torch.randint(0, 50, (2, L))
    with torch.no_grad():
        want = model(ids).last_hidden_state
        for layer in model.layers:
            layer.mixer = Mamba.from_module(layer.mixer)
        torch.testing.assert_close(model(ids).last_hidden_state, want, rtol=1e-4, atol=1e-4)
        for layer in model.layers:
            layer.mixer = LinearGrowthMamba.from_module(layer.mixer)
        assert torch.isfinite(model(ids, attention_mask=torch.ones_like(ids)).last_hidden_state).all()


@pytest.mark.parametrize("bias", [False, True])
def test_linear_growth_matches_its_definition(bias):
    torch.manual_seed(0)
    blk = LinearGrowthMamba(D_MODEL, **KW, bias=bias)
    _randomize(blk, 4)
    x = torch.randn(2, L, D_MODEL)
    x[0, 3] = 0.0
    torch.testing.assert_close(blk(x), _lg_reference(blk, x), rtol=1e-4, atol=1e-5)
    # The two changes matter: on the same weights the free block gives something else.
    assert not torch.allclose(blk(x), Mamba.from_module(blk)(x), atol=1e-3)


def test_gradients_flow_to_all_parameters():
    blk = LinearGrowthMamba(D_MODEL, **KW, bias=True)
    x = torch.randn(2, L, D_MODEL, requires_grad=True)
    blk(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in blk.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


# --------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
@pytest.mark.parametrize("prefill", [2, 5])
def test_prefill_then_steps_equal_full_forward(cls, prefill):
    torch.manual_seed(0)
    blk = cls(D_MODEL, **KW, layer_idx=0, bias=True)
    _randomize(blk, 5)
    x = torch.randn(2, 9, D_MODEL)
    full = blk(x)
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    outs = [blk(x[:, :prefill], inference_params=params)]
    for t in range(prefill, x.shape[1]):
        params.seqlen_offset = t
        outs.append(blk(x[:, t: t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-5)
    # and with explicit states from allocate_inference_cache, token by token from the start
    conv_state, ssm_state = blk.allocate_inference_cache(2, 9)
    assert conv_state.shape == (2, blk.d_inner, 4) and ssm_state.shape == (2, blk.d_inner, D_STATE)
    steps = [blk.step(x[:, t: t + 1], conv_state, ssm_state)[0] for t in range(x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_step_matches_mamba_ssm_step(mamba_ssm_ref):
    torch.manual_seed(0)
    ref = mamba_ssm_ref.Mamba(D_MODEL, **KW, use_fast_path=False)
    _randomize(ref, 6)
    blk = Mamba.from_module(ref)
    cs1, ss1 = ref.allocate_inference_cache(2, 4)
    cs2, ss2 = blk.allocate_inference_cache(2, 4)
    for _ in range(4):
        x = torch.randn(2, 1, D_MODEL)
        torch.testing.assert_close(blk.step(x, cs2, ss2)[0], ref.step(x, cs1, ss1)[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ss2, ss1, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- eps safety, dtypes

def test_all_zero_tokens_are_finite_with_finite_gradients():
    p = normalize_tokens(torch.zeros(2, 5, 3, requires_grad=True), dim=1, eps=DEFAULT_EPS)
    assert torch.equal(p, torch.zeros(2, 5, 3))
    blk = LinearGrowthMamba(D_MODEL, **KW, conv_bias=False)  # bias-free: a zero input gives zero conv tokens
    x = torch.zeros(2, L, D_MODEL, requires_grad=True)
    y = blk(x)
    assert torch.isfinite(y).all() and torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(q.grad).all() for q in blk.parameters() if q.grad is not None)


def test_normalization_is_overflow_safe_in_fp16():
    x = torch.full((1, 64, 2), 60000.0, dtype=torch.float16)  # sum of squares overflows fp16
    p = normalize_tokens(x, dim=1, eps=DEFAULT_EPS)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.float().norm(dim=1), torch.ones(1, 2), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cls", [LinearGrowthMamba, Mamba])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_forward(cls, dtype):
    torch.manual_seed(0)
    blk = cls(D_MODEL, **KW)
    x = torch.randn(2, L, D_MODEL)
    want = blk(x)
    half = cls.from_module(blk).to(dtype)
    got = half(x.to(dtype))
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"d_model": 0}, ValueError, "d_model"),
        ({"d_model": 4.0}, TypeError, "d_model"),
        ({"d_model": 8, "d_state": -1}, ValueError, "d_state"),
        ({"d_model": 8, "d_conv": True}, TypeError, "d_conv"),
        ({"d_model": 8, "expand": 0}, ValueError, "expand"),
        ({"d_model": 8, "expand": 0.01}, ValueError, "expand"),
        ({"d_model": 8, "dt_rank": "full"}, ValueError, "dt_rank"),
        ({"d_model": 8, "dt_rank": 0}, ValueError, "dt_rank"),
        ({"d_model": 8, "dt_min": 0.5, "dt_max": 0.1}, ValueError, "dt_min"),
        ({"d_model": 8, "dt_init": "xavier"}, ValueError, "dt_init"),
        ({"d_model": 8, "conv_bias": 1}, TypeError, "conv_bias"),
        ({"d_model": 8, "eps": 0.0}, ValueError, "eps"),
        ({"d_model": 8, "eps": float("nan")}, ValueError, "eps"),
        ({"d_model": 8, "layer_idx": -1}, ValueError, "layer_idx"),
        ({"d_model": 8, "dtype": torch.int32}, TypeError, "dtype"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        LinearGrowthMamba(**kwargs)


def test_bad_call_arguments(monkeypatch):
    blk = LinearGrowthMamba(D_MODEL, **KW)
    with pytest.raises(ValueError, match="d_model=16"):
        blk(torch.randn(2, L, D_MODEL + 1))
    with pytest.raises(ValueError, match="hidden_states"):
        blk(torch.randn(L, D_MODEL))
    with pytest.raises(TypeError, match="hidden_states"):
        blk([[0.0]])
    with pytest.raises(TypeError, match="hidden_states has dtype torch.int64; allowed"):
        blk(torch.ones(2, L, D_MODEL, dtype=torch.long))
    cs, ss = blk.allocate_inference_cache(2, 4)
    with pytest.raises(ValueError, match="one token"):
        blk.step(torch.randn(2, 2, D_MODEL), cs, ss)
    with pytest.raises(ValueError, match="ssm_state"):
        blk.step(torch.randn(2, 1, D_MODEL), cs, ss[:1])
    with pytest.raises(ValueError, match="layer_idx"):
        blk(torch.randn(2, L, D_MODEL), inference_params=types.SimpleNamespace(key_value_memory_dict={},
                                                                                  seqlen_offset=0))
    with pytest.raises(ValueError, match="use_cache=False"):
        blk(torch.randn(2, L, D_MODEL), cache=object())
    with pytest.raises(ValueError, match="attention_mask"):
        blk(torch.randn(2, L, D_MODEL), attention_mask=torch.ones(2, L + 1))
    with pytest.raises(TypeError, match="src"):
        LinearGrowthMamba.from_module(torch.randn(3))
    with pytest.raises(ValueError, match="not a Mamba mixer"):
        LinearGrowthMamba.from_module(torch.nn.Linear(3, 3))
    hf = _hf_mixer(monkeypatch)
    hf.activation = "gelu"
    with pytest.raises(ValueError, match="gelu"):
        LinearGrowthMamba.from_module(hf)


def test_class_exponents():
    assert LinearGrowthMamba.exponents == Exponents(1, 1)
    assert Mamba.exponents == Exponents(5, 5)

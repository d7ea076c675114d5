"""timm conformance of the certified ViTs: timm's own model tests, feature backbones, torch.fx, TorchScript.

The first two tests run timm's ``tests/test_models.py`` (a copy in ``../shared/peer-tests/timm``, never in this
repository) in a subprocess on the ``certblocks_vit_*`` models: every test timm's own ViTs pass.  timm picks the
tests of a model by its name and module: ``vit_*`` models skip ``test_model_default_cfgs`` (it checks an NCHW
feature map, which a ViT's ``forward_features`` tokens are not; timm's ``vit_tiny_patch16_224`` fails it the same
way) and run ``test_model_default_cfgs_non_std`` instead, and ``vision_transformer`` models run the
``forward_intermediates`` tests.  ``certblocks_vit_*`` match neither pattern, so the first test deselects the NCHW
one and the second calls timm's three ViT tests on them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

timm = pytest.importorskip("timm")
from certblocks.zoo import create_model  # noqa: E402  (registers certblocks_vit_* with timm)

from certblocks.blocks.attention import QKNormAttention, attention_mask  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT.parent / "shared" / "peer-tests" / "timm" / "test_models.py"
needs_peer = pytest.mark.skipif(not PEER.is_file(), reason="timm's model tests not in ../shared/peer-tests/timm")

#: the sizes run here: ViT-Ti only of each family (QK-norm, DyT), to keep `make test` short.  ViT-S and ViT-B are the
#: same classes and code paths at other widths; the README's command runs all of them (they pass the same tests).
MODELS = ("certblocks_vit_tiny_patch16_224", "certblocks_vit_dyt_tiny_patch16_224")
#: what timm's test_models.py selects for a certblocks_vit_* model, less test_model_default_cfgs (NCHW only)
PEER_TESTS = ("test_model_forward", "test_model_backward", "test_model_forward_torchscript",
              "test_model_forward_features", "test_model_forward_fx", "test_model_backward_fx",
              "test_model_forward_fx_torchscript")
#: the tests timm runs on its vision_transformer models by name or module, called on ours
VIT_TESTS = ("test_model_default_cfgs_non_std", "test_model_forward_intermediates",
             "test_model_forward_intermediates_features")

_VIT_TESTS_SCRIPT = """
import importlib.util, sys
import timm
import certblocks.zoo  # noqa: F401  registers certblocks_vit_* with timm
spec = importlib.util.spec_from_file_location("timm_test_models", sys.argv[1])
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)
for name in sys.argv[3:]:
    for test in sys.argv[2].split(","):
        arg = timm.list_models(name, include_tags=True)[0] if test.endswith("_non_std") else name
        getattr(peer, test)(arg, 1)
        print("PASSED", test, name, flush=True)
"""


def _run(args: list) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # write nothing into ../shared
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@needs_peer
def test_timm_model_tests_pass():
    select = " or ".join(MODELS)
    proc = _run(["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(PEER),
                 "-k", f"({select}) and not test_model_default_cfgs"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    passed = set(re.findall(r"^PASSED \S+::(\w+)\[\d+-([\w.]+)\]", proc.stdout, re.M))
    assert passed == {(t, m) for t in PEER_TESTS for m in MODELS}, out[-6000:]
    assert re.search(rf"\b{len(PEER_TESTS) * len(MODELS)} passed\b", proc.stdout), out[-3000:]
    assert not re.search(r"\b(failed|skipped|error|errors)\b", proc.stdout.splitlines()[-1]), out[-3000:]


@needs_peer
def test_timm_vit_tests_pass():
    proc = _run(["-c", _VIT_TESTS_SCRIPT, str(PEER), ",".join(VIT_TESTS), *MODELS])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    passed = set(re.findall(r"^PASSED (\w+) (\S+)$", proc.stdout, re.M))
    assert passed == {(t, m) for t in VIT_TESTS for m in MODELS}


def test_the_certified_vits_are_the_zoo_models_registered_with_timm():
    """The conformance runs above select ``certblocks_vit``: every model the zoo registers with timm matches it."""
    ours = [n for n in timm.list_models() if timm.models.model_entrypoint(n).__module__.startswith("certblocks.")]
    assert sorted(ours) == ["certblocks_vit_base_patch16_224", "certblocks_vit_dyt_base_patch16_224",
                            "certblocks_vit_dyt_small_patch16_224", "certblocks_vit_dyt_tiny_patch16_224",
                            "certblocks_vit_small_patch16_224", "certblocks_vit_tiny_patch16_224"]


# -- the certified ViT as a feature backbone (small sizes, in process) ----------------------------------------------
def _vit(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("certblocks_vit_test", depth=4, **kw).eval()


def _image(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_forward_intermediates_has_timm_semantics():
    m, x = _vit(), _image()
    with torch.no_grad():
        final, inter = m.forward_intermediates(x, indices=[1, 3])  # NCHW by default: (B, C, H / 8, W / 8)
        assert [t.shape for t in inter] == [(2, 32, 4, 4)] * 2
        assert torch.equal(final, m.forward_features(x))
        nlc = m.forward_intermediates(x, indices=[1, 3], output_fmt="NLC", intermediates_only=True)
        assert [t.shape for t in nlc] == [(2, 16, 32)] * 2
        for a, b in zip(inter, nlc):
            assert torch.equal(a, b.transpose(1, 2).reshape(2, 32, 4, 4))
        # an int takes the last n blocks; prefix tokens (the class token) on request; norm applies the final norm
        last2 = m.forward_intermediates(x, indices=2, output_fmt="NLC", intermediates_only=True)
        blocks23 = m.forward_intermediates(x, indices=[2, 3], output_fmt="NLC", intermediates_only=True)
        assert len(last2) == 2 and all(torch.equal(a, b) for a, b in zip(last2, blocks23))
        assert torch.equal(last2[1], nlc[1])
        with_prefix = m.forward_intermediates(x, indices=[3], output_fmt="NLC", return_prefix_tokens=True,
                                              intermediates_only=True)
        (spatial, prefix), = with_prefix
        assert prefix.shape == (2, 1, 32) and torch.equal(spatial, nlc[1])
        normed = m.forward_intermediates(x, indices=[3], norm=True, stop_early=True, output_fmt="NLC",
                                         intermediates_only=True)
        assert torch.allclose(normed[0], m.norm(nlc[1]), atol=1e-6)
    assert [f["module"] for f in m.feature_info] == [f"blocks.{i}" for i in range(4)]
    assert {f["num_chs"] for f in m.feature_info} == {32} and {f["reduction"] for f in m.feature_info} == {8}


def test_features_only_backbone_builds_a_feature_pyramid():
    torchvision_ops = pytest.importorskip("torchvision.ops")
    full, x = _vit(), _image()
    feats = _vit(features_only=True, out_indices=(1, 2, 3))
    missing, unexpected = feats.model.load_state_dict(full.state_dict(), strict=False)
    assert not missing and set(unexpected) == {"norm.weight", "norm.bias", "head.weight", "head.bias"}  # pruned
    assert feats.feature_info.channels() == [32, 32, 32] and feats.feature_info.reduction() == [8, 8, 8]
    with torch.no_grad():
        levels = feats(x)
        want = full.forward_intermediates(x, indices=[1, 2, 3], intermediates_only=True)
    assert len(levels) == 3 and all(torch.equal(a, b) for a, b in zip(levels, want))
    # a ViTDet-style simple pyramid: strides 4, 8, 16 from the three levels, then torchvision's FPN
    ups = torch.nn.ModuleList([torch.nn.ConvTranspose2d(32, 32, 2, stride=2), torch.nn.Identity(),
                               torch.nn.MaxPool2d(2)])
    fpn = torchvision_ops.FeaturePyramidNetwork([32, 32, 32], 16)
    out = fpn({f"p{i}": up(f) for i, (up, f) in enumerate(zip(ups, feats(x)))})
    assert [tuple(o.shape) for o in out.values()] == [(2, 16, 8, 8), (2, 16, 4, 4), (2, 16, 2, 2)]
    sum(o.square().mean() for o in out.values()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in feats.parameters())


def test_fx_feature_extraction_matches_eager():
    fx = pytest.importorskip("torchvision.models.feature_extraction")
    m, x = _vit(), _image()
    graph = fx.create_feature_extractor(m, return_nodes={"blocks.1": "b1", "blocks.3": "b3", "head": "logits"})
    with torch.no_grad():
        got = graph(x)
        want = m.forward_intermediates(x, indices=[1, 3], output_fmt="NLC", intermediates_only=True,
                                       return_prefix_tokens=True)
        assert torch.equal(got["logits"], m(x))  # the fused QK-norm is a leaf call: the same kernels as eager
    for name, (spatial, prefix) in zip(("b1", "b3"), want):
        assert torch.equal(got[name], torch.cat([prefix, spatial], 1))
    assert "split_qkv_rms_norm" in graph.code and "attention_mask" in graph.code


def test_torchscript_matches_eager():
    with timm.layers.set_scriptable(True):
        m = _vit()
    assert not m.blocks[0].attn.fused_qk_norm
    scripted, x = torch.jit.script(m), _image()
    with torch.no_grad():
        assert torch.allclose(scripted(x), m(x), atol=1e-6)
        mask = torch.rand(17, 17, generator=torch.Generator().manual_seed(2)) > 0.3
        tokens = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(3))
        assert torch.allclose(scripted.blocks[0](tokens, attn_mask=mask), m.blocks[0](tokens, attn_mask=mask),
                              atol=1e-6)
    eager = _vit()  # the fused path (eager default) and the plain one agree to rounding
    with torch.no_grad():
        assert torch.allclose(eager(x), m(x), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_scripted_attention_mask_equals_eager(dtype):
    scripted = torch.jit.script(attention_mask)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 4, generator=g).to(dtype)
    bool_mask, pad = torch.rand(5, 5, generator=g) > 0.5, torch.rand(2, 5, generator=g) > 0.7
    float_mask = torch.randn(2, 1, 5, 5, generator=g).to(dtype)
    for causal in (False, True):
        for am, kp in ((None, None), (bool_mask, None), (float_mask, pad), (None, pad)):
            a, b = attention_mask(x, causal, am, kp, dtype), scripted(x, causal, am, kp, dtype)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert attention_mask(x, True, None, None, dtype).min() == torch.finfo(dtype).min / 2


def test_traced_attention_keeps_causality_and_masks():
    """torch.fx makes every argument a graph input: a causal block traced with a mask input still masks causally
    when the graph runs without one, and a mask given to the graph is applied as in eager mode."""
    torch.manual_seed(0)
    attn = QKNormAttention(16, 2).eval()  # causal, GPT-2 naming
    graph = torch.fx.symbolic_trace(attn)
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True
    with torch.no_grad():
        # the graph's mask input is a proxy when traced: the leaf call adds the causal mask to the mask it builds
        assert torch.allclose(graph(x), attn(x), atol=1e-6)
        assert torch.equal(graph(x, None, pad), attn(x, key_padding_mask=pad))
        with pytest.raises(ValueError, match="key_padding_mask must have shape"):
            graph(x, None, pad[:, :3])  # the masks' checks run inside the leaf call


def test_eager_checks_are_kept():
    m = _vit()
    blk = m.blocks[0]
    with pytest.raises(ValueError, match="bidirectional"):
        blk(torch.zeros(1, 17, 32), is_causal=True)
    with pytest.raises(ValueError, match="last dimension 32"):
        blk(torch.zeros(1, 17, 16))
    with pytest.raises(ValueError, match="attn_mask must broadcast"):
        blk(torch.zeros(1, 17, 32), attn_mask=torch.ones(3, 3, dtype=torch.bool))

"""certblocks.checkpoint: a Hugging Face checkpoint certified layer by layer gives the loaded model's certificate.

Small random Llama and GPT-2 causal LMs are written with ``save_pretrained`` (one file, and sharded with a small
``max_shard_size``); :func:`certify_checkpoint` on the directory must return exactly what
:func:`certblocks.certify` returns on ``from_pretrained`` of it: every segment (names, coefficients, culprits, the
per-node tables), the notes, and ``.stack`` in fp16 (the loss scale read from the graph's backward), bf16 and fp32.
"""

from __future__ import annotations

import json
import os
from typing import Any, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from certblocks import checkpoint as ckpt  # noqa: E402
from certblocks import cli  # noqa: E402
from certblocks._validation import NonFiniteWeightError, all_finite  # noqa: E402
from certblocks.checkpoint import KEEP_GROUPS, CheckpointStats, certify_checkpoint, is_checkpoint  # noqa: E402
from certblocks.trace import certify  # noqa: E402

DTYPES = ("fp16", "bf16", "fp32")


def _llama(tied: bool = False) -> Any:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def _gpt2() -> Any:
    return transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)


def _write(tmp_path: Any, cfg: Any, shard: str = "", seed: int = 0) -> Tuple[str, Any]:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    directory = str(tmp_path / f"ckpt{shard or '_one'}")
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return directory, model


def _ids(vocab: int = 64, seq_len: int = 8) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))


def _loaded(directory: str) -> Any:
    return certify(transformers.AutoModelForCausalLM.from_pretrained(directory).eval(), _ids())


def _assert_same(rep: Any, ref: Any) -> None:
    assert rep.chained and ref.chained
    assert [s.name for s in rep.all_segments()] == [s.name for s in ref.all_segments()]
    for a, b in zip(rep.all_segments(), ref.all_segments()):
        assert a.certificate == b.certificate, a.name  # every coefficient, exactly
        assert a.to_dict() == b.to_dict(), a.name  # culprit, fix, per-node table
    assert [str(n) for n in rep.notes] == [str(n) for n in ref.notes]
    assert rep.to_dict() == ref.to_dict()
    for dtype in DTYPES:
        s1, s2 = rep.stack(dtype), ref.stack(dtype)
        assert s1 == s2, dtype
        assert s1.max_loss_scale == s2.max_loss_scale, dtype


@pytest.mark.parametrize("make, shard", [(_llama, ""), (_llama, "20KB"), (lambda: _llama(tied=True), "20KB"),
                                         (_gpt2, ""), (_gpt2, "20KB")],
                         ids=["llama", "llama-sharded", "llama-tied-sharded", "gpt2", "gpt2-sharded"])
def test_checkpoint_certificate_is_the_loaded_models(tmp_path, make, shard):
    directory, _ = _write(tmp_path, make(), shard)
    if shard:
        assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
        with open(os.path.join(directory, "model.safetensors.index.json")) as fh:
            assert len(set(json.load(fh)["weight_map"].values())) > 3  # really sharded
    stats = CheckpointStats()
    rep = certify_checkpoint(directory, stats=stats)
    _assert_same(rep, _loaded(directory))


def test_layer_by_layer_holds_at_most_two_groups(tmp_path):
    directory, model = _write(tmp_path, _llama(), "20KB")
    stats = CheckpointStats()
    certify_checkpoint(directory, stats=stats)
    sizes: dict = {}
    for name, p in model.named_parameters():
        grp = name.split(".mlp")[0].split(".self_attn")[0].split(".input_")[0].split(".post_")[0]
        sizes[grp] = sizes.get(grp, 0) + p.numel() * p.element_size()
    total = sum(sizes.values())
    largest = sum(sorted(sizes.values())[-KEEP_GROUPS:])
    assert {n for n, _ in model.named_parameters()} <= stats.read  # every weight was read
    assert 0 < stats.peak_bytes <= largest < total  # never more than two groups at once
    assert stats.bytes_read >= total


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_layer_is_never_held_with_another_matrix_group(tmp_path, monkeypatch, tied):
    """The cache drops its least recently used group before it reads a new one and is emptied after each segment:
    a layer's matrices are never held with another layer's, nor with the token table or the output projection."""
    directory, model = _write(tmp_path, _llama(tied), "20KB")
    held = []
    get = ckpt._Weights.get

    def spy(self: Any, name: str) -> torch.Tensor:
        t = get(self, name)
        held.append(sorted(grp for grp, ts in self._cache.items() if any(v.dim() >= 2 for v in ts.values())))
        return t

    monkeypatch.setattr(ckpt._Weights, "get", spy)
    stats = CheckpointStats()
    rep = certify_checkpoint(directory, stats=stats)
    monkeypatch.undo()
    _assert_same(rep, _loaded(directory))
    assert len(held) > len(list(model.parameters()))  # the run and the segments read through the cache
    seen = {g[0] for g in held if g}
    assert {"model.layers.0", "model.layers.2"} <= seen and {"model.embed_tokens.weight", "lm_head.weight"} & seen
    assert max(len(g) for g in held) == 1, [g for g in held if len(g) > 1][:3]
    table = model.config.vocab_size * model.config.hidden_size * 4
    layer = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("model.layers.0."))
    assert stats.peak_bytes < max(table, layer) + 4096  # the largest group and a norm's vector or a buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64])
def test_the_finiteness_check_finds_every_nan_and_inf(dtype):
    gen = torch.Generator().manual_seed(0)
    assert all_finite(torch.empty(0, 3, dtype=dtype))
    for n in (1, 2, 7, 33, 257, 4099, 70001):
        t = torch.randn(n, generator=gen).to(dtype) * 100
        assert all_finite(t) and all_finite(t.reshape(1, n).expand(3, n).t())
        for pos in {0, n // 3, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                u = t.clone()
                u[pos] = bad if not dtype.is_complex else complex(1.0, bad)
                assert not all_finite(u), (n, pos, bad)
                assert not all_finite(u.reshape(1, n).expand(2, n).t())  # not contiguous
    big = torch.full((8,), torch.finfo(dtype).max if not dtype.is_complex else 3e38, dtype=dtype)
    assert all_finite(big)  # a sum would overflow; the extremes do not


def test_a_trained_looking_checkpoint_refused_in_fp16_is_refused_the_same(tmp_path):
    """Weights scaled up: the fp16 verdict flips; the checkpoint path says the same as the loaded model."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(_llama()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(40.0)
    directory = str(tmp_path / "big")
    model.save_pretrained(directory, max_shard_size="30KB")
    rep, ref = certify_checkpoint(directory), _loaded(directory)
    _assert_same(rep, ref)
    assert not rep.stack("fp16").ok


def test_weights_dtype_and_example_input(tmp_path):
    directory, _ = _write(tmp_path, _gpt2(), "20KB")
    ids = _ids(seq_len=5)
    rep = certify_checkpoint(directory, example_input=ids, weights_dtype=torch.float64)
    ref = certify(transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval(), ids)
    _assert_same(rep, ref)


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="path must be a Hugging Face checkpoint directory"):
        certify_checkpoint(tmp_path)
    assert not is_checkpoint(tmp_path)
    directory, _ = _write(tmp_path, _llama())
    assert is_checkpoint(directory)
    with pytest.raises(TypeError, match="weights_dtype must be a floating torch.dtype"):
        certify_checkpoint(directory, weights_dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_len"):
        certify_checkpoint(directory, seq_len=0)
    with pytest.raises(TypeError, match="distributed must be True, False or None"):
        certify_checkpoint(directory, distributed="yes")
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        certify_checkpoint(directory, distributed=True)


def test_a_nan_weight_is_named(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_llama()).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    directory = str(tmp_path / "nan")
    model.save_pretrained(directory)
    with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has 1 non-finite entry"):
        certify_checkpoint(directory)


# ------------------------------------------------------------------------------------------------ the CLI
def test_cli_certifies_a_checkpoint_directory(tmp_path, capsys):
    directory, _ = _write(tmp_path, _llama(), "20KB")
    ref = _loaded(directory)
    for dtype in ("bf16", "fp16"):
        code = cli.main(["certify", directory, "--dtype", dtype, "--json", "--quiet"])
        doc = json.loads(capsys.readouterr().out)
        st = ref.stack(dtype)
        assert code == (0 if st.ok else 1)
        assert doc["read_from"] == "checkpoint"
        assert doc["stack"]["ok"] == st.ok
        assert [u["name"] for u in doc["certificates"]["updates"]] == [u.name for u in ref.updates]
    assert cli.main(["certify", directory, "--quiet"]) == (0 if ref.stack("bf16").ok else 1)
    out = capsys.readouterr().out
    assert "model.layers.2.mlp" in out and ref.stack("bf16").explain() in out


def test_cli_checkpoint_usage_errors(tmp_path, capsys):
    assert cli.main(["certify", str(tmp_path), "--quiet"]) == 2
    assert "not a Hugging Face checkpoint" in capsys.readouterr().err
    directory, _ = _write(tmp_path, _llama())
    assert cli.main(["certify", directory, "--dtype", "amp-fp16", "--quiet"]) == 2
    assert "pure dtype" in capsys.readouterr().err
    assert cli.main(["certify", directory, "--residual", "none", "--quiet"]) == 2
    assert "--residual" in capsys.readouterr().err

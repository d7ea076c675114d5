"""benchmarks/throughput.py: every row runs (tiny sizes), reports positive finite tokens/s, and bad arguments fail."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from throughput import ROW_NAMES, NanoGPT, Progress, main


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    yield ["--threads", "1"]
    torch.set_num_threads(n)


def _check_ok_row(r: dict, repeats: int) -> None:
    assert r["status"] == "ok", r
    assert r["tokens"] > 0 and r["certified"] and r["peer"] and r["shape"]
    for mode in ("fwd", "fwd+bwd"):
        m = r[mode]
        for side in ("cert", "peer"):
            rate = m[f"{side}_tokens_per_s"]
            assert math.isfinite(rate) and rate > 0, (r["name"], mode, side, rate)
            assert len(m[f"{side}_{r['clock']}_s"]) == repeats
            assert rate == pytest.approx(r["tokens"] / m[f"{side}_median_s"])
        assert m["ratio_cert_over_peer"] == pytest.approx(m["cert_median_s"] / m["peer_median_s"])


@pytest.mark.slow
def test_smoke_every_row(tmp_path, capsys, one_thread):
    out = tmp_path / "tp.json"
    res = main(["--smoke", "--no-progress", "--out", str(out), *one_thread])
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ROW_NAMES
    expected = {"block/attention", "block/attention_causal", "block/gated_mlp", "block/mamba_lg_vs_hf",
                "block/mamba_lg_vs_free", "block/mamba_lg_vs_mamba_ssm", "block/patchtst_vs_preln",
                "block/patchtst_vs_hf", "model/gpt2", "model/mamba_forecaster_vs_preln",
                "model/mamba_forecaster_vs_free", "model/patchtst_vs_preln", "model/vit", "model/toto_vs_rmsnorm"}
    assert set(rows) == expected
    for name, r in rows.items():
        if name == "block/mamba_lg_vs_mamba_ssm" and not torch.cuda.is_available():
            assert r["status"] == "skipped" and "CUDA" in r["reason"]  # reported, not silently dropped
            continue
        _check_ok_row(r, repeats=1)
    assert rows["model/gpt2"]["certified"] == "gpt2_qknorm_test"
    assert rows["model/patchtst_vs_preln"]["peer"] == "patchtst_preln_test"
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(res["rows"]))
    meta = res["meta"]
    assert meta["profile"] == "smoke" and meta["device"] == "cpu" and meta["threads"] == 1
    assert meta["clock"] == "cpu" and all(r["clock"] == "cpu" for r in res["rows"])  # auto: one CPU thread
    assert all(len(r[m]["cert_wall_s"]) == 1 for r in res["rows"] if r["status"] == "ok" for m in ("fwd", "fwd+bwd"))
    assert "--smoke" in meta["command"] and meta["versions"]["torch"] == torch.__version__
    table = capsys.readouterr().out
    for name in expected:
        assert f"| {name} |" in table


def test_only_capped_repeats_and_wall_clock(tmp_path, one_thread):
    res = main(["--smoke", "--no-progress", "--repeats", "2", "--warmup", "1", "--clock", "wall", "--only",
                "block/gated*,mamba_lg_vs_hf", "--out", str(tmp_path / "x.json"), *one_thread])
    assert res["meta"]["clock"] == "wall"
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ["block/gated_mlp", "block/mamba_lg_vs_hf"]
    _check_ok_row(rows["block/gated_mlp"], repeats=2)
    _check_ok_row(rows["block/mamba_lg_vs_hf"], repeats=1)  # the slow HF path is capped in --smoke
    assert "capped" in rows["block/mamba_lg_vs_hf"]["note"]
    g = rows["block/gated_mlp"]["fwd"]
    assert g["cert_median_s"] == pytest.approx(sorted(g["cert_wall_s"])[0] / 2 + sorted(g["cert_wall_s"])[1] / 2)
    assert g["ratio_cpu"] > 0 and len(g["cert_cpu_s"]) == 2  # the other clock is kept in the JSON


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--threads", "two"], "--threads must be an integer"),
    (["--only", "no_such_row"], "matches no row"),
    (["--quick", "--smoke"], "not allowed with argument"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--clock", "cycles"], "invalid choice"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_without_cuda(capsys):
    with pytest.raises(SystemExit):
        main(["--gpu", "--smoke"])
    assert "no CUDA device" in capsys.readouterr().err


def test_nanogpt_peer_is_causal_with_tied_head():
    torch.manual_seed(0)
    m = NanoGPT(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11).eval()
    assert m.wte.weight is m.lm_head.weight
    idx = torch.randint(0, 11, (2, 8))
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 8, 11) and torch.isfinite(loss)
    idx2 = idx.clone()
    idx2[:, 5:] = (idx2[:, 5:] + 1) % 11
    logits2, _ = m(idx2)
    assert torch.allclose(logits[:, :5], logits2[:, :5], atol=1e-6)  # no look-ahead
    assert not torch.allclose(logits[:, 5:], logits2[:, 5:])


def test_progress_line_counts_and_eta():
    s = io.StringIO()
    p = Progress(4, stream=s)
    p.advance(2, "block/x fwd")
    p.advance(2, "block/x fwd+bwd")
    lines = s.getvalue().splitlines()
    assert lines[0].startswith("[2/4] block/x fwd") and "ETA" in lines[0]
    assert lines[-1].startswith("[4/4] block/x fwd+bwd")

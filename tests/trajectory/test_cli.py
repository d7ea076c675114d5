"""``certblocks trajectory MODEL``: the report, JSON, the plot, exit codes and one-line errors for a bad ``--batch``."""

from __future__ import annotations

import json

import torch

from certblocks import cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_zoo_example_input(capsys) -> None:
    code, out, err = run(capsys, "trajectory", "gpt2_qknorm_test", "--seq-len", "6", "--no-certified")
    assert code == 0, err
    assert "on-data certificate of GPT2QKNorm on a batch of 1 x 6 tokens, fp16" in out
    for name in ("transformer.h.0.attn", "transformer.h.1.mlp"):
        assert name in out
    assert "headroom" in out and "most consumed by" in out


def test_batch_file_json_and_plot(capsys, tmp_path) -> None:
    batch = tmp_path / "b.pt"
    torch.save((torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))), batch)  # (idx, targets)
    png = tmp_path / "h.png"
    code, out, err = run(capsys, "trajectory", "gpt2_qknorm_test", "--batch", str(batch), "--json", "--plot", str(png))
    assert code == 0, err
    doc = json.loads(out)["trajectory"]
    assert doc["batch_size"] == 2 and doc["tokens"] == 5 and doc["head"]["source"] == "loss"
    assert [u["name"] for u in doc["updates"]][:2] == ["transformer.h.0.attn", "transformer.h.0.mlp"]
    assert doc["headroom"] == min(doc["forward_headroom"], doc["backward_headroom"])
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_overflowing_batch_exits_1(capsys) -> None:
    code, out, _ = run(capsys, "trajectory", "module:_traj_models:overflowing", "--dtype", "fp16")
    assert code == 1 and "OVERFLOWS" in out  # states reach 2^20 * 2 > 65504
    code, out, _ = run(capsys, "trajectory", "module:_traj_models:overflowing", "--dtype", "bf16")
    assert code == 0 and ": ok;" in out


def test_bad_batch_file_is_one_line(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_text("not a tensor")
    for path, needle in ((str(bad), "is not a torch.save'd tensor"), (str(tmp_path / "none.pt"), "no such file")):
        code, out, err = run(capsys, "trajectory", "gpt2_qknorm_test", "--batch", path)
        assert code == 2 and out == ""
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("certblocks trajectory: error: --batch") and needle in lines[0]
    wrong = tmp_path / "float.pt"
    torch.save(torch.randn(2, 5), wrong)  # floats where the model takes token ids
    code, _, err = run(capsys, "trajectory", "gpt2_qknorm_test", "--batch", str(wrong))
    assert code == 2 and len(err.splitlines()) == 1 and "gpt2_qknorm_test on --batch" in err


def test_no_jacobians_needs_targets_and_plots_the_measured_side(capsys, tmp_path) -> None:
    batch = tmp_path / "b.pt"
    torch.save((torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))), batch)  # (idx, targets)
    png = tmp_path / "h.png"
    code, out, err = run(capsys, "trajectory", "gpt2_qknorm_test", "--batch", str(batch), "--no-jacobians",
                         "--json", "--plot", str(png))
    assert code == 0, err
    doc = json.loads(out)["trajectory"]
    assert doc["estimated"] is False and doc["headroom"] is None and doc["headroom_measured"] > 0
    assert all(u["jacobian_norm"] is None and u["costate_norm"] > 0 for u in doc["updates"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the example input has no targets: no exact costate, a one-line usage error
    code, out, err = run(capsys, "trajectory", "gpt2_qknorm_test", "--seq-len", "6", "--no-jacobians")
    assert code == 2 and out == "" and "jacobians=False needs the exact costate" in err

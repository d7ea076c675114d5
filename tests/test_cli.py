"""The certblocks command line: output, one-line errors, exit codes, and the pages that show it (README.md's
depth table, docs/cli.md's exit status)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from certblocks import cli
from certblocks.cli import table

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(err: str, command: str, needle: str) -> None:
    """A usage error is exactly one line on stderr, names the command and the problem, and has no traceback."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"certblocks {command}: error: "), err
    assert needle in lines[0], err


def test_budget_prints_the_depth_table(capsys):
    argv = ["budget", "--q", "1", "--sigma", "2", "--c", "1", "--l1", "1", "--dtype", "fp16,bf16,fp32"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("fp16", "bf16", "fp32"))}
    assert rows["fp32"][2:] == ["127", "11", "11"]
    assert rows["fp16"][2] == "15" and set(rows) == {"fp16", "bf16", "fp32"}


def test_budget_json(capsys):
    code, out, _ = run(capsys, "budget", "--q", "1", "--dtype", "fp64", "--json")
    data = json.loads(out)
    assert code == 0 and data["depths"][0]["forward_overflow"] == 1024 and data["block"]["q"] == 1.0


def test_budget_with_a_peak(capsys):
    # R_k = 100 * 3^k; the intermediate 0.5 R^2 reaches bf16's M at k = 37, the state only at k = 77
    code, out, _ = run(capsys, "budget", "--q", "1", "--c", "2", "--r0", "100", "--peak", "2", "0.5", "0",
                       "--dtype", "fp16,bf16")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("fp16", "bf16"))}
    assert code == 0 and "peak <= 0.5 ||x||^2" in out
    assert rows["fp16"][2] == "2" and rows["bf16"][2] == "37"
    code, out, _ = run(capsys, "budget", "--q", "1", "--c", "2", "--r0", "100", "--dtype", "bf16")
    assert code == 0 and out.splitlines()[-1].split()[2] == "76"


@pytest.mark.parametrize("argv, needle", [(["--q", "1", "--dtype", "fp99"], "dtype 'fp99' is not supported"),
                                          (["--q", "1", "--dtype", ","], "needs at least one dtype"),
                                          (["--q", "-1"], "q must be a finite number >= 0"),
                                          (["--q", "1", "--peak", "2", "-1", "0"],
                                           "peak c must be a finite number >= 0"),
                                          (["--q", "1", "--dt", "0"], "dt must be a finite number > 0"),
                                          (["--q", "one"], "argument --q: invalid float value: 'one'")])
def test_budget_errors_exit_2_with_one_line(capsys, argv, needle):
    code, out, err = run(capsys, "budget", *argv)
    assert code == 2 and out == ""
    assert_one_line_error(err, "budget", needle)


def test_table_and_readme_are_current(capsys):
    code, out, _ = run(capsys, "table", "--markdown")
    assert code == 0 and "| 1 | 16 | 128 | 128 | 1,024 |" in out
    readme = (ROOT / "README.md").read_text()
    block = readme.split(table.README_START, 1)[1].split(table.README_END, 1)[0].strip()
    assert block == out.strip(), "README table is stale: run `make readme`"


def test_table_update_readme(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text(f"# title\n{table.README_START}\nold\n{table.README_END}\ntail\n")
    code, out, _ = run(capsys, "table", "--update-readme", str(path))
    assert code == 0 and out.strip() == f"{path}: updated"
    assert table.forward_table_text(markdown=True) in path.read_text() and "old" not in path.read_text()
    code, out, _ = run(capsys, "table", "--update-readme", str(path))
    assert code == 0 and out.strip() == f"{path}: already up to date"


def test_table_update_readme_errors(tmp_path, capsys):
    code, _, err = run(capsys, "table", "--update-readme", "/nonexistent/README.md")
    assert code == 2
    assert_one_line_error(err, "table", "'/nonexistent/README.md': No such file or directory")
    (tmp_path / "plain.md").write_text("no markers\n")
    code, _, err = run(capsys, "table", "--update-readme", str(tmp_path / "plain.md"))
    assert code == 2
    assert_one_line_error(err, "table", "has no generated-table markers")


def test_docs_document_the_exit_codes():
    """docs/cli.md's exit status table has every status the command's docstring lists (the README's python blocks run
    in tests/test_docs.py)."""
    page = (ROOT / "docs" / "cli.md").read_text()
    section = page.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    for code in ("`0`", "`1`", "`2`", "`3`", "`130`"):
        assert f"| {code} |" in section, code
    for line in ("* 0 --", "* 1 --", "* 2 --", "* 3 --"):
        assert line in cli.__doc__


def test_demo_runs(capsys):
    code, out, _ = run(capsys, "demo", "--dtype", "fp16")
    assert code == 0 and "CertificationError" in out and "certified: all 24 updates" in out


def test_zoo_bad_dtype_is_one_line(capsys):
    code, out, err = run(capsys, "zoo", "--dtype", "fp12")
    assert code == 2 and out == ""
    assert_one_line_error(err, "zoo", "argument --dtype: dtype 'fp12' is not supported; allowed: bf16, fp16")


def test_convert_unknown_timm_model_is_one_line(capsys):
    pytest.importorskip("timm")
    code, out, err = run(capsys, "convert", "timm:nonexist")
    assert code == 2 and out == ""
    assert_one_line_error(err, "convert", "timm could not create 'nonexist': timm has no such model")
    code, out, err = run(capsys, "convert", "timm:vit_tiny_patch16_22")  # checked in timm's registry: no build
    assert code == 2 and out == ""
    assert_one_line_error(err, "convert", "did you mean timm:vit_tiny_patch16_224")


def test_convert_passes_timm_only_the_arguments_given(monkeypatch):
    timm = pytest.importorskip("timm")
    from certblocks.cli.models import load_backbone

    calls = []
    create = timm.create_model

    def spy(name, **kwargs):
        calls.append(kwargs)
        return create(name, **kwargs)

    monkeypatch.setattr(timm, "create_model", spy)
    model, example = load_backbone("timm:resnet10t")  # takes no img_size: none is passed
    assert calls[-1] == {"pretrained": False}
    assert tuple(example.shape) == (1, *model.pretrained_cfg["input_size"])
    _, example = load_backbone("timm:vit_tiny_patch16_224", img_size=32, layers=1)
    assert calls[-1] == {"pretrained": False, "img_size": 32, "depth": 1} and tuple(example.shape) == (1, 3, 32, 32)


class _NotExportable(torch.nn.Module):
    """A residual update whose control flow depends on the input's values: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return x + self.lin(x)
        return x - self.lin(x)


def test_convert_capture_failure_exits_1_with_one_line(capsys, monkeypatch):
    from certblocks.cli import models

    monkeypatch.setattr(models, "load_backbone", lambda spec, **kw: (_NotExportable(), torch.randn(1, 3, 4)))
    code, out, err = run(capsys, "convert", "timm:anything")
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("certblocks convert: error: timm:anything: the model could not be "
                                                   "captured and certified before the conversion: CaptureError"), err


@pytest.mark.slow
def test_convert_with_an_image_too_small_for_the_patches_exits_1(capsys):
    pytest.importorskip("timm")
    code, out, err = run(capsys, "convert", "timm:vit_tiny_patch16_224", "--img-size", "7", "--layers", "1")
    assert code == 1 and out == "" and len(err.splitlines()) == 1 and "could not be captured" in err


@pytest.mark.parametrize("argv, needle", [
    (["certify", "gpt2_qknorm_tini"], "did you mean gpt2_qknorm_tiny"),
    (["certify", "timm-vit_tiny_patch16_224"], "did you mean timm:vit_tiny_patch16_224"),
    (["trajectory", "hf:gtp2"], "did you mean hf:gpt2"),
    (["convert", "hf:lama"], "did you mean hf:llama"),
    (["convert", "gpt2"], "MODEL must be timm:NAME"),
])
def test_unknown_models_are_answered_with_the_close_names(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_line_error(err, argv[0], needle)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_shown_on_a_terminal_only_and_erased():
    from certblocks.cli._common import Progress

    tty = _Terminal()
    p = Progress("convert", stream=tty)
    p("build", "hf:gpt2")
    p("capture")
    assert tty.getvalue().endswith("\r\033[Kcertblocks convert: hf:gpt2: capture ...")
    p.clear()
    assert tty.getvalue().endswith("\r\033[K")
    for stream, quiet in ((io.StringIO(), False), (_Terminal(), True)):  # not a terminal, or --quiet: nothing
        q = Progress("convert", quiet=quiet, stream=stream)
        q("build", "x")
        q.clear()
        assert stream.getvalue() == ""


def test_convert_shows_its_steps_on_a_terminal(capsys, monkeypatch):
    from certblocks.blocks.attention import Attention
    from certblocks.cli import models

    class Res(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention(16, 2)

        def forward(self, x):
            return x + self.attn(x)

    monkeypatch.setattr(models, "load_backbone", lambda spec, **kw: (Res().eval(), torch.randn(1, 4, 16)))
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    code = cli.main(["convert", "timm:toy", "--dtype", "fp32"])
    shown = tty.getvalue()
    assert code == 0, shown
    for step in ("timm:toy: build", "timm:toy: capture and certify the model before conversion",
                 "timm:toy: swap 1 modules", "timm:toy: capture and certify the converted model"):
        assert f"certblocks convert: {step} ..." in shown
    assert shown.endswith("\r\033[K")  # erased before the result
    assert "1 swaps" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert cli.main(["convert", "timm:toy", "--dtype", "fp32", "--quiet"]) == 0
    assert sys.stderr.getvalue() == ""


@pytest.mark.parametrize("value, got", [("0", "0"), ("-3", "-3"), ("two", "'two'")])
def test_convert_layers_must_be_at_least_1(capsys, value, got):
    code, out, err = run(capsys, "convert", "hf:gpt2", "--layers", value)
    assert code == 2 and out == ""
    assert_one_line_error(err, "convert", f"argument --layers: must be an integer >= 1, got {got} (see")


def test_convert_llama_prints_depths_before_and_after(capsys):
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "convert", "hf:llama", "--layers", "2", "--remove-norms", "--dtype", "bf16,fp16")
    assert code == 0, out
    assert "model.layers.0.self_attn: LlamaAttention (q=1, sigma=2) -> RotaryQKNormAttention (q=1, sigma=1)" in out
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split()[:1] in (["bf16"], ["fp16"])}
    assert set(lines) == {"bf16", "fp16"}
    for cells in lines.values():  # dtype, before, after, change: the change is after - before
        (b, nb), (a, na) = (map(int, c.split("/")) for c in cells[1:3])
        assert nb == na == 4 and int(cells[3]) == a - b
    assert "largest q of a residual update: before 0, after 1" in out


def test_convert_takes_precision_policies(capsys, monkeypatch):
    """``--dtype`` takes mixed policies: their rows come from graphs captured under the policy before and after (the
    conversion's tracer is called with ``precision=``), beside the pure dtypes'."""
    pytest.importorskip("transformers")
    from certblocks.conversion import api

    seen = []
    trace = api._trace
    monkeypatch.setattr(api, "_trace", lambda *a, **k: seen.append(k.get("precision")) or trace(*a, **k))
    code, out, _ = run(capsys, "convert", "hf:gpt2", "--layers", "2", "--dtype", "amp-fp16,fp16,fp8-e4m3")
    assert code in (0, 1), out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split()[:1] in (["amp-fp16"], ["fp16"],
                                                                                       ["fp8-e4m3"])}
    assert set(rows) == {"amp-fp16", "fp16", "fp8-e4m3"}, out
    for cells in rows.values():
        (b, nb), (a, na) = (map(int, c.split("/")) for c in cells[1:3])
        assert nb == na == 4 and int(cells[3]) == a - b
    assert seen.count("amp-fp16") == 2 and seen.count("fp8-e4m3") == 2 and seen.count(None) == 2, seen
    code, _, err = run(capsys, "convert", "hf:gpt2", "--dtype", "amp-fp17")
    assert code == 2 and "amp-fp17" in err


def test_convert_unknown_form_is_one_line(capsys):
    code, _, err = run(capsys, "convert", "resnet50")
    assert code == 2
    assert_one_line_error(err, "convert", "MODEL must be timm:NAME")


@pytest.mark.parametrize("spec, needle", [
    ("module:os.path:join", "os.path.join() raised TypeError"),
    ("module:os.path:sep", "os.path has no callable 'sep'"),
    ("module:no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    ("module:only_one_part", "module:pkg.mod:factory"),
    ("hf:bert", "hf:bert is not supported"),
])
def test_certify_bad_model_is_one_line(capsys, spec, needle):
    code, out, err = run(capsys, "certify", spec)
    assert code == 2 and out == ""
    assert_one_line_error(err, "certify", needle)


def test_certify_takes_one_dtype_with_a_model(capsys):
    code, _, err = run(capsys, "certify", "module:os.path:join", "--dtype", "fp16,bf16")
    assert code == 2
    assert_one_line_error(err, "certify", "--dtype takes one dtype with a MODEL, got 'fp16,bf16'")


_FACTORY = """\
import torch
from torch import nn


class Square(nn.Module):
    def forward(self, x):
        return x + x * x  # one residual update of exponent q = 2


def make():
    return Square(), torch.randn(1, 4, 8)
"""


@pytest.mark.parametrize("r0, expected", [("1", 0), ("1000", 1)])
def test_certify_exit_status_says_whether_certified(tmp_path, monkeypatch, capsys, r0, expected):
    # R_1 = r0 + r0^2: 2 in fp16 is certified (exit 0); 1000 + 1e6 > 65504 is not (exit 1)
    (tmp_path / "cb_cli_square.py").write_text(_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "certify", "module:cb_cli_square:make", "--dtype", "fp16", "--r0", r0)
    assert code == expected, out + err
    assert err == "" and ("certified: all 1 updates" in out) == (expected == 0)


def test_help_returns_0_and_lists_every_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in cli.COMMANDS:
        assert name in out
    for name in cli.COMMANDS:
        code, out, _ = run(capsys, name, "--help")
        assert code == 0 and out.startswith(f"usage: certblocks {name}")


def test_missing_or_unknown_command_exits_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and err.startswith("certblocks: error: the following arguments are required: COMMAND")
    code, _, err = run(capsys, "budgte")
    assert code == 2 and err.startswith("certblocks: error: argument COMMAND: invalid choice: 'budgte'")
    assert len(err.splitlines()) == 1


def test_an_internal_error_exits_3_with_the_traceback(capsys, monkeypatch):
    def broken(*, markdown: bool = False) -> str:
        raise RuntimeError("deliberately broken")

    monkeypatch.setattr(table, "forward_table_text", broken)
    code, out, err = run(capsys, "table")
    assert code == 3 and out == ""
    assert "Traceback" in err and "RuntimeError: deliberately broken" in err
    assert err.splitlines()[-1] == "certblocks table: internal error (a bug; please report it with the traceback above)"


def test_an_interrupt_exits_130(capsys, monkeypatch):
    def interrupted(*, markdown: bool = False) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(table, "forward_table_text", interrupted)
    code, _, err = run(capsys, "table")
    assert code == 130 and err.strip() == "certblocks table: interrupted"


def test_add_command_rejects_an_unknown_name():
    import argparse

    with pytest.raises(ValueError, match="name must be one of .*'budget'.*got 'nope'"):
        cli.add_command(argparse.ArgumentParser().add_subparsers(), "nope")


def test_convert_and_enforce_are_functions_after_their_modules_load():
    import certblocks
    import certblocks.conversion  # the modules are named apart from the functions, which stay functions
    import certblocks.enforcement

    assert callable(certblocks.convert) and callable(certblocks.enforce) and callable(certblocks.enforcement.unenforce)
    assert certblocks.convert.__module__ == "certblocks.conversion"
    assert callable(certblocks.certify) and certblocks.certify.__module__.startswith("certblocks.trace")


def test_lazy_package_namespace():
    import certblocks

    assert set(certblocks.__all__) <= set(dir(certblocks))
    for name in certblocks.__all__:
        assert getattr(certblocks, name) is not None
    assert certblocks.budget.float_max("fp16") == 65504.0  # a submodule the package used to load eagerly
    with pytest.raises(AttributeError, match="module 'certblocks' has no attribute 'nope'"):
        certblocks.nope  # noqa: B018

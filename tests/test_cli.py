"""The certblocks command line, and the README that shows it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from certblocks import cli

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


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
                                          (["--q", "-1"], "q must be a finite number >= 0"),
                                          (["--q", "1", "--peak", "2", "-1", "0"], "peak c must be >= 0"),
                                          (["--q", "1", "--dt", "0"], "dt must be > 0")])
def test_budget_errors_exit_2_with_a_message(capsys, argv, needle):
    code, _, err = run(capsys, "budget", *argv)
    assert code == 2 and needle in err


def test_table_and_readme_are_current(capsys):
    code, out, _ = run(capsys, "table", "--markdown")
    assert code == 0 and "| 1 | 16 | 128 | 128 | 1,024 |" in out
    readme = (ROOT / "README.md").read_text()
    block = readme.split(cli.README_START, 1)[1].split(cli.README_END, 1)[0].strip()
    assert block == out.strip(), "README table is stale: run `make readme`"


def test_readme_python_examples_run(capsys):
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)  # our own README
    out = capsys.readouterr().out
    assert "fp32: D_F=127, D_grad=11, D_cert=11" in out and "False 11" in out
    assert namespace["model"].certificate.certified_depth == 8


def test_demo_runs(capsys):
    code, out, _ = run(capsys, "demo", "--dtype", "fp16")
    assert code == 0 and "CertificationError" in out and "certified: all 24 updates" in out


def test_convert_and_enforce_are_functions_after_their_modules_load():
    import certblocks
    import certblocks.conversion  # the modules are named apart from the functions, which stay functions
    import certblocks.enforcement

    assert callable(certblocks.convert) and callable(certblocks.enforce) and callable(certblocks.unenforce)
    assert certblocks.convert.__module__ == "certblocks.conversion"

"""The README's zoo tables: one row per registered model, in the generator's format and with its verdict.

Regenerating every row certifies every full-size model (slow); here the generator runs on the test sizes,
and the README's rows are checked against the registry (names, families) and the generator's row format.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("timm")
from certblocks.zoo import list_models, model_entry  # noqa: E402

from certblocks.cli.zoo import zoo_table  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| (\w+) \| (\w+) \| (\d+) \| ([^|]+) \|( (?:yes|NO) \d+/\d+ \|){3}$")


def _rows() -> dict:
    out = {}
    for line in README.read_text().splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = (m.group(2), int(m.group(3)), line)
    return out


def test_readme_has_one_row_per_model_with_its_family():
    rows = _rows()
    assert sorted(rows) == list_models()
    for name, (family, _depth, _) in rows.items():
        assert model_entry(name).family == family, name


def test_generator_rows_have_the_readme_format_and_the_certified_defaults_say_yes():
    table = zoo_table(["gpt2_qknorm_test", "certblocks_vit_test"], markdown=True)
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert len(lines) == 2 and all(ROW.match(line) for line in lines), lines
    rows = _rows()
    for name, entry in ((n, model_entry(n)) for n in rows):
        verdict_bf16 = rows[name][2].split("|")[6].strip()
        if not entry.baseline:  # every certified zoo model is certified at its defaults in bf16
            assert verdict_bf16.startswith("yes"), (name, verdict_bf16)

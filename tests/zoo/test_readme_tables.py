"""The zoo's tables: README.md (fp16, bf16) and docs/zoo.md (fp16, amp-fp16, bf16, fp8-e4m3, fp32: the generator's
default columns), one row per registered model, in the generator's format and with its verdict.

The fast tests check the rows against the registry (names, families), the generator's row format (the generator run
on the test sizes), the two pages against each other, and that every certified model says yes in bf16.  Regenerating
every row certifies every full-size model: the slow test compares both pages with `certblocks zoo --markdown`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

pytest.importorskip("timm")
from certblocks import zoo  # noqa: E402  (the package, not certblocks.zoo: one import order in and out of a checkout)
from certblocks.cli.zoo import DEFAULT_DTYPES, zoo_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: page -> the dtypes of its zoo table (the README shows two, docs/zoo.md every one the generator prints by default)
PAGES: Dict[Path, Tuple[str, ...]] = {ROOT / "README.md": ("fp16", "bf16"),
                                      ROOT / "docs" / "zoo.md": ("fp16", "amp-fp16", "bf16", "fp8-e4m3", "fp32")}
README, DOCS = PAGES


def _row(n: int) -> re.Pattern[str]:
    return re.compile(r"^\| (\w+) \| (\w+) \| (\d+) \| ([^|]+) \|((?: (?:yes|NO) \d+/\d+ \|)" + f"{{{n}}})$")


def _rows(page: Path) -> Dict[str, Tuple[str, int, List[str], str]]:
    """name -> (family, depth, verdicts, line) of every zoo row of the page."""
    row = _row(len(PAGES[page]))
    out = {}
    for line in page.read_text().splitlines():
        m = row.match(line)
        if m:
            assert m.group(1) not in out, f"{page.name}: two rows for {m.group(1)}"
            out[m.group(1)] = (m.group(2), int(m.group(3)), [v.strip() for v in m.group(5).split("|") if v.strip()],
                               line)
    return out


def _header(page: Path) -> str:
    return "| model | family | D | (q, sigma) | " + " | ".join(PAGES[page]) + " |"


@pytest.mark.parametrize("page", list(PAGES), ids=[p.name for p in PAGES])
def test_page_has_one_row_per_model_with_its_family(page):
    rows = _rows(page)
    assert sorted(rows) == zoo.list_models(), page.name
    for name, (family, _depth, _verdicts, _) in rows.items():
        assert zoo.model_entry(name).family == family, (page.name, name)
    assert _header(page) in page.read_text().splitlines(), f"{page.name}: no table header {_header(page)!r}"


def test_the_docs_page_has_the_generators_default_columns():
    assert PAGES[DOCS] == DEFAULT_DTYPES


def test_the_readme_rows_are_the_docs_rows_for_their_dtypes():
    readme, docs = (_rows(p) for p in PAGES)
    columns = [PAGES[DOCS].index(dtype) for dtype in PAGES[README]]
    for name, (family, depth, verdicts, _) in readme.items():
        assert (family, depth, verdicts) == (docs[name][0], docs[name][1], [docs[name][2][c] for c in columns]), name


def test_generator_rows_have_the_pages_format_and_the_certified_defaults_say_yes():
    for page, dtypes in PAGES.items():
        table = zoo_table(["gpt2_qknorm_test", "certblocks_vit_test"], dtypes, markdown=True)
        lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| model")]
        assert len(lines) == 2 and all(_row(len(dtypes)).match(line) for line in lines), lines
        assert table.splitlines()[0] == _header(page)
        for name, (_, _, verdicts, _) in _rows(page).items():
            if not zoo.model_entry(name).baseline:  # every certified zoo model is certified at its defaults in bf16
                assert verdicts[dtypes.index("bf16")].startswith("yes"), (page.name, name, verdicts)


@pytest.mark.slow
def test_the_pages_are_what_the_generator_prints_today():
    """Every full-size model certified again (about 45 s of CPU): `certblocks zoo --markdown` (its default columns) is
    the source of both tables (README: its fp16 and bf16 columns, `--dtype fp16,bf16`)."""
    table = zoo_table(zoo.list_models(), PAGES[DOCS], markdown=True)
    generated = {line.split("|")[1].strip(): line.split("|")[1:-1] for line in table.splitlines()[2:]}
    for page, dtypes in PAGES.items():
        keep = list(range(4)) + [4 + PAGES[DOCS].index(dtype) for dtype in dtypes]
        for name, (*_, line) in _rows(page).items():
            want = "|" + "|".join(generated[name][c] for c in keep) + "|"
            assert line == want, f"{page.name} is stale for {name}: regenerate with `certblocks zoo --markdown`"

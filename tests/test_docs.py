"""The documentation, README.md and docs/: every python block runs on its own and prints what its output fence says;
the README is a front page that links every page; the sections that code comments cite exist; relative links
resolve.  The block mechanism itself (tests/_doc_blocks.py) is tested on small Markdown files written here."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the tests are not a package: the shared helper is imported by name
    sys.path.insert(0, _HERE)

from _doc_blocks import DocBlock, DocBlockError, pytest_params, python_blocks, run_block  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README] + DOCS

#: every page and the python blocks it has at least (each one runs below)
_EXAMPLES = {"README.md": 4, "theory.md": 10, "kernels.md": 3, "certificates.md": 9, "conversion.md": 8,
             "training.md": 4, "zoo.md": 2, "cli.md": 1, "testing.md": 3, "matrix.md": 0,
             "scale.md": 1}


def test_docs_exist_and_have_examples():
    counts = {p.name: len(python_blocks(p)) for p in PAGES}
    assert set(_EXAMPLES) <= set(counts), sorted(set(_EXAMPLES) - set(counts))
    assert all(counts[name] >= n for name, n in _EXAMPLES.items()), counts


def test_readme_is_a_front_page():
    """At most 250 lines; the two make commands; a certify example with its printed verdict; a link to every page of
    docs/."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    assert "make demo" in text and "make test" in text
    certify = text.split("## Certify a model you already have", 1)[1].split("\n## ", 1)[0]
    blocks = python_blocks(README)
    first = next(b for b in blocks if b.code.strip() and b.code in certify)
    assert first.expected and "StackCertificate(" in first.expected, first
    links = set(re.findall(r"\]\((docs/[^)#\s]+)", text))
    assert {f"docs/{p.name}" for p in DOCS} <= links, sorted({f"docs/{p.name}" for p in DOCS} - links)


@pytest.mark.parametrize("block", pytest_params(PAGES))
def test_doc_block_runs_on_its_own(block: DocBlock):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    missing = block.missing()
    if missing:
        pytest.skip(f"{block.id} needs {', '.join(missing)} (an optional extra)")
    run_block(block)


# ----------------------------------------------------------------------------- sections and links

_HEADING = re.compile(r"^## (\d+)\. ", re.M)
_SUBHEADING = re.compile(r"^### (\d+\.\d+) ", re.M)
#: "docs/theory.md section 3", "docs/theory.md section 2.6", "docs/theory.md sections 2 and 4"
_CITATION = re.compile(r"docs/theory\.md\s+sections?\s+(\d+(?:\.\d+)?)(?:\s*(?:,|and)\s*(\d+(?:\.\d+)?))?")
_SOURCES = ("certblocks", "kernels", "zoo", "tests", "benchmarks")


def _sources():
    for folder in _SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if ROOT in p.parents):
                continue  # certblocks/kernels and certblocks/zoo are links to kernels/ and zoo/
            yield path


def test_theory_sections_are_numbered_in_order():
    numbers = [int(n) for n in _HEADING.findall((ROOT / "docs" / "theory.md").read_text())]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 7, numbers


def test_every_cited_theory_section_exists():
    theory = (ROOT / "docs" / "theory.md").read_text()
    sections = set(_HEADING.findall(theory)) | set(_SUBHEADING.findall(theory))
    cited = {}
    for path in _sources():
        for m in _CITATION.finditer(path.read_text(encoding="utf-8")):
            for n in filter(None, m.groups()):
                cited.setdefault(n, str(path.relative_to(ROOT)))
    assert cited, "no citation of docs/theory.md found: the pattern no longer matches the comments"
    missing = {n: p for n, p in cited.items() if n not in sections}
    assert not missing, f"cited sections with no heading '## N.' or '### N.M' in docs/theory.md: {missing}"


def test_no_source_cites_a_file_outside_the_repository():
    """The mathematics is cited as docs/theory.md (THEORY.md is the specification's, not the repository's)."""
    here = Path(__file__).resolve()  # this file names the old citation in its pattern
    stale = [str(p.relative_to(ROOT)) for p in _sources()
             if p.resolve() != here and re.search(r"(?<!docs/)THEORY(\.md)?\b", p.read_text(encoding="utf-8"))]
    assert not stale, f"cite docs/theory.md instead of THEORY.md in {stale}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(doc: Path):
    text = re.sub(r"^(```|~~~).*?^\1", "", doc.read_text(), flags=re.M | re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, f"{doc.name} has no links"
    for link in links:
        if re.match(r"^[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: link {link!r} points to a missing file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc.name}: link {link!r} has no heading #{anchor} in {path.name}"


# ----------------------------------------------------------------------------- the block mechanism


def _md(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(textwrap.dedent(text))
    return path


def test_blocks_directives_and_outputs_are_read(tmp_path):
    path = _md(tmp_path, """\
        # title

        ```python
        print("a")
        ```

        ```output
        a
        ```

        <!-- doctest: skip needs a GPU; requires numpy -->

        ```python
        raise RuntimeError
        ```

        ````markdown
        ```python
        inside another fence: not a block
        ```
        ````

        <!-- doctest: subprocess; slow -->
        ```python
        x = 1
        ```

        ```bash
        echo not python
        ```
        """)
    blocks = python_blocks(path)
    assert [b.line for b in blocks] == [4, 14, 25]
    assert blocks[0].expected == "a\n" and blocks[0].skip is None
    assert blocks[1].skip == "needs a GPU" and blocks[1].requires == ("numpy",)
    assert blocks[2].subprocess and blocks[2].slow and blocks[2].expected is None
    assert run_block(blocks[0]) == "a\n"


@pytest.mark.parametrize("text, message", [
    ("<!-- doctest: skip -->\n```python\nx = 1\n```\n", "needs a reason"),
    ("<!-- doctest: sometimes -->\n```python\nx = 1\n```\n", "unknown doctest directive 'sometimes'"),
    ("<!-- doctest: slow -->\ntext\n```python\nx = 1\n```\n", "must be followed by a python block"),
    ("<!-- doctest: slow -->\n```bash\nls\n```\n", "must precede a python block"),
    ("```output\na\n```\n", "must follow a python block"),
    ("```python\nx = 1\n", "never closed"),
    ("text\n<!-- doctest: slow -->\n", "has no block"),
])
def test_malformed_pages_are_refused_with_the_line(tmp_path, text, message):
    with pytest.raises(DocBlockError, match=message) as info:
        python_blocks(_md(tmp_path, text))
    assert "page.md:" in str(info.value)


def test_a_wrong_output_or_an_error_fails_with_the_markdown_line(tmp_path):
    path = _md(tmp_path, """\
        ```python
        print(1 + 1)
        ```

        ```output
        3
        ```

        ```python
        x = 1
        y = x / 0
        ```
        """)
    wrong, error = python_blocks(path)
    with pytest.raises(AssertionError, match=r"(?s)page.md:2: the printed output differs.*-3.*\+2"):
        run_block(wrong)
    with pytest.raises(AssertionError, match="page.md:10 raised ZeroDivisionError") as info:
        run_block(error)
    tb = info.value.__cause__.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_filename == str(path) and tb.tb_lineno == 11  # the line in the page


def test_blocks_run_in_fresh_namespaces_and_restore_torch_state(tmp_path):
    import torch

    path = _md(tmp_path, """\
        ```python
        import torch
        torch.set_default_dtype(torch.float64)
        secret = 1
        ```

        ```python
        print("secret" in dir())
        ```
        """)
    first, second = python_blocks(path)
    before = torch.get_default_dtype()
    run_block(first)
    assert torch.get_default_dtype() == before
    assert run_block(second) == "False\n"


@pytest.mark.subprocess
def test_a_subprocess_block_reports_its_error(tmp_path):
    path = _md(tmp_path, """\
        <!-- doctest: subprocess -->
        ```python
        import sys
        print("ran in", "a fresh interpreter" if "pytest" not in sys.modules else "pytest")
        ```

        ```output
        ran in a fresh interpreter
        ```

        <!-- doctest: subprocess -->
        ```python
        raise SystemExit(3)
        ```
        """)
    ok, failing = python_blocks(path)
    run_block(ok)
    with pytest.raises(AssertionError, match="page.md:13 \\(subprocess\\) exited with 3"):
        run_block(failing)


@pytest.mark.parametrize("subprocess", [False, True])
def test_a_deprecated_certblocks_name_fails_the_block(tmp_path, subprocess):
    """A block that uses a name the API moved (its shim warns with DeprecationWarning) fails, in-process or not;
    the moved name itself still works outside the runner."""
    directive = "<!-- doctest: subprocess -->\n" if subprocess else ""
    path = _md(tmp_path, directive + "```python\nimport certblocks\nprint(certblocks.float_max('fp16'))\n```\n")
    (block,) = python_blocks(path)
    with pytest.raises(AssertionError, match="DeprecationWarning|float_max moved"):
        run_block(block)
    path = _md(tmp_path, directive + "```python\nfrom certblocks.budget import float_max\nprint(float_max('fp16'))\n"
                                     "```\n\n```output\n65504.0\n```\n")
    (block,) = python_blocks(path)
    run_block(block)

"""Number formatting and the one table renderer shared by every report (certificates, conversions, the CLI).

Pure Python: the ``certblocks budget`` / ``table`` commands use it without importing torch.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

__all__ = ["fmt_num", "json_number", "render_table"]


def fmt_num(x: float | None) -> str:
    """A number for reports: ``?`` when unknown, ``inf``, ints with separators, else 4 significant digits."""
    if x is None:
        return "?"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}" if abs(x) < 10**15 else f"{float(x):.3g}"
    if math.isinf(x):
        return "inf"
    if math.isnan(x):
        return "?"
    return f"{x:.4g}"


def json_number(x: Any) -> Any:
    """JSON has no inf/nan and loses big ints in many readers: inf -> "inf", huge ints stay ints."""
    if isinstance(x, float):
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if math.isnan(x):
            return None
    return x


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool = False,
                 align: Optional[str] = None, rule: bool = True, indent: str = "",
                 max_width: Optional[int] = None) -> str:
    """Rows of strings as an aligned text table or a Markdown table.

    Args:
        header: the column titles.
        rows: the cells, one sequence of strings per row (as many as ``header``).
        markdown: a Markdown table (``| a | b |`` and a ``|---|`` rule) instead of aligned text.
        align: one letter per column, ``"l"`` (left) or ``"r"`` (right); default: the first column left, the
            others right (names, then numbers).  Markdown tables are not padded.
        rule: a line of dashes under the header (text tables).
        indent: put before every line of a text table.
        max_width: cut longer cells to this width (text tables); ``None``: no limit.

    Raises:
        ValueError: a row with another number of cells than ``header``, or ``align`` of another length or with
            letters other than ``l`` and ``r``.
    """
    n = len(header)
    for k, r in enumerate(rows):
        if len(r) != n:
            raise ValueError(f"rows[{k}] has {len(r)} cells, the header {n}")
    if align is None:
        align = "l" + "r" * (n - 1)
    if len(align) != n or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one letter 'l' or 'r' per column ({n}), got {align!r}")
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    cells = [list(header)] + [list(r) for r in rows]
    if max_width is not None:
        cells = [[c[:max_width] for c in r] for r in cells]
    widths = [max(len(r[i]) for r in cells) for i in range(n)]

    def line(r: Sequence[str]) -> str:
        return indent + "  ".join(s.ljust(w) if a == "l" else s.rjust(w) for s, w, a in zip(r, widths, align))

    lines = [line(cells[0])] + ([line(["-" * w for w in widths])] if rule else []) + [line(r) for r in cells[1:]]
    return "\n".join(lines)

"""Number formatting shared by the certificates' text and JSON renderings."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fmt_num", "json_number"]


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

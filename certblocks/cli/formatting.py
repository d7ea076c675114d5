"""How the command line prints depths, certificates and tables (pure Python, no torch)."""

from __future__ import annotations

import math
from typing import Any, Optional

from certblocks._format import render_table  # the one renderer (re-exported: the CLI modules import it here)

__all__ = ["format_depth", "format_exponents", "format_number", "render_table", "verdict"]


def format_depth(depth: Optional[float], exact: bool = True) -> str:
    """Render a depth: exact ints below a million, three digits above, ``>=`` for lower bounds.

    Args:
        depth: an int, ``math.inf`` (never reached) or None (unknown).
        exact: False when the depth is a sound lower bound rather than the exact boundary.
    """
    if depth is None:
        return "?"
    if isinstance(depth, float) and math.isinf(depth):
        return "never"
    prefix = "" if exact else ">= "
    if abs(depth) < 10**6:
        return f"{prefix}{depth:,}"
    return f"{prefix}{float(depth):.3g}"


def format_number(x: float) -> str:
    """Three significant digits (coefficients, radii, bounds)."""
    return f"{x:.3g}"


def format_exponents(q: Optional[float], sigma: Optional[float]) -> str:
    """``(q, sigma)``, with ``?`` for an exponent that was not derived."""
    return f"({'?' if q is None else f'{q:g}'}, {'?' if sigma is None else f'{sigma:g}'})"


def verdict(cert: Any) -> str:
    """``yes 24/24`` or ``NO 11/14``: whether a stack certificate holds, its certified depth and its depth."""
    return f"{'yes' if cert.ok else 'NO'} {cert.certified_depth}/{cert.depth}"

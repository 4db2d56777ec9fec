"""The comparison with a known-good run (``analyze --known-good``, ``torchrun-diag --diag-known-good``) as text:
the terminal's lines, the same for the live launcher and the offline analysis. Plain data in, lines out."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def format_known_good(kg: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], shown: Callable[[str], str] = str,
                      top: int = 5) -> list[str]:  # fmt: skip
    """The terminal's lines of the comparison (``kg``: ``known_good``; ``rows``: ``first_divergence``)."""
    if kg.get("refused"):
        return [f"  known-good run: {shown(str(kg['refused']))}"]
    out = []
    good = f"{kg.get('good_files', 0)} file(s), {kg.get('good_lines', 0):,} lines"
    if not rows:
        out.append(f"  known-good run ({good}): no line before an error differs from it")
    else:
        out.append(f"  first divergence from the known-good run ({good}; {kg.get('novel_templates', 0)} new line "
                   "shapes):")  # fmt: skip
        for r in rows[:top]:
            out.append("    " + divergence_line(r, shown))
        if len(rows) > top:
            out.append(f"    ... {len(rows) - top} more in the JSON (first_divergence)")
    if kg.get("suspect"):
        out.append(f"  suspect: rank {kg['suspect']['rank']}: {shown(str(kg['suspect']['reason']))}")
    lay = kg.get("layout") or {}
    if lay.get("changed"):
        out.append(f"  layout changed: {shown('; '.join(lay['changes']))}")
    out.extend(f"  note: {shown(str(n))}" for n in (kg.get("notes") or [])[:6])
    return out


def divergence_line(r: Mapping[str, Any], shown: Callable[[str], str] = str) -> str:
    """One row: who, how, where, what."""
    who = f"rank {r['rank']}" if r.get("rank") is not None else "rank ?"
    ahead = f", {r['seconds_before_error']:g} s before its first error" if r.get("seconds_before_error") else ""
    if r.get("rank") is None:
        only = "a line of no rank (a launcher's, or no prefix)"
    else:
        only = "only this rank" if r.get("ranks_printing") == 1 else f"{r.get('ranks_printing')} ranks"
    return (f"{who} [{r.get('level')}; {only}{ahead}] {Path(str(r.get('file'))).name}:{r.get('line')}: "
            f"{shown(str(r.get('text', ''))[:200])}")  # fmt: skip


__all__ = ["divergence_line", "format_known_good"]

"""Ranks told as stories: one rank's timeline and ending as a row, and ranks with the same story
grouped, so a 1,024-rank job with one culprit reads as a handful of rows (pure, no torch).

Read from report.json's rank entries (or the offline analyzer's), tolerant of missing or mistyped
fields; used by report.html's timeline and table and by the terminal's compact table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.values import as_seconds
from elastic_diag.core.verdict import format_ranks

PER_RANK_ROWS = 48  # up to this many ranks, a row each; beyond, ranks with the same story share one


num = as_seconds  # report.json's times, read tolerantly


def integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def text(value: Any) -> str:
    return "" if value is None else str(value)


@dataclass(slots=True)
class RankRow:
    """One rank as the page draws it."""

    rank: int
    node: str
    role: str
    start: float | None
    progress: float | None
    error: float | None
    exit: float | None
    how: str  # "SIGTERM", "exit 1", "running"
    exception: str  # "ValueError: bad batch"
    location: str
    steps: int | None
    entry: dict[str, Any]

    @property
    def story(self) -> tuple[str, str, str, str]:
        return (self.role, self.how, self.exception.split(":", 1)[0], self.location)


def rank_rows(ranks: Iterable[Any], decided_at: float | None = None) -> list[RankRow]:
    """Rows from report.json's rank entries. A rank ended by the launcher's own teardown (SIGTERM or
    SIGKILL at or after ``decided_at``, no exception) has no first error: its exit is not its failure."""
    rows = []
    for i, r in enumerate(ranks):
        if not isinstance(r, dict):
            continue
        rank = integer(r.get("rank"))
        exc = r.get("exception") if isinstance(r.get("exception"), dict) else None
        code = integer(r.get("exit_code"))
        if r.get("signal"):
            how = str(r["signal"])
        elif code is not None:
            how = "exit 0" if code == 0 else f"exit {code}"
        else:
            how = "no exit seen"
        exception = ""
        if exc:
            exception = text(exc.get("type")) + (f": {exc.get('message')}" if exc.get("message") else "")
        elif r.get("errors"):
            exception = text(r["errors"][0]) if isinstance(r["errors"], list) else ""
        error = num(r.get("first_error_time"))
        exit_time = num(r.get("exit_time"))
        teardown = how in ("SIGTERM", "SIGKILL") and not exc and decided_at is not None
        if teardown and error is not None and error == exit_time and error >= decided_at:  # type: ignore[operator]
            error = None
        rows.append(
            RankRow(
                rank=rank if rank is not None else -1 - i,
                node=text(r.get("node")),
                role=text(r.get("role")) or "unknown",
                start=num(r.get("start_time")),
                progress=num(r.get("last_progress_time")),
                error=error,
                exit=exit_time,
                how=how,
                exception=" ".join(exception.split())[:300],
                location=text(r.get("location")) or _location_of(r),
                steps=integer(r.get("steps")),
                entry=r,
            )
        )
    return sorted(rows, key=lambda row: row.rank)


def _location_of(r: dict[str, Any]) -> str:
    """Where the rank's code was, from its stack (reports written before ``location`` existed)."""
    stack = r.get("stack")
    if isinstance(stack, str) and stack:
        dump = parse_stack_dump(stack[-20_000:])
        if dump is not None and (frame := dump.user_frame()):
            return str(frame)
    return ""


def short_location(location: str) -> str:
    """``train.py:114 in loader`` for ``/long/path/train.py:114 in loader`` (a terminal's narrow column)."""
    head, sep, tail = location.partition(" in ")
    return head.rsplit("/", 1)[-1] + sep + tail


@dataclass(slots=True)
class Group:
    """Ranks drawn as one row: one rank, or every rank with the same story."""

    rows: list[RankRow] = field(default_factory=list)

    @property
    def first(self) -> RankRow:
        return self.rows[0]

    @property
    def label(self) -> str:
        ranks = [r.rank for r in self.rows]
        nodes = sorted({r.node for r in self.rows if r.node})
        if len(ranks) == 1:
            return f"rank {ranks[0]}" + (f" ({nodes[0]})" if nodes else "")
        where = f" on {nodes[0]}" if len(nodes) == 1 else (f" on {len(nodes)} nodes" if nodes else "")
        listed = format_ranks(ranks)
        if len(listed) > 40:  # a scattered set (one local rank of every node): the count first, then the list
            return f"{len(ranks)} ranks{where}: {listed[:40].rsplit(',', 1)[0]}, \u2026"
        return f"ranks {listed}{where}"

    @property
    def members(self) -> str:
        """Every rank of the group, as ranges (the label may shorten them)."""
        return format_ranks([r.rank for r in self.rows])

    def span(self, attr: str) -> tuple[float, float] | None:
        values = [v for r in self.rows if (v := getattr(r, attr)) is not None]
        return (min(values), max(values)) if values else None


def group_rows(rows: Sequence[RankRow], per_rank: int = PER_RANK_ROWS) -> list[Group]:
    """One group a rank up to ``per_rank`` ranks; beyond, one a story (the initiating ranks first)."""
    if len(rows) <= per_rank:
        return [Group([r]) for r in rows]
    by_story: dict[tuple[str, str, str, str], Group] = {}
    for r in rows:
        by_story.setdefault(r.story, Group()).rows.append(r)
    return sorted(by_story.values(), key=lambda g: (g.first.role != "initiating", g.first.rank))

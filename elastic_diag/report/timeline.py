"""The timeline of report.html: one SVG row per story of ranks (start, last progress, first error, exit,
teardown), zoomed on the failure window, with the launcher's verdict time marked. Inline SVG, no script.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from elastic_diag.report.rank_story import Group

_W = 1000  # SVG width


_LABEL_W = 250


_ROW_H = 22


_TOP = 34


_PLOT_W = _W - _LABEL_W - 70  # room on the right for the exit labels


def _nice_step(span: float) -> float:
    raw = span / 8
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def _fmt_s(seconds: float) -> str:
    if abs(seconds) >= 100 or float(seconds).is_integer():
        return f"{seconds:.0f} s"
    return f"{seconds:.1f} s" if abs(seconds) >= 1 else f"{seconds:.2f} s"


def _times(groups: Sequence[Group], decided_at: float | None) -> list[float]:
    times = [t for g in groups for r in g.rows for t in (r.start, r.progress, r.error, r.exit) if t is not None]
    return [*times, decided_at] if decided_at is not None else times


def failure_window(groups: Sequence[Group], decided_at: float | None) -> tuple[float, float] | None:
    """The stretch from the first rank's last progress or first error to the end, when it is a small
    part of the run (a long start-up would squeeze it into a few pixels); None when it is not."""
    times = _times(groups, decided_at)
    marks = [t for g in groups for r in g.rows for t in (r.progress, r.error) if t is not None]
    if not times or not marks:
        return None
    lo, hi = min(marks), max(times)
    if hi - lo >= 0.4 * (max(times) - min(times)):
        return None
    margin = max((hi - lo) * 0.1, 0.05)
    return max(lo - margin, min(times)), hi


def timeline_svg(
    groups: Sequence[Group],
    decided_at: float | None,
    initiating: int | None,
    window: tuple[float, float] | None = None,
) -> str:
    """Inline SVG: a row a group, x = seconds since the first rank started (``window``: draw only
    that stretch; what lies before it starts at the left edge)."""
    times = _times(groups, decided_at)
    if not times:
        return '<p class="missing">No times were recorded for these ranks, so there is no timeline.</p>'
    origin = min(times)
    t0, t1 = window or (origin, max(times))
    span = max(t1 - t0, 1e-3)
    height = _TOP + _ROW_H * len(groups) + 16

    def x(t: float) -> float:
        return round(_LABEL_W + (min(max(t, t0), t1) - t0) / span * _PLOT_W, 1)

    out = [
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
        f'viewBox="0 0 {_W} {height}" role="img" aria-label="per-rank timeline">'
    ]
    step = _nice_step(span)
    tick = math.ceil((t0 - origin) / step - 1e-9) * step
    while origin + tick <= t1 + 1e-9:
        xt = x(origin + tick)
        out.append(
            f'<line x1="{xt}" y1="{_TOP - 6}" x2="{xt}" y2="{height - 12}" class="grid"/>'
            f'<text x="{xt}" y="{_TOP - 10}" class="tick">{_fmt_s(tick)}</text>'
        )
        tick += step
    for i, g in enumerate(groups):
        y = _TOP + i * _ROW_H
        mid = y + _ROW_H / 2
        first = g.first
        is_init = first.role == "initiating" or (initiating is not None and any(r.rank == initiating for r in g.rows))
        colour = ROLE_COLOURS.get(first.role, ROLE_COLOURS["unknown"])
        if i % 2 == 0:
            out.append(f'<rect x="0" y="{y}" width="{_W}" height="{_ROW_H}" class="stripe"/>')
        if is_init:
            out.append(f'<rect x="0" y="{y}" width="{_W}" height="{_ROW_H}" class="initiating-row"/>')
        weight = ' font-weight="bold"' if is_init else ""
        label = ("&#9654; " if is_init else "") + html.escape(clip(g.label, 38))
        out.append(
            f'<text x="6" y="{mid + 4}" class="label"{weight}>{label}<title>ranks {html.escape(g.members)}: '
            f"{html.escape(first.role)}</title></text>"
        )
        start = g.span("start")
        end_candidates = [v for v in (g.span("exit"), g.span("error"), g.span("progress")) if v]
        begin = start[0] if start else t0
        end = max((v[1] for v in end_candidates), default=None)
        if end is None or (g.span("exit") is None and decided_at is not None):
            end = max(end or t1, decided_at or t1)
        bar_h = 10 if is_init else 7
        out.append(
            f'<rect x="{x(begin)}" y="{mid - bar_h / 2}" width="{max(x(end) - x(begin), 1.5)}" '
            f'height="{bar_h}" rx="2" fill="{colour}" class="bar"><title>{html.escape(_story(g))}</title></rect>'
        )
        for kind, words in (("progress", "last progress"), ("error", "first error")):
            if (sp := g.span(kind)) is not None:
                until = f" to {_fmt_s(sp[1] - origin)}" if sp[1] > sp[0] else ""
                out.append(_marker_span(x(sp[0]), x(sp[1]), mid, kind, f"{words} {_fmt_s(sp[0] - origin)}{until}"))
        if (ex := g.span("exit")) is not None:
            out.append(
                f'<line x1="{x(ex[1])}" y1="{mid - 7}" x2="{x(ex[1])}" y2="{mid + 7}" class="exit">'
                f"<title>exit ({html.escape(first.how)}) at {_fmt_s(ex[1] - origin)}</title></line>"
                f'<text x="{x(ex[1]) + 4}" y="{mid + 4}" class="how">{html.escape(first.how)}</text>'
            )
    if decided_at is not None:
        xd = x(decided_at)
        out.append(
            f'<line x1="{xd}" y1="{_TOP - 4}" x2="{xd}" y2="{height - 12}" class="teardown">'
            f"<title>the launcher's verdict, then teardown, at {_fmt_s(decided_at - origin)}</title></line>"
            f'<text x="{xd - 4}" y="{height - 2}" class="teardown-label" text-anchor="end">verdict + teardown</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _marker_span(x0: float, x1: float, mid: float, kind: str, title: str) -> str:
    band = ""
    if x1 - x0 >= 2:
        band = f'<rect x="{x0}" y="{mid - 2}" width="{x1 - x0}" height="4" class="{kind}-band"/>'
    if kind == "progress":
        mark = f'<circle cx="{x0}" cy="{mid}" r="4" class="progress"/>'
    else:
        mark = f'<path d="M{x0} {mid - 6} L{x0 + 5} {mid} L{x0} {mid + 6} L{x0 - 5} {mid} Z" class="error"/>'
    return f"<g>{band}{mark}<title>{html.escape(title)}</title></g>"


def _story(g: Group) -> str:
    r = g.first
    parts = [f"{g.label}: {r.role}, {r.how}"]
    if r.exception:
        parts.append(r.exception)
    if r.location:
        parts.append(f"at {r.location}")
    return "; ".join(parts)


def clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


ROLE_COLOURS = {
    "initiating": "#c62828",
    "collateral": "#ef8f00",
    "stopped": "#8a8f98",
    "healthy": "#2e7d32",
    "unknown": "#7b5ea7",
}


PROGRESS_COLOUR = "#1565c0"


ERROR_COLOUR = "#111111"

"""pytest's hooks. What the tests share is in helpers.py."""

from __future__ import annotations

import parity
import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """The parity records (parity.py) of an earlier session are removed, once (by the xdist controller)."""
    if not hasattr(session.config, "workerinput"):
        parity.clear()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-process tests first: with two xdist workers the quick ones then fill the gaps at the
    end instead of one worker finishing a long job alone."""
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The offline analyzer's score on the corpus of real logs (tests/fixtures/logs), known gaps included;
    the parity of every torchrun-diag run's live verdict with the offline analysis of the same run."""
    scores = [value for reports in terminalreporter.stats.values() for r in reports
              if getattr(r, "when", None) == "call"
              for key, value in getattr(r, "user_properties", ()) if key == "fixture_score"]  # fmt: skip
    if scores:
        rank = sum(1 for s in scores if s[0])
        cls = sum(1 for s in scores if s[1])
        terminalreporter.write_line(f"analyzer fixtures: {len(scores)} logs, culprit right {rank} "
                                    f"({100 * rank / len(scores):.0f}%), class right {cls} "
                                    f"({100 * cls / len(scores):.0f}%)")  # fmt: skip
    if not hasattr(config, "workerinput"):
        _parity_summary(terminalreporter)


def _parity_summary(tr: pytest.TerminalReporter) -> None:
    records = parity.load()
    if not records:
        return
    tr.section(f"parity: live verdict vs offline analysis of the same run ({len(records)} runs)")
    rows = [("test", "script", "live", *parity.WAYS)]
    for r in records:
        live = parity.cell(r["live"]) + ("" if r["live"]["status"] == "failed" else f" [{r['live']['status']}]")
        ways = [f"{parity.cell(r['offline'][w])} {r['offline'][w]['comparison']}" for w in parity.WAYS]
        note = " (documented)" if r.get("documented") and r.get("failing") else ""
        rows.append((parity.short_test(r["test"]), r["argv"], live, *ways[:-1], ways[-1] + note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        tr.write_line("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    for way, counts in parity.totals(records).items():
        tr.write_line(f"parity {way}: {parity.totals_text(counts)}")

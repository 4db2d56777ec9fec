"""pytest's hooks. What the tests share is in helpers.py."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-process tests first: with two xdist workers the quick ones then fill the gaps at the
    end instead of one worker finishing a long job alone."""
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The offline analyzer's score on the corpus of real logs (tests/fixtures/logs), known gaps included."""
    scores = [value for reports in terminalreporter.stats.values() for r in reports
              if getattr(r, "when", None) == "call"
              for key, value in getattr(r, "user_properties", ()) if key == "fixture_score"]  # fmt: skip
    if scores:
        rank = sum(1 for s in scores if s[0])
        cls = sum(1 for s in scores if s[1])
        terminalreporter.write_line(f"analyzer fixtures: {len(scores)} logs, culprit right {rank} "
                                    f"({100 * rank / len(scores):.0f}%), class right {cls} "
                                    f"({100 * cls / len(scores):.0f}%)")  # fmt: skip

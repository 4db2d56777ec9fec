"""pytest's hooks. What the tests share is in helpers.py."""

from __future__ import annotations

import os

import launcher_parity
import parity
import pytest
from hypothesis import settings

# the property tests' budget: a fixed number of examples, so that the whole property suite (pytest -m hypothesis)
# costs under 30 s on a 2-core machine; "thorough" for a longer hunt, by hand
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=False, print_blob=True)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# the ledger of verdicts is on by default, in the user's state dir: the suite's hundreds of runs must not write
# there (nor pay 0.3 s each for it); tests/ledger/ turns it on with a ledger of their own
os.environ["ELASTIC_DIAG_LEDGER"] = "off"


def pytest_sessionstart(session: pytest.Session) -> None:
    """The parity records (parity.py) of an earlier session are removed, once (by the xdist controller)."""
    if not hasattr(session.config, "workerinput"):
        parity.clear()
        launcher_parity.clear()


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
        for line in added_fixture_lines(scores) + family_lines(scores):
            terminalreporter.write_line(line)
    if not hasattr(config, "workerinput"):
        _parity_summary(terminalreporter)
        lines = launcher_parity.table(launcher_parity.load())
        if lines:
            terminalreporter.section("launcher parity: one failure under torchrun-diag, srun, mpirun, mp.spawn")
            for line in lines:
                terminalreporter.write_line(line)


def family_lines(scores: list[list[object]]) -> list[str]:
    """Per failure family, every fixture of it (whichever issue added it): how many, and the score now."""
    fams: dict[str, list[list[object]]] = {}
    for s in scores:
        if len(s) > 3 and s[3]:
            fams.setdefault(str(s[3]), []).append(s)
    return [f"  family {fam}: {len(rows)} logs in all, culprit {sum(1 for s in rows if s[0])}, class "
            f"{sum(1 for s in rows if s[1])}" for fam, rows in sorted(fams.items())]  # fmt: skip


def added_fixture_lines(scores: list[list[object]]) -> list[str]:
    """Per issue that added fixtures, the analyzer's score on them before the issue's change and now, overall
    and per failure family."""
    out = []
    for issue in sorted({s[2] for s in scores if len(s) > 2 and s[2]}, key=str):
        mine = [s for s in scores if s[2] == issue]
        fams: dict[str, list[list[object]]] = {"all": mine}
        for s in mine:
            fams.setdefault(str(s[3]), []).append(s)
        for fam, rows in fams.items():
            n = len(rows)
            b_rank, b_cls = sum(1 for s in rows if s[4]), sum(1 for s in rows if s[5])
            rank, cls = sum(1 for s in rows if s[0]), sum(1 for s in rows if s[1])
            out.append(f"  {issue} fixtures, {fam}: {n} logs, culprit {b_rank} -> {rank}, class {b_cls} -> {cls} "
                       "(before the issue's change -> now)")  # fmt: skip
    return out


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

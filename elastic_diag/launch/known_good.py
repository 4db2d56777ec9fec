"""After a failed run's verdict: the comparison with a known-good run, into report.json, report.html and stderr.

The good run is ``--diag-known-good PATH`` (``ELASTIC_DIAG_KNOWN_GOOD``: a diag dir, a log dir, a log file), else,
with the ledger on, the newest successful run of the same job (the same ``ELASTIC_DIAG_JOB_ID``, else the same
launch command: script and arguments). The comparison is ``elastic-diag analyze DIAG_DIR --known-good GOOD``
run as a child process after the summary is printed and the verdict recorded: it never delays the verdict, is
bounded in time (``ELASTIC_DIAG_KNOWN_GOOD_TIMEOUT_S``, 120 s), and whatever goes wrong with it is one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_diag import redaction

ENV_KNOWN_GOOD = "ELASTIC_DIAG_KNOWN_GOOD"
ENV_TIMEOUT_S = "ELASTIC_DIAG_KNOWN_GOOD_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0


def good_run(report: Mapping[str, Any], given: str | None, ledger_url: str | None,
             env: Mapping[str, str]) -> tuple[Path | None, str]:  # fmt: skip
    """The good run to compare with and how it was found ('given', 'the ledger ...'), or (None, why not)."""
    if given:
        return Path(given), "given"
    if ledger_url is None:
        return None, "no --diag-known-good and the ledger is off"
    from elastic_diag.ledger.store import Ledger, LedgerError

    job_id = env.get("ELASTIC_DIAG_JOB_ID", "").strip() or None
    launch = report.get("launch") if isinstance(report.get("launch"), Mapping) else {}
    assert isinstance(launch, Mapping)
    raw = launch.get("launch_command")
    command = redaction.current().text(str(raw))[:2048] if raw else None  # as the ledger keeps it
    ledger = Ledger(ledger_url, retry_s=2.0)
    try:
        found = ledger.last_success(job_id=job_id, command=None if job_id else command)
    except LedgerError as e:
        return None, f"the ledger could not be read ({e})"
    finally:
        ledger.close()
    if found is None:
        return None, "the ledger has no successful run of this job"
    folder = Path(found).parent
    if not folder.is_dir():
        return None, f"the ledger's last successful run of this job is gone ({folder})"
    how = f"the last successful run of job {job_id}" if job_id else "the last successful run of the same command"
    return folder, how + " (ledger)"


def compare_after_verdict(report: Mapping[str, Any], diag_dir: Path, given: str | None, ledger_url: str | None,
                          env: Mapping[str, str] | None = None) -> list[str]:  # fmt: skip
    """Compare a failed run's diag dir with its good run; the comparison merged into report.json and the page;
    the lines to say on stderr. Nothing for a success, nor when there is no good run and none was asked for."""
    e = os.environ if env is None else env
    if str(report.get("status")) == "succeeded":
        return []
    good, how = good_run(report, given, ledger_url, e)
    if good is None:
        return [f"no known-good run to compare with: {how}"] if given or "could not" in how else []
    try:
        timeout = float(e.get(ENV_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    except ValueError:
        timeout = DEFAULT_TIMEOUT_S
    argv = [sys.executable, "-m", "elastic_diag", "analyze", str(diag_dir), "--json", "--known-good", str(good)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env={**e, "ELASTIC_DIAG_LEDGER": "off"}, check=False)  # fmt: skip
        data = json.loads(done.stdout) if done.stdout.strip() else None
    except subprocess.TimeoutExpired:
        return [f"the comparison with the known-good run {good} took more than {timeout:g} s: given up"]
    except (OSError, ValueError) as err:
        return [f"the comparison with the known-good run {good} failed: {err}"]
    if not isinstance(data, dict) or not isinstance(data.get("known_good"), dict):
        tail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return [f"the comparison with the known-good run {good} failed: {tail[0][:200]}"]
    kg: dict[str, Any] = {**data["known_good"], "found": how}
    rows = data.get("first_divergence") or []
    lines = merge_into_report(diag_dir, kg, rows)
    from elastic_diag.report.known_good import format_known_good
    from elastic_diag.report.terminal import shown

    said = [f"compared with the known-good run {good} ({how}):"]
    return said + [line.strip() for line in format_known_good(kg, rows, shown)] + lines


def merge_into_report(diag_dir: Path, kg: dict[str, Any], rows: list[Any]) -> list[str]:
    """``known_good`` and ``first_divergence`` into report.json (read again) and the page; a suspect the
    comparison gives where the verdict named none. The lines to say when that cannot be done."""
    from elastic_diag.layout import REPORT_FILE
    from elastic_diag.report.document import read_report, write_report
    from elastic_diag.report.html import write_html

    path = diag_dir / REPORT_FILE
    report = read_report(path)
    if report is None:
        return [f"the comparison is not in {path}: no readable report there"]
    report["known_good"] = kg
    report["first_divergence"] = rows
    d = report.get("diagnosis")
    suspect = kg.get("suspect")
    if isinstance(d, dict) and isinstance(suspect, dict) and d.get("initiating_rank") is None \
            and d.get("suspected_rank") is None:  # fmt: skip
        d["suspected_rank"] = suspect.get("rank")
        d["suspected_reason"] = suspect.get("reason")
    try:
        write_report(path, report)
        write_html(diag_dir, report)
    except OSError as err:
        return [f"the comparison is not in {path}: {err.strerror or err}"]
    return []


__all__ = ["ENV_KNOWN_GOOD", "compare_after_verdict", "good_run"]

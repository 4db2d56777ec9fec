"""Parity of the live verdict and the offline one on the same run: every torchrun-diag run of the suite
(``helpers.launch``) is also analysed by ``elastic_diag.offline.analyze.analyze_paths``, as a user would
after it, three ways, and each compared with report.json's verdict:

- ``console``: what the launcher printed, stdout and stderr interleaved (what a user pastes from the terminal);
- ``rank_folders``: the diag dir without any report.json / report.html: only what the launcher and the
  ranks wrote as evidence;
- ``diag_dir``: the diag dir as it is.

A comparison is ``same`` (same initiating rank, same class), ``weaker`` (a weakening: the same rank with
another class; or no rank, with the live culprit among the ranks the offline verdict leaves suspected: its
``suspected_rank``, or any rank it does not clear: a rank that exited 0 is cleared, one that failed or only
waited may still be the one that began it), ``differs`` (another rank; or no rank, the live culprit cleared),
``healthy_on_failure`` (the
run failed and offline says healthy) or ``error`` (the analyzer raised). A run that succeeded should be
``healthy`` offline (``same``), anything else ``differs``.

One JSON record per run goes to ``test-artifacts/parity/`` (shared by the xdist workers; conftest.py
clears it at the start of a session and prints the table at the end; tools/parity_table.py renders it
as Markdown). ``differs``, ``healthy_on_failure`` and ``error`` fail the test unless the case is in
``DOCUMENTED``, and so does a ``weaker`` one without a documented reason (why that way shows less): the
issue's rule, "the same verdict, or a documented reason why the log shows less, and then a weakening".
``ELASTIC_DIAG_PARITY=record`` records without failing, ``off`` skips it all.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from helpers import Run

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "test-artifacts" / "parity"
RECORD_SCHEMA = "elastic_diag.tests.parity/1"
REPORT_SCHEMA = "elastic_diag.report/1"
VERDICT_FILES = ("report.json", "report.html")  # what the rank_folders way leaves out
MODE_VARIABLE = "ELASTIC_DIAG_PARITY"  # enforce (default), record, off

WAYS = ("console", "rank_folders", "diag_dir")
OUTCOMES = ("same", "weaker", "differs", "healthy_on_failure", "error")
FAILING = frozenset({"differs", "healthy_on_failure", "error"})
# the role that clears a rank of having begun the failure: it exited 0. A rank that failed or waited may still be
# the one that began it (a rank that reached the collective late times out in it like its peers)
CLEARED = frozenset({"healthy"})

# Why a way shows less than the live verdict, by the way and a key (a test's node id, "script --inject
# VALUE" or a script's name). A documented run's weakening is recorded with the reason and does not fail
# its test; a documented run that differs still does (never another rank, never healthy).
_STACKS = ("the verdict rests on the ranks' stacks and progress records, taken by the launcher before it stopped "
           "them: a console shows only that every rank was stopped (SIGTERM)")  # fmt: skip
_RECORDS = ("the verdict rests on the ranks' flight recorders (which collective each issued, with which sizes): "
            "a console shows only gloo's abort of the rank that received too much and its peers' lost "
            "connections")  # fmt: skip
_NONFINITE = ("the verdict rests on the beacon's record of each rank's first non-finite loss: a console shows only "
              "that every rank found the averaged values non-finite")  # fmt: skip
_CALLS = ("the verdict rests on the roots and peers each rank's beacon recorded (calls.json): a console shows only "
          "the ranks' collective timeouts")  # fmt: skip
_NO_RANK_FOLDER = "the launch failed before any rank started: there is no rank folder, only the report"
DOCUMENTED: dict[str, dict[str, str]] = {
    **{f"train_ddp.py --inject {kind}": {"console": _STACKS}
       for kind in ("hang", "deadlock", "infinite-loop", "regex-hang", "shape-mismatch")},
    **{f"train_ddp.py --inject {kind}": {"console": _RECORDS}
       for kind in ("extra-collective", "skip-collective", "unused-layer")},
    **{f"train_fsdp2.py --inject {kind}": {"console": _STACKS}
       for kind in ("hang", "extra-collective", "shape-mismatch", "skip-collective")},
    "train_ddp.py --inject nan": {"console": _NONFINITE},
    "train_fsdp2.py --inject nan": {"console": _NONFINITE},
    "nan_batch_clip_error.py": {"console": _NONFINITE},
    **{script: {"console": _STACKS} for script in ("fsdp2_grad_hook_blocks.py", "watch_timeout_eval.py",
                                                     "slow_checkpoint_save.py", "flock_shard_fetch.py",
                                                     "filelock_download_stalls.py")},
    **{script: {"console": _RECORDS} for script in ("all_gather_into_tensor_bank.py", "allgather_ragged_eval.py",
                                                      "allreduce_metric_dtype.py", "broadcast_vocab_stale.py",
                                                      "reduce_scatter_shard_size.py")},
    **{script: {"console": _CALLS} for script in ("broadcast_best_checkpoint_src.py", "gather_counts_logger_rank.py",
                                                    "broadcast_object_list_two_sources.py",
                                                    "pipeline_skips_empty_send.py", "scatter_shards_reader_rank.py")},
    "python -c": {"console": "the Python API prints no failure table: a console does not show the ranks' exits"},
    "tests/launch/test_launcher_matrix.py::test_unusable_evidence_folder_degrades_to_plain_torchrun": {
        "rank_folders": "the evidence folder could not be written: no rank folder"},
    "tests/agent/test_cluster.py::test_an_unreachable_endpoint_and_a_port_in_use_are_diagnosed": {
        "rank_folders": _NO_RANK_FOLDER},
}  # fmt: skip

_ATTEMPT = re.compile(r"attempt_\d+")
_counter = itertools.count()


def mode() -> str:
    value = os.environ.get(MODE_VARIABLE, "").strip().lower()
    return value if value in ("record", "off") else "enforce"


def current_test() -> str:
    """The running test's node id (without pytest's ``(call)`` / ``(setup)`` phase)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.rsplit(" (", 1)[0] if current.endswith(")") else current


def describe_argv(argv: list[str]) -> tuple[str, str | None]:
    """The launched script's name and its ``--inject`` value, if any."""
    script = next((Path(a).name for a in argv[1:] if a.endswith((".py", ".sh"))), None)
    if script is None:
        script = "python -c" if "-c" in argv else Path(argv[-1]).name if argv else "?"
    if "--inject" in argv[:-1]:
        return script, argv[argv.index("--inject") + 1]
    return script, next((a.split("=", 1)[1] for a in argv if a.startswith("--inject=")), None)


def label(script: str, inject: str | None) -> str:
    return f"{script} --inject {inject}" if inject else script


def live_verdict(diag_dir: Path) -> dict[str, Any] | None:
    """report.json's status and final verdict; None where the run wrote no report of ours."""
    path = diag_dir / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA:
        return None
    d = report.get("diagnosis") or {}
    return {"status": report.get("status"), "initiating_rank": d.get("initiating_rank"),
            "failure_class": d.get("failure_class"), "suspected_rank": d.get("suspected_rank")}  # fmt: skip


def copy_evidence(src: Path, dst: Path) -> None:
    """The diag dir without its verdicts (report.json / report.html at the top and in every attempt_N/);
    regular files only (a beacon's FIFO left behind would block a copy)."""
    for folder, _dirs, files in os.walk(src):
        rel = Path(folder).relative_to(src)
        verdict_level = rel == Path(".") or (len(rel.parts) == 1 and _ATTEMPT.fullmatch(rel.parts[0]) is not None)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            path = Path(folder) / name
            if (verdict_level and name in VERDICT_FILES) or not path.is_file():
                continue
            shutil.copy2(path, dst / rel / name)


def offline_verdict(path: Path) -> dict[str, Any]:
    """``analyze_paths([path])`` in process; an exception is an ``error`` with its text."""
    from elastic_diag.offline.analyze import analyze_paths

    try:
        analysis = analyze_paths([path])
    except Exception as e:  # an analyzer that raises on our own run's files is the finding
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    d = analysis.diagnosis
    return {"initiating_rank": d.initiating_rank, "failure_class": d.failure_class, "suspected_rank": d.suspected_rank,
            "failure_seen": analysis.failure_seen, "rule": d.rule,
            "roles": {str(r): role for r, role in sorted(d.roles.items())}}  # fmt: skip


def compare(live: dict[str, Any], offline: dict[str, Any]) -> str:
    if "error" in offline:
        return "error"
    rank, cls = offline["initiating_rank"], offline["failure_class"]
    if live["status"] == "succeeded":
        return "same" if cls == "healthy" else "differs"
    if cls == "healthy":
        return "healthy_on_failure"
    culprit = live["initiating_rank"]
    if rank == culprit and cls == live["failure_class"]:
        return "same"
    if rank is not None and rank == culprit:
        return "weaker"  # the same rank, told less precisely
    suspected = culprit is None or culprit == offline.get("suspected_rank")
    if rank is None and (suspected or offline.get("roles", {}).get(str(culprit), "unknown") not in CLEARED):
        return "weaker"
    return "differs"


def analyse(run: Run, live: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The three offline verdicts of a run, each with its comparison with ``live``."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        inputs: dict[str, Path] = {"diag_dir": run.diag_dir}
        try:
            console = Path(tmp) / "console.log"
            console.write_text(run.console, encoding="utf-8", errors="replace")
            inputs["console"] = console
        except Exception as e:  # the harness's own failure: recorded, never a crash
            results["console"] = {"error": f"the harness could not write console.log: {type(e).__name__}: {e}"}
        try:
            folders = Path(tmp) / run.diag_dir.name
            copy_evidence(run.diag_dir, folders)
            inputs["rank_folders"] = folders
        except Exception as e:  # the harness's own failure: recorded, never a crash
            results["rank_folders"] = {"error": f"the harness could not copy the diag dir: {type(e).__name__}: {e}"}
        for way in WAYS:
            if way in inputs:
                start = time.monotonic()
                results[way] = offline_verdict(inputs[way])
                results[way]["seconds"] = round(time.monotonic() - start, 3)
    for way in WAYS:
        results[way]["comparison"] = compare(live, results[way])
    return {way: results[way] for way in WAYS}


def documented(node: str, script: str, inject: str | None) -> dict[str, str]:
    """Why each way shows less for this run (way -> reason), where it is documented."""
    for key in (node, label(script, inject), script):
        if key in DOCUMENTED:
            return DOCUMENTED[key]
    return {}


def write_record(record: dict[str, Any]) -> Path | None:
    name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", record["test"] or "no-test").strip("_")[:150]
    path = FOLDER / f"{name}-{os.getpid()}-{next(_counter)}.json"
    try:
        FOLDER.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    except OSError:
        return None
    return path


def verdict_text(v: dict[str, Any]) -> str:
    """``rank 2, hang``; ``no rank (suspect 1), desync``; ``error: ...``."""
    if "error" in v:
        return f"error: {v['error']}"
    rank = "no rank" if v.get("initiating_rank") is None else f"rank {v['initiating_rank']}"
    if v.get("suspected_rank") is not None:
        rank += f" (suspect {v['suspected_rank']})"
    unseen = v.get("failure_seen") is False and v.get("failure_class") != "healthy"
    seen = " (no failure seen: `elastic-diag analyze` exits 0)" if unseen else ""
    return f"{rank}, {v.get('failure_class')}{seen}"


def check(run: Run, argv: list[str]) -> dict[str, Any] | None:
    """Called by ``launch`` after every run: record the parity of a torchrun-diag run (one that wrote
    report.json) and fail its test on a real difference unless it is documented or only recorded."""
    if mode() == "off":
        return None
    live = live_verdict(run.diag_dir)
    if live is None:
        return None
    node = current_test()
    script, inject = describe_argv(argv)
    offline = analyse(run, live)
    reasons = documented(node, script, inject)
    failing = [way for way in WAYS if offline[way]["comparison"] in FAILING
               or (offline[way]["comparison"] == "weaker" and way not in reasons)]  # fmt: skip
    reason = "; ".join(f"{way}: {why}" for way, why in reasons.items()) or None
    record = {"schema": RECORD_SCHEMA, "test": node, "script": script, "inject": inject, "argv": label(script, inject),
              "returncode": run.returncode, "diag_dir": str(run.diag_dir), "live": live, "offline": offline,
              "failing": failing, "documented": reason, "mode": mode()}  # fmt: skip
    path = write_record(record)
    if path is not None and any(offline[way]["comparison"] != "same" for way in WAYS):
        with contextlib.suppress(OSError):  # what the console way read, to see why
            path.with_suffix(".console.log").write_text(run.console, encoding="utf-8", errors="replace")
    if failing and mode() == "enforce":
        lines = [f"parity: the offline analysis of this run disagrees with its live verdict ({label(script, inject)})",
                 f"  live ({live['status']}): {verdict_text(live)}"]  # fmt: skip
        for way in WAYS:
            v = offline[way]
            lines.append(f"  {way}: {verdict_text(v)} -> {v['comparison']}")
            if "traceback" in v:
                lines.append("    " + v["traceback"].rstrip().replace("\n", "\n    "))
        lines.append(f"  record: {path}" if path else "  (the record could not be written)")
        lines.append(f"  {MODE_VARIABLE}=record only records; a way that shows less (a weakening) goes in DOCUMENTED "
                     "(tests/parity.py) with the reason; a difference is a bug")  # fmt: skip
        pytest.fail("\n".join(lines), pytrace=False)
    return record


# --- the records, read back (conftest.py's summary, tools/parity_table.py) ---------------------------------
def clear() -> None:
    shutil.rmtree(FOLDER, ignore_errors=True)


def load(folder: Path = FOLDER) -> list[dict[str, Any]]:
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("schema") == RECORD_SCHEMA:
            records.append(record)
    return sorted(records, key=lambda r: (r["test"], r["argv"]))


def short_test(node: str, width: int = 70) -> str:
    node = node.removeprefix("tests/").replace(".py::", "::")
    return node if len(node) <= width else node[: width - 1] + "…"


def cell(v: dict[str, Any]) -> str:
    """``2/hang``, ``-/collective_timeout (suspect 1)``, ``error``."""
    if "error" in v:
        return "error"
    rank = "-" if v.get("initiating_rank") is None else str(v["initiating_rank"])
    suspect = f" (suspect {v['suspected_rank']})" if v.get("suspected_rank") is not None else ""
    return f"{rank}/{v.get('failure_class')}{suspect}"


def totals(records: list[dict[str, Any]]) -> dict[str, Counter[str]]:
    return {way: Counter(r["offline"][way]["comparison"] for r in records) for way in WAYS}


def totals_text(counts: Counter[str]) -> str:
    return ", ".join(f"{counts.get(o, 0)} {o}" for o in OUTCOMES)

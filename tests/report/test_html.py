"""report.html and `elastic-diag report`: the page renders the verdict and the timeline, at 1,024
ranks too, and renders what it can from a partial or missing report.json (pure, no torch runs)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.progress import Progress
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.layout import write_json_atomic
from elastic_diag.report.document import AttemptRecord, build_report
from elastic_diag.report.html import render_html, write_html
from elastic_diag.report.rank_story import group_rows, rank_rows
from elastic_diag.report.reading import load_report_dir, salvage_object

REPORTS = FIXTURES / "reports"

WATCHDOG = (
    "[rank{r}]:[E ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=90210, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600071 "
    "milliseconds before timing out."
)
STACK = "\n".join(
    [
        "Thread 0x00007f0000000001 (most recent call first):",
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
        '  File "/job/train.py", line 211 in train_step',
        '  File "/job/train.py", line 300 in main',
    ]
)


LINES = tuple(f"line {i}" for i in range(20))


def big_report(nodes: int = 128, per_node: int = 8, culprit: int = 613) -> dict:
    """A 1,024-rank failure as the agent reports it: one CUDA OOM, every other rank's watchdog."""
    ranks = []
    for r in range(nodes * per_node):
        node = f"host-{r // per_node}"
        start = 1000.0 + (r % 97) / 50
        if r == culprit:
            exc = ExceptionRecord(
                type="torch.OutOfMemoryError",
                message="CUDA out of memory. Tried to allocate 20.00 GiB",
                traceback='  File "/job/train.py", line 198, in forward\n',
                time=1400.0,
            )
            ranks.append(RankEvidence(rank=r, local_rank=r % per_node, node=node, exit_code=1, exit_time=1400.2,
                                      start_time=start, progress=Progress(progress_time=1399.5, steps=4000),
                                      exception=exc,
                                      stderr_tail=(*LINES[:19], f"{exc.type}: {exc.message}")))  # fmt: skip
        elif r % per_node == per_node - 1 and per_node > 2:  # never reached its watchdog: stopped at teardown
            ranks.append(RankEvidence(rank=r, local_rank=r % per_node, node=node, exit_code=-15, exit_time=2002.5,
                                      start_time=start, progress=Progress(progress_time=1399.9, steps=4000),
                                      alive_at_decision=True,
                                      stopped_by_agent=True, stack=parse_stack_dump(STACK)))  # fmt: skip
        else:
            ranks.append(RankEvidence(rank=r, local_rank=r % per_node, node=node, exit_code=-6,
                                      exit_time=2001 + (r % 13) / 10, start_time=start,
                                      progress=Progress(progress_time=1399.9, steps=4000), stderr_tail=LINES[:18]
                                      + (WATCHDOG.format(r=r), "Fatal Python error: Aborted"),
                                      stack=parse_stack_dump(STACK)))  # fmt: skip
    evidence = AttemptEvidence(attempt=0, ranks=tuple(ranks), decided_at=2002.0)
    diagnosis = classify_attempt(evidence)
    record = AttemptRecord(evidence=evidence, diagnosis=diagnosis, status="failed", final=True)
    return build_report(run_id="big", status="failed", attempts=[record], diag_dir="/runs/big", node="host-0")


def test_1024_ranks_render_fast_small_and_grouped(tmp_path):
    report = big_report()
    assert report["diagnosis"]["initiating_rank"] == 613
    write_json_atomic(tmp_path / "report.json", report)
    json_mb = (tmp_path / "report.json").stat().st_size / 1e6
    start = time.perf_counter()
    path, problems = write_html(tmp_path)  # read report.json, render, write: what `elastic-diag report` does
    seconds = time.perf_counter() - start
    page = path.read_text()
    size_mb = len(page.encode()) / 1e6
    print(f"1024 ranks: report.json {json_mb:.1f} MB, report.html {size_mb:.2f} MB in {seconds:.2f} s")
    assert problems == []
    assert seconds < 2.0
    assert size_mb < 3.0
    groups = group_rows(rank_rows(report["ranks"]))
    labels = [g.label for g in groups]
    assert len(groups) == 3, labels  # the culprit, the ranks whose watchdog fired, the ranks stopped at teardown
    assert groups[0].first.rank == 613 and groups[0].first.role == "initiating"
    assert "Initiating rank 613 on host-76" in page
    assert sum(len(g.rows) for g in groups) == 1024
    assert labels[1].startswith("895 ranks on 128 nodes: 0-6, 8-14,") and labels[2].startswith("128 ranks on 128 nodes")
    svg = re.search(r"<svg class=\"timeline\".*?</svg>", page, re.S)
    assert svg is not None and svg.group(0).count('class="bar"') == len(groups)


def test_small_job_has_a_row_a_rank_and_the_initiating_row_stands_out():
    report = big_report(nodes=1, per_node=4, culprit=2)
    page = render_html(report)
    svg = re.search(r"<svg class=\"timeline\".*?</svg>", page, re.S).group(0)  # type: ignore[union-attr]
    assert svg.count('class="bar"') == 4
    assert svg.count('class="initiating-row"') == 1
    assert svg.count('class="how">SIGTERM<') == 1 and svg.count('class="how">SIGABRT<') == 2
    assert "&#9654; rank 2 (host-0)" in svg
    assert 'class="teardown"' in svg and svg.count('class="progress"') == 4
    # the verdict comes first, then the timeline, the table, the evidence with the stack
    order = [page.index(s) for s in ('id="verdict"', "<svg", "What every rank was doing", "stack taken before")]
    assert order == sorted(order)
    assert "CUDA out of memory" in page and "train.py:211 in train_step" in page


def test_the_page_is_self_contained():
    page = render_html(big_report(nodes=2, per_node=4, culprit=5))
    without_ns = page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for forbidden in ("http://", "https://", "<script", "<link", " src=", "url(", "@import", "<img", "<iframe"):
        assert forbidden not in without_ns, forbidden


def test_html_escapes_what_the_ranks_printed():
    report = big_report(nodes=1, per_node=2, culprit=1)
    report["ranks"][1]["last_lines"] = ["<script>alert(1)</script> & </pre>"]
    page = render_html(report)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;/pre&gt;" in page


def test_a_report_from_a_real_run_renders_its_collective_and_stacks():
    report, problems = load_report_dir(REPORTS / "desync")
    assert problems == []
    page = render_html(report, problems)
    d = report["diagnosis"]
    assert f"Initiating rank {d['initiating_rank']}" in page
    assert "Where the collective schedules part" in page and "train_ddp.py" in page
    assert page.count("<details") == 4 and "last lines of stderr" in page  # the initiating rank + one a story


def test_missing_report_json_is_reconstructed_from_the_rank_folders(tmp_path):
    shutil.copytree(FIXTURES / "runs" / "diag_hang", tmp_path / "run")
    for written in (tmp_path / "run").rglob("report.*"):  # as if the launcher died before writing them
        written.unlink()
    report, problems = load_report_dir(tmp_path / "run")
    assert any("no report.json" in p for p in problems)
    assert any("judged again from the evidence" in p for p in problems)
    assert any("no launcher.json" in p for p in problems)  # an earlier version's folder, its report gone too
    page = render_html(report, problems)
    assert "Incomplete report" in page
    assert report["diagnosis"]["initiating_rank"] is not None
    assert f"Initiating rank {report['diagnosis']['initiating_rank']}" in page


def test_truncated_report_keeps_every_complete_entry(tmp_path):
    full = json.dumps(big_report(nodes=1, per_node=4, culprit=2), indent=2)
    cut = full[: full.index('"warnings"') - 500]  # inside the ranks list
    (tmp_path / "report.json").write_text(cut)
    report, problems = load_report_dir(tmp_path)
    assert report["diagnosis"]["initiating_rank"] == 2
    assert 1 <= len(report["ranks"]) < 4
    assert any("incomplete" in p and "'ranks'" in p for p in problems)
    assert any("no 'attempts'" in p for p in problems)
    page = render_html(report, problems)
    assert "Initiating rank 2" in page and "Incomplete report" in page


def test_garbage_empty_and_foreign_reports_say_so(tmp_path):
    cases = {
        "garbage": (b"\x00\xffnot json at all", "incomplete"),
        "empty": (b"", "is empty"),
        "list": (b"[1, 2]", "holds a JSON list"),
        "foreign": (json.dumps({"schema": "other/9", "diagnosis": {}, "ranks": []}).encode(), "schema 'other/9'"),
    }
    for name, (raw, expected) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "report.json").write_bytes(raw)
        report, problems = load_report_dir(d)
        assert any(expected in p for p in problems), (name, problems)
        assert "<h1>" in render_html(report, problems)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=10_000))
def test_any_prefix_of_a_report_renders(cut):
    full = json.dumps(big_report(nodes=1, per_node=3, culprit=1), indent=2)
    salvaged, where = salvage_object(full[: cut % (len(full) + 1)])
    page = render_html(salvaged, [where or ""])
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>")


def test_elastic_diag_report_command(tmp_path):
    write_json_atomic(tmp_path / "report.json", big_report(nodes=1, per_node=2, culprit=0))
    out = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "report", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "report.html")
    assert "Initiating rank 0" in (tmp_path / "report.html").read_text()
    missing = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "no such folder" in missing.stderr


@pytest.mark.parametrize("status", ["succeeded", "failed"])
def test_no_ranks_at_all_still_renders(status):
    page = render_html({"status": status, "diagnosis": {"failure_class": "healthy"}, "attempts": []})
    assert "<h1>" in page and "Incomplete report" not in page


def test_restarts_show_every_attempt_and_the_gate():
    first = big_report(nodes=1, per_node=2, culprit=1)
    attempt0 = dict(first["attempts"][0], attempt=0)
    attempt1 = dict(first["attempts"][0], attempt=1, came_up=False,
                    gate={"decision": "refuse", "reason": "the same failure as attempt 0",
                          "controls": [{"name": "collective", "passed": False, "summary": "all_reduce timed out",
                                        "output_file": "attempt_1/gate/collective.log"}]})  # fmt: skip
    report = dict(first, attempts=[attempt0, attempt1])
    page = render_html(report)
    assert page.index("Attempt 1") < page.index("Attempt 0")  # the job's end first
    assert "never came up" in page and "Restart gate" in page and "<b>FAILED</b>" in page
    assert "attempt_1/gate/collective.log" in page

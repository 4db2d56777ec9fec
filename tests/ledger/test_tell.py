"""elastic_diag/ledger/tell.py: the verdict posted to local HTTP servers this module starts (one that answers, a slow
one, one that answers 500, one that never answers), a command run with the report, and a real failed job under
torchrun-diag and under elastic-diag exec: recorded in the ledger, told, bounded in time, its exit status unchanged."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import ROOT, launch, torchrun_diag

from elastic_diag.ledger.store import Ledger
from elastic_diag.ledger.tell import TellOptions, notification, post_json, run_notify_cmd, tell

pytestmark = [pytest.mark.timeout(240)]
REPORT = {"schema": "elastic_diag.report/1", "run_id": "r1", "status": "failed",
          "diagnosis": {"failure_class": "python_exception", "initiating_rank": 1, "initiating_node": "gpu-3",
                        "signature_id": "python-exception", "summary": "Rank 1 on gpu-3 raised KeyError. More.",
                        "evidence": ["KeyError: 'ferret'"], "fix": "Fix the label map."},
          "attempts": [{"attempt": 0, "status": "failed", "ranks": [{"rank": 1, "node": "gpu-3"}],
                        "diagnosis": {"failure_class": "python_exception", "initiating_rank": 1,
                                      "initiating_node": "gpu-3", "signature_id": "python-exception"}}]}  # fmt: skip


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []
    delay = 0.0
    status = 200

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        time.sleep(self.delay)
        type(self).received.append({"path": self.path, "body": json.loads(body)})
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def _server(delay: float = 0.0, status: int = 200) -> tuple[ThreadingHTTPServer, type[_Hook]]:
    handler = type("Hook", (_Hook,), {"received": [], "delay": delay, "status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


@pytest.fixture
def silent() -> Iterator[str]:
    """A server that accepts the connection and never answers (nor reads)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/services/T000/B000/very-secret-token"
    sock.close()


def _stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


def _url(server: ThreadingHTTPServer, path: str = "/hook") -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_a_verdict_is_posted_with_a_slack_text_and_its_fields():
    server, hook = _server()
    try:
        out = post_json(_url(server), notification(REPORT, "/runs/x/report.json", env={"SLURM_JOB_ID": "77"}), 5.0)
    finally:
        _stop(server)
    assert out["ok"] and out["status"] == 200
    (got,) = hook.received
    text, fields = got["body"]["text"], got["body"]["elastic_diag"]
    head = "elastic_diag: job FAILED: initiating rank 1 on gpu-3: python_exception - Rank 1 on gpu-3 raised KeyError"
    assert text.startswith(head)
    assert "report: /runs/x/report.json" in text
    assert (fields["schema"], fields["job_id"], fields["blame"], fields["initiating_host"]) == (
        "elastic_diag.notify/1",
        "slurm:77",
        "job",
        "gpu-3",
    )
    assert fields["fingerprint"] and fields["hosts"] == ["gpu-3"]


@pytest.mark.parametrize("kind", ["slow", "500"])
def test_a_slow_server_and_one_that_fails_are_bounded_and_said(kind):
    server, _ = _server(delay=6.0) if kind == "slow" else _server(status=500)
    try:
        started = time.monotonic()
        out = post_json(_url(server, "/services/T0/B0/secret-path"), {"text": "x"}, 1.5)
        took = time.monotonic() - started
    finally:
        _stop(server)
    assert not out["ok"] and took < 3.0
    assert ("HTTP 500" if kind == "500" else "timed out") in out["line"] or "no answer" in out["line"]
    assert "secret-path" not in out["line"] and "/..." in out["line"]


def test_a_server_that_never_answers_is_given_up_within_the_bound(silent):
    started = time.monotonic()
    out = post_json(silent, {"text": "x"}, 1.0)
    assert not out["ok"] and time.monotonic() - started < 2.5 and "very-secret-token" not in json.dumps(out)


def test_the_command_gets_the_report_and_a_failing_or_stuck_one_is_said(tmp_path):
    mark = tmp_path / "args"
    ok = run_notify_cmd(f"{sys.executable} -c \"import sys; open('{mark}', 'w').write(' '.join(sys.argv[1:]))\"",
                        "/runs/x/report.json", 10.0, os.environ)  # fmt: skip
    assert ok["ok"] and mark.read_text() == "/runs/x/report.json"
    bad = run_notify_cmd(f"{sys.executable} -c \"import sys; sys.exit('pager down')\"", "/r.json", 10.0, os.environ)
    assert not bad["ok"] and "exited 1: pager down" in bad["line"]
    started = time.monotonic()
    stuck = run_notify_cmd(f'{sys.executable} -c "import time; time.sleep(60)"', "/r.json", 1.0, os.environ)
    assert "killed after 1 s" in stuck["line"] and time.monotonic() - started < 5
    assert "could not start" in run_notify_cmd("/no/such/notifier", "/r.json", 1.0, os.environ)["line"]


def test_a_success_is_not_told(tmp_path):
    server, hook = _server()
    try:
        lines = tell({**REPORT, "status": "succeeded"}, None, TellOptions(ledger=None, notify_url=_url(server)),
                     diag_dir=tmp_path)  # fmt: skip
    finally:
        _stop(server)
    assert lines == [] and hook.received == [] and not (tmp_path / "notify.json").exists()


def _rows(path: Path) -> list[dict]:
    import sqlalchemy as sa

    ledger = Ledger(f"sqlite:///{path}")
    try:
        return ledger.read("rows", lambda c: [dict(r._mapping) for r in c.execute(sa.select(ledger.table()))])
    finally:
        ledger.close()


def test_a_failed_job_is_recorded_and_told_and_its_exit_status_is_unchanged(tmp_path, silent):
    """torchrun-diag on a real 2-rank job whose rank 1 raises: the webhook never answers (given up after 2 s), the
    command runs, the ledger has the verdict, the exit status is torchrun's 1."""
    mark = tmp_path / "told"
    ledger = tmp_path / "ledger.sqlite"
    argv = torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-dir", str(tmp_path / "diag"),
                         "--diag-ledger", str(ledger), "--diag-notify", silent, "--diag-notify-cmd",
                         f"{sys.executable} -c \"import sys; open('{mark}', 'w').write(sys.argv[1])\"",
                         str(ROOT / "tests" / "scenarios" / "chain_timeout_then_report.py"))  # fmt: skip
    started = time.monotonic()
    run = launch(argv, tmp_path / "diag", timeout=150, env={"ELASTIC_DIAG_NOTIFY_TIMEOUT_S": "2",
                                                            "ELASTIC_DIAG_LEDGER": "off"})  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]
    assert time.monotonic() - started < 120
    assert "torchrun-diag: the verdict was not posted to http://127.0.0.1:" in run.stderr
    assert "very-secret-token" not in run.stderr
    assert mark.read_text() == str(tmp_path / "diag" / "report.json")
    told = json.loads((tmp_path / "diag" / "notify.json").read_text())
    assert [(o["kind"], o["ok"]) for o in told["outcomes"]] == [("webhook", False), ("command", True)]
    (row,) = _rows(ledger)
    assert (row["source"], row["status"], row["initiating_rank"], row["failure_class"], row["blame"]) == (
        "torchrun-diag",
        "failed",
        1,
        "python_exception",
        "job",
    )
    assert row["report_path"] == str(tmp_path / "diag" / "report.json")
    # the verification it prints tells nobody
    assert "--diag-notify" not in run.report["diagnosis"]["verify"]


def test_elastic_diag_exec_records_every_rank_watchs_verdict_once(tmp_path):
    """Two watched ranks (no torch: plain Python), rank 1 raises: one row, the exec verdict."""
    import subprocess

    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    raise KeyError('ferret')\n"
                      "time.sleep(1)\n")  # fmt: skip
    ledger = tmp_path / "ledger.sqlite"
    procs = [subprocess.Popen([sys.executable, "-m", "elastic_diag", "exec", "--diag-dir", str(tmp_path / "diag"),
                               "--diag-grace", "2", "--diag-ledger", str(ledger), "--", sys.executable, str(script)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 1], outs
    (row,) = _rows(ledger)
    assert (row["source"], row["initiating_rank"], row["failure_class"]) == ("exec", 1, "python_exception")


def test_a_second_node_failure_on_a_host_says_to_keep_it_out(tmp_path, monkeypatch):
    from elastic_diag.ledger.tell import keep_out, record_verdict

    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid={}, name=python, GPU has fallen off the bus."

    def report(run: str, sig: str, line: str) -> dict:
        d = {"failure_class": "cuda_error", "initiating_rank": 0, "initiating_node": "gpu-9", "signature_id": sig,
             "evidence": [line]}  # fmt: skip
        return {
            "run_id": run,
            "status": "failed",
            "requeue": {"requeue": True},
            "attempts": [{"attempt": 0, "status": "failed", "diagnosis": d, "ranks": [{"rank": 0, "node": "gpu-9"}]}],
        }

    options = TellOptions(ledger=f"sqlite:///{tmp_path / 'l.sqlite'}")
    bug = report("u", "python-exception", "KeyError: 1")
    first = report("a", "gpu-xid-ecc", xid.format(11))
    second = report("b", "gpu-xid-ecc", xid.format(12))
    for r, job in ((bug, "1"), (first, "2")):
        assert record_verdict(r, None, options, source="exec", env={"SLURM_JOB_ID": job}) == []
        assert keep_out(r, options, {"SLURM_JOB_ID": job}) == []  # a user's bug; one GPU fault is not a pattern
    record_verdict(second, None, options, source="exec", env={"SLURM_JOB_ID": "3"})
    (line,) = keep_out(second, options, {"SLURM_JOB_ID": "3"})
    assert line.startswith("gpu-9 is recommended for exclusion: 2 node failure(s) in 14 days (rule: 2)")
    assert "the requeued job may land on it again" in line and "--diag-drain" in line and "--exclude=gpu-9" in line
    (line,) = keep_out(second, options, {})
    assert line.endswith("resubmit with --exclude=gpu-9, or drain it (elastic-diag fleet --apply)")
    # --diag-drain where the drain cannot run (the real drain: tests/launch/test_slurm.py): said, with the way out
    monkeypatch.setenv("PATH", str(tmp_path))
    (line,) = keep_out(second, replace(options, drain=True), {"SLURM_JOB_ID": "3"})
    assert "could not be drained (scontrol is not on PATH)" in line and line.endswith("--exclude=gpu-9"), line


def test_secrets_of_the_process_never_reach_the_ledger_or_the_webhook(tmp_path, monkeypatch):
    from elastic_diag import redaction
    from elastic_diag.ledger.tell import record_verdict

    secret = "hf_" + "Zq8" * 12
    monkeypatch.setattr(redaction, "_CURRENT", redaction.Redactor({secret}))
    leaky = json.loads(json.dumps(REPORT))
    leaky["diagnosis"]["summary"] = f"Rank 1 on gpu-3 failed to log in with {secret}. More."
    leaky["attempts"][0]["diagnosis"]["summary"] = leaky["diagnosis"]["summary"]
    leaky["launch"] = {"launch_command": f"torchrun-diag train.py --hub-token {secret}"}
    options = TellOptions(ledger=f"sqlite:///{tmp_path / 'l.sqlite'}")
    assert record_verdict(leaky, None, options, source="exec") == []
    for f in tmp_path.glob("l.sqlite*"):  # the WAL too
        assert secret not in f.read_bytes().decode("latin-1"), f
    server, hook = _server()
    try:
        tell(leaky, None, TellOptions(ledger=None, notify_url=_url(server)), diag_dir=tmp_path)
    finally:
        _stop(server)
    assert secret not in json.dumps(hook.received) and "***" in json.dumps(hook.received)

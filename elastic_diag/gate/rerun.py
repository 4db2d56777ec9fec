"""``elastic-diag verify DIR``: run the report's verification command, judge it (core/verification.py:
exit 0 within the deadline and the signature gone), and record the outcome in report.json
(``verification``, additive) and report.html.

The command runs in its own process group with a deadline; on the deadline the group gets SIGTERM
(a relaunched torchrun-diag writes its stopped report then), and SIGKILL ``KILL_AFTER_S`` later. Its
output goes to ``<diag-dir>/verification.log``, at most ``LOG_LIMIT`` bytes (the head and the tail of
a command that prints GBs, with how much was left out); memory stays bounded whatever it prints.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verification import judge, signature_line
from elastic_diag.errors import UsageError
from elastic_diag.layout import REPORT_FILE
from elastic_diag.report.document import read_report

VERIFICATION_LOG = "verification.log"
LOG_LIMIT = 8 * 1024 * 1024  # bytes of output kept on disk: the first half and the last half
TAIL_LIMIT = 64 * 1024  # bytes of the output's end kept in memory (and judged with the log's head)
KILL_AFTER_S = 15.0  # SIGTERM at the deadline, SIGKILL this much later
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(slots=True)
class CommandRun:
    exit_code: int | None  # None: killed at the deadline
    timed_out: bool
    seconds: float
    output_bytes: int
    head: str  # the first LOG_LIMIT / 2 bytes
    tail: str  # the last TAIL_LIMIT bytes
    log_file: str | None


def _push(buf: deque[bytes], size: int, chunk: bytes, limit: int) -> int:
    """Append ``chunk``, drop whole chunks from the front while the rest still holds ``limit`` bytes."""
    buf.append(chunk)
    size += len(chunk)
    while len(buf) > 1 and size - len(buf[0]) >= limit:
        size -= len(buf.popleft())
    return size


class _BoundedSink:
    """Keeps the first and the last ``LOG_LIMIT // 2`` bytes in memory and writes them to the log, with
    a line between them saying how much was left out."""

    def __init__(self, log: IO[bytes] | None) -> None:
        self.log = log
        self.total = 0
        self.head = bytearray()
        self.tail: deque[bytes] = deque()  # whole chunks holding at least the last LOG_LIMIT // 2 bytes
        self.tail_bytes = 0
        self.closed = False

    def add(self, chunk: bytes) -> None:
        if self.closed:
            return
        self.total += len(chunk)
        room = LOG_LIMIT // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            if self.log is not None:
                self.log.write(chunk[:room])
            chunk = chunk[room:]
        if chunk:
            self.tail_bytes = _push(self.tail, self.tail_bytes, chunk, LOG_LIMIT // 2)

    def close(self) -> None:
        self.closed = True
        if self.log is None:
            return
        end = b"".join(self.tail)[-(LOG_LIMIT // 2) :]
        kept = len(self.head) + len(end)
        if self.total > kept:
            self.log.write(f"\n[elastic_diag: {self.total - kept} bytes of output left out here]\n".encode())
        self.log.write(end)
        self.log.close()

    def text_tail(self) -> str:
        """The output's last TAIL_LIMIT bytes."""
        ends: list[bytes] = []
        size = 0
        for chunk in reversed(self.tail):
            ends.append(chunk)
            size += len(chunk)
            if size >= TAIL_LIMIT:
                break
        data = bytes(self.head) + b"".join(reversed(ends)) if size < TAIL_LIMIT else b"".join(reversed(ends))
        return data[-TAIL_LIMIT:].decode(errors="replace")


def run_command(command: str, *, timeout_s: float, log_path: Path | None, cwd: str | None = None,
                env: dict[str, str] | None = None) -> CommandRun:  # fmt: skip
    """``bash -c command`` with a deadline and bounded output (see the module's doc)."""
    started = time.monotonic()
    log: IO[bytes] | None = None
    if log_path is not None:
        try:
            # 0600 whatever the umask, as every file of the diag dir (layout.PRIVATE_FILE_MODE); closed by the sink
            log = open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")  # noqa: SIM115
            os.fchmod(log.fileno(), 0o600)
        except OSError:
            log = None
    sink = _BoundedSink(log)
    try:
        proc = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd if cwd and os.path.isdir(cwd) else None,
                                env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip
    except OSError as e:
        sink.add(f"cannot run bash: {e.strerror or e}\n".encode())
        sink.close()
        return CommandRun(127, False, 0.0, sink.total, bytes(sink.head).decode(errors="replace"), sink.text_tail(),
                          str(log_path) if log is not None else None)  # fmt: skip
    assert isinstance(proc.stdout, io.BufferedReader)
    stdout = proc.stdout

    def pump() -> None:
        while chunk := stdout.read1(1 << 20):
            sink.add(chunk)

    reader = threading.Thread(target=pump, name="elastic-diag-verify-output", daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    _signal_group(proc.pid, signal.SIGKILL)  # what the command left behind in its group goes with it
    reader.join(timeout=5)
    if not reader.is_alive():  # else a process that left the group still holds the pipe: the thread keeps it
        stdout.close()
    sink.close()
    if log is not None and log_path is not None:  # no secret of this process in the kept output
        from elastic_diag import redaction

        redaction.redact_file(log_path, redaction.current())
    tail = sink.text_tail() + (f"\n[elastic_diag: killed after the {timeout_s:g} s deadline]\n" if timed_out else "")
    return CommandRun(None if timed_out else proc.returncode, timed_out, time.monotonic() - started, sink.total,
                      bytes(sink.head).decode(errors="replace"), tail,
                      str(log_path) if log is not None else None)  # fmt: skip


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signature_patterns(signature_id: str | None) -> tuple[str, ...]:
    if not signature_id:
        return ()
    try:
        sig = load_taxonomy().get(signature_id)
    except KeyError:
        return ()
    return tuple(p.pattern for p in sig.patterns)


def verify_diag_dir(diag_dir: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Run the verification of ``diag_dir``'s report, record it there, and return the record
    (``passed``, ``summary``, ...). Raises UsageError when there is no report or nothing to run."""
    diag_dir = diag_dir.absolute()
    report_path = diag_dir / REPORT_FILE
    report = read_report(report_path)
    if report is None:
        raise UsageError(f"no readable {REPORT_FILE} in {diag_dir}: is it a diag dir of torchrun-diag?")
    d = dict(report.get("diagnosis") or {})
    plan = dict(d.get("verify_plan") or {})
    command = str(plan.get("command") or d.get("verify") or "")
    started_at = time.time()
    if report.get("status") == "succeeded" and not command:
        record: dict[str, Any] = {"passed": True, "summary": "the run succeeded: nothing to verify", "command": None}
    elif not command:
        raise UsageError(f"{report_path} has no verification command (diagnosis.verify is empty)")
    else:
        verify_dir = plan.get("verify_dir")
        run = run_command(command, timeout_s=timeout_s, log_path=diag_dir / VERIFICATION_LOG, cwd=plan.get("cwd"))
        rerun = None
        if verify_dir:
            candidate = Path(str(verify_dir)) / REPORT_FILE
            try:
                if candidate.stat().st_mtime >= started_at - 1:
                    rerun = read_report(candidate)
            except OSError:
                rerun = None
        patterns = signature_patterns(d.get("signature_id"))
        seen = signature_line(patterns, run.head) or signature_line(patterns, run.tail)
        rank = d.get("initiating_rank") if isinstance(d.get("initiating_rank"), int) else None
        verdict = judge(exit_code=run.exit_code, timed_out=run.timed_out, timeout_s=timeout_s,
                        signature_id=d.get("signature_id"), seen_line=seen, rerun_report=rerun,
                        initiating_rank=rank)  # fmt: skip
        record = {
            "passed": verdict.passed,
            "summary": verdict.summary,
            "command": command,
            "exit_code": run.exit_code,
            "timed_out": run.timed_out,
            "timeout_s": timeout_s,
            "seconds": round(run.seconds, 3),
            "output_bytes": run.output_bytes,
            "output_file": run.log_file,
            "output_tail": run.tail[-4000:],
            "signature_seen": verdict.signature_seen,
            "rerun_report": str(Path(str(verify_dir)) / REPORT_FILE) if rerun is not None else None,
            "rerun_status": rerun.get("status") if rerun is not None else None,
        }
    record["started_at"] = datetime.fromtimestamp(started_at).isoformat(timespec="seconds")
    _record(diag_dir, record)
    return record


def _record(diag_dir: Path, record: dict[str, Any]) -> None:
    """``verification`` into report.json (read again: the launcher may have rewritten it meanwhile) and the page."""
    from elastic_diag.report.document import write_report
    from elastic_diag.report.html import write_html

    report = read_report(diag_dir / REPORT_FILE) or {}
    report["verification"] = record
    write_report(diag_dir / REPORT_FILE, report)
    write_html(diag_dir, report)

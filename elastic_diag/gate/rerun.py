"""``elastic-diag verify DIR``: run the report's verification command, judge it (core/verification.py:
exit 0 within the deadline and the signature gone), and record the outcome in report.json
(``verification``, additive) and report.html.

A report is data, not a script (gate/report_command.py): :func:`pending_verification` reads what it
asks to run and where it comes from, for the CLI to show and ask about; :func:`verify_diag_dir` runs
only that, step by step with no shell, and refuses (:class:`~elastic_diag.errors.CommandRefused`) a
command off the allow-list unless ``allow_any_command``. The restart gate's controls are the user's own
``--diag-verify`` commands and still run with ``bash -c`` (:func:`run_command` given a string).

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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from elastic_diag.core.schema_ids import REPORT_SCHEMA as SCHEMA
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verification import judge, signature_line
from elastic_diag.errors import CommandRefused, UsageError
from elastic_diag.gate.report_command import ReportCommand, Step, read_command
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
    a line between them saying how much was left out. A log that cannot be written (a full disk) is
    given up (``log_failed``): the output stays in memory, bounded as ever."""

    def __init__(self, log: IO[bytes] | None) -> None:
        self.log = log
        self.log_failed = False
        self.total = 0
        self.head = bytearray()
        self.tail: deque[bytes] = deque()  # whole chunks holding at least the last LOG_LIMIT // 2 bytes
        self.tail_bytes = 0
        self.closed = False

    def _write(self, data: bytes) -> None:
        if self.log is None:
            return
        try:
            self.log.write(data)
        except OSError:
            self._give_up_log()

    def _give_up_log(self) -> None:
        assert self.log is not None
        with contextlib.suppress(OSError):
            self.log.close()
        self.log, self.log_failed = None, True

    def add(self, chunk: bytes) -> None:
        if self.closed:
            return
        self.total += len(chunk)
        room = LOG_LIMIT // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            self._write(chunk[:room])
            chunk = chunk[room:]
        if chunk:
            self.tail_bytes = _push(self.tail, self.tail_bytes, chunk, LOG_LIMIT // 2)

    def close(self) -> None:
        self.closed = True
        end = b"".join(self.tail)[-(LOG_LIMIT // 2) :]
        kept = len(self.head) + len(end)
        if self.total > kept:
            self._write(f"\n[elastic_diag: {self.total - kept} bytes of output left out here]\n".encode())
        self._write(end)
        if self.log is not None:
            try:
                self.log.close()
            except OSError:  # the buffered rest did not fit
                self._give_up_log()

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


def run_command(command: str | Sequence[Step], *, timeout_s: float, log_path: Path | None, cwd: str | None = None,
                env: dict[str, str] | None = None) -> CommandRun:  # fmt: skip
    """Steps run one after the other with no shell, stopping at the first that fails (a report's command,
    read by gate/report_command.py), or a string run with ``bash -c`` (the user's own ``--diag-verify``);
    with one deadline and bounded output (see the module's doc)."""
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
    if isinstance(command, str):
        steps: Sequence[Step] = [Step(("bash", "-c", command))]
        cwd = cwd if cwd and os.path.isdir(cwd) else None
    else:
        steps = command
        if cwd and not os.path.isdir(cwd):
            sink.add(f"cd: {cwd}: no such folder\n".encode())
            steps = []
    deadline = started + timeout_s
    exit_code: int | None = 1 if not steps else 0
    timed_out = False
    for step in steps:
        exit_code, timed_out = _run_step(step, sink, deadline, cwd, env)
        if timed_out or exit_code != 0:
            break
    sink.close()
    if sink.log_failed and log_path is not None:  # a part of a log is no log: the output tail is in the record
        with contextlib.suppress(OSError):
            os.unlink(log_path)
        log = None
    if log is not None and log_path is not None:  # no secret of this process in the kept output
        from elastic_diag import redaction

        try:
            redaction.redact_file(log_path, redaction.current())
        except OSError:  # a full disk: a log that may hold a secret is not kept
            with contextlib.suppress(OSError):
                os.unlink(log_path)
            log = None
    tail = sink.text_tail() + (f"\n[elastic_diag: killed after the {timeout_s:g} s deadline]\n" if timed_out else "")
    return CommandRun(None if timed_out else exit_code, timed_out, time.monotonic() - started, sink.total,
                      bytes(sink.head).decode(errors="replace"), tail,
                      str(log_path) if log is not None else None)  # fmt: skip


def _run_step(step: Step, sink: _BoundedSink, deadline: float, cwd: str | None,
              env: dict[str, str] | None) -> tuple[int | None, bool]:  # fmt: skip
    """One program, its output into ``sink``; (its exit code, whether the deadline killed it)."""
    try:
        proc = subprocess.Popen(list(step.argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, shell=False,
                                env={**os.environ, **(env or {}), **dict(step.env)},
                                start_new_session=True)  # fmt: skip
    except OSError as e:  # command not found, as a shell says it (exit 127)
        sink.add(f"cannot run {step.argv[0]}: {e.strerror or e} (command not found)\n".encode())
        return 127, False
    assert isinstance(proc.stdout, io.BufferedReader)
    stdout = proc.stdout

    def pump() -> None:
        while chunk := stdout.read1(1 << 20):
            sink.add(chunk)

    reader = threading.Thread(target=pump, name="elastic-diag-verify-output", daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
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
    return proc.returncode, timed_out


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


@dataclass(frozen=True, slots=True)
class PendingVerification:
    """What a diag dir's report asks ``verify`` to run, and where that report comes from: shown (and
    asked about) before anything runs, then run as it was shown."""

    diag_dir: Path
    report: dict[str, Any]
    command: str  # "" when there is nothing to run (a succeeded run)
    parsed: ReportCommand
    cwd: str | None
    verify_dir: str | None
    run_id: str
    node: str
    written: str  # report.json's modification time: a report names no time of its own

    def describe(self) -> str:
        """The origin and the command, secrets masked, for a person to read before saying yes."""
        lines = [f"the verification command of {self.diag_dir / REPORT_FILE}",
                 f"  from run {self.run_id} on host {self.node}, report.json written {self.written}",
                 f"  runs in {self.parsed.cwd or self.cwd or os.getcwd()}:",
                 f"    {shown_command(self.command)}"]  # fmt: skip
        if self.parsed.refusals or self.parsed.unreadable:
            lines.append("  not on the allow-list of what verify runs (docs/report.md#what-verify-runs):")
            lines.extend(f"    - {why}" for why in (self.parsed.unreadable, *self.parsed.refusals) if why)
        return "\n".join(lines)


def shown_command(command: str) -> str:
    """A command as it may be printed: this process's secrets and the values of secret flags and
    settings in the command itself (``--api-key VALUE``, ``HF_TOKEN=VALUE``) masked."""
    from elastic_diag import redaction

    values = set(redaction.current().values)
    for step in read_command(command).steps:
        values |= redaction.secret_values(dict(step.env), step.argv)
    return redaction.Redactor(values).text(command)


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any, limit: int = 200) -> str:
    return str(value)[:limit] if isinstance(value, str | int) and not isinstance(value, bool) else "(unknown)"


def pending_verification(diag_dir: Path) -> PendingVerification:
    """What ``diag_dir``'s report asks to run. Raises UsageError when there is no readable report of this
    schema, or it names no command and the run did not succeed."""
    diag_dir = diag_dir.absolute()
    report_path = diag_dir / REPORT_FILE
    report = read_report(report_path)
    if report is None:
        raise UsageError(f"no readable {REPORT_FILE} in {diag_dir} (missing, not a JSON object, nested too deep, "
                         "or over its size limit): is it a diag dir of torchrun-diag?")  # fmt: skip
    if report.get("schema") != SCHEMA:
        raise UsageError(f"{report_path} has schema {_text(report.get('schema'), 80)!r}; this elastic_diag verifies "
                         f"{SCHEMA!r}: use the version of elastic_diag that wrote it")  # fmt: skip
    d = _object(report.get("diagnosis"))
    plan = _object(d.get("verify_plan"))
    command = plan.get("command") or d.get("verify") or ""
    if not isinstance(command, str):
        raise UsageError(f"{report_path}: diagnosis.verify is a JSON {type(command).__name__}, not a command")
    if not command and report.get("status") != "succeeded":
        raise UsageError(f"{report_path} has no verification command (diagnosis.verify is empty)")
    try:
        written = datetime.fromtimestamp(report_path.stat().st_mtime).isoformat(timespec="seconds")
    except OSError:
        written = "(unknown)"
    cwd, verify_dir = plan.get("cwd"), plan.get("verify_dir")
    return PendingVerification(diag_dir=diag_dir, report=report, command=command, parsed=read_command(command),
                               cwd=cwd if isinstance(cwd, str) and cwd else None,
                               verify_dir=verify_dir if isinstance(verify_dir, str) and verify_dir else None,
                               run_id=_text(report.get("run_id")), node=_text(report.get("node")),
                               written=written)  # fmt: skip


def verify_diag_dir(diag_dir: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S, allow_any_command: bool = False,
                    pending: PendingVerification | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the verification of ``diag_dir``'s report (``pending``: as it was shown), record it there, and
    return the record (``passed``, ``summary``, ...). Raises UsageError when there is no report or
    nothing to run, CommandRefused when the command is not one verify runs (gate/report_command.py)."""
    pending = pending or pending_verification(diag_dir)
    diag_dir, command, parsed = pending.diag_dir, pending.command, pending.parsed
    d = _object(pending.report.get("diagnosis"))
    if command and parsed.unreadable is not None:
        raise CommandRefused(f"not running the command of {diag_dir / REPORT_FILE}: {parsed.unreadable}")
    if command and parsed.refusals and not allow_any_command:
        raise CommandRefused(f"not running the command of {diag_dir / REPORT_FILE}: "
                             + "; ".join(parsed.refusals)
                             + "; read it and run it yourself, or pass --allow-any-command (no shell)")  # fmt: skip
    started_at = time.time()
    if not command:
        record: dict[str, Any] = {"passed": True, "summary": "the run succeeded: nothing to verify", "command": None}
    else:
        verify_dir = pending.verify_dir
        run = run_command(parsed.steps, timeout_s=timeout_s, log_path=diag_dir / VERIFICATION_LOG,
                          cwd=parsed.cwd or pending.cwd)  # fmt: skip
        rerun = None
        if verify_dir:
            candidate = Path(verify_dir) / REPORT_FILE
            try:
                if candidate.stat().st_mtime >= started_at - 1:
                    rerun = read_report(candidate)
            except OSError:
                rerun = None
        signature_id = d.get("signature_id") if isinstance(d.get("signature_id"), str) else None
        patterns = signature_patterns(signature_id)
        seen = signature_line(patterns, run.head) or signature_line(patterns, run.tail)
        rank = d.get("initiating_rank") if isinstance(d.get("initiating_rank"), int) else None
        verdict = judge(exit_code=run.exit_code, timed_out=run.timed_out, timeout_s=timeout_s,
                        signature_id=signature_id, seen_line=seen, rerun_report=rerun,
                        initiating_rank=rank)  # fmt: skip
        again = divergence_seen_again(pending.report, [Path(run.log_file)] if run.log_file else [],
                                      Path(verify_dir) if verify_dir else None)  # fmt: skip
        passed, summary = verdict.passed, verdict.summary
        if again is not None and again.get("seen"):
            passed = False
            summary = (f"{summary.rstrip('.')}; but the line that first diverged from the known-good run is printed "
                       f"again: {again['text'][:160]!r}")  # fmt: skip
        record = {
            "passed": passed,
            "summary": summary,
            "command": command,
            "allowed_by": "the allow-list" if parsed.allowed else "--allow-any-command",
            "exit_code": run.exit_code,
            "timed_out": run.timed_out,
            "timeout_s": timeout_s,
            "seconds": round(run.seconds, 3),
            "output_bytes": run.output_bytes,
            "output_file": run.log_file,
            "output_tail": run.tail[-4000:],
            "signature_seen": verdict.signature_seen,
            "rerun_report": str(Path(verify_dir) / REPORT_FILE) if rerun is not None and verify_dir else None,
            "rerun_status": rerun.get("status") if rerun is not None else None,
            "first_divergence_again": again,
        }
    record["started_at"] = datetime.fromtimestamp(started_at).isoformat(timespec="seconds")
    _record(diag_dir, record)
    return record


def divergence_seen_again(report: dict[str, Any], logs: list[Path], verify_dir: Path | None,
                          limit: int = 256 << 20) -> dict[str, Any] | None:  # fmt: skip
    """Whether the verification printed again the line that first diverged from the known-good run (the report's
    first ``first_divergence`` row, by its template): None when the report has none."""
    from elastic_diag.core.templates import pre_templates, template

    rows = [r for r in _list(report.get("first_divergence")) if isinstance(r, dict) and isinstance(r.get("raw"), str)]
    if not rows:
        return None
    row = rows[0]
    want = template(pre_templates(row["raw"].encode("utf-8", "replace"))[0])
    files = list(logs)
    if verify_dir is not None and verify_dir.is_dir():
        files += sorted(verify_dir.glob("attempt_*/rank_*/std*.log"))
    read = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                carry = b""
                while read < limit:
                    block = fh.read(4 << 20)
                    read += len(block)
                    chunk, _, carry = (carry + block).rpartition(b"\n") if block else (carry, b"", b"")
                    if any(template(p) == want for p in set(pre_templates(chunk))):
                        return {"text": str(row.get("text", "")), "seen": True, "where": str(f)}
                    if not block:
                        break
        except OSError:
            continue
    return {"text": str(row.get("text", "")), "seen": False, "read": [str(f) for f in files]}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _record(diag_dir: Path, record: dict[str, Any]) -> None:
    """``verification`` into report.json (read again: the launcher may have rewritten it meanwhile) and the page.
    Where that cannot be done (a read-only or full diag dir, a report.json gone bad meanwhile) nothing
    there is overwritten and ``record["not_recorded"]`` says why."""
    from elastic_diag.report.document import write_report
    from elastic_diag.report.html import write_html

    report = read_report(diag_dir / REPORT_FILE)
    if report is None:
        record["not_recorded"] = f"{diag_dir / REPORT_FILE} is no longer a readable report; left as it is"
        return
    report["verification"] = record
    try:
        write_report(diag_dir / REPORT_FILE, report)
        write_html(diag_dir, report)
    except OSError as e:
        record["not_recorded"] = f"cannot write in {diag_dir} ({e.strerror or e})"

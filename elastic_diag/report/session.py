"""DiagSession: the state of one diagnosed run, and the one place that writes its reports.

Every change (an attempt's verdict, an internal error, the end of the run) rewrites
``<diag-dir>/report.json`` at once, so the evidence already captured is on disk whatever happens
next. Writing never raises: a report that cannot be written (a full disk) is logged in one line, kept
in ``unwritten`` for the terminal summary, and the job goes on. While the run goes on, the launcher's
record (``launcher_alive.<node>.json``) says it is alive; it is removed once the final report is written,
so one left behind says the launcher died.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from elastic_diag.config import ENV_REQUEUE_EXIT_CODE, DiagConfig, host_name
from elastic_diag.core.evidence import AttemptEvidence
from elastic_diag.core.findings import retryable_own_failure
from elastic_diag.core.requeue import RequeueDecision, requeue_decision
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verdict import AttemptStatus, Diagnosis, RunStatus, stopped_from_outside
from elastic_diag.core.verification import JobFacts
from elastic_diag.errors import EXIT_FAILED, EXIT_OK, EXIT_RESTART_REFUSED, EXIT_SIGNALLED, EXIT_VERIFY_FAILED
from elastic_diag.layout import (
    HTML_FILE,
    PROGRESS_FILE,
    REPORT_FILE,
    attempt_dir_name,
    latest_checkpoint,
    read_progress,
    write_launcher_alive,
)
from elastic_diag.report.document import AttemptRecord, build_report, write_report
from elastic_diag.report.termination import termination_message, write_termination_message

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunEnd:
    """The end of a run: its report as written, the launcher's exit status, and the requeue decision's line for
    the terminal (None when no requeue exit code was set)."""

    report: dict[str, Any]
    exit_code: int
    requeue_line: str | None = None


class DiagSession:
    def __init__(self, config: DiagConfig, run_id: str = "", node: str | None = None) -> None:
        self.config = config
        self.run_id = run_id
        self.node = node or host_name()
        self.status: RunStatus = "running"
        self.attempts: dict[int, AttemptRecord] = {}
        self.internal_errors: list[str] = []
        self.notes: list[str] = []
        self.warnings: list[dict[str, Any]] = []
        self.gates: dict[int, dict[str, Any]] = {}  # attempt -> the restart gate's record
        self.policy: Any = None  # the restart policy (gate.RestartPolicy), loaded at start-up
        self.launch_diagnosis: Diagnosis | None = None
        self.launch_context: dict[str, Any] | None = None  # what a failed rendezvous knew
        # exceptions a guard lets through (torch's SignalException: a stop from outside is no internal error)
        self.pass_through: tuple[type[BaseException], ...] = ()
        self.stop: dict[str, Any] | None = None  # a stop from outside: who exited within the grace, where the rest were
        self.requeue: RequeueDecision | None = None  # with a requeue exit code: whether the run asks for a requeue
        self.termination_log: Path | None = config.termination_log  # None: no termination message
        self.job: JobFacts | None = None  # what the verification commands re-run (launch/relaunch.py)
        self.unwritten: dict[str, str] = {}  # a report file whose last write failed -> why (the summary says it)
        self.alive_record: Path | None = None  # the launcher's record while it runs (mark_running)

    @property
    def report_path(self) -> Path:
        return self.config.diag_dir / REPORT_FILE

    def record_attempt(
        self,
        evidence: AttemptEvidence,
        diagnosis: Diagnosis,
        *,
        status: AttemptStatus,
        final: bool,
        cluster: dict[str, Any] | None = None,
        environment: dict[str, Any] | None = None,
    ) -> None:
        earlier = self.attempts.get(evidence.attempt)
        if environment is None and earlier is not None:  # a merged verdict keeps the snapshot taken here
            environment = earlier.environment
        record = AttemptRecord(evidence=evidence, diagnosis=diagnosis, status=status, final=final,
                               gate=self.gates.get(evidence.attempt), cluster=cluster,
                               environment=environment)  # fmt: skip
        self.attempts[evidence.attempt] = record
        attempt_report = build_report(run_id=self.run_id, status=status, attempts=[record], node=self.node,
                                      diag_dir=str(self.config.diag_dir), job=self.job_now())  # fmt: skip
        self._write(self.config.diag_dir / attempt_dir_name(evidence.attempt) / REPORT_FILE, attempt_report)
        # a failed attempt's page at once (the launcher may be killed before the end); a healthy one's at the end
        self.write(page=status == "failed")

    def mark_running(self) -> None:
        """The launcher's record in the diag dir while it runs (:func:`~elastic_diag.layout.write_launcher_alive`)."""
        with self.guard("writing the launcher's record"):
            self.alive_record = write_launcher_alive(self.config.diag_dir, self.node)

    def internal_error(self, what: str, exc: BaseException) -> None:
        # a fault of the machine (a full disk, a folder removed) is said in one line; a bug of ours with its trace
        trace = None if isinstance(exc, OSError) else exc
        logger.warning("elastic_diag: error while %s: %r (the job is not affected)", what, exc, exc_info=trace)
        self.internal_errors.append(f"{what}: {type(exc).__name__}: {exc}")
        self.write(page=False)

    @contextlib.contextmanager
    def guard(self, what: str, on_error: Callable[[Exception], None] | None = None) -> Iterator[None]:
        """Any error inside is recorded (``internal_errors`` of report.json, "while <what>") and goes no
        further: the diagnosis never changes what the job does. ``on_error`` runs after the record."""
        try:
            yield
        except Exception as e:
            if isinstance(e, self.pass_through):
                raise
            self.internal_error(what, e)
            if on_error is not None:
                on_error(e)

    def record_gate(self, attempt: int, record: dict[str, Any]) -> None:
        self.gates[attempt] = record
        if attempt in self.attempts:
            self.attempts[attempt].gate = record
        self.write()

    @property
    def gate_outcome(self) -> str | None:
        """``refused`` / ``verification_failed`` when the gate ended the run, else None."""
        last = self.gates[max(self.gates)] if self.gates else None
        if last is None or last.get("decision") == "restart":
            return None
        return "verification_failed" if last.get("verification_failed") else "refused"

    def warn(self, warning: dict[str, Any]) -> None:
        """Something that deserves attention without having failed the run (a straggler)."""
        self.warnings.append(warning)
        self.write(page=False)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def record_stop(self, record: dict[str, Any], signum: int) -> None:
        """The ranks' answer to a forwarded signal (AttemptCapture.stop_from_outside): the stopped report
        on disk at once, as it will stay; torch's teardown and the scheduler's SIGKILL may come next."""
        self.stop = record
        self.finish_stopped(signum)

    def finish_stopped(self, signum: int) -> dict[str, Any]:
        """The launcher was signalled from outside: status ``stopped``, no rank to blame, the step the
        ranks had reached (their beacons' progress.json in the newest attempt)."""
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        steps: list[int] = []
        ranks: list[int] = []
        attempts = sorted(self.config.diag_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[-1])
                          if p.name.split("_")[-1].isdigit() else -1)  # fmt: skip
        for rank_dir in sorted(attempts[-1].glob("rank_*")) if attempts else []:
            progress = read_progress(rank_dir / PROGRESS_FILE)
            if rank_dir.name.split("_")[-1].isdigit():
                ranks.append(int(rank_dir.name.split("_")[-1]))
            if progress is not None and progress.steps is not None:
                steps.append(progress.steps)
        if not any(n.startswith(f"the launcher received {name} at ") for n in self.notes):
            self.note(f"the launcher received {name} at {datetime.now().isoformat(timespec='seconds')}")
        holdouts = [(r["rank"], r.get("where")) for r in (self.stop or {}).get("ranks", []) if not r.get("exited")]
        grace = float((self.stop or {}).get("grace_s") or self.config.grace_s)
        diagnosis = stopped_from_outside(name, max(steps) if steps else None, sorted(ranks), holdouts=holdouts,
                                         grace_s=grace)  # fmt: skip
        return self.finish("stopped", launch_diagnosis=diagnosis)

    def end(self, status: RunStatus, *, signum: int | None = None, launch_error: str | None = None) -> RunEnd:
        """The end of the run, the same however it was launched (torchrun-diag, plain torchrun with the switch,
        the Python API): the report and the termination message written, and the exit status: 0; after a
        stop from outside, 128 + the signal; after a failure, the requeue code where it asks for a requeue,
        else the gate's (restart refused, verification failed), else 1. ``launch_error``: the text of an
        error raised outside the workers (a rendezvous that timed out, a port in use): it is the verdict."""
        if status == "stopped":
            sig = signum if signum is not None else signal.SIGTERM
            return RunEnd(self.finish_stopped(sig), EXIT_SIGNALLED + int(sig))
        diagnosis = None
        if launch_error is not None:
            from elastic_diag.core.classify import classify_launch_error

            diagnosis = classify_launch_error(launch_error, context=self.launch_context)
        report = self.finish(status, launch_diagnosis=diagnosis)
        if status == "succeeded":
            return RunEnd(report, EXIT_OK)
        gate = {"refused": EXIT_RESTART_REFUSED, "verification_failed": EXIT_VERIFY_FAILED}
        code = self.exit_status(gate.get(self.gate_outcome or "", EXIT_FAILED))
        line = None
        if self.requeue is not None:
            reason = self.requeue.reason
            line = (f"elastic_diag: exit {code} ({ENV_REQUEUE_EXIT_CODE}): {reason}" if self.requeue.requeue
                    else f"elastic_diag: exit {code}: no requeue: {reason}")  # fmt: skip
        return RunEnd(report, code, line)

    def finish(self, status: RunStatus, launch_diagnosis: Diagnosis | None = None) -> dict[str, Any]:
        """The run's end: the report (and the requeue decision, when a requeue exit code is set), then
        the container's termination message."""
        self.status = status
        self.launch_diagnosis = launch_diagnosis
        if self.config.requeue_exit_code is not None:
            self.requeue = self._requeue_decision()
        report = self.write()
        if self.termination_log is not None:
            message = termination_message(report, str(self.report_path))
            problem = write_termination_message(self.termination_log, message)
            if problem is not None:
                logger.warning("elastic_diag: %s", problem)
                self.internal_errors.append(problem)
                report = self.write()
        if self.alive_record is not None:  # the final record is there (or said not to be): no death to report
            with contextlib.suppress(OSError):
                self.alive_record.unlink()
        return report

    def exit_status(self, default: int) -> int:
        """``default`` (torchrun's own), or the requeue exit code when the run asks for a requeue."""
        if self.requeue is not None and self.requeue.requeue and self.requeue.exit_code is not None:
            return self.requeue.exit_code
        return default

    def _requeue_decision(self) -> RequeueDecision:
        last = self.attempts[max(self.attempts)] if self.attempts else None
        final = last.diagnosis if last is not None and last.status == "failed" else None
        if self.launch_diagnosis is not None and (final is None or self.status == "stopped"):
            final = self.launch_diagnosis
        own = False
        if last is not None and final is not None and final.initiating_rank is not None:
            ev = next((r for r in last.evidence.ranks if r.rank == final.initiating_rank), None)
            own = ev is not None and retryable_own_failure(ev, load_taxonomy()) is not None
        gate = self.gates.get(max(self.gates)) if self.gates else None
        return requeue_decision(self.status, final, own_retryable=own, gate=gate,
                                exit_code=self.config.requeue_exit_code)  # fmt: skip

    def report(self) -> dict[str, Any]:
        status = self.status if self.status != "running" else "failed"
        report = build_report(
            run_id=self.run_id,
            status=status,
            attempts=[self.attempts[k] for k in sorted(self.attempts)],
            diag_dir=str(self.config.diag_dir),
            node=self.node,
            launch_diagnosis=self.launch_diagnosis,
            warnings=self.warnings,
            internal_errors=self.internal_errors,
            notes=self.notes,
            job=self.job_now(),
        )
        if self.stop is not None:  # additive fields (docs/report.md)
            report["stop"] = self.stop
        if self.requeue is not None:
            report["requeue"] = self.requeue.to_json()
        return report

    def job_now(self) -> JobFacts | None:
        """The job's facts with the newest checkpoint as it is now (the checkpoint a verification loads)."""
        if self.job is None or self.config.checkpoint_dir is None:
            return self.job
        from dataclasses import replace

        latest = latest_checkpoint(self.config.checkpoint_dir)
        return replace(self.job, checkpoint=str(latest) if latest is not None else None)

    def write(self, *, page: bool = True) -> dict[str, Any]:
        """report.json, and with ``page`` report.html (rendered once at the end of a healthy run, at every
        verdict of a failed one; ``elastic-diag report DIR`` renders it from any report.json)."""
        report = self.report()
        self._write(self.report_path, report)
        if not page:
            return report
        # the page's modules load with the first page (the run's end, or a failure), not before the ranks start
        from elastic_diag.report.html import write_html

        page_path = self.report_path.parent / HTML_FILE
        try:  # the page a person opens, beside the JSON
            write_html(self.report_path.parent, report)
            self.unwritten.pop(str(page_path), None)
        except Exception as e:  # the job comes first; report.json is written
            self._unwritten(page_path, e)
        return report

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        try:
            write_report(path, data)
            self.unwritten.pop(str(path), None)
        except Exception as e:  # the job comes first
            self._unwritten(path, e)

    def _unwritten(self, path: Path, e: Exception) -> None:
        why = (e.strerror or str(e)) if isinstance(e, OSError) else repr(e)
        if self.unwritten.get(str(path)) != why:  # once, not at every rewrite on a disk that stays full
            logger.error("elastic_diag: could not write %s: %s", path, why)
        self.unwritten[str(path)] = why

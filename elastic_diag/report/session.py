"""DiagSession: the state of one diagnosed run, and the one place that writes its reports.

Every change (an attempt's verdict, an internal error, the end of the run) rewrites
``<diag-dir>/report.json`` at once, so the evidence already captured is on disk whatever happens
next. Writing never raises: a report that cannot be written is logged, and the job goes on.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from elastic_diag.config import DiagConfig
from elastic_diag.core.evidence import AttemptEvidence
from elastic_diag.core.verdict import AttemptStatus, Diagnosis, RunStatus, stopped_from_outside
from elastic_diag.layout import PROGRESS_FILE, REPORT_FILE, attempt_dir_name, read_progress
from elastic_diag.report.document import AttemptRecord, build_report, write_json_atomic
from elastic_diag.report.html import write_html

logger = logging.getLogger(__name__)


class DiagSession:
    def __init__(self, config: DiagConfig, run_id: str = "", node: str | None = None) -> None:
        self.config = config
        self.run_id = run_id
        self.node = node or socket.gethostname()
        self.status: RunStatus = "running"
        self.attempts: dict[int, AttemptRecord] = {}
        self.internal_errors: list[str] = []
        self.notes: list[str] = []
        self.warnings: list[dict[str, Any]] = []
        self.gates: dict[int, dict[str, Any]] = {}  # attempt -> the restart gate's record
        self.policy: Any = None  # the restart policy (gate.RestartPolicy), loaded at start-up
        self.launch_diagnosis: Diagnosis | None = None
        self.launch_context: dict[str, Any] | None = None  # what a failed rendezvous knew

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
    ) -> None:
        record = AttemptRecord(evidence=evidence, diagnosis=diagnosis, status=status, final=final,
                               gate=self.gates.get(evidence.attempt), cluster=cluster)  # fmt: skip
        self.attempts[evidence.attempt] = record
        attempt_report = build_report(
            run_id=self.run_id, status=status, attempts=[record], diag_dir=str(self.config.diag_dir), node=self.node
        )
        self._write(self.config.diag_dir / attempt_dir_name(evidence.attempt) / REPORT_FILE, attempt_report)
        self.write()

    def internal_error(self, what: str, exc: BaseException) -> None:
        logger.warning("elastic_diag: error while %s: %r (the job is not affected)", what, exc, exc_info=exc)
        self.internal_errors.append(f"{what}: {type(exc).__name__}: {exc}")
        self.write()

    @contextlib.contextmanager
    def guard(self, what: str, on_error: Callable[[Exception], None] | None = None) -> Iterator[None]:
        """Any error inside is recorded (``internal_errors`` of report.json, "while <what>") and goes no
        further: the diagnosis never changes what the job does. ``on_error`` runs after the record."""
        try:
            yield
        except Exception as e:
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
        self.write()

    def note(self, text: str) -> None:
        self.notes.append(text)

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
            if progress is not None and isinstance(progress.get("steps"), int):
                steps.append(progress["steps"])
        self.note(f"the launcher received {name} at {datetime.now().isoformat(timespec='seconds')}")
        return self.finish("stopped", launch_diagnosis=stopped_from_outside(name, max(steps) if steps else None,
                                                                             sorted(ranks)))  # fmt: skip

    def finish(self, status: RunStatus, launch_diagnosis: Diagnosis | None = None) -> dict[str, Any]:
        self.status = status
        self.launch_diagnosis = launch_diagnosis
        return self.write()

    def report(self) -> dict[str, Any]:
        status = self.status if self.status != "running" else "failed"
        return build_report(
            run_id=self.run_id,
            status=status,
            attempts=[self.attempts[k] for k in sorted(self.attempts)],
            diag_dir=str(self.config.diag_dir),
            node=self.node,
            launch_diagnosis=self.launch_diagnosis,
            warnings=self.warnings,
            internal_errors=self.internal_errors,
            notes=self.notes,
        )

    def write(self) -> dict[str, Any]:
        report = self.report()
        self._write(self.report_path, report)
        try:  # the page a person opens, beside the JSON
            write_html(self.report_path.parent, report)
        except Exception as e:  # the job comes first; report.json is written
            logger.error("elastic_diag: could not write report.html: %r", e)
        return report

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        try:
            write_json_atomic(path, data)
        except Exception as e:  # the job comes first
            logger.error("elastic_diag: could not write %s: %r", path, e)

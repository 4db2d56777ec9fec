"""AttemptCapture: the evidence of one attempt of the local worker group, taken BEFORE torch tears the
group down.

torch's ``_monitor_workers`` polls the ranks and, in the same call, SIGTERMs every live rank the
moment one has failed (multiprocessing/api.py, ``SubprocessContext._poll``). So the agent asks the
capture first, while every rank that is still alive is still alive:

1. exit watchers (one thread per rank, ``os.waitid(..., WNOWAIT)``: they see the exit the instant
   it happens, with a sub-millisecond time, and never reap, so Popen still gets the status);
2. on the first failure, a bounded grace for the other ranks to exit on their own (a rank that
   times out waiting for a dead peer exits within it; the grace ends as soon as all have exited);
3. the stacks of the ranks still alive (:mod:`elastic_diag.agent.dumps`);
4. the verdict (:mod:`elastic_diag.core.classify`) and report.json on disk;
5. after torch's teardown, the verdict refined with the final exit codes (and merged with the other
   nodes' records), and torch's failure list corrected so that its "Root Cause (first observed
   failure)" and the launcher's error file name the initiating rank.

The processes, the clock and the sleep are injected: the decisions are unit-tested with fake
processes and a fake clock.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from elastic_diag import redaction
from elastic_diag.agent.clock import Clock, Sleep
from elastic_diag.agent.dumps import POLL_S, native_stacks_of, request_dumps
from elastic_diag.agent.environment import BUDGET_S as ENVIRONMENT_BUDGET_S
from elastic_diag.agent.environment import take_snapshot
from elastic_diag.agent.health import HangAlarm, HealthMonitor
from elastic_diag.agent.processes import Worker, WorkerProcesses
from elastic_diag.agent.root_cause import corrected_failures
from elastic_diag.agent.stall import StallSnapshots
from elastic_diag.agent.tailer import StreamTailer
from elastic_diag.config import DiagConfig
from elastic_diag.core.environment import environment_findings
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.progress import kernel_from_json
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.stall import StallRecord
from elastic_diag.core.verdict import AttemptStatus, Diagnosis
from elastic_diag.layout import (
    ENVIRONMENT_FILE,
    FILTERED_STDERR_FILE,
    FILTERED_STDOUT_FILE,
    LAUNCHER_FILE,
    PROGRESS_FILE,
    STACKS_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    AttemptLayout,
    read_attempt,
    stack_file_size,
    write_json_atomic,
    write_launcher_record,
)
from elastic_diag.report.session import DiagSession

if TYPE_CHECKING:
    from elastic_diag.agent.cluster import Cluster


def _classify(evidence: AttemptEvidence) -> Diagnosis:
    """The classifier's modules load when a verdict is first needed, after the ranks have started: not
    in the seconds before the spawn, nor beside the ranks' own imports (python benchmarks/launcher.py phases)."""
    from elastic_diag.core.classify import classify_attempt

    return classify_attempt(evidence)


CGROUP_POLL_S = 0.25  # how often a live rank's cgroup is read (it may move itself into another)
STALL_JOIN_S = 10.0  # the end of an attempt waits this long at most for a stall snapshot under way


class AttemptCapture:
    """The evidence of one attempt of the local worker group."""

    def __init__(
        self,
        *,
        attempt: AttemptLayout,
        workers: list[Worker],
        node: str,
        config: DiagConfig,
        session: DiagSession,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
        cluster: Cluster | None = None,
    ) -> None:
        """``clock`` stamps events (wall time, comparable across ranks and nodes); ``monotonic`` and ``sleep``
        bound the waits (the grace, the dumps, the teardown). Unit tests pass fakes for all three."""
        self.attempt = attempt
        self.cluster = cluster
        self.processes = WorkerProcesses(workers, clock=clock, monotonic=monotonic, sleep=sleep)
        self.workers = self.processes.workers
        self.node = node
        self.config = config
        self.session = session
        self._clock = clock
        self._monotonic = monotonic
        self._sleep = sleep
        self.decided = False
        self.decided_at: float | None = None
        self.finished = False
        self.alive_at_decision: set[int] = set()
        self.problems: list[str] = []
        self.final_evidence: AttemptEvidence | None = None
        self.stacks: dict[int, str] = {}  # the stacks taken at the verdict, by local rank
        self.stack_offsets: dict[int, int] = {}  # where each begins in the rank's stacks.txt
        self.diagnosis: Diagnosis | None = None
        self.hang: HangAlarm | None = None
        self.missing_evidence: list[str] = []
        # every rank's output read as it grows, each line stamped: the first error a rank printed of its
        # own is when its failure began, even if it re-raised only after seconds of cleanup
        self.tailer = StreamTailer({w.local_rank: w.layout.dir for w in workers}, clock=clock)
        self._environment: threading.Thread | None = None
        self.environment: dict[str, Any] | None = None  # the snapshot, once taken
        # one request for the ranks' stacks at a time: a stall snapshot's and a verdict's would read each other's
        self.dump_lock = threading.Lock()
        self.stalls = StallSnapshots(
            attempt_dir=attempt.dir, attempt=attempt.attempt, node=node, stack_timeout_s=config.stack_timeout_s,
            targets={w.local_rank: (w.rank, w.proc.pid, w.layout) for w in workers}, dump_lock=self.dump_lock,
            decided=lambda: self.decided or self.finished, exited=self.processes.watcher.exited,
            warn=self.session.warnings.append, clock=clock,
        )  # fmt: skip
        self.health: HealthMonitor | None = None
        if config.monitored:
            files = {w.local_rank: w.layout.path(PROGRESS_FILE) for w in workers}
            self.health = HealthMonitor(files, config.hang_timeout_s, exited=self.processes.watcher.exited,
                                        stall_timeout_s=config.stall_timeout_s, on_stall=self.stalls.on_stall,
                                        on_stall_end=self.stalls.on_stall_end)  # fmt: skip

    def start(self) -> AttemptCapture:
        """The threads of the attempt: the exit watchers, the line clock, the health monitor."""
        self.processes.start()
        self.tailer.start()
        if self.health is not None:
            self.health.start()
        return self

    # -- the processes (agent/processes.py) ------------------------------------------------------------
    def _poll(self) -> dict[int, int | None]:
        return self.processes.poll()

    def exit_time(self, lr: int) -> float | None:
        return self.processes.exit_time(lr)

    def has_failure(self) -> bool:
        """A rank exited non-zero, or recorded an uncaught exception (its exit can take seconds)."""
        return self.processes.has_failure()

    # -- the capture before teardown ---------------------------------------------------------------
    def decide(self) -> Diagnosis:
        """Grace, stacks of live ranks, verdict on disk; all before torch's teardown.

        The grace ends when every rank has exited or recorded its own uncaught exception; the
        stacks are taken of the ranks alive with neither (they are where the story is).
        """
        deadline = self._monotonic() + self.config.grace_s
        codes = self._poll()
        while self.processes.waiting_for(codes) and self._monotonic() < deadline:
            self._sleep(POLL_S)
            codes = self._poll()
        alive = {lr for lr, c in codes.items() if c is None}
        self.alive_at_decision = alive
        self.decided_at = self._clock()
        silent = self.processes.waiting_for(codes)  # alive with no exception of their own: where are they?
        self.decided = True  # no stall snapshot starts from now on
        if silent:  # their stacks and flight recorders (the beacon; the faulthandler signal if it is silent)
            targets = {lr: (self.workers[lr].proc.pid, self.workers[lr].layout) for lr in silent}
            request = f"failure-{self.attempt.attempt}-{self.decided_at:.6f}"
            with self.dump_lock:
                self.stack_offsets = {lr: stack_file_size(self.workers[lr].layout.dir) for lr in targets}
                self.stacks, _ = request_dumps(targets, self.config.stack_timeout_s, request, clock=self._monotonic,
                                               sleep=self._sleep)  # fmt: skip
        evidence = self.evidence(final=False)
        self.diagnosis = _classify(evidence)
        self.session.record_attempt(evidence, self.diagnosis, status="failed", final=False)
        self.start_environment_snapshot()
        return self.diagnosis

    def start_environment_snapshot(self) -> None:
        """attempt_N/environment.json, once, in a thread of its own (bounded: environment.BUDGET_S), so
        that the teardown and the verdict never wait for it; finish() joins it."""
        if self._environment is not None:
            return

        def take() -> None:
            with self.session.guard("taking the environment snapshot"):
                snapshot = take_snapshot(Path.cwd(), self.config.checkpoint_dir)
                write_json_atomic(self.attempt.dir / ENVIRONMENT_FILE, snapshot)
                self.environment = snapshot
                for finding in environment_findings(snapshot):
                    self.session.warnings.append({"class": "environment", "summary": finding, "rank": None,
                                                  "node": self.node, "attempt": self.attempt.attempt})  # fmt: skip

        self._environment = threading.Thread(target=take, daemon=True, name="elastic-diag-environment")
        self._environment.start()

    def hang_alarm(self) -> HangAlarm | None:
        return self.health.alarm if self.health is not None else None

    def decide_hang(self, alarm: HangAlarm) -> Diagnosis:
        """No rank progressed for the threshold: every rank's stacks and flight recorder (all before
        any kill), the verdict on disk, then the group is stopped (the agent lives on)."""
        self.hang = alarm
        codes = self._poll()
        alive = {lr for lr, c in codes.items() if c is None}
        self.alive_at_decision = alive
        self.decided_at = self._clock()
        targets = {lr: (self.workers[lr].proc.pid, self.workers[lr].layout) for lr in alive}
        timeout = max(self.config.stack_timeout_s, 1.0)
        self.decided = True  # no stall snapshot starts from now on
        request = f"hang-{self.attempt.attempt}-{self.decided_at:.6f}"
        with self.dump_lock:
            self.stack_offsets = {lr: stack_file_size(self.workers[lr].layout.dir) for lr in targets}
            self.stacks, answered = request_dumps(targets, timeout, request, clock=self._monotonic, sleep=self._sleep)
        for lr in sorted(alive - answered):
            self.missing_evidence.append(
                f"rank {self.workers[lr].rank}: its beacon did not answer the dump request within {timeout:.1f} s "
                "(stack from the faulthandler signal, no fresh flight-recorder dump)"
            )
        native_stacks_of([(self.workers[lr].proc.pid, self.workers[lr].layout.dir) for lr in sorted(alive)])
        evidence = self.evidence(final=False)
        self.diagnosis = _classify(evidence)
        self.session.record_attempt(evidence, self.diagnosis, status="failed", final=False)
        self.start_environment_snapshot()
        self.stop_group()
        return self.diagnosis

    def stop_from_outside(self, signum: int) -> dict[str, Any]:
        """The launcher was signalled (scancel, a time limit, an eviction): pass the signal on to every
        live rank as torchrun does, give them the grace to exit, and take the stacks of those that do
        not (a checkpoint save that blocks, a handler that waits on a dead peer) before torch's own
        teardown SIGKILLs them. Returns the record of who exited and where the others were."""
        codes = self._poll()
        alive = sorted(lr for lr, c in codes.items() if c is None)
        self.processes.signal(alive, signum)
        sent_at = self._clock()
        deadline = self._monotonic() + self.config.grace_s
        while self._monotonic() < deadline and any(codes[lr] is None for lr in alive):
            self._sleep(POLL_S)
            codes = self._poll()
        holdouts = [lr for lr in alive if codes[lr] is None]
        stacks: dict[int, str] = {}
        if holdouts:
            targets = {lr: (self.workers[lr].proc.pid, self.workers[lr].layout) for lr in holdouts}
            with self.dump_lock:
                stacks, _ = request_dumps(targets, max(self.config.stack_timeout_s, 1.0), f"stop-{self._clock():.6f}",
                                          clock=self._monotonic, sleep=self._sleep)  # fmt: skip
        ranks = []
        for lr in sorted(self.workers):
            w = self.workers[lr]
            entry: dict[str, Any] = {"rank": w.rank, "local_rank": lr, "exited": codes[lr] is not None,
                                     "exit_code": codes[lr]}  # fmt: skip
            if lr in alive and codes[lr] is not None and (t := self.exit_time(lr)) is not None:
                entry["exit_s_after_signal"] = round(max(0.0, t - sent_at), 3)
            if lr in holdouts:
                dump = parse_stack_dump(stacks.get(lr, ""))
                frame = dump.user_frame() if dump is not None else None
                entry["where"] = str(frame) if frame is not None else None
                entry["stack_file"] = str(w.layout.dir / STACKS_FILE) if stacks.get(lr) else None
            ranks.append(entry)
        return {"signal": signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else signum,
                "grace_s": self.config.grace_s, "ranks": ranks}  # fmt: skip

    def stop_group(self) -> None:
        """SIGTERM every live rank; torch's own monitor then sees the exits and tears down the rest."""
        self.processes.stop()

    def evidence(self, *, final: bool) -> AttemptEvidence:
        """Every rank's evidence as it stands now (``final``: after torch's teardown): what the launcher saw is
        written to ``launcher.json``, then the attempt's folder is read back as a whole (:func:`read_attempt`),
        as ``elastic-diag analyze`` reads it: the live verdict is the verdict on what is on disk."""
        codes = self._poll()
        with self.session.guard("reading the ranks' output"):
            self.tailer.poll(final=final)  # catch up with what the ranks printed until now
        alive, stopped = self.processes.alive_and_stopped(codes, final=final, decided=self.decided,
                                                          alive_at_decision=self.alive_at_decision)  # fmt: skip
        kernel: dict[int, dict[str, Any]] = {}
        with self.session.guard("reading the kernel's evidence of a SIGKILL"):
            kernel = self.processes.kernel_evidence(codes, stopped)
        seen = AttemptEvidence(
            attempt=self.attempt.attempt,
            ranks=tuple(
                RankEvidence(rank=w.rank, local_rank=lr, node=self.node, pid=w.proc.pid, exit_code=codes[lr],
                             exit_time=self.exit_time(lr), alive_at_decision=lr in alive,
                             stopped_by_agent=lr in stopped, kernel=kernel_from_json(kernel.get(lr)))
                for lr, w in sorted(self.workers.items())
            ),
            run_id=self.session.run_id,
            decided_at=self.decided_at,
            hang=self.hang.to_json() if self.hang is not None else None,
        )  # fmt: skip
        offsets = {self.workers[lr].rank: offset for lr, offset in self.stack_offsets.items() if self.stacks.get(lr)}
        records, unwritten = write_launcher_record(self.attempt, seen, node=self.node, stack_offsets=offsets,
                                                   tail_lines=self.config.tail_lines)  # fmt: skip
        read = read_attempt(self.attempt.dir, tail_lines=self.config.tail_lines,
                            only={w.rank for w in self.workers.values()}, launcher_records=records)  # fmt: skip
        problems = [*unwritten[:3], *read.problems, *self.tailer.problems]
        if len(unwritten) > 3:
            problems.insert(3, f"and {len(unwritten) - 3} more ranks' {LAUNCHER_FILE}: not written either")
        problems.extend(evidence_gaps(list(read.evidence.ranks), self.tailer))
        self.problems = [*self.missing_evidence, *problems]
        return read.evidence

    @property
    def stall_records(self) -> tuple[StallRecord, ...]:
        return self.stalls.in_order()

    def finish(self, result: RunResult) -> RunResult:
        """After torch's teardown: final verdict and report, and torch's failure list corrected."""
        self.finished = True
        if self.health is not None:
            self.health.stop()
        self.tailer.stop()
        status: AttemptStatus = "succeeded" if result.state == WorkerState.SUCCEEDED else "failed"
        self.stalls.join(STALL_JOIN_S)
        if status == "failed":
            self.start_environment_snapshot()  # torch saw the failure first: take it now
        if self._environment is not None:
            self._environment.join(timeout=ENVIRONMENT_BUDGET_S + 1.0)
        evidence = self.evidence(final=True)
        with self.session.guard("settling the stalls' outcomes"):  # a failure that began in a stall came out of it
            stalls = self.stalls.finish(failed=status == "failed", began=evidence.failure_began)
            evidence = replace(evidence, stalls=stalls)
        self.final_evidence = evidence
        from elastic_diag.core.classify import straggler_warnings

        diagnosis = _classify(evidence)
        self.diagnosis = diagnosis
        for problem in self.problems:
            self.session.note(f"attempt {self.attempt.attempt}: missing evidence: {problem}")
        for warning in straggler_warnings(evidence):
            self.session.warnings.append(warning)
        self.session.record_attempt(evidence, diagnosis, status=status, final=True, environment=self.environment)
        if self.cluster is not None and status == "failed":
            with self.session.guard("merging the other nodes' records (the local verdict stands)"):
                from elastic_diag.agent.cluster import global_verdict

                diagnosis = global_verdict(self.cluster, self.session, attempt=self.attempt.attempt, node=self.node,
                                           evidence=evidence, local=diagnosis, status=status)  # fmt: skip
        if status == "failed" and diagnosis.initiating_rank is not None:
            result.failures = corrected_failures(
                result.failures,
                evidence,
                diagnosis,
                diag_dir=self.config.diag_dir,
                rank_dirs={lr: w.layout.dir for lr, w in self.workers.items()},
            )
        self.redact_streams()
        return result

    def redact_streams(self) -> None:
        """The ranks have exited: mask this job's secrets in what they printed (redaction.py)."""
        streams = [w.layout.path(name) for w in self.workers.values() for name in (STDOUT_FILE, STDERR_FILE)]
        streams += [self.attempt.dir / name for name in (FILTERED_STDOUT_FILE, FILTERED_STDERR_FILE)]
        with self.session.guard("masking secrets in the ranks' output"):
            redaction.redact_files(streams)


def evidence_gaps(ranks: list[RankEvidence], tailer: StreamTailer) -> list[str]:
    """What could not be recorded about the ranks, said in the report (nothing is silently lost)."""
    gaps: list[str] = []
    for ev in ranks:
        if ev.exception is not None:
            gaps.extend(f"rank {ev.rank}: its exception record: {p}" for p in ev.exception.problems)
        printed = ev.error_line.exception if ev.error_line is not None else None
        if ev.failed and not ev.stopped_by_agent and ev.exception is None and printed is not None:
            gaps.append(f"rank {ev.rank}: no exception record although it printed {printed.type} (the script "
                        "replaced sys.excepthook, or printed the error and exited): read from its output")  # fmt: skip
        skipped = tailer.skipped_bytes(ev.local_rank)
        if skipped:
            gaps.append(f"rank {ev.rank}: {skipped} bytes of its output went unread for errors (it printed faster "
                        "than the line clock reads); the end of each stream was read")  # fmt: skip
    return gaps

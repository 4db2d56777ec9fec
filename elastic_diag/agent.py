"""DiagAgent: torch's LocalElasticAgent, plus evidence taken BEFORE torch tears the group down.

torch's ``_monitor_workers`` polls the ranks and, in the same call, SIGTERMs every live rank the
moment one has failed (multiprocessing/api.py, ``SubprocessContext._poll``). So the capture runs
first, in our override, while every rank that is still alive is still alive:

1. exit watchers (one thread per rank, ``os.waitid(..., WNOWAIT)``: they see the exit the instant
   it happens, with a sub-millisecond time, and never reap, so Popen still gets the status);
2. on the first failure, a bounded grace for the other ranks to exit on their own (a rank that
   times out waiting for a dead peer exits within it; the grace ends as soon as all have exited);
3. the stacks of the ranks still alive (faulthandler on SIGURG, works while blocked in gloo);
4. the verdict (:mod:`elastic_diag.classify`) and report.json on disk;
5. only then torch's own ``_monitor_workers``, which tears down; afterwards the verdict is refined
   with the final exit codes, and torch's failure list is corrected so that its "Root Cause
   (first observed failure)" and the launcher's error file name the initiating rank.

Any error inside the diagnosis is recorded in the report and never changes what the job does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from elastic_diag import beacon, bootstrap, gate, nodes
from elastic_diag.capture import (
    AttemptLayout,
    DiagLogsSpecs,
    RankLayout,
    read_exception,
    read_flight_record,
    read_json,
    read_stack_since,
    read_tail,
    read_thread_exception,
    stack_file_size,
)
from elastic_diag.classify import Diagnosis, classify_attempt, straggler_warnings
from elastic_diag.config import DiagConfig
from elastic_diag.evidence import AttemptEvidence, RankEvidence, as_seconds, parse_stack_dump
from elastic_diag.findings import retryable_own_failure
from elastic_diag.gate import AttemptOutcome
from elastic_diag.health import HangAlarm, HealthMonitor, read_progress
from elastic_diag.report import print_summary
from elastic_diag.session import DiagSession
from elastic_diag.tailer import StreamTailer
from elastic_diag.taxonomy import load_taxonomy

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], None]
_POLL_S = 0.02
NATIVE_STACKS_S = 5.0  # py-spy, all ranks together
STACK_LIMIT = 256 * 1024


class ExitWatcher:
    """Records the exact time each worker process exits, without reaping it."""

    def __init__(self, pids: dict[int, int], clock: Clock = time.time) -> None:
        self._clock = clock
        self.exit_times: dict[int, float] = {}
        self._lock = threading.Lock()
        for key, pid in pids.items():
            t = threading.Thread(target=self._watch, args=(key, pid), name=f"elastic-diag-exit-{key}", daemon=True)
            t.start()

    def _watch(self, key: int, pid: int) -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return  # already reaped by Popen.poll(); the poller's time is used instead
        except OSError:
            return
        with self._lock:
            self.exit_times.setdefault(key, self._clock())

    def time_of(self, key: int) -> float | None:
        with self._lock:
            return self.exit_times.get(key)

    def exited(self) -> set[int]:
        with self._lock:
            return set(self.exit_times)


def dump_stacks(
    targets: dict[int, tuple[int, RankLayout]], timeout: float, clock: Clock = time.monotonic, sleep: Sleep = time.sleep
) -> dict[int, str]:
    """Ask each live rank for a faulthandler dump of all threads; wait at most ``timeout``."""
    before = {k: stack_file_size(layout.dir) for k, (_, layout) in targets.items()}
    pending = set()
    for k, (pid, _) in targets.items():
        try:
            os.kill(pid, bootstrap.DUMP_SIGNAL)
            pending.add(k)
        except OSError:
            pass
    last: dict[int, int] = {}
    deadline = clock() + timeout
    while pending and clock() < deadline:
        sleep(_POLL_S)
        for k in list(pending):
            size = stack_file_size(targets[k][1].dir)
            if size > before[k] and last.get(k) == size:
                pending.discard(k)
            last[k] = size
    return {k: read_stack_since(layout.dir, before[k]) for k, (_, layout) in targets.items()}


def request_dumps(
    targets: dict[int, tuple[int, RankLayout]],
    timeout: float,
    request_id: str,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> tuple[dict[int, str], set[int]]:
    """Ask each live rank's beacon for its stacks and flight recorder (a ``dump.request`` file); the
    ranks that do not answer within ``timeout`` get the faulthandler signal instead. Returns the
    stack text per rank and the ranks whose beacon answered."""
    before = {k: stack_file_size(layout.dir) for k, (_, layout) in targets.items()}
    pending = set()
    for k, (_, layout) in targets.items():
        try:
            (layout.dir / beacon.DUMP_DONE_FILE).unlink(missing_ok=True)
            tmp = layout.dir / f".{beacon.DUMP_REQUEST_FILE}.tmp"
            tmp.write_text(request_id)
            os.replace(tmp, layout.dir / beacon.DUMP_REQUEST_FILE)
            pending.add(k)
        except OSError:
            pass
    answered: set[int] = set()
    deadline = clock() + timeout
    while pending and clock() < deadline:
        sleep(_POLL_S)
        for k in list(pending):
            done = read_json(targets[k][1].dir / beacon.DUMP_DONE_FILE)
            if done and done.get("id") == request_id:
                pending.discard(k)
                answered.add(k)
    stacks = {k: read_stack_since(layout.dir, before[k]) for k, (_, layout) in targets.items() if k in answered}
    silent = {k: v for k, v in targets.items() if k not in answered}
    if silent:  # the beacon thread never ran (the GIL held in C, or no bootstrap): faulthandler's signal
        stacks.update(dump_stacks(silent, timeout, clock=clock, sleep=sleep))
    return stacks, answered


def find_py_spy() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment that was not activated)."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)


def native_stacks_of(workers: list[tuple[int, Path]], deadline_s: float = NATIVE_STACKS_S) -> int:
    """py-spy's native stacks of several ranks at once (threads), all within ``deadline_s``; returns
    how many were written (``pyspy.txt`` in each rank's folder). Nothing when py-spy is absent."""
    exe = find_py_spy()
    if exe is None or not workers:
        return 0
    threads = [
        threading.Thread(target=native_stacks, args=(pid, d, deadline_s, exe), daemon=True) for pid, d in workers
    ]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s + 0.5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return sum(1 for _, d in workers if (d / "pyspy.txt").exists())


def native_stacks(pid: int, rank_dir: Path, timeout: float = NATIVE_STACKS_S, exe: str | None = None) -> str | None:
    """py-spy's dump with native frames, when py-spy is installed (saved beside the other evidence)."""
    exe = exe or find_py_spy()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True, timeout=timeout,
                             check=False, text=True, errors="replace")  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"py-spy failed: {e}"
    text = (out.stdout or out.stderr)[:STACK_LIMIT]
    with contextlib.suppress(OSError):
        (rank_dir / "pyspy.txt").write_text(text)
    return text


@dataclass(slots=True)
class _Worker:
    rank: int
    local_rank: int
    proc: Popen[bytes]
    layout: RankLayout


class AttemptCapture:
    """The evidence of one attempt of the local worker group."""

    def __init__(
        self,
        *,
        attempt: AttemptLayout,
        workers: list[_Worker],
        node: str,
        config: DiagConfig,
        session: DiagSession,
        clock: Clock = time.time,
        sleep: Sleep = time.sleep,
        cluster: Cluster | None = None,
    ) -> None:
        self.attempt = attempt
        self.cluster = cluster
        self.workers = {w.local_rank: w for w in workers}
        self.node = node
        self.config = config
        self.session = session
        self._clock = clock
        self._sleep = sleep
        self.watcher = ExitWatcher({w.local_rank: w.proc.pid for w in workers}, clock)
        self.poll_times: dict[int, float] = {}
        self.decided = False
        self.decided_at: float | None = None
        self.finished = False
        self.alive_at_decision: set[int] = set()
        self.problems: list[str] = []
        self.final_evidence: AttemptEvidence | None = None
        self.stacks: dict[int, str] = {}
        self.diagnosis: Diagnosis | None = None
        self.hang: HangAlarm | None = None
        self.missing_evidence: list[str] = []
        # every rank's output read as it grows, each line stamped: the first error a rank printed of its
        # own is when its failure began, even if it re-raised only after seconds of cleanup
        self.tailer = StreamTailer({w.local_rank: w.layout.dir for w in workers}, clock=clock)
        self.tailer.start()
        self.health: HealthMonitor | None = None
        if config.hang_timeout_s != 0:
            files = {w.local_rank: w.layout.path(beacon.PROGRESS_FILE) for w in workers}
            self.health = HealthMonitor(files, config.hang_timeout_s, exited=self.watcher.exited)
            self.health.start()

    # -- polling ----------------------------------------------------------------------------------
    def _poll(self) -> dict[int, int | None]:
        codes = {}
        for lr, w in self.workers.items():
            code = w.proc.poll()  # Popen's own bookkeeping; torch's later poll() sees the same code
            if code is not None and lr not in self.poll_times:
                self.poll_times[lr] = self._clock()
            codes[lr] = code
        return codes

    def exit_time(self, lr: int) -> float | None:
        return self.watcher.time_of(lr) or self.poll_times.get(lr)

    def _dying(self, lr: int) -> bool:
        """The rank's excepthook has recorded an uncaught exception: it is on its way out."""
        return self.workers[lr].layout.path(bootstrap.EXCEPTION_FILE).exists()

    def has_failure(self) -> bool:
        """A rank exited non-zero, or recorded an uncaught exception (its exit can take seconds)."""
        codes = self._poll()
        return any(c not in (None, 0) for c in codes.values()) or any(
            self._dying(lr) for lr, c in codes.items() if c is None
        )

    def _waiting_for(self, codes: dict[int, int | None]) -> set[int]:
        return {lr for lr, c in codes.items() if c is None and not self._dying(lr)}

    # -- the capture before teardown ---------------------------------------------------------------
    def decide(self) -> Diagnosis:
        """Grace, stacks of live ranks, verdict on disk; all before torch's teardown.

        The grace ends when every rank has exited or recorded its own uncaught exception; the
        stacks are taken of the ranks alive with neither (they are where the story is).
        """
        deadline = time.monotonic() + self.config.grace_s
        codes = self._poll()
        while self._waiting_for(codes) and time.monotonic() < deadline:
            self._sleep(_POLL_S)
            codes = self._poll()
        alive = {lr for lr, c in codes.items() if c is None}
        self.alive_at_decision = alive
        self.decided_at = self._clock()
        silent = self._waiting_for(codes)  # alive with no exception of their own: where are they?
        if silent:  # their stacks and flight recorders (the beacon; the faulthandler signal if it is silent)
            targets = {lr: (self.workers[lr].proc.pid, self.workers[lr].layout) for lr in silent}
            request = f"failure-{self.attempt.attempt}-{self.decided_at:.6f}"
            self.stacks, _ = request_dumps(targets, self.config.stack_timeout_s, request, sleep=self._sleep)
        self.decided = True
        evidence = self.evidence(final=False)
        self.diagnosis = classify_attempt(evidence)
        self.session.record_attempt(evidence, self.diagnosis, status="failed", final=False)
        return self.diagnosis

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
        self.stacks, answered = request_dumps(targets, timeout, f"hang-{self.attempt.attempt}-{self.decided_at:.6f}",
                                              sleep=self._sleep)  # fmt: skip
        for lr in sorted(alive - answered):
            self.missing_evidence.append(
                f"rank {self.workers[lr].rank}: its beacon did not answer the dump request within {timeout:.1f} s "
                "(stack from the faulthandler signal, no fresh flight-recorder dump)"
            )
        native_stacks_of([(self.workers[lr].proc.pid, self.workers[lr].layout.dir) for lr in sorted(alive)])
        self.decided = True
        evidence = self.evidence(final=False)
        self.diagnosis = classify_attempt(evidence)
        self.session.record_attempt(evidence, self.diagnosis, status="failed", final=False)
        self.stop_group()
        return self.diagnosis

    def stop_group(self) -> None:
        """SIGTERM every live rank; torch's own monitor then sees the exits and tears down the rest."""
        for lr, code in self._poll().items():  # the capture's own poll: it records each exit's time
            if code is None:
                with contextlib.suppress(OSError):
                    os.kill(self.workers[lr].proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and None in self._poll().values():
            self._sleep(_POLL_S)

    def evidence(self, *, final: bool) -> AttemptEvidence:
        codes = self._poll()
        try:
            self.tailer.poll(final=final)  # catch up with what the ranks printed until now
        except Exception as e:
            self.session.internal_error("reading the ranks' output", e)
        stopped: set[int] = set()
        alive_at_decision = set(self.alive_at_decision)
        if final and not self.decided:
            # torch saw the failure before we did: ranks it killed are the SIGTERM/SIGKILL exits
            # that came after the first failure.
            failures = [self.exit_time(lr) for lr, c in codes.items() if c not in (None, 0)]
            first = min((t for t in failures if t is not None), default=None)
            for lr, c in codes.items():
                t = self.exit_time(lr)
                if c in (-signal.SIGTERM, -signal.SIGKILL) and first is not None and t is not None and t > first:
                    alive_at_decision.add(lr)
        if final:  # the launcher's teardown ends a rank with SIGTERM, or SIGKILL after its deadline
            stopped = {lr for lr in alive_at_decision if codes.get(lr) in (-signal.SIGTERM, -signal.SIGKILL)}
        ranks = []
        problems: list[str] = []
        came_up: bool | None = None
        for lr, w in sorted(self.workers.items()):
            info = read_json(w.layout.path(bootstrap.WORKER_FILE)) or {}
            record, problem = read_flight_record(w.layout.dir, w.rank)
            if problem:
                problems.append(problem)
            progress = read_progress(w.layout.path(beacon.PROGRESS_FILE)) or {}
            durations = tuple(float(d) for d in progress.get("step_durations") or () if isinstance(d, int | float))
            if progress:
                came_up = bool(came_up) or _completed_a_collective(progress) or bool(record and record.groups)
            stack_text = self.stacks.get(lr, "")
            start = info.get("start_time")
            ranks.append(
                RankEvidence(
                    rank=w.rank,
                    local_rank=lr,
                    node=self.node,
                    pid=w.proc.pid,
                    exit_code=codes[lr],
                    exit_time=self.exit_time(lr),
                    start_time=float(start) if isinstance(start, int | float) else None,
                    alive_at_decision=lr in alive_at_decision,
                    stopped_by_agent=lr in stopped,
                    exception=read_exception(w.layout.dir),
                    stderr_tail=read_tail(w.layout.path(bootstrap.STDERR_FILE), self.config.tail_lines),
                    stdout_tail=read_tail(w.layout.path(bootstrap.STDOUT_FILE), 10),
                    stack=parse_stack_dump(stack_text) if stack_text else None,
                    evidence_dir=str(w.layout.dir),
                    flight_record=record,
                    nonfinite=read_json(w.layout.path(beacon.NONFINITE_FILE)),
                    step_durations=durations,
                    progress_time=as_seconds(progress.get("progress_time")),
                    steps=int(progress["steps"]) if isinstance(progress.get("steps"), int) else None,
                    error_line=self.tailer.first_error(lr),
                    thread_exception=read_thread_exception(w.layout.dir),
                )
            )
        problems.extend(self.tailer.problems)
        problems.extend(evidence_gaps(ranks, self.tailer))
        self.problems = [*self.missing_evidence, *problems]
        return AttemptEvidence(
            attempt=self.attempt.attempt,
            ranks=tuple(ranks),
            run_id=self.session.run_id,
            decided_at=self.decided_at,
            hang=self.hang.to_json() if self.hang is not None else None,
            came_up=came_up,
        )

    def finish(self, result: RunResult) -> RunResult:
        """After torch's teardown: final verdict and report, and torch's failure list corrected."""
        self.finished = True
        if self.health is not None:
            self.health.stop()
        self.tailer.stop()
        status = "succeeded" if result.state == WorkerState.SUCCEEDED else "failed"
        evidence = self.evidence(final=True)
        self.final_evidence = evidence
        diagnosis = classify_attempt(evidence)
        self.diagnosis = diagnosis
        for problem in self.problems:
            self.session.note(f"attempt {self.attempt.attempt}: missing evidence: {problem}")
        for warning in straggler_warnings(evidence):
            self.session.warnings.append(warning)
        self.session.record_attempt(evidence, diagnosis, status=status, final=True)
        if self.cluster is not None and status == "failed":
            try:
                diagnosis = self._global_verdict(evidence, diagnosis, status)
            except Exception as e:
                self.session.internal_error("merging the other nodes' records (the local verdict stands)", e)
        if status == "failed" and diagnosis.initiating_rank is not None:
            result.failures = self._corrected_failures(result.failures, evidence, diagnosis)
        return result

    def _global_verdict(self, evidence: AttemptEvidence, local: Diagnosis, status: str) -> Diagnosis:
        """One verdict for all nodes: every agent publishes its record; the agent of group rank 0 reads
        them all (bounded), merges, and publishes the verdict (one key) and each node's roles (one key
        per node); the others read those two keys. O(nodes) keys per failure. If the leader's verdict
        does not come, an agent merges the records itself."""
        c = self.cluster
        assert c is not None
        n = self.attempt.attempt
        c.exchange.publish(n, c.group_rank, nodes.record_of(evidence, node=self.node, group_rank=c.group_rank,
                                                            offset=c.offset))  # fmt: skip
        info: dict[str, Any] = {"clock_offset_s": round(c.offset, 6), "local_diagnosis": local.to_json()}
        if c.group_rank != 0:
            verdict = c.exchange.verdict(n, c.group_rank, self.config.grace_s + 25.0, offset=c.offset)
            if verdict is not None:
                diagnosis = nodes.diagnosis_from_json(verdict["diagnosis"], verdict["roles"])
                info.update(decided_by="group rank 0", nodes=verdict.get("nodes"),
                            missing_group_ranks=verdict.get("missing"), store_bytes_sent=c.exchange.bytes_sent,
                            store_bytes_read=c.exchange.bytes_read)  # fmt: skip
                self.session.record_attempt(evidence, diagnosis, status=status, final=True, cluster=info)
                c.exchange.done(n, c.group_rank)
                return diagnosis
            self.session.note(f"attempt {n}: no verdict from group rank 0; merged the nodes' records here")
        records, problems = c.exchange.records(n, c.world, self.config.grace_s + 15.0, offset=c.offset)
        hellos = c.exchange.hellos(c.world, 2.0)
        merged = nodes.merge(n, records, c.world, hellos, problems)
        for p in merged.problems:
            self.session.note(f"attempt {n}: {p}")
        if len(records) <= 1 and not merged.missing:
            return local
        if c.group_rank == 0:
            c.exchange.publish_verdict(n, merged, hellos)
        info.update(decided_by=f"group rank {c.group_rank}", nodes=merged.nodes, missing_group_ranks=merged.missing,
                    store_bytes_sent=c.exchange.bytes_sent, store_bytes_read=c.exchange.bytes_read)  # fmt: skip
        self.session.record_attempt(merged.evidence, merged.diagnosis, status=status, final=True, cluster=info)
        # the leader hosts the store: it stays until every node has read the verdict (bounded)
        c.exchange.done(n, c.group_rank)
        if c.group_rank == 0:
            c.exchange.wait_done(n, sorted(records), 10.0)  # not for nodes that are gone
        return merged.diagnosis

    def _corrected_failures(
        self, failures: dict[int, ProcessFailure], evidence: AttemptEvidence, diagnosis: Diagnosis
    ) -> dict[int, ProcessFailure]:
        root = diagnosis.initiating_rank
        if root not in failures:
            return failures
        old = failures[root]
        ev = next(r for r in evidence.ranks if r.rank == root)
        earliest = min(f.timestamp for f in failures.values())
        detail = [f"elastic_diag: rank {root} is the initiating rank ({diagnosis.failure_class}).", diagnosis.summary]
        if ev.exception is not None and ev.exception.traceback:
            detail.append(ev.exception.traceback.rstrip())
        elif ev.stack is not None:
            detail.append("Its stack when the launcher took the verdict:")
            detail.append(ev.stack.text.rstrip()[:8000])
        else:
            detail.append("Last lines of its stderr:")
            detail.extend(f"  {line}" for line in ev.stderr_tail[-15:])
        detail.append(f"Evidence: {self.session.config.diag_dir}")
        root_file = self.workers[old.local_rank].layout.path("root_cause.json")
        data: dict[str, Any] = {
            "message": {
                "message": diagnosis.summary,
                "extraInfo": {"py_callstack": "\n".join(detail), "timestamp": str(earliest)},
                "errorCode": old.exitcode,
            }
        }
        root_file.write_text(json.dumps(data))
        fixed = ProcessFailure(local_rank=old.local_rank, pid=old.pid, exitcode=old.exitcode, error_file=str(root_file))
        ordered = {root: fixed}
        ordered.update((r, f) for r, f in failures.items() if r != root)
        return ordered


class DiagAgent(LocalElasticAgent):
    """LocalElasticAgent that keeps the evidence of every attempt and names the initiating rank."""

    def __init__(self, *args: Any, session: DiagSession, print_summary: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = session
        self._print_summary = print_summary  # the launch is plain torchrun's: the agent reports at the end
        self._capture: AttemptCapture | None = None
        self._node = socket.gethostname()
        self._clock = skewed_clock()
        self._history: list[AttemptOutcome] = []

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        result: RunResult = super().run(role)
        if self._print_summary:
            try:
                report = self._session.finish("succeeded" if result.state == WorkerState.SUCCEEDED else "failed")
                print_summary(report, str(self._session.report_path))
            except Exception as e:
                self._session.internal_error("writing the report at the end of the run", e)
        return result

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        try:
            super()._rendezvous(worker_group)
        except RendezvousTimeoutError:
            self._session.launch_context = rendezvous_context(worker_group.spec.rdzv_handler, self._node)
            raise

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids: dict[int, Any] = super()._start_workers(worker_group)
        self._capture = None
        specs = self._logs_specs
        if isinstance(specs, DiagLogsSpecs):
            while specs.errors:
                self._session.internal_error("starting the workers", OSError(specs.errors.pop(0)))
        try:
            self._capture = self._new_capture(worker_group)
        except Exception as e:  # the job runs on without diagnosis; the report says so
            self._session.internal_error("starting the capture", e)
        return pids

    def _new_capture(self, worker_group: WorkerGroup) -> AttemptCapture | None:
        pcontext = self._pcontext
        handlers = getattr(pcontext, "subprocess_handlers", None)
        specs = self._logs_specs
        if not handlers or not isinstance(specs, DiagLogsSpecs) or specs.current is None:
            self._session.note("workers are not subprocesses of a DiagLogsSpecs launch: no live capture")
            return None
        layout = specs.current
        workers = [
            _Worker(rank=w.global_rank, local_rank=w.local_rank, proc=handlers[w.local_rank].proc,
                    layout=layout.ranks[w.local_rank])
            for w in worker_group.workers
        ]  # fmt: skip
        world = worker_group.group_world_size or 1
        node = nodes.node_label(self._node, worker_group.group_rank or 0, world)
        cluster = self._join_cluster(worker_group, layout.attempt, node) if world > 1 else None
        return AttemptCapture(attempt=layout, workers=workers, node=node, config=self._session.config,
                              session=self._session, clock=self._clock, cluster=cluster)  # fmt: skip

    def _join_cluster(self, worker_group: WorkerGroup, attempt: int, node: str) -> Cluster | None:
        """Several nodes: say who is where, and measure this node's clock against the leader's."""
        group_rank, world = worker_group.group_rank or 0, worker_group.group_world_size or 1
        try:
            exchange = nodes.StoreExchange(worker_group.store, self._session.run_id, clock=self._clock)
            ranks = [w.global_rank for w in worker_group.workers]
            exchange.hello(group_rank, {"node": node, "group_rank": group_rank, "ranks": ranks, "pid": os.getpid()})
            offset = 0.0
            if group_rank == 0:
                threading.Thread(target=exchange.answer_pings, args=(world, attempt, 60.0), daemon=True,
                                 name="elastic-diag-clock").start()  # fmt: skip
            else:
                measured = exchange.measure_offset(group_rank, attempt, 10.0)
                if measured is None:
                    self._session.note(f"attempt {attempt}: no clock reply from node 0; times left uncorrected")
                else:
                    offset = measured
            cluster = Cluster(exchange=exchange, group_rank=group_rank, world=world, offset=offset)
            threading.Thread(target=cluster.beat_forever, daemon=True, name="elastic-diag-beat").start()
            return cluster
        except Exception as e:
            self._session.internal_error("joining the other nodes through the rendezvous store", e)
            return None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        capture = self._capture
        if capture is not None and not capture.decided:
            try:
                if capture.has_failure():
                    capture.decide()
                elif (alarm := capture.hang_alarm()) is not None:
                    capture.decide_hang(alarm)
            except Exception as e:
                self._session.internal_error("capturing evidence before teardown", e)
        result: RunResult = super()._monitor_workers(worker_group)
        ended = result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNHEALTHY)
        if ended and capture is not None and not capture.finished:
            try:
                result = capture.finish(result)
            except Exception as e:
                self._session.internal_error("writing the verdict after teardown", e)
        elif ended and capture is None and result.failures:
            try:
                self._verdict_from_failures(worker_group, result)
            except Exception as e:
                self._session.internal_error("taking a verdict from torch's failure list", e)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts > 0:
            try:
                self._gate(worker_group)
            except Exception as e:  # the gate itself failed: no restart storm on a broken gate
                self._remaining_restarts = 0
                self._session.internal_error("deciding whether to restart (no restart)", e)
                self._session.record_gate(self._attempt(worker_group), {"decision": "refused", "reason":
                                          f"the restart gate failed: {type(e).__name__}: {e}"})  # fmt: skip
        return result

    def _attempt(self, worker_group: WorkerGroup) -> int:
        return worker_group.spec.max_restarts - self._remaining_restarts

    def _gate(self, worker_group: WorkerGroup) -> None:
        """Torch would restart now: ask the policy, run the verification controls, and either let the
        restart happen (with the resume variables for the next attempt) or end the run."""
        attempt = self._attempt(worker_group)
        nodes = worker_group.group_world_size or 1
        if nodes > 1 and worker_group.group_rank != 0:
            followed = self._follow_gate(worker_group, attempt)
            if followed is not None:
                self._apply_gate(attempt, followed, Diagnosis(failure_class="unknown"))
                return
        record = self._session.attempts.get(attempt)
        diagnosis = record.diagnosis if record is not None else Diagnosis(failure_class="unknown")
        evidence = record.evidence if record is not None else None
        config = self._session.config
        outcome = outcome_of(attempt, diagnosis, evidence, config.checkpoint_dir)
        self._history.append(outcome)
        policy = self._session.policy or gate.verified
        decision = gate.ask_policy(policy, self._history)
        entry: dict[str, Any] = {"attempt": attempt, "policy": config.restart_policy, "failure": outcome.describe(),
                                 "reason": decision.reason, "controls": []}  # fmt: skip
        verification_failed = False
        if decision.restart and decision.verify:
            specs = list(config.verify) or gate.default_controls(config.checkpoint_dir)
            out_dir = config.diag_dir / f"attempt_{attempt}" / "gate"
            out_dir.mkdir(parents=True, exist_ok=True)
            sig = self._taxonomy_patterns(diagnosis.signature_id)
            ctx = gate.ControlContext(nproc=worker_group.spec.local_world_size, out_dir=out_dir,
                                      checkpoint_dir=config.checkpoint_dir, timeout_s=config.verify_timeout_s,
                                      retries=config.verify_retries, signature_patterns=sig)  # fmt: skip
            logger.warning("elastic_diag: attempt %s failed (%s); verifying before restart: %s", attempt,
                           outcome.describe(), ", ".join(specs))  # fmt: skip
            results = gate.verify(specs, ctx)
            for i, r in enumerate(results):
                out_file = out_dir / f"control_{i}_{_slug(r.name)}.log"
                try:
                    out_file.write_text(r.output)
                except OSError:
                    out_file = None  # type: ignore[assignment]
                entry["controls"].append(r.to_json(str(out_file) if out_file else None))
            failed = next((r for r in results if not r.passed), None)
            if failed is not None:
                verification_failed = True
                decision = gate.Decision(False, f"verification failed: {failed.name}: {failed.summary}")
        entry["decision"] = "restart" if decision.restart else "refused"
        entry["reason"] = decision.reason
        entry["verification_failed"] = verification_failed
        if decision.restart:
            entry["resume_from"] = str(gate.latest_checkpoint(config.checkpoint_dir) or "") or None
        if nodes > 1:
            self._publish_gate(worker_group, attempt, entry)
        self._apply_gate(attempt, entry, diagnosis)

    def _apply_gate(self, attempt: int, entry: dict[str, Any], diagnosis: Diagnosis) -> None:
        if entry.get("decision") == "restart":
            self._prepare_resume(attempt, diagnosis)
        else:
            self._remaining_restarts = 0
            logger.warning("elastic_diag: no restart: %s", entry.get("reason"))
        self._session.record_gate(attempt, entry)

    def _gate_key(self, attempt: int) -> str:
        return f"elastic_diag/gate/{self._session.run_id}/{attempt}"

    def _publish_gate(self, worker_group: WorkerGroup, attempt: int, entry: dict[str, Any]) -> None:
        """One decision for every node: the agent of group rank 0 decides and publishes it."""
        store: Any = worker_group.store
        try:
            store.set(self._gate_key(attempt), json.dumps(entry))
        except Exception as e:
            self._session.internal_error("publishing the restart decision to the other nodes", e)

    def _follow_gate(self, worker_group: WorkerGroup, attempt: int) -> dict[str, Any] | None:
        """The decision of the agent of group rank 0, or None (then this agent decides alone) when it
        does not come within the controls' worst-case time."""
        config = self._session.config
        wait_s = config.verify_timeout_s * (config.verify_retries + 1) * max(1, len(config.verify) or 3) + 60
        store: Any = worker_group.store
        try:
            from datetime import timedelta

            store.wait([self._gate_key(attempt)], timedelta(seconds=wait_s))
            entry = json.loads(store.get(self._gate_key(attempt)))
        except Exception as e:
            self._session.note(f"attempt {attempt}: no restart decision from group rank 0 ({e}); decided locally")
            return None
        if not isinstance(entry, dict):
            return None
        entry["decided_by"] = "group rank 0"
        return entry

    def _taxonomy_patterns(self, signature_id: str | None) -> tuple[str, ...]:
        if not signature_id:
            return ()
        try:
            return tuple(p.pattern for p in load_taxonomy().get(signature_id).patterns)
        except Exception:
            return ()

    def _prepare_resume(self, attempt: int, diagnosis: Diagnosis) -> None:
        """What the next attempt's ranks find in their environment (DiagLogsSpecs adds it)."""
        specs = self._logs_specs
        if not isinstance(specs, DiagLogsSpecs):
            return
        latest = gate.latest_checkpoint(self._session.config.checkpoint_dir)
        specs.extra_env = {
            ENV_RESUME_FROM: str(latest) if latest is not None else "",
            ENV_PREVIOUS_DIAGNOSIS: diagnosis_id(self._session.run_id, attempt, diagnosis),
        }

    def _verdict_from_failures(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """No live capture this attempt: the verdict from exit codes and error files only."""
        restart_count = worker_group.spec.max_restarts - self._remaining_restarts
        evidence = evidence_from_failures(restart_count, result.failures, worker_group, self._node)
        self._session.note(f"attempt {restart_count}: verdict from exit codes only (no evidence folder)")
        self._session.record_attempt(evidence, classify_attempt(evidence), status="failed", final=True)


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


def _completed_a_collective(progress: dict[str, Any]) -> bool:
    for status in (progress.get("pg_status") or {}).values():
        try:
            if int(status.get("last_completed_collective", -1)) >= 1:
                return True
        except (AttributeError, TypeError, ValueError):
            continue
    return bool(progress.get("steps"))


def rendezvous_context(handler: Any, node: str) -> dict[str, Any]:
    """What a rendezvous that timed out knew: the nodes that joined, how many it needed, the timeout.
    Read from torch's dynamic rendezvous (private state, so every field is optional)."""
    out: dict[str, Any] = {"this_node": node}
    settings = getattr(handler, "_settings", None)
    if settings is not None:
        out["min_nodes"], out["max_nodes"] = getattr(settings, "min_nodes", None), getattr(settings, "max_nodes", None)
        timeout = getattr(settings, "timeout", None)
        join = getattr(timeout, "join", None)
        out["join_timeout_s"] = join.total_seconds() if join is not None else None
    try:
        holder = handler._state_holder
        holder.sync()
        state = holder.state
        joined = list(state.participants) + list(getattr(state, "wait_list", ()))
        names = {f"{d.addr} (pid {d.pid})" for d in joined}
    except Exception as e:
        out["joined_error"] = f"{type(e).__name__}: {e}"
        names = set()
    # this agent was waiting in the rendezvous (torch drops it from the state when its join times out)
    if not any(n.startswith(f"{node} (pid {os.getpid()})") for n in names):
        names.add(f"{node} (pid {os.getpid()}, this node)")
    out["joined"] = sorted(names)
    return out


ENV_CLOCK_SKEW = "ELASTIC_DIAG_CLOCK_SKEW"  # a test hook: seconds added to this host's clock (agent and ranks)


def skewed_clock() -> Clock:
    try:
        skew = float(os.environ.get(ENV_CLOCK_SKEW, "") or 0.0)
    except ValueError:
        skew = 0.0
    if skew == 0.0:
        return time.time
    return lambda: time.time() + skew


@dataclass(slots=True)
class Cluster:
    exchange: nodes.StoreExchange
    group_rank: int
    world: int
    offset: float  # add to this node's times to get the leader's
    stopped: threading.Event = field(default_factory=threading.Event)

    def beat_forever(self) -> None:
        """The agent's heartbeat in the store (a daemon thread), so the others can tell it is gone."""
        while not self.stopped.wait(nodes.BEAT_S):
            try:
                self.exchange.beat(self.group_rank, self.offset)
            except Exception:
                return  # the store is gone: nothing to tell anyone


ENV_RESUME_FROM = "ELASTIC_DIAG_RESUME_FROM"
ENV_PREVIOUS_DIAGNOSIS = "ELASTIC_DIAG_PREVIOUS_DIAGNOSIS"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)[:40] or "control"


def diagnosis_id(run_id: str, attempt: int, diagnosis: Diagnosis) -> str:
    """``<run>/attempt_0/python-exception/rank2``: names a verdict in the previous attempt's report."""
    what = diagnosis.signature_id or diagnosis.failure_class
    rank = f"rank{diagnosis.initiating_rank}" if diagnosis.initiating_rank is not None else "rank?"
    return f"{run_id or 'run'}/attempt_{attempt}/{what}/{rank}"


def outcome_of(
    attempt: int, diagnosis: Diagnosis, evidence: AttemptEvidence | None, ckpt: Path | None
) -> AttemptOutcome:
    location = None
    own_retryable = False
    if evidence is not None and diagnosis.initiating_rank is not None:
        ev = next((r for r in evidence.ranks if r.rank == diagnosis.initiating_rank), None)
        location = ev.location() if ev is not None else None
        own_retryable = ev is not None and retryable_own_failure(ev, load_taxonomy()) is not None
    return AttemptOutcome(
        attempt=attempt,
        failure_class=diagnosis.failure_class,
        signature_id=diagnosis.signature_id,
        initiating_rank=diagnosis.initiating_rank,
        exception_type=diagnosis.exception_type,
        location=location,
        retryable=diagnosis.retryable,
        checkpoint=gate.checkpoint_identity(ckpt),
        own_retryable=own_retryable,
    )


def evidence_from_failures(
    attempt: int, failures: dict[int, ProcessFailure], worker_group: WorkerGroup, node: str
) -> AttemptEvidence:
    """Evidence from torch's own failure records. Ranks torch SIGTERMed/SIGKILLed while another rank
    had failed by itself count as stopped by the launcher; ranks absent from the list succeeded."""
    by_signal = (-signal.SIGTERM, -signal.SIGKILL)
    others_failed = any(f.exitcode not in by_signal for f in failures.values())
    ranks = []
    for w in worker_group.workers:
        f = failures.get(w.global_rank)
        if f is None:
            ranks.append(RankEvidence(rank=w.global_rank, local_rank=w.local_rank, node=node, exit_code=0))
            continue
        stopped = others_failed and f.exitcode in by_signal
        error_file = Path(f.error_file)
        ranks.append(
            RankEvidence(
                rank=w.global_rank,
                local_rank=w.local_rank,
                node=node,
                pid=f.pid,
                exit_code=f.exitcode,
                exit_time=float(f.timestamp),
                alive_at_decision=stopped,
                stopped_by_agent=stopped,
                exception=read_exception(error_file.parent) if error_file.is_file() else None,
            )
        )
    return AttemptEvidence(attempt=attempt, ranks=tuple(ranks))

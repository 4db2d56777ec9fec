"""DiagAgent: torch's LocalElasticAgent with the diagnosis in its template methods.

``_start_workers`` opens an :class:`~elastic_diag.agent.capture.AttemptCapture` for the new attempt;
``_monitor_workers`` lets the capture take its evidence and verdict BEFORE torch's own monitor tears
the group down, then has it refine the verdict after; when torch would restart, the restart gate
(:mod:`elastic_diag.gate`) decides first. ``_rendezvous`` keeps what a rendezvous that timed out knew.

Any error inside the diagnosis is recorded in the report (``DiagSession.guard``) and never changes
what the job does.

The capture's, the cluster's and the classifier's modules are imported when first used, once the ranks are
started: every import before then delays the ranks' start by its full cost (the launcher is all the machine
runs then), after it only by its share of the CPU the ranks use (benchmarks/launcher.py phases).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from elastic_diag._compat import worker_processes
from elastic_diag.agent.clock import skewed_clock
from elastic_diag.agent.logs_specs import DiagLogsSpecs
from elastic_diag.config import host_name
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.errors import EXIT_FAILED, EXIT_SIGNALLED
from elastic_diag.layout import read_exception
from elastic_diag.report.session import DiagSession, RunEnd

if TYPE_CHECKING:
    from elastic_diag.agent.capture import AttemptCapture
    from elastic_diag.agent.cluster import Cluster

logger = logging.getLogger(__name__)


class DiagAgent(LocalElasticAgent):
    """LocalElasticAgent that keeps the evidence of every attempt and names the initiating rank."""

    def __init__(self, *args: Any, session: DiagSession, print_summary: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = session
        self._print_summary = print_summary  # the launch is plain torchrun's: the agent reports at the end
        self._capture: AttemptCapture | None = None
        self._node = host_name()
        self._clock = skewed_clock()
        self._restart_gate: Any = None  # agent/restart.py's RestartGate, built when torch would first restart
        self._stopped_by: int | None = None  # the signal that stopped the launcher from outside
        self._stop_taken = False  # the ranks' answer to it is recorded once
        session.pass_through = (SignalException,)  # a stop from outside is not an internal error

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's run; launched by plain torchrun (the switch), the agent also ends the run itself
        (``DiagSession.end``, as torchrun-diag does): the report, the summary, and on a stop from outside exit
        128 + N, on a failure that asks for a requeue the requeue code (torch's own exit is 1)."""
        try:
            result: RunResult = super().run(role)
        except SignalException as e:  # torch has passed the signal on to the workers and stopped them
            if not self._print_summary:
                raise  # torchrun-diag writes the report and exits 128 + N itself
            # plain torchrun: keep the rendezvous open for the other nodes as torch does on a signal
            code = EXIT_SIGNALLED + int(e.sigval)
            with self._session.guard("writing the report of a launcher stopped by a signal"):
                code = self._announce(self._session.end("stopped", signum=int(e.sigval)))
            keep_rendezvous_open(self._worker_group.spec.rdzv_handler)
            defer_stop_signals(exiting=True)
            raise SystemExit(code) from e
        if self._print_summary:
            code = EXIT_FAILED
            with self._session.guard("writing the report at the end of the run"):
                code = self._announce(self._session.end("succeeded" if result.state == WorkerState.SUCCEEDED
                                                        else "failed"))  # fmt: skip
            if result.state != WorkerState.SUCCEEDED and self._session.requeue is not None \
                    and self._session.requeue.requeue:  # fmt: skip
                raise SystemExit(code)
        return result

    def _announce(self, end: RunEnd) -> int:
        from elastic_diag.report.summary import print_summary

        print_summary(end.report, str(self._session.report_path), unwritten=self._session.unwritten)
        if end.requeue_line:
            print(end.requeue_line, file=sys.stderr)
        from elastic_diag.ledger.tell import TellOptions, after_verdict  # the environment's ledger and notifications

        try:
            lines = after_verdict(end.report, str(self._session.report_path), TellOptions.resolve(),
                                  source="torchrun", diag_dir=self._session.report_path.parent)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the job's outcome comes first (a bad ELASTIC_DIAG_LEDGER too)
            lines = [f"the verdict was not recorded or told: {e}"]
        for line in lines:
            print(f"elastic_diag: {line}", file=sys.stderr)
        return end.exit_code

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            result: RunResult = super()._invoke_run(role)
        except SignalException as e:  # torch's run() shuts the workers down next (our _shutdown)
            self._stopped_by = int(e.sigval)
            raise
        return result

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """torch's teardown; after a signal from outside, first the ranks' own answer to it: the signal
        passed on, the grace, the stacks of the ranks that do not exit, the report (then torch kills them)."""
        if self._stopped_by is None:
            super()._shutdown(death_sig, timeout)
            return
        # Slurm signals every process of the job and srun passes it on again: a second SIGTERM a few ms
        # later must not cut the stop short
        defer_stop_signals()
        capture = self._capture
        if not self._stop_taken and capture is not None:
            self._stop_taken = True
            started = time.monotonic()
            with self._session.guard("taking the stacks of ranks that did not exit on the signal"):
                self._session.record_stop(capture.stop_from_outside(self._stopped_by), self._stopped_by)
            # the whole stop fits in torch's own shutdown timeout less a margin, not the grace on top of it:
            # the scheduler's SIGKILL follows its kill wait (Slurm's KillWait and Kubernetes'
            # terminationGracePeriodSeconds are 30 s by default, torch's shutdown timeout too)
            timeout = max(1, int(timeout - (time.monotonic() - started) - STOP_MARGIN_S))
        super()._shutdown(death_sig, timeout)
        if capture is not None:
            capture.redact_streams()

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
        with self._session.guard("starting the capture"):  # the job runs on without diagnosis; the report says so
            self._capture = self._new_capture(worker_group)
        return pids

    def _new_capture(self, worker_group: WorkerGroup) -> AttemptCapture | None:
        from elastic_diag.agent.capture import AttemptCapture
        from elastic_diag.agent.processes import Worker
        from elastic_diag.core.merge import node_label

        procs = worker_processes(self._pcontext)
        specs = self._logs_specs
        if not procs or not isinstance(specs, DiagLogsSpecs) or specs.current is None:
            self._session.note("workers are not subprocesses of a DiagLogsSpecs launch: no live capture")
            return None
        layout = specs.current
        workers = [
            Worker(rank=w.global_rank, local_rank=w.local_rank, proc=procs[w.local_rank],
                   layout=layout.ranks[w.local_rank])
            for w in worker_group.workers
        ]  # fmt: skip
        world = worker_group.group_world_size or 1
        node = node_label(self._node, worker_group.group_rank or 0, world)
        cluster = self._join_cluster(worker_group, layout.attempt, node) if world > 1 else None
        return AttemptCapture(attempt=layout, workers=workers, node=node, config=self._session.config,
                              session=self._session, clock=self._clock, cluster=cluster).start()  # fmt: skip

    def _join_cluster(self, worker_group: WorkerGroup, attempt: int, node: str) -> Cluster | None:
        """Several nodes: say who is where, and measure this node's clock against the leader's."""
        from elastic_diag.agent.cluster import Cluster, StoreExchange

        group_rank, world = worker_group.group_rank or 0, worker_group.group_world_size or 1
        with self._session.guard("joining the other nodes through the rendezvous store"):
            exchange = StoreExchange(worker_group.store, self._session.run_id, clock=self._clock)
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
        return None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        capture = self._capture
        if capture is not None and not capture.decided:
            with self._session.guard("capturing evidence before teardown"):
                if capture.has_failure():
                    capture.decide()
                elif (alarm := capture.hang_alarm()) is not None:
                    capture.decide_hang(alarm)
        result: RunResult = super()._monitor_workers(worker_group)
        ended = result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNHEALTHY)
        if ended and capture is not None and not capture.finished:
            with self._session.guard("writing the verdict after teardown"):
                result = capture.finish(result)
        elif ended and capture is None and result.failures:
            with self._session.guard("taking a verdict from torch's failure list"):
                self._verdict_from_failures(worker_group, result)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts > 0:

            def refuse(e: Exception) -> None:  # the gate itself failed: no restart storm on a broken gate
                self._remaining_restarts = 0
                self._session.record_gate(self._attempt(worker_group), {"decision": "refused", "reason":
                                          f"the restart gate failed: {type(e).__name__}: {e}"})  # fmt: skip

            with self._session.guard("deciding whether to restart (no restart)", on_error=refuse):
                self._gate(worker_group)
        return result

    def _attempt(self, worker_group: WorkerGroup) -> int:
        return worker_group.spec.max_restarts - self._remaining_restarts

    def _gate(self, worker_group: WorkerGroup) -> None:
        """Torch would restart now: the restart gate decides; either the restart happens (with the resume
        variables for the next attempt's ranks) or the run ends."""
        from elastic_diag.agent.restart import RestartGate, resume_env  # the gate's modules: only when asked

        attempt = self._attempt(worker_group)
        if self._restart_gate is None:
            self._restart_gate = RestartGate(self._session)
        gate, diagnosis = self._restart_gate.decide(
            attempt, nproc=worker_group.spec.local_world_size, nodes=worker_group.group_world_size or 1,
            group_rank=worker_group.group_rank or 0, store=worker_group.store,
        )  # fmt: skip
        if gate.decision == "restart":
            if isinstance(self._logs_specs, DiagLogsSpecs):
                self._logs_specs.extra_env = resume_env(self._session, attempt, diagnosis)
        else:
            self._remaining_restarts = 0
            logger.warning("elastic_diag: no restart: %s", gate.reason)
        self._session.record_gate(attempt, gate.to_json())

    def _verdict_from_failures(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """No live capture this attempt: the verdict from exit codes and error files only."""
        from elastic_diag.core.classify import classify_attempt

        restart_count = worker_group.spec.max_restarts - self._remaining_restarts
        evidence = evidence_from_failures(restart_count, result.failures, worker_group, self._node)
        self._session.note(f"attempt {restart_count}: verdict from exit codes only (no evidence folder)")
        self._session.record_attempt(evidence, classify_attempt(evidence), status="failed", final=True)


STOP_MARGIN_S = 3.0  # the launcher exits this long before torch's shutdown timeout after a stop from outside
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torch's TORCHELASTIC_SIGNALS_TO_HANDLE default


def defer_stop_signals(*, exiting: bool = False) -> None:
    """The launcher is stopping and will not take up the job again: from now on a repeated stop
    signal is logged, not raised (torch would raise it in the middle of the grace or of the report).
    ``exiting``: the report is written and the launcher leaves: ignore them (Python puts its own
    handlers back to the default while it finalizes, and a late SIGTERM would then kill it)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if exiting:
        for name in STOP_SIGNALS:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
        return

    def again(signum: int, frame: Any) -> None:
        logger.warning("elastic_diag: %s again while stopping; the stop goes on", signal.Signals(signum).name)

    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, again)


def keep_rendezvous_open(handler: Any) -> None:
    """torch's launch_agent leaves the rendezvous open when its agent was signalled (the other nodes may
    go on without this one) and shuts it on any other exit: the agent that leaves with SystemExit after a
    signal makes this one handler's shutdown a no-op, so the other nodes see what torch would give them."""
    try:
        handler.shutdown = lambda: True
    except Exception as e:  # a handler that refuses the attribute: the rendezvous closes, the report is written
        logger.warning("elastic_diag: could not keep the rendezvous open after the signal: %r", e)


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

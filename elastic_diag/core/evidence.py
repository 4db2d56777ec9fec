"""The evidence model: what is known about each rank of one attempt, and about the attempt, as plain frozen
records. Every front-end fills the same records: the live agent and ``elastic-diag analyze`` pointed at an
evidence folder through :func:`elastic_diag.layout.read_attempt`, the log readers of
:mod:`elastic_diag.offline` from console output, torchrun log dirs and per-rank files. What a front-end
cannot see stays empty (a pasted console has no stacks, no flight records, no progress); the rules of
:mod:`elastic_diag.core.attribution` say what they concluded without it.

The records of one rank (:class:`RankEvidence`): its exit (code, time, whether the launcher stopped it),
its uncaught exception and a thread's (:mod:`~elastic_diag.core.exceptions`), the first error it printed
(:class:`ErrorLine`), the error lines it printed (:class:`LogLine`), the tails of its streams, its stack
(:mod:`~elastic_diag.core.stacks`), its flight record, its progress and first non-finite loss
(:mod:`~elastic_diag.core.progress`), what the kernel said of its SIGKILL. Of the attempt
(:class:`AttemptEvidence`): when the verdict was taken, the health monitor's alarm, the stalls, what the
launchers printed of the workers' exits (:class:`LauncherExit`), lines no rank could be found for, the lines
that say a rank-local phase began, that the run ended well, or that something failed.

No torch import, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from elastic_diag.core.calls import RankCalls
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.flight_recorder import RankRecord
from elastic_diag.core.progress import KernelEvidence, NonFinite, Progress
from elastic_diag.core.stacks import StackDump, parse_stack_dump
from elastic_diag.core.stall import StallRecord, stall_at_failure
from elastic_diag.core.values import signal_name


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorLine:
    """The first error of its own a rank printed (a traceback, a fatal-signal banner, a native error
    line), stamped with when it was written: ``arrival`` is when the launcher read the line,
    ``logged`` the time the line carries itself (a logging timestamp), ``time`` the better of the two.

    Scripts log an exception (``logging.exception``, ``traceback.print_exc()``, a framework's logger),
    clean up for seconds, then re-raise: this line, not the excepthook, is when the failure began."""

    time: float
    text: str
    arrival: float | None = None
    logged: float | None = None
    exception: ExceptionRecord | None = None  # when the line is a printed traceback
    stream: str = "stderr"


@dataclass(frozen=True, slots=True)
class WatchdogTimeout:
    """What a ProcessGroupNCCL watchdog line says of the collective that timed out:
    ``WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1024, ...)``."""

    seq: int
    op: str
    numel: int | None = None


@dataclass(frozen=True, slots=True)
class FingerprintReport:
    """One rank's TORCH_DISTRIBUTED_DEBUG=DETAIL "Detected mismatch between collectives on ranks": its own
    collective and the other rank's it was compared with (either side's fields may be missing where the
    line is cut)."""

    rank: int
    seq: int | None
    op: str | None
    other: int | None
    other_seq: int | None
    other_op: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LogLine:
    """A line of a log kept as evidence, its prefixes (rank, host, timestamps) taken off: when it says it was
    written (``time``, epoch seconds; ``clock``, a glog header's "MMDD HH:MM:SS.ffffff" with no year), its
    position in the read (``order``: orders lines whose time is unknown), where it was read (``source``,
    ``offset``), the rank it belongs to when it is kept apart from any rank's record (``rank``), the
    signature the reader matched it with (shown, never decided on: the rules match again), and the fields a
    watchdog line or a DETAIL fingerprint report carries."""

    text: str
    time: float | None = None
    order: int = 0
    source: str | None = None
    offset: int | None = None
    clock: str | None = None
    rank: int | None = None
    signature: str | None = None
    watchdog: WatchdogTimeout | None = None
    fingerprint: FingerprintReport | None = None


# what printed a LauncherExit line
Launcher = Literal["torchrun", "torch-agent", "deepspeed", "composer", "mpirun", "horovodrun", "torchrun-diag", "other"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LauncherExit:
    """What a launcher printed of one worker's exit: torchrun's failure summary (``launcher="torchrun"``:
    an entry of ``ChildFailedError``'s table, ``root`` for its "Root Cause (first observed failure)"), torch's
    agent's ``failed (exitcode: 1) local_rank: 2 (pid: ...)`` line (``torch-agent``: the first failure the
    agent saw on its node, a LOCAL rank), DeepSpeed's ``exits with return code = -9`` (``deepspeed``: the
    global rank when its rank mapping was printed), MosaicML Composer's "Global rank 2 (PID ..) exited with
    code -7" (``composer``), torchrun-diag's "job succeeded" (``torchrun-diag``, no rank: every rank exited 0).
    ``rank`` is the global rank where the line (or a mapping printed elsewhere in the log) says it."""

    exit_code: int | None  # None: the entry's exit status was cut off
    launcher: Launcher = "torchrun"
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    pid: int | None = None
    time: float | None = None
    root: bool = False
    exception: ExceptionRecord | None = None  # the exception of the summary entry's traceback
    text: str = ""

    @property
    def signal(self) -> str | None:
        return signal_name(self.exit_code)


# A rank that made progress this long after an error line it printed had recovered from it.
RECOVERED_AFTER_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEvidence:
    """Everything known about one rank of one attempt.

    ``exit_code`` is None while the rank is alive or where no launcher's line tells it (a log);
    ``alive_at_decision`` marks a rank that was still running when the verdict was taken (its stack was
    dumped then); ``stopped_by_agent`` marks one whose exit came from the launcher's own teardown.
    ``order``: where a log was read, the position of the rank's first error line in the read (orders the
    ranks whose lines carry no time).
    """

    rank: int
    local_rank: int
    node: str
    pid: int | None = None
    exit_code: int | None = None
    exit_time: float | None = None
    start_time: float | None = None
    alive_at_decision: bool = False
    stopped_by_agent: bool = False
    exception: ExceptionRecord | None = None
    stderr_tail: tuple[str, ...] = ()
    stdout_tail: tuple[str, ...] = ()
    lines: tuple[LogLine, ...] = ()  # the error lines it printed, anywhere in its output, in order
    stack: StackDump | None = None
    evidence_dir: str | None = None
    notes: tuple[str, ...] = field(default=())
    flight_record: RankRecord | None = None
    calls: RankCalls | None = None  # the roots, peers and groups of its collective calls (core/calls.py)
    nonfinite: NonFinite | None = None  # the first non-finite loss this rank backpropagated
    progress: Progress | None = None  # its progress beacon's last record
    error_line: ErrorLine | None = None  # the first error of its own it printed (the launcher's line clock)
    thread_exception: ExceptionRecord | None = None  # the first uncaught exception of one of its threads
    kernel: KernelEvidence | None = None  # a SIGKILLed rank: what the kernel says (agent/kernel.py)
    order: int | None = None
    # "local": the log names this process only by a local index (torch's agent's "local_rank: K", an mp.spawn
    # process index), with no line of it under a global rank; "global" otherwise
    coordinate: str = "global"
    exit_seen: bool = True  # False: no launcher told its exit; ``exit_code`` was inferred from its lines

    @property
    def steps(self) -> int | None:
        """Optimizer steps the beacon counted."""
        return self.progress.steps if self.progress is not None else None

    @property
    def progress_time(self) -> float | None:
        """When the beacon last saw a step, backward or heartbeat."""
        return self.progress.progress_time if self.progress is not None else None

    @property
    def step_durations(self) -> tuple[float, ...]:
        return self.progress.step_durations if self.progress is not None else ()

    def location(self) -> str | None:
        """Where the rank's own code was when it failed or was stopped: its traceback, the stack the
        launcher took, or the faulthandler dump in its stderr (a fatal signal)."""
        if self.exception is not None and (loc := self.exception.user_location()):
            return loc
        if self.stack is not None and (frame := self.stack.user_frame()):
            return str(frame)
        dumped = parse_stack_dump("\n".join(self.stderr_tail))
        if dumped is not None and (frame := dumped.user_frame()):
            return str(frame)
        return None

    @property
    def signal(self) -> str | None:
        return signal_name(self.exit_code)

    @property
    def failed(self) -> bool:
        return self.exit_code is not None and self.exit_code != 0

    def _recovered_after(self, t: float | None) -> bool:
        return t is not None and self.progress_time is not None and self.progress_time > t + RECOVERED_AFTER_S

    def own_error_line(self) -> ErrorLine | None:
        """The error line it printed, when that line began its failure: it made no progress after it,
        and a traceback it printed is the exception it died of (or one in that exception's chain)."""
        line = self.error_line
        if line is None or self._recovered_after(line.time):
            return None
        printed = line.exception
        if printed is not None and self.exception is not None:
            died_of = {self.exception.type, *(t for t, _ in self.exception.chain)}
            if printed.type not in died_of and printed.type.rsplit(".", 1)[-1] not in {
                t.rsplit(".", 1)[-1] for t in died_of
            }:
                return None
        return line

    def own_thread_exception(self) -> ExceptionRecord | None:
        """A thread's uncaught exception, when the rank made no progress after it."""
        exc = self.thread_exception
        if exc is None or self._recovered_after(exc.time):
            return None
        return exc

    @property
    def first_error_time(self) -> float | None:
        line = self.own_error_line()
        thread = self.own_thread_exception()
        candidates = (
            self.exception.time if self.exception else None,
            line.time if line else None,
            thread.time if thread else None,
            self.exit_time,
        )
        times = [t for t in candidates if t]
        return min(times) if times else None

    def texts(self) -> list[str]:
        """Every line of its that a rule may match against the taxonomy: the kernel's proof of an OOM kill,
        its exception's last line, the error lines it printed. A front-end keeps every line of the rank's output
        that matches a signature in ``lines`` (of a live rank, those of its streams' tails); a record with none
        (built by hand, another node's, an earlier version's) has its tails matched instead."""
        out: list[str] = []
        if self.kernel is not None and self.kernel.proven and self.kernel.line:
            out.append(self.kernel.line)
        if self.exception is not None:
            out.append(self.exception.last_line)
        if self.lines:
            out.extend(line.text for line in self.lines)
        else:
            out.extend(self.stderr_tail)
            out.extend(self.stdout_tail)
        return out


# where the evidence came from: a launcher that watched the ranks, or logs read afterwards
Source = Literal["live", "logs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptEvidence:
    """One attempt; ``decided_at`` is when the launcher took its verdict and began the teardown.

    From logs (``source="logs"``) also: what the launchers printed of the workers' exits, the lines no rank
    could be found for, the lines that say a rank-local phase began (a checkpoint save, an evaluation), that
    the run ended well, or that something failed (a few of each), and how many processes torch's agent sent a
    closing signal that no line ties to a rank."""

    attempt: int
    ranks: tuple[RankEvidence, ...]
    run_id: str = ""
    source: Source = "live"
    decided_at: float | None = None
    hang: dict[str, Any] | None = None  # the health monitor's alarm: threshold_s, stalled_s, reason
    came_up: bool | None = None  # a collective completed on some rank (None: no beacon to tell)
    stalls: tuple[StallRecord, ...] = ()  # the stalls the health monitor recorded (core/stall.py), in order
    launcher_exits: tuple[LauncherExit, ...] = ()
    unranked: tuple[LogLine, ...] = ()
    phases: tuple[LogLine, ...] = ()
    completions: tuple[str, ...] = ()
    failure_lines: tuple[str, ...] = ()
    single_node: str | None = None  # a line that shows the job ran on one node (local ranks are global ones)
    signalled_unknown: int = 0  # processes torch's agent sent a closing signal that no line ties to a rank

    def rank(self, rank: int) -> RankEvidence | None:
        return next((ev for ev in self.ranks if ev.rank == rank), None)

    @property
    def failure_began(self) -> float | None:
        """When the first rank that failed by itself (not stopped by the launcher) began to fail."""
        times = [t for ev in self.ranks if (ev.failed or ev.exception is not None) and not ev.stopped_by_agent
                 and (t := ev.first_error_time) is not None]  # fmt: skip
        return min(times, default=None)

    @property
    def stall(self) -> StallRecord | None:
        """The stall under way when the attempt began to fail (its snapshot taken while the ranks were stuck)."""
        return stall_at_failure(self.stalls, self.failure_began)

    @property
    def torchrun_root(self) -> int | None:
        """The rank torchrun's summary named as "Root Cause (first observed failure)", if a log shows it."""
        return next((e.rank for e in self.launcher_exits if e.root and e.launcher == "torchrun"), None)

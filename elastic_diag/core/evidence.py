"""Evidence records: what is known about one rank of one attempt, as plain frozen data.

Built by the agent (live) or by the log readers (offline) and handed to :mod:`elastic_diag.core.classify`.
Also the parser of faulthandler stack dumps, which decides whether a rank's main thread was inside
a collective. No torch import, no I/O.
"""

from __future__ import annotations

import math
import re
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic_diag.core.flight_recorder import RankRecord

if TYPE_CHECKING:
    from elastic_diag.core.stall import StallRecord

# Innermost frames in these parts of torch mean "inside a collective or waiting on one" (DDP's and
# FSDP's collectives run inside autograd's backward, so a rank blocked there shows autograd frames).
_COLLECTIVE_PATHS = (
    "/torch/distributed/",
    "/torch/nn/parallel/",
    "/torch/autograd/",
    "/torch/_tensor.py",
)
_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)(?: \[[^\]]*\])? \(most recent call first\):")
_STDLIB = re.compile(r"/lib/python\d+\.\d+/(?!site-packages/|dist-packages/)")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
_CHAIN_SEPARATOR = re.compile(
    r"\n\s*(?:During handling of the above exception, another exception occurred|"
    r"The above exception was the direct cause of the following exception):\s*\n"
)


@dataclass(frozen=True, slots=True)
class ExceptionRecord:
    """An exception as the worker bootstrap recorded it (or as a rank printed it).

    ``mro``: the qualified names of its class's bases, itself first (so a numpy ``_ArrayMemoryError``
    is known to be a ``MemoryError``). ``chain``: the exceptions it was raised while handling or from
    (``__context__`` / ``__cause__``), oldest first, as ``(type, message)``: a cleanup that fails in a
    collective while handling the rank's own ValueError raises a peer-closed error whose chain holds
    the cause. ``thread``: the name of the thread that raised it when not the main thread.
    ``problems``: what could not be recorded (a ``__str__`` that raised, a message cut to size)."""

    type: str
    message: str
    traceback: str
    time: float | None = None
    mro: tuple[str, ...] = ()
    chain: tuple[tuple[str, str], ...] = ()
    thread: str | None = None
    problems: tuple[str, ...] = ()

    @property
    def last_line(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type

    def section(self, index: int) -> str:
        """The part of the traceback text that belongs to the ``index``-th exception of the chain,
        oldest first (Python prints each one's frames, then "During handling of the above exception,
        another exception occurred:"); the whole text when it has no such parts."""
        parts = _CHAIN_SEPARATOR.split(self.traceback)
        if len(parts) < 2 or not -len(parts) <= index < len(parts):
            return self.traceback
        return parts[index]

    def type_names(self) -> tuple[str, ...]:
        """Its type, then the bases it was recorded with (short and qualified names both match)."""
        return (self.type, *self.mro) if self.type not in self.mro else self.mro

    def location(self) -> str | None:
        """``file:line in func`` of the innermost frame of the traceback, if there is one."""
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', self.traceback)
        if not frames:
            return None
        file, line, func = frames[-1]
        return f"{file}:{line} in {func}"

    def user_location(self) -> str | None:
        """The innermost traceback frame in the user's code (outside torch and the standard library)."""
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', self.traceback)
        for file, line, func in reversed(frames):
            if _is_user_file(file):
                return f"{file}:{line} in {func}"
        return None


def _is_user_file(path: str) -> bool:
    p = path.replace("\\", "/")
    return (
        "/torch/" not in p
        and "/threading.py" not in p
        and "/site-packages/" not in p
        and not _STDLIB.search(p)
        and not p.endswith("elastic_diag/worker/beacon.py")  # the backward hook's own frame
        and not p.startswith("<")
    )


@dataclass(frozen=True, slots=True)
class StackFrame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


@dataclass(frozen=True, slots=True)
class StackDump:
    """One faulthandler dump of all threads; ``threads[-1]`` is the oldest thread (the main one)."""

    text: str
    threads: tuple[tuple[StackFrame, ...], ...]

    @property
    def main_thread(self) -> tuple[StackFrame, ...]:
        return self.threads[-1] if self.threads else ()

    def in_collective(self) -> bool | None:
        """Whether the main thread's innermost frame is inside torch.distributed / autograd."""
        frames = self.main_thread
        if not frames:
            return None
        return any(p in frames[0].file.replace("\\", "/") for p in _COLLECTIVE_PATHS)

    def user_frame(self) -> StackFrame | None:
        """The innermost main-thread frame outside torch and the standard library's threading."""
        for f in self.main_thread:
            if _is_user_file(f.file):
                return f
        return self.main_thread[0] if self.main_thread else None


def parse_stack_dump(text: str) -> StackDump | None:
    """Parse faulthandler's ``dump_traceback(all_threads=True)`` text; None when it has no thread."""
    threads: list[list[StackFrame]] = []
    for raw in text.splitlines():
        if _THREAD_HEADER.match(raw):
            threads.append([])
            continue
        m = _FRAME.match(raw)
        if m and threads:
            threads[-1].append(StackFrame(m["file"], int(m["line"]), m["func"].strip()))
    if not threads:
        return None
    return StackDump(text=text, threads=tuple(tuple(t) for t in threads))


def as_seconds(value: Any) -> float | None:
    """A time or duration read from JSON written by another process: a finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def exception_to_json(
    exc: ExceptionRecord, *, message_chars: int = 20_000, traceback_chars: int = 100_000, time: float | None = None
) -> dict[str, Any]:
    """An ExceptionRecord as JSON (the bootstrap's exception.json shape), bounded; ``time`` replaces its own
    (a record moved onto another clock)."""
    return {"type": exc.type, "message": exc.message[:message_chars], "traceback": exc.traceback[-traceback_chars:],
            "time": exc.time if time is None else time, "mro": list(exc.mro), "chain": [list(c) for c in exc.chain],
            "thread": exc.thread, "problems": list(exc.problems)}  # fmt: skip


def exception_from_json(data: Any) -> ExceptionRecord | None:
    """exception.json, thread_exception.json, and the exceptions inside first_error.json and the nodes'
    records, back as an ExceptionRecord; None for anything that is not one (garbled, foreign)."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str) or not data["type"]:
        return None
    mro, chain, thread = data.get("mro"), data.get("chain"), data.get("thread")
    return ExceptionRecord(
        type=data["type"],
        message=str(data.get("message", "")),
        traceback=str(data.get("traceback", ""))[:100_000],
        time=as_seconds(data.get("time")),
        mro=tuple(str(m) for m in mro) if isinstance(mro, list) else (),
        chain=tuple((str(c[0]), str(c[1])) for c in chain if isinstance(c, list) and len(c) == 2)
        if isinstance(chain, list)
        else (),
        thread=str(thread) if thread else None,
        problems=tuple(p for p in data.get("problems") or () if isinstance(p, str)),
    )


def signal_name(exit_code: int | None) -> str | None:
    """``SIGKILL`` for an exit code of -9 (Popen's convention), else None."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"SIG{-exit_code}"


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


# A rank that made progress this long after an error line it printed had recovered from it.
RECOVERED_AFTER_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEvidence:
    """Everything known about one rank of one attempt.

    ``exit_code`` is None while the rank is alive. ``alive_at_decision`` marks a rank that was
    still running when the verdict was taken (its stack was dumped then); ``stopped_by_agent``
    marks one whose exit came from the launcher's own teardown.
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
    stack: StackDump | None = None
    evidence_dir: str | None = None
    notes: tuple[str, ...] = field(default=())
    flight_record: RankRecord | None = None
    nonfinite: dict[str, Any] | None = None  # the first non-finite loss this rank backpropagated
    step_durations: tuple[float, ...] = ()
    progress_time: float | None = None  # when the beacon last saw a step, backward or heartbeat
    steps: int | None = None  # optimizer steps the beacon counted
    error_line: ErrorLine | None = None  # the first error of its own it printed (the launcher's line clock)
    thread_exception: ExceptionRecord | None = None  # the first uncaught exception of one of its threads
    # a SIGKILLed rank: what the kernel says (agent/kernel.py: proven, line, cgroup, looked_at)
    kernel: dict[str, Any] | None = None

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


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptEvidence:
    """One attempt; ``decided_at`` is when the launcher took its verdict and began the teardown."""

    attempt: int
    ranks: tuple[RankEvidence, ...]
    run_id: str = ""
    decided_at: float | None = None
    hang: dict[str, Any] | None = None  # the health monitor's alarm: threshold_s, stalled_s, reason
    came_up: bool | None = None  # a collective completed on some rank (None: no beacon to tell)
    stalls: tuple[StallRecord, ...] = ()  # the stalls the health monitor recorded (core/stall.py), in order

    @property
    def failure_began(self) -> float | None:
        """When the first rank that failed by itself (not stopped by the launcher) began to fail."""
        times = [t for ev in self.ranks if (ev.failed or ev.exception is not None) and not ev.stopped_by_agent
                 and (t := ev.first_error_time) is not None]  # fmt: skip
        return min(times, default=None)

    @property
    def stall(self) -> StallRecord | None:
        """The stall under way when the attempt began to fail (its snapshot taken while the ranks were stuck)."""
        from elastic_diag.core.stall import stall_at_failure

        return stall_at_failure(self.stalls, self.failure_began)

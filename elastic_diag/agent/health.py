"""The agent's health monitor: a timer thread that calls a hang long before the collective timeout.

Every rank's progress beacon (:mod:`elastic_diag.worker.beacon`) rewrites ``progress.json`` every 2 s (more
often under a short threshold the user set: ``DiagConfig.progress_interval_s``).
The monitor reads them on its own timer and keeps, per rank, the last time its progress changed:
optimizer steps, ``loss.backward()`` calls, heartbeats, a watched section, or the sequence numbers
of its collectives. A hang is called when NO running rank has made progress for the threshold while
at least one of them waits inside a collective (a rank stuck in a dataloader deadlock or a Python
loop stops progressing, and its peers block in their next collective), or when a rank stays in a
``watch`` section past its own timeout. Ranks that have exited are not watched.

Threshold: fixed (``--diag-hang-timeout SECONDS``) or automatic: ``AUTO_FACTOR`` times the median
step time once ``WARMUP_STEPS`` steps are seen, never below ``AUTO_FLOOR_S``; before that (slow first
steps, compilation, loading) ``AUTO_START_S``. A checkpoint save that stalls every rank for less than
the threshold raises nothing. Ranks without a beacon (``--no-python``, a bootstrap that failed) are
not watched; with no beacon at all, the monitor never fires.

A **stall** is the same condition held for a shorter time (``--diag-stall-timeout``; automatic:
``STALL_FACTOR`` times the median step, never below ``STALL_FLOOR_S``, ``STALL_START_S`` before the
warm-up): it stops nothing. The monitor records it (:class:`Stall`: since when, which ranks wait inside
a collective and which are outside it, holding the others) and calls ``on_stall``; the capture then takes
every rank's stacks and flight recorder while the culprit is still stuck. When progress resumes the stall
ends (``on_stall_end``) and becomes a warning; if the job fails instead, its evidence serves the verdict.
One record per stall, and a snapshot at most every ``STALL_SPACING_S`` (a stall within a minute of the
last snapshot is recorded without one). A stall threshold at or above the hang threshold gives no stall:
the hang verdict takes the evidence then.

The clock is injected; :meth:`HealthMonitor.check` is the whole decision and runs without a thread in
unit tests.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_diag.core.progress import Progress, Watch
from elastic_diag.layout import read_progress

AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 60.0
AUTO_START_S = 600.0
WARMUP_STEPS = 3
POLL_S = 0.5  # a rank's progress is seen at most this long after its beacon wrote it
STALL_FACTOR = 3.0
STALL_FLOOR_S = 5.0
STALL_START_S = 30.0
STALL_SPACING_S = 60.0  # at most one snapshot a minute per attempt


@dataclass(slots=True)
class _RankState:
    key: Any = None
    changed_at: float | None = None
    # moving forward: a step, a backward, a heartbeat, a watch, or a new collective entered; a collective that
    # only ended (a timed-out one counts as completed) is not (a stall ends on this, not on changed_at)
    forward: Any = None
    moved_at: float | None = None
    steps: int = 0
    durations: tuple[float, ...] = ()
    watch: Watch | None = None
    seen: bool = False
    in_collective: bool = False  # its last snapshot: a collective enqueued and not completed
    exiting: bool = False  # the rank's interpreter is shutting down (its beacon said so at exit)


@dataclass(frozen=True, slots=True)
class HangAlarm:
    threshold_s: float
    stalled_s: float
    reason: str
    rank: int | None = None  # a rank past its own watch timeout
    detected_at: float | None = None  # wall clock

    def to_json(self) -> dict[str, Any]:
        return {"threshold_s": round(self.threshold_s, 3), "stalled_s": round(self.stalled_s, 3),
                "reason": self.reason, "rank": self.rank, "detected_at": self.detected_at}  # fmt: skip


@dataclass(slots=True)
class Stall:
    """No running rank made progress for ``threshold_s`` while some waited inside a collective. Ranks are
    the monitor's keys (local ranks); times are wall clock."""

    number: int  # 1, 2, ... within the attempt
    since: float  # the last progress any running rank made
    detected_at: float
    threshold_s: float
    waiting: tuple[int, ...]  # inside a collective
    outside: tuple[int, ...]  # outside any collective: the ranks the others wait for
    last_progress: dict[int, float]  # each watched rank's last progress
    snapshot: bool  # a snapshot is due (False: the last one was less than STALL_SPACING_S ago)
    ended_at: float | None = None  # progress resumed
    _since_clock: float = 0.0  # the same instant on the monitor's clock

    @property
    def stalled_s(self) -> float:
        return self.detected_at - self.since

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.since


def _off_when_zero(value: float | None) -> float | None:
    return math.inf if value == 0 else value


class HealthMonitor:
    """Watches the progress files of one attempt's local ranks (``{rank: path}``).

    ``hang_timeout_s`` / ``stall_timeout_s``: seconds, None for the automatic threshold, 0 for off.
    ``on_stall`` / ``on_stall_end`` are called from :meth:`check` (the monitor's thread): keep them short."""

    def __init__(
        self,
        files: dict[int, Path],
        hang_timeout_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        exited: Callable[[], set[int]] = set,
        *,
        stall_timeout_s: float | None = None,
        on_stall: Callable[[Stall], None] | None = None,
        on_stall_end: Callable[[Stall], None] | None = None,
    ) -> None:
        self.files = files
        self._exited = exited  # ranks whose process has exited: they are not watched any more
        self.fixed = _off_when_zero(hang_timeout_s)
        self.stall_fixed = _off_when_zero(stall_timeout_s)
        self._clock = clock
        self._wall = wall
        self.started = clock()
        self.ranks = {r: _RankState() for r in files}
        self.alarm: HangAlarm | None = None
        self.stall: Stall | None = None  # the stall under way
        self.stalls: list[Stall] = []  # every stall of the attempt, in order
        self._on_stall = on_stall
        self._on_stall_end = on_stall_end
        self._last_snapshot: float | None = None  # the monitor's clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the decision ------------------------------------------------------------------------------
    def _median_step(self, seen: int = WARMUP_STEPS + 1) -> float | None:
        """The median of the last steps of the ranks that have made at least ``seen`` steps."""
        durations = [d for st in self.ranks.values() if st.steps >= seen for d in st.durations[-10:]]
        return statistics.median(durations) if durations else None

    def threshold(self) -> float:
        if self.fixed is not None:
            return self.fixed
        median = self._median_step()
        return AUTO_START_S if median is None else max(AUTO_FLOOR_S, AUTO_FACTOR * median)

    def stall_threshold(self) -> float:
        if self.stall_fixed is not None:
            return self.stall_fixed
        median = self._median_step(WARMUP_STEPS)  # once 3 steps are seen: a hang at step 3 is a stall in 5 s
        return STALL_START_S if median is None else max(STALL_FLOOR_S, STALL_FACTOR * median)

    def observe(self, rank: int, progress: Progress | None, now: float) -> None:
        st = self.ranks[rank]
        if progress is None:
            return
        key = progress.activity()
        if key != st.key:
            st.key, st.changed_at = key, now
        forward = progress.forward_activity()
        if forward != st.forward:
            st.forward, st.moved_at = forward, now
        # watched once it shows training activity: a script that never starts a process group, an
        # optimizer or a heartbeat is not a distributed job this monitor can judge
        st.exiting = progress.exiting
        st.seen = st.seen or progress.started
        st.in_collective = progress.in_collective
        st.steps = progress.steps or 0
        st.durations = progress.step_durations
        st.watch = progress.watch

    def check(self, now: float | None = None) -> HangAlarm | None:
        """Read every progress file once and decide; the first alarm sticks."""
        if self.alarm is not None:
            return self.alarm
        now = self._clock() if now is None else now
        for rank, path in self.files.items():
            self.observe(rank, read_progress(path), now)
        wall = self._wall()
        self._end_stall(now, wall)
        exited = self._exited()
        seen = {r: st for r, st in self.ranks.items()
                if st.seen and st.changed_at is not None and r not in exited and not st.exiting}  # fmt: skip
        if not seen:
            return None
        for r, st in seen.items():
            w = st.watch
            if w is not None and w.timeout is not None:
                over = wall - w.since
                if over > w.timeout:
                    self.alarm = HangAlarm(threshold_s=w.timeout, stalled_s=over, rank=r, detected_at=wall,
                                           reason=f"rank {r} stayed in watch({w.name!r}) past its timeout")  # fmt: skip
                    return self.alarm
        threshold = self.threshold()
        last = max(st.changed_at for st in seen.values() if st.changed_at is not None)
        stalled = now - last
        # a distributed hang has someone WAITING in a collective; every rank busy outside one (a final
        # checkpoint, an evaluation, a slow step) is not called a hang
        waiting = any(st.in_collective for st in seen.values())
        # ranks alive that never showed training activity (a beacon starved since before the first step: the
        # GIL held in native code) are not known to be in a collective: the stall lists them outside
        quiet = {r: st for r, st in self.ranks.items()
                 if not st.seen and st.key is not None and r not in exited and not st.exiting}  # fmt: skip
        self._track_stall({**quiet, **seen}, last, stalled, waiting, now, wall, threshold)
        if stalled >= threshold and waiting:
            kind = "--diag-hang-timeout" if self.fixed is not None else "automatic threshold"
            self.alarm = HangAlarm(threshold_s=threshold, stalled_s=stalled, reason=kind, detected_at=wall)
        return self.alarm

    def _end_stall(self, now: float, wall: float) -> None:
        """The stall under way ends when any rank moves forward, even one that then exited (a final checkpoint,
        then the end of the job); the collective its peers waited in ending with a timeout does not end it."""
        current = self.stall
        if current is None:
            return
        moved = [st.moved_at for st in self.ranks.values() if st.moved_at is not None]
        resumed = max(moved, default=current._since_clock)
        if resumed > current._since_clock:
            current.ended_at = wall - (now - resumed)
            self.stall = None
            if self._on_stall_end is not None:
                self._on_stall_end(current)

    def _track_stall(self, live: dict[int, _RankState], last: float, stalled: float, waiting: bool, now: float,
                     wall: float, hang_threshold: float) -> None:  # fmt: skip
        """Record a new stall when the condition holds (one record per stall); ``live``: the ranks running."""
        if self.stall is not None or not waiting or (self.stalls and self.stalls[-1]._since_clock == last):
            return  # one record per stall: a stall that ended when a rank left is not recorded again
        threshold = self.stall_threshold()
        if stalled < threshold or threshold >= hang_threshold:
            return
        due = self._last_snapshot is None or now - self._last_snapshot >= STALL_SPACING_S
        if due:
            self._last_snapshot = now
        stall = Stall(
            number=len(self.stalls) + 1, since=wall - stalled, detected_at=wall, threshold_s=threshold,
            waiting=tuple(sorted(r for r, st in live.items() if st.in_collective)),
            outside=tuple(sorted(r for r, st in live.items() if not st.in_collective)),
            last_progress={r: wall - (now - st.changed_at) for r, st in live.items()
                           if st.seen and st.changed_at is not None},
            snapshot=due, _since_clock=last,
        )  # fmt: skip
        self.stall = stall
        self.stalls.append(stall)
        if self._on_stall is not None:
            self._on_stall(stall)

    # -- the timer thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="elastic-diag-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if self.check() is not None:
                    return
            except Exception:  # the monitor never takes the agent down
                return

    def stop(self) -> None:
        self._stop.set()

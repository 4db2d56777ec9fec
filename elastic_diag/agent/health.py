"""The agent's health monitor: a timer thread that calls a hang long before the collective timeout.

Every rank's progress beacon (:mod:`elastic_diag.worker.beacon`) rewrites ``progress.json`` twice a second.
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

The clock is injected; :meth:`HealthMonitor.check` is the whole decision and runs without a thread in
unit tests.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_diag.layout import read_progress

AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 60.0
AUTO_START_S = 600.0
WARMUP_STEPS = 3
POLL_S = 0.25


@dataclass(slots=True)
class _RankState:
    key: Any = None
    changed_at: float | None = None
    steps: int = 0
    durations: tuple[float, ...] = ()
    watch: Any = None
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


class HealthMonitor:
    """Watches the progress files of one attempt's local ranks (``{rank: path}``)."""

    def __init__(
        self,
        files: dict[int, Path],
        hang_timeout_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        exited: Callable[[], set[int]] = set,
    ) -> None:
        self.files = files
        self._exited = exited  # ranks whose process has exited: they are not watched any more
        self.fixed = hang_timeout_s
        self._clock = clock
        self._wall = wall
        self.started = clock()
        self.ranks = {r: _RankState() for r in files}
        self.alarm: HangAlarm | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the decision ------------------------------------------------------------------------------
    def threshold(self) -> float:
        if self.fixed is not None:
            return self.fixed
        durations = [d for st in self.ranks.values() if st.steps > WARMUP_STEPS for d in st.durations[-10:]]
        if not durations:
            return AUTO_START_S
        return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(durations))

    def observe(self, rank: int, data: dict[str, Any] | None, now: float) -> None:
        st = self.ranks[rank]
        if data is None:
            return
        pg = data.get("pg_status") or {}
        seqs = tuple(sorted((str(k), str(v.get("last_enqueued_collective")), str(v.get("last_completed_collective")))
                            for k, v in pg.items() if isinstance(v, dict)))  # fmt: skip
        watch = data.get("watch")
        key = (data.get("steps"), data.get("backward"), data.get("heartbeats"), seqs, json.dumps(watch))
        if key != st.key:
            st.key, st.changed_at = key, now
        # watched once it shows training activity: a script that never starts a process group, an
        # optimizer or a heartbeat is not a distributed job this monitor can judge
        st.exiting = bool(data.get("exiting"))
        st.seen = st.seen or bool(seqs or data.get("steps") or data.get("backward") or data.get("heartbeats") or watch)
        st.in_collective = any(int(v.get("last_enqueued_collective", -1)) > int(v.get("last_completed_collective", -1))
                               for v in pg.values() if isinstance(v, dict))  # fmt: skip
        st.steps = int(data.get("steps") or 0)
        durations = data.get("step_durations") or []
        st.durations = tuple(float(d) for d in durations if isinstance(d, int | float))
        st.watch = watch

    def check(self, now: float | None = None) -> HangAlarm | None:
        """Read every progress file once and decide; the first alarm sticks."""
        if self.alarm is not None:
            return self.alarm
        now = self._clock() if now is None else now
        for rank, path in self.files.items():
            self.observe(rank, read_progress(path), now)
        exited = self._exited()
        seen = {r: st for r, st in self.ranks.items()
                if st.seen and st.changed_at is not None and r not in exited and not st.exiting}  # fmt: skip
        if not seen:
            return None
        wall = self._wall()
        for r, st in seen.items():
            w = st.watch
            if isinstance(w, list) and len(w) == 3 and isinstance(w[2], int | float) and isinstance(w[1], int | float):
                over = wall - w[1]
                if over > w[2]:
                    self.alarm = HangAlarm(threshold_s=float(w[2]), stalled_s=over, rank=r, detected_at=wall,
                                           reason=f"rank {r} stayed in watch({w[0]!r}) past its timeout")  # fmt: skip
                    return self.alarm
        threshold = self.threshold()
        last = max(st.changed_at for st in seen.values() if st.changed_at is not None)
        stalled = now - last
        # a distributed hang has someone WAITING in a collective; every rank busy outside one (a final
        # checkpoint, an evaluation, a slow step) is not called a hang
        if stalled >= threshold and any(st.in_collective for st in seen.values()):
            kind = "--diag-hang-timeout" if self.fixed is not None else "automatic threshold"
            self.alarm = HangAlarm(threshold_s=threshold, stalled_s=stalled, reason=kind, detected_at=wall)
        return self.alarm

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

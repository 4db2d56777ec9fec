"""Hangs and stalls under ``elastic-diag exec``: torchrun-diag's health monitor, run by each watch over every
rank's progress file in the shared diag dir.

Each watch runs :class:`~elastic_diag.agent.health.HealthMonitor` (the same thresholds: ``--diag-hang-timeout``
/ ``--diag-stall-timeout``, automatic by default) over ``attempt_0/rank_<R>/progress.json`` of every rank of
the world, its own and those other watches (other hosts too, through a shared file system) keep. All watches
read the same files, so they call the same hang within one poll of each other, each for the ranks it watches:

* a **stall** (nobody progressed for the stall threshold while some wait inside a collective): the watch's
  own ranks' stacks and flight recorders go to ``stall_<K>/rank_<R>/`` and its part of the record to
  ``stall_<K>/stall.<part>.json`` (:class:`~elastic_diag.agent.stall.StallSnapshots`; ``read_stalls`` merges
  the parts into one record); nothing is stopped;
* a **hang** (the same past the hang threshold): the watch's live ranks' stacks and flight recorders are taken
  (the beacon's dump request, faulthandler's signal when it is silent), the alarm goes into their
  ``launcher.json``, then they are stopped (SIGTERM, SIGKILL after the grace period), and the verdict is
  judged as after any failure.

A watch that sees no world size (PMIx gives none) watches its own ranks only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_diag.agent.dumps import request_dumps
from elastic_diag.agent.health import POLL_S, HangAlarm, HealthMonitor
from elastic_diag.agent.stall import StallSnapshots
from elastic_diag.config import DEFAULT_STACK_TIMEOUT_S
from elastic_diag.layout import PROGRESS_FILE, RankLayout, rank_dir_name, stack_file_size

Targets = dict[int, tuple[int, RankLayout]]  # rank -> (pid, folder): the live ranks this watch can signal


class ExecHealth:
    """One watch's health monitor: ``ranks()`` the ranks it watches (rank -> pid, folder), ``world()`` the world
    size once known, ``exited()`` the ranks known to have ended (theirs and the other watches'), ``on_hang`` what
    to do once the stacks are taken."""

    def __init__(
        self,
        *,
        attempt_dir: Path,
        node: str,
        part: str,
        hang_timeout_s: float | None,
        stall_timeout_s: float | None,
        ranks: Callable[[], Targets],
        world: Callable[[], int | None],
        exited: Callable[[], set[int]],
        on_hang: Callable[[HangAlarm], None],
    ) -> None:
        self.attempt_dir = attempt_dir
        self.hang_timeout_s = hang_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._ranks = ranks
        self._world = world
        self._exited = exited
        self._on_hang = on_hang
        self.dump_lock = threading.Lock()
        self.decided = False
        self.warnings: list[dict[str, Any]] = []
        self.targets: dict[int, tuple[int, int, RankLayout]] = {}  # StallSnapshots': rank -> (rank, pid, folder)
        self.stalls = StallSnapshots(attempt_dir=attempt_dir, attempt=0, targets=self.targets, node=node,
                                     stack_timeout_s=DEFAULT_STACK_TIMEOUT_S, dump_lock=self.dump_lock,
                                     decided=lambda: self.decided, exited=exited, warn=self.warnings.append,
                                     record_file=f"stall.{part}.json")  # fmt: skip
        self.monitor: HealthMonitor | None = None
        self.alarm: HangAlarm | None = None
        self.stack_offsets: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-diag-exec-health", daemon=True)

    @property
    def on(self) -> bool:
        return self.hang_timeout_s != 0 or self.stall_timeout_s != 0

    def start(self) -> ExecHealth:
        if self.on:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if self._tick():
                    return
            except Exception:  # the monitor never takes the watch down
                return

    def _tick(self) -> bool:
        live = self._ranks()
        self.targets.update({r: (r, pid, layout) for r, (pid, layout) in live.items()})
        if self.monitor is None:
            size = self._world()
            watched = range(size) if size else sorted(live)
            if not watched:
                return False
            files = {r: self.attempt_dir / rank_dir_name(r) / PROGRESS_FILE for r in watched}
            self.monitor = HealthMonitor(files, self.hang_timeout_s, exited=self._exited,
                                         stall_timeout_s=self.stall_timeout_s, on_stall=self.stalls.on_stall,
                                         on_stall_end=self.stalls.on_stall_end)  # fmt: skip
        alarm = self.monitor.check()
        if alarm is None:
            return False
        self.alarm = alarm
        self.take_stacks(f"hang-0-{time.time():.6f}")
        self._on_hang(alarm)
        return True

    def take_stacks(self, request: str) -> None:
        """The stacks and flight recorders of this watch's live ranks, once (a hang, or the launcher stopping
        them: srun's SIGTERM after another task failed); where each stack begins in its stacks.txt."""
        if self.decided:
            return
        self.decided = True  # no stall snapshot starts from now on
        live = self._ranks()
        if not live:
            return
        with self.dump_lock:
            self.stack_offsets = {r: stack_file_size(layout.dir) for r, (_, layout) in live.items()}
            request_dumps(live, DEFAULT_STACK_TIMEOUT_S, request)

    def finish(self, *, failed: bool, began: float | None) -> None:
        """Stop watching; settle the stalls' outcomes (a stall the job got over becomes a warning)."""
        self.stop()
        self.stalls.join(2 * DEFAULT_STACK_TIMEOUT_S)
        self.stalls.finish(failed=failed, began=began)

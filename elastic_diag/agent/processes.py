"""The worker processes of one attempt, watched: when each exits (to the millisecond, without reaping it),
its exit status, whether its excepthook has recorded an exception (it is on its way out), the cgroups it
lives in, and what the kernel says of one killed by SIGKILL. The processes, the clock and the sleep are
injected: the capture's decisions are unit-tested with fake processes and a fake clock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from elastic_diag.agent.clock import Clock, Sleep
from elastic_diag.agent.dumps import POLL_S
from elastic_diag.agent.kernel import kernel_log_oom_lines, oom_evidence, remember_cgroups
from elastic_diag.layout import EXCEPTION_FILE, RankLayout

CGROUP_POLL_S = 0.25  # how often a live rank's cgroup is read (it may move itself into another)


class ExitWatcher:
    """Records the exact time each worker process exits, without reaping it: a thread per process waits in
    ``os.waitid(..., WNOWAIT)``, so Popen still gets the status."""

    def __init__(self, pids: dict[int, int], clock: Clock = time.time) -> None:
        self._clock = clock
        self._pids = dict(pids)
        self.exit_times: dict[int, float] = {}
        self._lock = threading.Lock()

    def start(self) -> ExitWatcher:
        for key, pid in self._pids.items():
            t = threading.Thread(target=self._watch, args=(key, pid), name=f"elastic-diag-exit-{key}", daemon=True)
            t.start()
        return self

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


class Process(Protocol):
    """What the capture needs of a worker process: torch's ``Popen`` (or a fake in the unit tests)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


@dataclass(slots=True)
class Worker:
    rank: int
    local_rank: int
    proc: Process
    layout: RankLayout


class WorkerProcesses:
    """One attempt's workers (by local rank), watched."""

    def __init__(self, workers: list[Worker], *, clock: Clock = time.time, monotonic: Clock = time.monotonic,
                 sleep: Sleep = time.sleep) -> None:  # fmt: skip
        self.workers = {w.local_rank: w for w in workers}
        self._clock = clock
        self._monotonic = monotonic
        self._sleep = sleep
        self.watcher = ExitWatcher({w.local_rank: w.proc.pid for w in workers}, clock)
        self.poll_times: dict[int, float] = {}
        self.cgroups: dict[int, dict[str, str]] = {}  # each live rank's cgroup paths, last read
        self.cgroup_baseline: dict[int, dict[str, Any] | None] = {}  # its memory cgroup when first seen there
        self._cgroups_read_at = float("-inf")
        self._started_monotonic = monotonic()  # kernel log stamps are seconds since boot, as CLOCK_MONOTONIC
        self._kernel: dict[int, dict[str, Any]] = {}

    def start(self) -> None:
        self.watcher.start()

    def poll(self) -> dict[int, int | None]:
        """Each worker's exit status (None: running), by local rank; every few polls, the live ones' cgroups."""
        codes = {}
        for lr, w in self.workers.items():
            code = w.proc.poll()  # Popen's own bookkeeping; torch's later poll() sees the same code
            if code is not None and lr not in self.poll_times:
                self.poll_times[lr] = self._clock()
            codes[lr] = code
        now = self._monotonic()
        if now - self._cgroups_read_at >= CGROUP_POLL_S:  # a zombie's /proc/<pid>/cgroup shows the root
            self._cgroups_read_at = now
            gone = self.watcher.exited()
            live = {lr: self.workers[lr].proc.pid for lr, c in codes.items() if c is None and lr not in gone}
            with contextlib.suppress(Exception):
                remember_cgroups(live, self.cgroups, self.cgroup_baseline)
        return codes

    def exit_time(self, lr: int) -> float | None:
        return self.watcher.time_of(lr) or self.poll_times.get(lr)

    def dying(self, lr: int) -> bool:
        """The rank's excepthook has recorded an uncaught exception: it is on its way out."""
        return self.workers[lr].layout.path(EXCEPTION_FILE).exists()

    def has_failure(self) -> bool:
        """A rank exited non-zero, or recorded an uncaught exception (its exit can take seconds)."""
        codes = self.poll()
        return any(c not in (None, 0) for c in codes.values()) or any(
            self.dying(lr) for lr, c in codes.items() if c is None
        )

    def waiting_for(self, codes: dict[int, int | None]) -> set[int]:
        """The ranks alive with no exception of their own: those a grace waits for."""
        return {lr for lr, c in codes.items() if c is None and not self.dying(lr)}

    def kernel_evidence(self, codes: dict[int, int | None], stopped: set[int]) -> dict[int, dict[str, Any]]:
        """For each rank SIGKILLed by something other than the launcher: what the kernel says (an OOM
        kill proven by its log or the rank's memory cgroup, or which sources proved nothing). Once."""
        killed = {lr for lr, c in codes.items() if c == -signal.SIGKILL and lr not in stopped}
        todo = killed - set(self._kernel)
        if todo:
            pids = {self.workers[lr].proc.pid for lr in todo}
            lines, memcgs, source = kernel_log_oom_lines(pids, since=self._started_monotonic - 5.0)
            for lr in todo:
                pid = self.workers[lr].proc.pid
                self._kernel[lr] = oom_evidence(pid, self.cgroup_baseline.get(lr), self.cgroups.get(lr, {}), lines,
                                                source, memcgs.get(pid))  # fmt: skip
        return {lr: self._kernel[lr] for lr in killed}

    def signal(self, local_ranks: list[int] | set[int], signum: int) -> None:
        for lr in local_ranks:
            with contextlib.suppress(OSError):
                os.kill(self.workers[lr].proc.pid, signum)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every live rank, and wait for them at most ``timeout_s``; torch's own monitor then sees the
        exits and tears down the rest."""
        self.signal([lr for lr, code in self.poll().items() if code is None], signal.SIGTERM)
        deadline = self._monotonic() + timeout_s
        while self._monotonic() < deadline and None in self.poll().values():
            self._sleep(POLL_S)

    def alive_and_stopped(self, codes: dict[int, int | None], *, final: bool, decided: bool,
                          alive_at_decision: set[int]) -> tuple[set[int], set[int]]:  # fmt: skip
        """The ranks alive when the verdict was taken, and those the launcher's teardown ended (SIGTERM, or
        SIGKILL after its deadline). Where torch saw the failure before the capture did (no verdict taken),
        the ranks it killed are the SIGTERM/SIGKILL exits that came after the first failure."""
        alive = set(alive_at_decision)
        if final and not decided:
            failures = [self.exit_time(lr) for lr, c in codes.items() if c not in (None, 0)]
            first = min((t for t in failures if t is not None), default=None)
            for lr, c in codes.items():
                t = self.exit_time(lr)
                if c in (-signal.SIGTERM, -signal.SIGKILL) and first is not None and t is not None and t > first:
                    alive.add(lr)
        stopped = {lr for lr in alive if codes.get(lr) in (-signal.SIGTERM, -signal.SIGKILL)} if final else set()
        return alive, stopped

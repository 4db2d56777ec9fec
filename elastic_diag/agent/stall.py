"""Stall snapshots: every rank's stacks and flight recorder, taken while the job is stuck, stopping nothing.

The health monitor (:mod:`elastic_diag.agent.health`) calls :meth:`StallSnapshots.on_stall` from its
thread when no running rank has made progress for the stall threshold while some wait inside a
collective. The snapshot runs in a thread of its own, so the monitor goes on watching:

1. each live rank's beacon is asked for its stacks and flight recorder (``dump.request``); a rank whose
   beacon does not answer within the stack timeout (the GIL held in native code) gets faulthandler's
   signal, which writes its stack from C;
2. what the kernel shows each rank outside the collective blocked on: a lock another rank holds, a child
   process, a pipe, a socket (:mod:`elastic_diag.agent.blocked`, a few milliseconds from /proc);
3. the stacks and a copy of each flight recorder go to ``attempt_N/stall_K/rank_R/``, then
   ``stall_K/stall.json`` (:mod:`elastic_diag.core.stall`): that file on disk means the evidence is;
4. py-spy's native stacks, where installed, within ``NATIVE_STACKS_S``, of the ranks outside the collective
   and of those whose beacon was silent (py-spy stops a rank for the time of its dump); stall.json again.

Bounded: one snapshot per stall, at most one every ``STALL_SPACING_S`` (the monitor's rule), the dumps
within twice the stack timeout, py-spy within its deadline, each stack at most 256 KiB and each flight
recorder copy at most ``STALL_FR_MAX_BYTES``. It shares one lock with the failure verdict's own dumps
(two requests at once would read each other's stacks) and never starts once a verdict is under way.

When progress resumes (:meth:`on_stall_end`) the record says how long it lasted and the run gets a
warning; when the attempt fails instead, the capture hands the records to the verdict.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_diag.agent.blocked import probe_blocked
from elastic_diag.agent.clock import Clock
from elastic_diag.agent.dumps import STACK_LIMIT, native_stacks_of, request_dumps
from elastic_diag.agent.health import Stall
from elastic_diag.core.blocked import Blocked
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.stall import StallRank, StallRecord, label_outcomes, stall_to_json, stall_warning
from elastic_diag.layout import (
    FR_FILE,
    STACKS_FILE,
    STALL_FILE,
    STALL_FR_MAX_BYTES,
    RankLayout,
    rank_dir_name,
    read_json,
    stall_dir_name,
    write_atomic,
    write_json_atomic,
)

LOCK_WAIT_S = 15.0  # a verdict's own dumps hold the lock this long at most


def _left_the_collective(stacks: dict[int, str], answered: set[int], only: int | None = None) -> set[int]:
    """Local ranks whose beacon just answered with a main thread outside torch.distributed and autograd (its
    innermost frame the user's own code: a lock, a save, a callback). That stack outranks progress.json's
    process-group status, written up to a tick earlier and on gloo at times still showing a collective that
    completed."""
    out = set()
    for lr in [only] if only is not None else list(stacks):
        dump = parse_stack_dump(stacks.get(lr, "")) if lr in answered else None
        if dump is not None and dump.in_collective() is False:
            out.add(lr)
    return out


class StallSnapshots:
    """The stall records of one attempt on this node. ``targets``: local rank -> (global rank, pid, layout)."""

    def __init__(
        self,
        *,
        attempt_dir: Path,
        attempt: int,
        targets: dict[int, tuple[int, int, RankLayout]],
        node: str,
        stack_timeout_s: float,
        dump_lock: threading.Lock,
        decided: Callable[[], bool],
        exited: Callable[[], set[int]],
        warn: Callable[[dict[str, Any]], None],
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        record_file: str = STALL_FILE,
    ) -> None:
        self.attempt_dir = attempt_dir
        self.record_file = record_file  # stall.json; one part a watch under elastic-diag exec (read_stalls merges)
        self.attempt = attempt
        self.targets = targets
        self.node = node
        self.stack_timeout_s = max(stack_timeout_s, 1.0)
        self._dump_lock = dump_lock
        self._decided = decided
        self._exited = exited
        self._warn = warn
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self.records: dict[int, StallRecord] = {}
        self._ended: dict[int, float] = {}  # progress resumed at
        self._warned: set[int] = set()
        self._threads: list[threading.Thread] = []

    # -- the monitor's callbacks (its thread: return at once) ---------------------------------------
    def on_stall(self, stall: Stall) -> None:
        if self._decided():
            return  # a failure's verdict is under way: its own dumps are the evidence
        if not stall.snapshot:
            self._record(stall, None, "not taken: a snapshot was taken less than a minute earlier in this attempt")
            return
        t = threading.Thread(target=self.take, args=(stall,), name=f"elastic-diag-stall-{stall.number}", daemon=True)
        self._threads.append(t)
        t.start()

    def on_stall_end(self, stall: Stall) -> None:
        """Progress resumed: the record says when (its outcome is settled at the end of the attempt: a failure
        that began before this moment came out of the stall)."""
        if stall.ended_at is None:
            return
        with self._lock:
            self._ended[stall.number] = stall.ended_at
            record = self.records.get(stall.number)
            if record is not None:
                record = self.records[stall.number] = record.ended(stall.ended_at, "resumed")
        if record is not None:
            self._write(record)

    # -- the snapshot --------------------------------------------------------------------------------
    def take(self, stall: Stall) -> StallRecord | None:
        """Stacks and flight recorders of every live rank, then stall.json; then py-spy's, where installed."""
        if not self._dump_lock.acquire(timeout=LOCK_WAIT_S):
            return self._record(stall, None, "not taken: the launcher's own dumps held the ranks")
        try:
            if self._decided():
                return None
            started, wall = self._monotonic(), self._clock()
            gone = self._exited()
            live = {lr: (pid, layout) for lr, (_, pid, layout) in self.targets.items() if lr not in gone}
            stacks, answered = request_dumps(live, self.stack_timeout_s, f"stall-{self.attempt}-{stall.number}")
            outside = set(stall.outside) | _left_the_collective(stacks, answered)
            blocked = self._blocked(outside, live, stacks)
            folder = self.attempt_dir / stall_dir_name(stall.number)
            collectives = {lr: self._keep(lr, folder, stacks.get(lr, ""), wall if lr in answered else None)
                           for lr in live}  # fmt: skip
            took = self._monotonic() - started
        finally:
            self._dump_lock.release()
        record = self._record(stall, (stacks, answered, collectives, blocked), "taken", took)
        # py-spy stops a rank for the time of its native dump (0.8 s measured: benchmarks/stall.py snapshot-cost),
        # so only where native frames tell what the Python stack cannot: the ranks outside the collective (what
        # holds the others) and those whose beacon was silent (the GIL held in native code); after the record
        held = [lr for lr in sorted(live) if lr in outside or lr not in answered]
        pids = [(self.targets[lr][1], folder / rank_dir_name(self.targets[lr][0])) for lr in held]
        if native_stacks_of(pids):
            self._rewrite(stall.number)
        return record

    def _blocked(self, ranks: set[int], live: dict[int, tuple[int, RankLayout]],
                 stacks: dict[int, str]) -> dict[int, Blocked]:  # fmt: skip
        """What the kernel shows each rank outside the collective (``ranks``: local ranks) blocked on: a lock
        another rank holds, a child process, a pipe (agent/blocked.py)."""
        outside = {lr: pid for lr, (pid, _) in live.items() if lr in ranks}
        rank_pids = {pid: rank for rank, pid, _ in self.targets.values()}
        found = probe_blocked({self.targets[lr][0]: pid for lr, pid in outside.items()}, rank_pids,
                              {self.targets[lr][0]: stacks.get(lr, "") for lr in outside})  # fmt: skip
        by_rank = {rank: lr for lr, (rank, _, _) in self.targets.items()}
        return {by_rank[rank]: b for rank, b in found.items() if rank in by_rank}

    def _keep(self, lr: int, folder: Path, stack: str, asked_at: float | None) -> str | None:
        """The rank's stack and its fresh flight recorder into the stall's folder; the collective it waits in."""
        rank, _, layout = self.targets[lr]
        out = folder / rank_dir_name(rank)
        write_atomic(out / STACKS_FILE, stack[:STACK_LIMIT], redact=False)  # its folder made 0700
        if asked_at is None:
            return None  # a silent beacon wrote no fresh flight record
        fr = read_json(layout.path(FR_FILE), STALL_FR_MAX_BYTES)
        if fr is None or not isinstance(fr.get("time"), int | float) or fr["time"] < asked_at:
            return None
        with contextlib.suppress(OSError):  # the beacon's file as it wrote it (the next dump replaces the original)
            shutil.copyfile(layout.path(FR_FILE), out / FR_FILE)
        return pending_collective(fr.get("trace"))

    def _record(self, stall: Stall, taken: Any, snapshot: str, took: float | None = None) -> StallRecord:
        stacks, answered, collectives, blocked = taken if taken is not None else ({}, set(), {}, {})
        ranks = []
        for lr in sorted(set(stall.waiting) | set(stall.outside)):
            rank = self.targets[lr][0] if lr in self.targets else lr
            dump = parse_stack_dump(stacks.get(lr, "")) if lr in stacks else None
            frame = dump.user_frame() if dump is not None else None
            # a silent beacon means the main thread holds the GIL, which a rank waiting in a collective releases:
            # its stack, taken now, outranks its last progress.json (written before the GIL was taken, perhaps
            # while a collective of the previous step was still in flight)
            held_gil = dump is not None and lr not in answered and dump.in_collective() is False
            left = lr in _left_the_collective(stacks, answered, only=lr)
            ranks.append(StallRank(
                rank=rank, local_rank=lr, in_collective=lr in stall.waiting and not held_gil and not left,
                last_progress=stall.last_progress.get(lr),
                where=str(frame) if frame is not None else None, collective=collectives.get(lr),
                beacon=(lr in answered) if lr in stacks else None, stack=dump, blocked=blocked.get(lr),
            ))  # fmt: skip
        record = StallRecord(number=stall.number, node=self.node, since=stall.since, detected_at=stall.detected_at,
                             threshold_s=stall.threshold_s, ranks=tuple(ranks), snapshot=snapshot,
                             took_s=round(took, 3) if took is not None else None)  # fmt: skip
        with self._lock:
            if stall.number in self._ended:  # progress resumed while the snapshot was being taken
                record = record.ended(self._ended[stall.number], "resumed")
            self.records[stall.number] = record
        self._write(record)
        return record

    def _rewrite(self, number: int) -> None:
        with self._lock:
            record = self.records.get(number)
        if record is not None:
            self._write(record)

    def _write(self, record: StallRecord) -> None:
        folder = self.attempt_dir / stall_dir_name(record.number)
        data = stall_to_json(record)
        data["files"] = {str(r.rank): sorted(p.name for p in (folder / rank_dir_name(r.rank)).glob("*"))
                         for r in record.ranks if (folder / rank_dir_name(r.rank)).is_dir()}  # fmt: skip
        write_json_atomic(folder / self.record_file, data)

    def in_order(self) -> tuple[StallRecord, ...]:
        with self._lock:
            return tuple(self.records[n] for n in sorted(self.records))

    # -- the end of the attempt ------------------------------------------------------------------------
    def join(self, timeout: float) -> None:
        """Wait for the snapshots under way, at most ``timeout`` seconds in all."""
        end = self._monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - self._monotonic()))

    def finish(self, *, failed: bool, began: float | None) -> tuple[StallRecord, ...]:
        """Settle each stall's outcome (core/stall.py ``label_outcomes``), rewrite its record, and make each one
        the job got over a warning of the run. The records, in order."""
        with self._lock:
            labelled = label_outcomes(tuple(self.records[n] for n in sorted(self.records)), failed=failed,
                                      began=began, at=self._clock())  # fmt: skip
            fresh = [r for r in labelled if r.number not in self._warned and r.outcome in ("resumed", "ended")]
            self._warned.update(r.number for r in fresh)
            self.records.update((r.number, r) for r in labelled)
        for record in labelled:
            self._write(record)
        for record in fresh:
            self._warn(stall_warning(record, self.attempt))
        return labelled


def pending_collective(trace: Any) -> str | None:
    """``all_reduce #12 (process group 0)``: the collective a rank entered and did not complete, from its
    flight recorder's entries and pg_status; None when it waits in none."""
    if not isinstance(trace, dict):
        return None
    status = trace.get("pg_status") or {}
    entries = trace.get("entries") or []
    if not isinstance(status, dict) or not isinstance(entries, list):
        return None
    for pg, st in status.items():
        try:
            enqueued, completed = int(st["last_enqueued_collective"]), int(st["last_completed_collective"])
        except (KeyError, TypeError, ValueError):
            continue
        if enqueued <= completed:
            continue
        for e in reversed(entries):
            if isinstance(e, dict) and e.get("collective_seq_id") == completed + 1 and str(e.get("pg_id")) == str(pg):
                op = str(e.get("profiling_name") or "?").split(":")[-1]
                return f"{op} #{completed + 1} (process group {pg})"
        return f"collective #{completed + 1} (process group {pg})"
    return None

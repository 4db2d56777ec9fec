"""Stalls: the job stopped progressing for a while with some ranks waiting inside a collective.

The health monitor (``agent/health.py``) sees a stall long before any hang verdict: no running rank
made progress for the stall threshold while at least one waited in a collective. The agent then takes
every rank's stacks and flight recorder without stopping anything (``agent/stall.py``) and writes a
:class:`StallRecord` (``attempt_N/stall_K/stall.json``, :mod:`elastic_diag.layout`): per rank whether it
was inside a collective, since when it had made no progress, where its main thread was, and whether its
beacon answered. The ranks outside the collective are the ones the others waited for.

Then one of two things happens:

* progress resumes: the stall was a rank that held its peers (a checkpoint save, an evaluation on rank
  0, a slow shared file system), and :func:`stall_warning` makes it a warning of the run
  ("rank 0 held its peers 41 s at checkpoint.py:88 in save");
* the attempt fails (the collective timeout fires, the hang verdict, a rank dies): the stall's evidence
  was taken while the culprit was still stuck, before any watchdog tore the group down, and the
  attribution uses it (``outside_collective_at_stall`` in :mod:`elastic_diag.core.attribution`).

Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from elastic_diag.core.blocked import Blocked, blocked_from_json, blocked_to_json, holding_rank
from elastic_diag.core.stacks import StackDump
from elastic_diag.core.values import as_seconds
from elastic_diag.core.verdict import format_ranks

SNAPSHOT_TAKEN = "taken"


@dataclass(frozen=True, slots=True, kw_only=True)
class StallRank:
    """One rank at the stall. ``beacon``: its beacon answered the dump request (False: its stack came from
    faulthandler's signal, the GIL held in native code or no bootstrap; None: no snapshot was taken)."""

    rank: int
    local_rank: int
    in_collective: bool
    last_progress: float | None = None  # wall clock of its last progress
    where: str | None = None  # its main thread's innermost frame in the user's code
    collective: str | None = None  # the collective it waited in, from its flight recorder ("all_reduce #12")
    beacon: bool | None = None
    blocked: Blocked | None = None  # what its main thread was blocked on, for a rank outside the collective
    stack: StackDump | None = None  # loaded from the snapshot's files (not in stall.json)


@dataclass(frozen=True, slots=True, kw_only=True)
class StallRecord:
    """One stall of one attempt on one node. ``snapshot`` is ``taken`` or why it was not."""

    number: int
    node: str
    since: float  # the last progress any running rank made
    detected_at: float
    threshold_s: float
    ranks: tuple[StallRank, ...]
    snapshot: str = SNAPSHOT_TAKEN
    took_s: float | None = None  # how long the stacks and flight recorders took
    ended_at: float | None = None  # progress resumed (or the attempt ended with the ranks' exit)
    # open | resumed (the job went on) | ended (it lasted until the ranks exited) | failed (the attempt failed in it)
    outcome: str = "open"

    @property
    def outside(self) -> tuple[StallRank, ...]:
        """The ranks outside any collective: those the others waited for."""
        return tuple(r for r in self.ranks if not r.in_collective)

    @property
    def waiting(self) -> tuple[StallRank, ...]:
        return tuple(r for r in self.ranks if r.in_collective)

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else max(0.0, self.ended_at - self.since)

    @property
    def taken(self) -> bool:
        return self.snapshot == SNAPSHOT_TAKEN

    def rank(self, rank: int) -> StallRank | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    @property
    def holder(self) -> int | None:
        """The rank outside the collective that the other blocked ranks waited on (a lock it held, a pipe
        it was to write), following the chain; None when no blocked rank waited on another rank."""
        return holding_rank({r.rank: r.blocked for r in self.outside})

    def holders_first(self) -> tuple[int, ...]:
        """The ranks outside the collective, the one holding the others up first."""
        ranks = sorted(r.rank for r in self.outside)
        holder = self.holder
        return tuple([holder] + [r for r in ranks if r != holder]) if holder in ranks else tuple(ranks)

    def ended(self, at: float, outcome: str) -> StallRecord:
        return replace(self, ended_at=at, outcome=outcome)


def short_where(location: str | None) -> str | None:
    """``checkpoint.py:88 in save`` for ``/job/src/checkpoint.py:88 in save``."""
    if not location:
        return None
    head, sep, tail = location.partition(" in ")
    return head.rsplit("/", 1)[-1] + sep + tail


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def _holders(record: StallRecord) -> str:
    """``rank 0 at checkpoint.py:88 in save``, or several such, or why none is known."""
    parts = []
    for r in record.outside:
        where = short_where(r.where)
        parts.append(
            f"rank {r.rank}"
            + (f" at {where}" if where else "")
            + (f", which {r.blocked.describe(r.rank)}" if r.blocked is not None else "")
        )
    return "; ".join(parts)


def _waited_in(record: StallRecord) -> str:
    """``waited in barrier``: the collectives the waiting ranks' flight recorders show them in."""
    ops = sorted({r.collective.split(" #", 1)[0] for r in record.waiting if r.collective})
    return f"waited in {' / '.join(ops)}" if ops else "waited inside a collective"


def stall_summary(record: StallRecord) -> str:
    """One sentence: who held whom, how long, where."""
    outside, waiting = record.outside, record.waiting
    lasted = record.duration_s
    how_long = _seconds(lasted) if lasted is not None else f"at least {_seconds(record.detected_at - record.since)}"
    waited = format_ranks([r.rank for r in waiting])
    waited_in = _waited_in(record)
    if len(outside) == 1:
        r = outside[0]
        where = short_where(r.where)
        text = f"rank {r.rank} held its peers {how_long}" + (f" at {where}" if where else "")
        if not record.taken:
            text += f" (no stack: {record.snapshot})"
        elif r.beacon is False:
            text += " (its beacon was silent: the GIL held in native code; stack from faulthandler)"
        blocked = blocked_text(record, r.rank)
        return (
            text
            + f"; rank{'s' if len(waiting) > 1 else ''} {waited} {waited_in}"
            + (f" ({blocked})" if blocked else "")
        )
    holder = record.holder
    if holder is not None:
        held = record.rank(holder)
        where = short_where(held.where) if held is not None else None
        return (
            f"rank {holder} held its peers {how_long}"
            + (f" at {where}" if where else "")
            + f" ({blocked_text(record, holder)}); rank{'s' if len(waiting) > 1 else ''} {waited} {waited_in}"
        )
    if outside:
        return (f"ranks {format_ranks([r.rank for r in outside])} held their peers {how_long} ({_holders(record)}); "
                f"rank{'s' if len(waiting) > 1 else ''} {waited} {waited_in}")  # fmt: skip
    return (f"ranks {waited} {waited_in} for {how_long} with no rank of node {record.node or 'this node'} outside "
            "it: the rank they waited for is on another node")  # fmt: skip


def stall_warning(record: StallRecord, attempt: int) -> dict[str, Any]:
    """The warning of a stall the job got over (report.json ``warnings``, class ``stall``)."""
    outside = record.outside
    holder = outside[0] if len(outside) == 1 else record.rank(record.holder) if record.holder is not None else None
    return {
        "class": "stall",
        "rank": holder.rank if holder is not None else None,
        "node": record.node,
        "attempt": attempt,
        "stall": record.number,
        "duration_s": round(record.duration_s, 1) if record.duration_s is not None else None,
        "where": holder.where if holder is not None else None,
        "summary": stall_summary(record)[:1].upper() + stall_summary(record)[1:] + ".",
    }


def stall_line(record: StallRecord, rank: int) -> str | None:
    """The verdict's evidence line for ``rank`` when the stall saw it outside the collective."""
    r = record.rank(rank)
    if r is None or r.in_collective:
        return None
    stalled = record.detected_at - record.since
    waited = record.waiting
    what = ", ".join(sorted({w.collective for w in waited if w.collective})) or "a collective"
    where = f" at {r.where}" if r.where else ""
    line = (f"elastic_diag stall snapshot {_seconds(stalled)} after the last progress: rank {rank} outside any "
            f"collective{where} while rank{'s' if len(waited) > 1 else ''} {format_ranks([w.rank for w in waited])} "
            f"waited in {what}")  # fmt: skip
    return line + (f"; {blocked_text(record, rank)}" if blocked_text(record, rank) else "")


def blocked_text(record: StallRecord, rank: int) -> str | None:
    """``rank 2 waited for its child process 4242 (ffmpeg ...); rank 1 waited for the lock on x.lock held by
    rank 2 (pid 4100)``: what the kernel showed ``rank`` and the ranks that waited on it blocked on."""
    r = record.rank(rank)
    if r is None or r.blocked is None:
        return None
    parts = [f"rank {rank} {r.blocked.describe(rank)}"]
    parts += [f"rank {o.rank} {o.blocked.describe(o.rank)}" for o in record.outside
              if o.rank != rank and o.blocked is not None and o.blocked.holder_rank == rank]  # fmt: skip
    return "; ".join(parts)


# --- stall.json --------------------------------------------------------------------------------------


def stall_to_json(record: StallRecord) -> dict[str, Any]:
    return {
        "stall": record.number,
        "node": record.node,
        "since": record.since,
        "detected_at": record.detected_at,
        "stalled_s": round(record.detected_at - record.since, 3),
        "threshold_s": round(record.threshold_s, 3),
        "snapshot": record.snapshot,
        "took_s": record.took_s,
        "ended_at": record.ended_at,
        "duration_s": round(record.duration_s, 3) if record.duration_s is not None else None,
        "outcome": record.outcome,
        "outside": [r.rank for r in record.outside],
        "waiting": [r.rank for r in record.waiting],
        "ranks": [
            {
                "rank": r.rank,
                "local_rank": r.local_rank,
                "in_collective": r.in_collective,
                "last_progress": r.last_progress,
                "where": r.where,
                "collective": r.collective,
                "beacon": r.beacon,
                "blocked": blocked_to_json(r.blocked) if r.blocked is not None else None,
            }
            for r in record.ranks
        ],  # fmt: skip
    }


def stall_from_json(data: Any, stacks: dict[int, StackDump] | None = None) -> StallRecord | None:
    """A stall.json back as a record (``stacks``: each rank's stack from the snapshot's files); None for
    anything that is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("stall"), int) or not isinstance(data.get("ranks"), list):
        return None
    since, detected = as_seconds(data.get("since")), as_seconds(data.get("detected_at"))
    if since is None or detected is None:
        return None
    ranks = []
    for r in data["ranks"]:
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
            continue
        beacon = r.get("beacon")
        ranks.append(StallRank(
            rank=r["rank"], local_rank=int(r.get("local_rank") or 0), in_collective=bool(r.get("in_collective")),
            last_progress=as_seconds(r.get("last_progress")),
            where=str(r["where"]) if r.get("where") else None,
            collective=str(r["collective"]) if r.get("collective") else None,
            beacon=beacon if isinstance(beacon, bool) else None, stack=(stacks or {}).get(r["rank"]),
            blocked=blocked_from_json(r.get("blocked")),
        ))  # fmt: skip
    return StallRecord(
        number=data["stall"], node=str(data.get("node") or ""), since=since, detected_at=detected,
        threshold_s=as_seconds(data.get("threshold_s")) or 0.0, ranks=tuple(ranks),
        snapshot=str(data.get("snapshot") or SNAPSHOT_TAKEN), took_s=as_seconds(data.get("took_s")),
        ended_at=as_seconds(data.get("ended_at")), outcome=str(data.get("outcome") or "open"),
    )  # fmt: skip


def stall_at_failure(records: tuple[StallRecord, ...], began: float | None) -> StallRecord | None:
    """The stall the failure came out of: the last one with its snapshot taken that was still under way when
    the first rank began to fail (``began``; None when no rank failed by itself, as when the hang verdict
    stopped the group). A stall that ended before is one the job got over."""
    for record in reversed(records):
        if not record.taken:
            continue
        if record.ended_at is None or (began is not None and record.ended_at >= began):
            return record
    return None


def label_outcomes(records: tuple[StallRecord, ...], *, failed: bool, began: float | None,
                   at: float) -> tuple[StallRecord, ...]:  # fmt: skip
    """At the end of the attempt: ``failed`` for a stall under way when the attempt began to fail (or when the
    launcher stopped it), ``resumed`` for one the job got over, ``ended`` for one that lasted until the ranks
    exited (ended ``at``)."""
    out = []
    for r in records:
        if failed and (r.ended_at is None or (began is not None and r.ended_at >= began)):
            out.append(replace(r, outcome="failed"))
        elif r.ended_at is None:
            out.append(r.ended(at, "ended"))
        else:
            out.append(replace(r, outcome="resumed"))
    return tuple(out)

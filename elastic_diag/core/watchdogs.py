"""What the ranks' NCCL watchdogs say, compared across ranks: each timed-out collective's own fields
(``WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1024, ...)``) and the heartbeat monitor's report that a
watchdog got stuck.

* :func:`watchdogs_disagree_on_op` and :func:`watchdog_out_of_step` are VOTES (the peers' lines naming a
  rank, :data:`elastic_diag.core.attribution.VOTES`): a rank whose timed-out collective differs from what a
  majority of its peers timed out in left the schedule they follow;
* :func:`watchdogs_part` is a RULE: every rank only waited and their watchdogs disagree with no majority:
  the schedules parted, no rank is named, both sides are said;
* :func:`stuck_together` is a REFINEMENT of a hang verdict: several ranks' watchdogs got stuck at the same
  moment, so which one stopped first is not in the evidence.

Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from elastic_diag.core.context import Context
from elastic_diag.core.evidence import AttemptEvidence, WatchdogTimeout
from elastic_diag.core.naming import unattributed, unnamed_lead
from elastic_diag.core.taxonomy import Signature, Taxonomy
from elastic_diag.core.verdict import Diagnosis, Role

Vote = tuple[int, Signature, str]


def watchdog_fields(evidence: AttemptEvidence) -> dict[int, WatchdogTimeout]:
    """Per rank, the collective its watchdog timed out in (its first watchdog line)."""
    seen: dict[int, WatchdogTimeout] = {}
    for ev in evidence.ranks:
        first = next((line.watchdog for line in ev.lines if line.watchdog is not None), None)
        if first is not None:
            seen[ev.rank] = first
    return seen


def one_collective_each(evidence: AttemptEvidence) -> dict[int, WatchdogTimeout]:
    """Per rank, the collective its watchdog timed out in, for ranks whose every watchdog line names the
    same SeqNum (a rank with several timed-out SeqNums waits in several process groups: not comparable)."""
    first = watchdog_fields(evidence)
    out = {}
    for ev in evidence.ranks:
        seqs = {line.watchdog.seq for line in ev.lines if line.watchdog is not None}
        if len(seqs) == 1 and ev.rank in first:
            out[ev.rank] = first[ev.rank]
    return out


def watchdogs_disagree_on_op(evidence: AttemptEvidence, taxonomy: Taxonomy) -> list[Vote]:
    """Ranks whose timed-out collective is another op than what most ranks timed out in at the same SeqNum."""
    seen = watchdog_fields(evidence)
    if len(seen) < 3:
        return []
    by_seq: dict[int, dict[str, list[int]]] = {}
    for rank, w in seen.items():
        by_seq.setdefault(w.seq, {}).setdefault(w.op, []).append(rank)
    votes: list[Vote] = []
    sig = taxonomy.get("nccl-desync-report")
    for seq, ops in by_seq.items():
        if len(ops) < 2:
            continue
        majority = max(ops, key=lambda o: len(ops[o]))
        for op, ranks in ops.items():
            if op != majority and len(ranks) < len(ops[majority]):
                for rank in ranks:
                    line = (f"rank {rank} timed out in {op} #{seq} while ranks {sorted(ops[majority])} timed out "
                            f"in {majority} #{seq}: the collective schedules diverged")  # fmt: skip
                    votes.append((rank, sig, line))
    return votes


def watchdog_out_of_step(evidence: AttemptEvidence, taxonomy: Taxonomy) -> list[Vote]:
    """One rank whose watchdog timed out at another SeqNum (ahead or behind) than the rest, when the rest
    agree on one collective and are more than half of the ranks (the world is at least the highest rank
    seen plus one): that rank left the schedule its peers follow."""
    seen = one_collective_each(evidence)
    if len(seen) < 3 or len({w.seq for w in seen.values()}) < 2:
        return []
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, w in seen.items():
        groups.setdefault((w.seq, w.op), []).append(rank)
    (seq, op), agree = max(groups.items(), key=lambda kv: len(kv[1]))
    others = sorted(r for r in seen if r not in agree)
    world = max(ev.rank for ev in evidence.ranks) + 1
    if len(others) != 1 or 2 * len(agree) <= world:
        return []
    rank = others[0]
    theirs = seen[rank]
    where = "behind" if theirs.seq < seq else "ahead of"
    line = (f"rank {rank} timed out in {theirs.op} #{theirs.seq}, {where} ranks {sorted(agree)} that all timed out "
            f"in {op} #{seq}: the collective schedules diverged")  # fmt: skip
    return [(rank, taxonomy.get("nccl-desync-report"), line)]


def _side(rank: int, w: WatchdogTimeout) -> str:
    return f"rank {rank}: #{w.seq} {w.op}" + (f" ({w.numel} elements)" if w.numel is not None else "")


def watchdogs_part(ctx: Context) -> Diagnosis | None:
    """Every rank only waited, and their watchdogs disagree on the collective they waited in: another op or
    other sizes at the same SeqNum, or (each rank waiting in one collective only) different SeqNums, and no
    majority names a rank (a majority would have: :func:`watchdogs_disagree_on_op`,
    :func:`watchdog_out_of_step`). Both sides are said and no rank is named."""
    if unnamed_lead(ctx)[1] != "collective_timeout":
        return None
    seen = watchdog_fields(ctx.evidence)
    one_each = one_collective_each(ctx.evidence)
    roles: dict[int, Role] = {r: "unknown" for r in ctx.findings}
    # different SeqNums are compared only when every rank timed out in one collective: a rank with several
    # waits in several process groups (the old watchdog line does not say which), whose counters run apart
    if len(seen) >= 2 and len(one_each) == len(seen) and len({w.seq for w in seen.values()}) > 1:
        sides = [_side(r, w) for r, w in sorted(one_each.items())]
        summary = (
            f"The ranks' watchdogs timed out in different collectives ({'; '.join(sides[:6])}): each rank waits "
            "at another point of the same schedule, so the collective schedules parted. No majority of the ranks "
            "agrees on one collective, so no rank is named: compare the code paths of the sides at that point (a "
            "collective on one rank's path only: a checkpoint save, an evaluation, a data-dependent branch)."
        )
        sig = ctx.taxonomy.get("collective-schedule-diverged")
        return unattributed(sig, "collective_desync", summary, tuple(sides), roles)
    if len(seen) < 2 or len({w.seq for w in seen.values()}) != 1 or len({(w.op, w.numel) for w in seen.values()}) < 2:
        return None
    seq = next(iter(seen.values())).seq
    sides = [_side(r, w) for r, w in sorted(seen.items())]
    same_op = len({w.op for w in seen.values()}) == 1
    what = "the same collective with other sizes" if same_op else "different collectives"
    sig = ctx.taxonomy.get("collective-mismatch" if same_op else "collective-schedule-diverged")
    summary = (
        f"The ranks' watchdogs disagree on the collective they waited in: at collective #{seq} they issued "
        f"{what} ({'; '.join(sides[:6])}). The collective schedules parted, but no majority tells which side "
        "left the schedule, so no rank is named: compare the code paths of the two sides at that point (a "
        "collective on one rank's path only: a checkpoint save, an evaluation, an epoch's end)."
    )
    cls = "collective_mismatch" if same_op else "collective_desync"
    return unattributed(sig, cls, summary, tuple(sides), roles)


_GLOG_CLOCK = re.compile(r"\b[EWIF]\d{4} (?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?)\b")
_CLOCK = re.compile(r"(?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?)$")
TOGETHER_S = 5.0  # heartbeat monitors that fired this close fired together


def _seconds(clock: str | None, text: str) -> float | None:
    """Seconds into the day of a glog clock: the line's own (its header), else one quoted in its text."""
    m = _CLOCK.search(clock) if clock else _GLOG_CLOCK.search(text)
    return 3600 * int(m["h"]) + 60 * int(m["m"]) + float(m["s"]) if m else None


def stuck_together(ctx: Context, verdict: Diagnosis, rules: Callable[[Context], Diagnosis]) -> Diagnosis | None:
    """A hang verdict naming a rank, when two or more ranks' ProcessGroupNCCL watchdogs got stuck at the same
    moment (the heartbeat monitor's report, within a few seconds): the whole job stalled together, and which
    rank was first is not in the evidence. No rank is named."""
    if verdict.failure_class != "hang" or verdict.initiating_rank is None:
        return None
    stuck: dict[int, float | None] = {}
    lines: dict[int, str] = {}
    for ev in ctx.evidence.ranks:
        for line in ev.lines:
            if line.signature == "nccl-heartbeat-stuck":
                stuck[ev.rank] = _seconds(line.clock, line.text)
                lines[ev.rank] = line.text
                break
    if len(stuck) < 2:
        return None
    clocks = [c for c in stuck.values() if c is not None]
    if clocks and (len(clocks) < len(stuck) or max(clocks) - min(clocks) > TOGETHER_S):
        return None
    ranks = sorted(stuck)
    sig = ctx.taxonomy.get("nccl-heartbeat-stuck")
    summary = (
        f"The NCCL watchdogs of ranks {', '.join(map(str, ranks))} got stuck at the same moment (the heartbeat "
        "monitor's report, then the abort: exit -6): the whole job stalled together, and these logs do not "
        "show which rank stopped first (no collective timed out, no rank failed differently). No rank is "
        "named: take the stacks of every rank while it hangs (py-spy dump, or the flight recorder with "
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1) to see where each one is."
    )
    roles: dict[int, Role] = {r: "unknown" for r in ctx.findings}
    return unattributed(sig, "hang", summary, tuple(lines[r] for r in ranks), roles)

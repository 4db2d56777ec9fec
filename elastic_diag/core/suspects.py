"""The suspect: when no rank is proven (every rank only waited), a rank that stands out without proof,
given as ``suspected_rank`` with the reason in words, ``initiating_rank`` staying None. The last step of
every verdict, live and offline (:data:`elastic_diag.core.attribution.SUSPECTS`), tried in order:

1. :func:`odd_one_out`: the one rank whose watchdog timed out in another collective than all the others;
2. :func:`only_silent_rank`: the one rank that reported nothing while every other rank up to the highest
   seen timed out waiting;
3. :func:`rank_zero_path`: rank 0, when every waiting rank waits in a BROADCAST (rank 0 is its root in
   nearly every framework), or in a small collective right after a phase frameworks run on rank 0 alone;
4. :func:`rank_zero_left_silent`: rank 0, when rank 1 alone timed out and rank 0 reported nothing.

Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from elastic_diag.core.context import Context
from elastic_diag.core.evidence import LogLine
from elastic_diag.core.taxonomy import Taxonomy
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.core.watchdogs import one_collective_each

# the verdicts of ranks that only waited: a suspect may stand out among them
WAITING_CLASSES = ("collective_timeout", "collective_desync", "collective_mismatch", "hang")
CONTROL_NUMEL = 1024  # a collective this small carries a flag, a metric, a path: not gradients

Suspect = Callable[[Context], tuple[int, str] | None]


def _waits(line: LogLine, taxonomy: Taxonomy) -> bool:
    sig = taxonomy.find(line.signature)
    return sig is not None and sig.failure_class == "collective_timeout" and sig.role_hint == "collateral"


def odd_one_out(ctx: Context) -> tuple[int, str] | None:
    """The single rank whose timed-out collective differs from the one all the others agree on (at least two
    others, three ranks in all)."""
    seen = one_collective_each(ctx.evidence)
    if len(seen) < 3:
        return None
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, w in seen.items():
        groups.setdefault((w.seq, w.op), []).append(rank)
    if len(groups) != 2:
        return None
    (key_a, a), (key_b, b) = sorted(groups.items(), key=lambda kv: len(kv[1]))
    if len(a) != 1 or len(b) < 2:
        return None
    return a[0], (f"rank {a[0]} alone timed out in {key_a[1]} #{key_a[0]} while ranks {sorted(b)} agree on "
                  f"{key_b[1]} #{key_b[0]}; not proven: ranks whose lines are missing could side with it")  # fmt: skip


def only_silent_rank(ctx: Context) -> tuple[int, str] | None:
    """Every rank from 0 to the highest seen waited in a collective except one that printed nothing at all: it
    is the natural suspect (it may never have reached the collective), but its output may also simply be
    missing from the evidence."""
    waited = sorted(ev.rank for ev in ctx.evidence.ranks if any(_waits(line, ctx.taxonomy) for line in ev.lines))
    if len(waited) < 2:
        return None
    quiet = [r for r in range(max(waited) + 1) if r not in waited]
    if len(quiet) != 1:
        return None
    rank = quiet[0]
    ev = ctx.evidence.rank(rank)
    if ev is not None and (ev.lines or ev.exception is not None or (ev.exit_seen and ev.exit_code not in (None, 0))):
        return None
    return rank, (f"ranks {', '.join(map(str, waited))} timed out waiting in a collective and rank {rank} is the only "
                  "rank among them that reported nothing: it may never have reached that collective, or its output "
                  "is not in these logs")  # fmt: skip


def rank_zero_path(ctx: Context) -> tuple[int, str] | None:
    """Every rank that timed out waits in the same collective, rank 0 is not among them, and either the
    collective is a BROADCAST (whose root is rank 0 in nearly every framework) or it is a small one right
    after a phase that frameworks run on rank 0 alone (a line "Saving checkpoint ...", "Evaluating" from
    rank 0 or from a logger with no rank prefix): rank 0 was most likely still in that path."""
    seen = one_collective_each(ctx.evidence)
    if not seen or 0 in seen or len({(w.seq, w.op) for w in seen.values()}) != 1:
        return None
    ev0 = ctx.evidence.rank(0)
    if ev0 is not None and (ev0.lines or ev0.exception is not None):
        return None
    first_seen = next(iter(seen.values()))
    seq, op = first_seen.seq, first_seen.op
    waiters = ", ".join(map(str, sorted(seen)))
    if op == "BROADCAST" and len(seen) >= 2:
        return 0, (f"ranks {waiters} timed out in BROADCAST #{seq}, whose root is rank 0 in nearly every "
                   "framework (sending a flag, a path, generated samples), and rank 0 reported no timeout")  # fmt: skip
    if any(w.numel is None or w.numel > CONTROL_NUMEL for w in seen.values()):
        return None
    orders = [line.order for r in seen for line in ctx.evidence.rank(r).lines if line.watchdog is not None]  # type: ignore[union-attr]
    first = min(orders, default=None)
    before = [p for p in ctx.evidence.phases if first is not None and p.order < first]
    if not before or before[-1].rank not in (None, 0):
        return None
    who = "rank" if len(seen) == 1 else "ranks"
    phase = before[-1].text[:120]
    return 0, (f"{who} {waiters} timed out in a {op} of at most {CONTROL_NUMEL} elements (#{seq}) right after "
               f'"{phase}", a phase frameworks run on rank 0 alone; rank 0 reported no timeout')  # fmt: skip


def rank_zero_left_silent(ctx: Context) -> tuple[int, str] | None:
    """Rank 1 alone timed out waiting and rank 0 reported nothing at all (a two-rank job, or a paste of one
    rank's lines): rank 0 is the only rank known to be left, the weakest suspect of all."""
    waited = [ev.rank for ev in ctx.evidence.ranks if any(_waits(line, ctx.taxonomy) for line in ev.lines)]
    if waited != [1]:
        return None
    ev = ctx.evidence.rank(0)
    if ev is not None and (ev.lines or ev.exception is not None or (ev.exit_seen and ev.exit_code not in (None, 0))):
        return None
    return 0, ("rank 1 timed out waiting in a collective and rank 0, the only other rank known, reported nothing: it "
               "may never have reached that collective, or its output is not in these logs")  # fmt: skip


SUSPECTS: tuple[Suspect, ...] = (odd_one_out, only_silent_rank, rank_zero_path, rank_zero_left_silent)


def with_suspect(ctx: Context, verdict: Diagnosis) -> Diagnosis:
    """The verdict with the first suspect that stands out, when it names no rank and its ranks only waited."""
    if verdict.initiating_rank is not None or verdict.failure_class not in WAITING_CLASSES:
        return verdict
    for suspect in SUSPECTS:
        found = suspect(ctx)
        if found is not None:
            rank, reason = found
            return replace(verdict, suspected_rank=rank, suspected_reason=reason,
                           summary=f"{verdict.summary} Suspected, not proven: rank {rank} ({reason}).")  # fmt: skip
    return verdict

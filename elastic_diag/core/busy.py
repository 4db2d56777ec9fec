"""A rank that was slow, not dead: every rank but one timed out waiting in the same collective, and the one
missing from the timeouts was busy with work of its own (tokenising the dataset under
``main_process_first``, an evaluation or a checkpoint save on rank 0 only) for longer than the collective
timeout. Its peers' timeouts name the ranks that WAITED; the rank that never arrived printed no error at
all, often only a progress bar.

The rule (:func:`busy_while_peers_waited`, in :data:`elastic_diag.core.attribution.RULES`) names it,
class ``hang``, when the proof holds: at least three ranks timed out, all in the same collective (SeqNum and
op), exactly one rank from 0 up to the highest rank known is missing from them and failed in no way of its
own, and either that rank is rank 0 (the rank frameworks give work alone: the pattern the issue trackers
show over and over) or a line of its own shows it working (a phase: tokenising, evaluating, saving). With
weaker proof the rank stays a suspect (:mod:`elastic_diag.core.suspects`). Pure: no torch, no I/O.
"""

from __future__ import annotations

import re

from elastic_diag.core.context import Context
from elastic_diag.core.evidence import LogLine, RankEvidence
from elastic_diag.core.naming import named_verdict
from elastic_diag.core.verdict import Diagnosis, Role, format_ranks
from elastic_diag.core.watchdogs import one_collective_each

SIGNATURE = "rank-outlasted-collective-timeout"
# no log states the world size: three ranks waiting in one collective with one missing below them is the
# proof; with two, a paste of two ranks out of eight looks the same (the missing rank stays a suspect)
MIN_WAITERS = 3


def _busy_lines(ctx: Context, rank: int) -> list[LogLine]:
    """Lines that show ``rank`` working on its own: its phase lines, and for rank 0 the phase lines that
    carry no rank (a logger or a progress bar without a prefix: frameworks run those phases on rank 0)."""
    return [p for p in ctx.evidence.phases if p.rank == rank or (rank == 0 and p.rank is None)]


def busy_while_peers_waited(ctx: Context) -> Diagnosis | None:
    """``hang`` on the one rank missing from its peers' timeouts in one collective, busy on its own (rank 0,
    or a line of its own shows it working), when no rank failed in a way of its own."""
    if ctx.own:
        return None
    seen = one_collective_each(ctx.evidence)
    if len(seen) < MIN_WAITERS or len({(w.seq, w.op) for w in seen.values()}) != 1:
        return None
    known = {ev.rank for ev in ctx.evidence.ranks} | set(seen)
    missing = [r for r in range(max(known) + 1) if r not in seen]
    if len(missing) != 1:
        return None
    rank = missing[0]
    ev = ctx.evidence.rank(rank)
    if ev is not None and (ev.exception is not None or (ev.exit_seen and ev.exit_code not in (None, 0))):
        return None
    if ev is not None and any((s := ctx.taxonomy.find(line.signature)) is not None and s.failure_class != "hang"
                              for line in ev.lines):  # fmt: skip
        return None  # it printed an error of some kind: not only busy
    busy = _busy_lines(ctx, rank)
    if rank != 0 and not busy:
        return None
    sig = ctx.taxonomy.get(SIGNATURE)
    if sig is None:
        return None
    w = next(iter(seen.values()))
    waiters = sorted(seen)
    what = f"{w.op} #{w.seq}" + (f" ({w.numel} element{'s' if w.numel != 1 else ''})" if w.numel is not None else "")
    doing = f', and its last line of work was "{busy[-1].text[:160]}"' if busy else ""
    summary = (
        f"Ranks {format_ranks(waiters)} timed out waiting in the same collective ({what}); rank {rank}, the only rank "
        f"not among them, reported no error{doing}: it was busy on its own (a phase frameworks run on "
        f"{'rank 0 alone: tokenising the dataset, an evaluation, a checkpoint save' if rank == 0 else 'one rank'}) "
        "for longer than the collective timeout, and its peers gave up waiting. It was slow, not dead."
    )
    roles: dict[int, Role] = {r: "collateral" for r in waiters}
    roles[rank] = "initiating"
    for r in ctx.findings:
        roles.setdefault(r, "unknown")
    lines = [busy[-1].text] if busy else []
    waited = [line.text for r in waiters for line in ctx.ev(r).lines if line.watchdog is not None]
    lines += waited[:3]
    target = ev if ev is not None else RankEvidence(rank=rank, local_rank=rank, node="")
    return named_verdict(sig, "hang", target, summary, lines, roles)


MAIN_FIRST = "main-process-first-wait"
# an error of a rank that only waited: a timeout of a barrier, a store, a socket; the root's unique id
_WAIT_WORDS = re.compile(r"[Tt]imed? ?out|Timeout|wait timeout|ncclUniqueId from \[\d+\]|[Ww]atchdog caught")


def _is_wait(ctx: Context, line: LogLine) -> bool:
    sig = ctx.taxonomy.find(line.signature)
    return sig is None or sig.role_hint == "collateral" or _WAIT_WORDS.search(line.text) is not None


BAR_BESIDE = 2  # read lines between the bar's last frame and the first wait, at most (a glued record, a poll)
_BAR = re.compile(r"\d%\||\d+/\d+ \[\d+:\d+|examples/s\]|it/s\]|s/it\]")


def _waits_beside_a_moving_bar(ctx: Context, every: list[LogLine]) -> list[LogLine]:
    """The waits a progress bar of rank 0's data preparation was still being drawn beside: the bar's last
    frame is one of the lines just before the first wait, or after it (the others failed while it worked)."""
    bars = [p for p in _busy_lines(ctx, 0) if _BAR.search(p.text) and p.order is not None]
    waits = [line for line in every if line.order is not None and _is_wait(ctx, line)
             and ctx.taxonomy.find(line.signature) is not None]  # fmt: skip
    if not bars or not waits:
        return []
    first = min(waits, key=lambda line: line.order or 0)
    return waits if (bars[-1].order or 0) >= (first.order or 0) - BAR_BESIDE else []


def waited_for_main_process(ctx: Context) -> Diagnosis | None:
    """``hang`` on rank 0: ranks failed waiting inside ``main_process_first`` (their tracebacks pass through it)
    and every error in the evidence is a wait's (a timeout of a barrier, a store, a socket), rank 0's included:
    the main process was still doing the block's work alone when the others gave up."""
    ev = ctx.evidence
    every = [line for r in ev.ranks for line in r.lines] + list(ev.unranked)
    waits = [line for line in every if line.signature == MAIN_FIRST]
    if not waits:
        # no traceback through the block, but rank 0's progress bar was still moving when a rank gave up
        waits = _waits_beside_a_moving_bar(ctx, every)
    if not waits or not all(_is_wait(ctx, line) for line in every):
        return None  # some rank failed in a way of its own (inside the block too: its traceback passes there)
    main = ev.rank(0)
    if main is not None and (main.exception is not None or any(line.signature == MAIN_FIRST for line in main.lines)):
        return None
    sig = ctx.taxonomy.get(MAIN_FIRST)
    if sig is None:
        return None
    waiters = sorted({r.rank for r in ev.ranks if r.rank != 0 and r.lines})
    busy = _busy_lines(ctx, 0)
    who = f"Ranks {format_ranks(waiters)}" if len(waiters) > 1 else f"Rank {waiters[0]}" if waiters else "A rank"
    doing = f' ("{busy[-1].text[:160]}")' if busy else ""
    summary = (
        f"{who} failed waiting at main_process_first's barrier for the main process, rank 0, which was still "
        f"doing the block's work alone{doing} when the timeout expired: it was slow, not dead. The waiting "
        "ranks' timeouts are the symptom."
    )
    roles: dict[int, Role] = {r: "collateral" for r in waiters}
    roles[0] = "initiating"
    for r in ctx.findings:
        roles.setdefault(r, "unknown")
    failed = [line.text for line in every if line.signature != MAIN_FIRST]
    lines = ([busy[-1].text] if busy else []) + [waits[0].text] + failed[:2]
    target = main if main is not None else RankEvidence(rank=0, local_rank=0, node="")
    return named_verdict(sig, "hang", target, summary, lines, roles)

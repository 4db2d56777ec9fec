"""The steps that complete an attempt's evidence before the rules judge it, where no launcher watched the
ranks (``elastic-diag analyze`` on logs): each rank's exit from what the launchers printed, the exits the
logs never show, the ranks only their peers' lines speak of. On live evidence (every exit seen by the
launcher) they change nothing.

Each step is ``(evidence, taxonomy) -> evidence`` and is listed, in order, in
:data:`elastic_diag.core.attribution.STEPS`. Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from elastic_diag.core.evidence import AttemptEvidence, LogLine, RankEvidence
from elastic_diag.core.taxonomy import Signature, Taxonomy

_BY_SIGNAL = (-signal.SIGTERM, -signal.SIGKILL)


def _with_ranks(evidence: AttemptEvidence, ranks: dict[int, RankEvidence]) -> AttemptEvidence:
    return replace(evidence, ranks=tuple(sorted(ranks.values(), key=lambda ev: ev.rank)))


def _first_time(ev: RankEvidence) -> float | None:
    """When its first error line that carries a time says it was written."""
    return next((line.time for line in ev.lines if line.time is not None), None)


def _empty(rank: int) -> RankEvidence:
    return RankEvidence(rank=rank, local_rank=rank, node="")


def exits_from_launchers(evidence: AttemptEvidence, taxonomy: Taxonomy) -> AttemptEvidence:
    """What the launchers printed of the workers' exits, given to ranks whose exit no launcher watched.

    torchrun's failure summary gives each listed rank its exit status, pid, host and the exception of its
    traceback, and, when every closing signal torch's agent sent went to a process the logs tie to a rank,
    the ranks it does not list exited 0 (it lists every rank it did not see exit 0). DeepSpeed's and other
    launchers' exit lines count where no summary told, or where they tell more than a plain 0 or 1. Without a
    summary, torch's agent's "failed (exitcode: N) local_rank: R" line is taken for rank R (one node: the
    local rank is the rank). torchrun-diag's "job succeeded" means every rank exited 0. A rank torchrun's summary
    shows SIGTERMed while another rank failed by itself was stopped by the launcher (whether it had failed on its
    own before is decided on its lines, later)."""
    exits = evidence.launcher_exits
    if not exits:
        return evidence
    ranks = {ev.rank: ev for ev in evidence.ranks}
    settled: dict[int, int | None] = {}
    summary = [e for e in exits if e.launcher == "torchrun"]
    for e in summary:
        if e.rank is None:
            continue
        ev = ranks.get(e.rank) or _empty(e.rank)
        if ev.exit_code is not None and e.rank not in settled:
            continue
        settled[e.rank] = e.exit_code
        ranks[e.rank] = replace(
            ev,
            exit_code=e.exit_code,
            pid=e.pid,
            node=ev.node or e.host or "",
            exit_time=next((t for t in (ev.exit_time, _first_time(ev), e.time) if t is not None), None),
            exception=ev.exception or e.exception,
        )
    others = [
        e for kind in ("deepspeed", "composer", "mpirun", "horovodrun", "other") for e in exits if e.launcher == kind
    ]
    for e in others:
        if e.rank is None:
            continue
        ev = ranks.get(e.rank) or _empty(e.rank)
        if ev.exit_code is not None and e.rank not in settled:
            continue
        if e.rank not in settled or e.exit_code not in (0, 1):
            settled[e.rank] = e.exit_code
            ranks[e.rank] = replace(ev, exit_code=e.exit_code, node=ev.node or e.host or "")
    if any(e.launcher == "torchrun-diag" and e.rank is None and e.exit_code == 0 for e in exits):
        # torchrun-diag said the job succeeded: it saw every rank of its last attempt exit 0
        for r, ev in ranks.items():
            if ev.exit_code is None and r not in settled:
                settled[r] = 0
                ranks[r] = replace(ev, exit_code=0)
    if summary and not evidence.signalled_unknown:
        listed = {e.rank for e in summary}
        for r, ev in ranks.items():
            if r not in listed and r not in settled and ev.exit_code is None and not ev.lines and ev.exception is None:
                ranks[r] = replace(ev, exit_code=0)
    if not summary:
        for e in exits:
            if e.launcher != "torch-agent" or e.local_rank is None:
                continue
            rank = e.rank if e.rank is not None else e.local_rank  # a row of torchrun's table maps it
            known = ranks.get(rank)
            ev = known or _empty(rank)
            if ev.exit_code is None:
                # a process the log knows by no other line is known only by its local rank
                local = known is None and e.rank is None
                ranks[rank] = replace(ev, exit_code=e.exit_code, pid=e.pid,
                                      coordinate="local" if local else ev.coordinate)  # fmt: skip
    if any(e.exit_code not in (*_BY_SIGNAL, None) for e in summary):
        for e in summary:
            if e.rank is not None and e.exit_code == -signal.SIGTERM and e.rank in ranks:
                ranks[e.rank] = replace(ranks[e.rank], stopped_by_agent=True)
    return _with_ranks(evidence, ranks)


def _waits(line: LogLine, taxonomy: Taxonomy) -> bool:
    """A line that shows its rank waiting for a peer: a collective timeout (a symptom)."""
    sig = taxonomy.find(line.signature)
    return sig is not None and sig.failure_class == "collective_timeout" and sig.role_hint == "collateral"


def watchdog_aborts(evidence: AttemptEvidence, taxonomy: Taxonomy) -> AttemptEvidence:
    """A rank known only by its SIGABRT exit (torchrun's summary: ``exitcode: -6``, no line of its own)
    while its peers' watchdogs timed out died of the same watchdog: NCCL aborts a rank whose collective
    timed out. It waited too; torchrun's "first observed failure" is then not the culprit."""
    timed_out = [ev for ev in evidence.ranks if any(_waits(line, taxonomy) for line in ev.lines)]
    if not timed_out and not any(_waits(line, taxonomy) for line in evidence.unranked):
        return evidence
    sig = taxonomy.get("nccl-watchdog-abort")
    peers = max(1, len(timed_out))
    text = ("exit status -6 (SIGABRT) in the launcher's summary and no line of its own, while "
            f"{peers} of its peers' watchdogs timed out: the NCCL watchdog's abort")  # fmt: skip
    ranks = {ev.rank: ev for ev in evidence.ranks}
    for r, ev in ranks.items():
        if ev.exit_code == -signal.SIGABRT and not ev.lines and ev.exception is None:
            ranks[r] = replace(ev, lines=(LogLine(text=text, signature=sig.id),))
    return _with_ranks(evidence, ranks)


def named_ranks_exist(evidence: AttemptEvidence, taxonomy: Taxonomy) -> AttemptEvidence:
    """A rank that only its peers' lines speak of (NCCL's desync report on rank 0 naming rank 7: it printed
    nothing, or its output is not in these logs) is among the ranks, so that the peers' lines can name it."""
    named: set[int] = set()
    for line in [*evidence.unranked, *(line for ev in evidence.ranks for line in ev.lines)]:
        for sig, peers in taxonomy.named_ranks(line.text, line.signature):
            if not sig.wraps:
                named.update(peers)
    ranks = {ev.rank: ev for ev in evidence.ranks}
    missing = named - set(ranks)
    if not missing:
        return evidence
    ranks.update((r, _empty(r)) for r in missing)
    return _with_ranks(evidence, ranks)


def _about_another_process(sig: Signature) -> bool:
    """A signature whose lines name the process they are about (a kernel OOM kill's pid, srun's task)."""
    return any("(?P<pid>" in p.pattern or "(?P<rank>" in p.pattern for p in sig.patterns)


def unranked_cause_of_the_one_failed(evidence: AttemptEvidence, taxonomy: Taxonomy) -> AttemptEvidence:
    """The error lines that belong to no rank (a traceback pasted without prefixes) are the one failed
    process's, when a launcher says exactly one process failed by itself, with the status of an uncaught
    exception (torch's agent's "failed (exitcode: 1) local_rank: 0", the others SIGTERMed while alive), no rank
    has a line of its own, and the lines show one cause, printed once (printed by each process, they are every
    rank's: same_failure_everywhere)."""
    failed = [ev for ev in evidence.ranks if ev.exit_code not in (0, None) and not ev.stopped_by_agent
              and ev.exit_code != -signal.SIGTERM]  # fmt: skip
    if len(failed) != 1 or any(ev.lines or ev.exception is not None for ev in evidence.ranks):
        return evidence
    if failed[0].exit_code != 1:
        return evidence  # an uncaught exception exits 1: another status is not that traceback's process
    causes = [line for line in evidence.unranked
              if (sig := taxonomy.find(line.signature)) is not None and sig.role_hint != "collateral"
              and not _about_another_process(sig)]  # fmt: skip
    if not causes or len({line.text for line in causes}) != len({line.order for line in causes}):
        return evidence  # no cause, or one printed more than once
    best: dict[tuple[int, str], Signature] = {}  # a line matched by several signatures: its most specific
    for line in causes:
        sig = taxonomy.find(line.signature)
        key = (line.order, line.text)
        if sig is not None and (key not in best or sig.priority > best[key].priority):
            best[key] = sig
    if len({sig.failure_class for sig in best.values()}) != 1:
        return evidence
    ranks = {ev.rank: ev for ev in evidence.ranks}
    one = failed[0]
    ranks[one.rank] = replace(one, lines=tuple(replace(line, rank=one.rank) for line in causes))
    kept = tuple(line for line in evidence.unranked if line not in causes)
    return replace(_with_ranks(evidence, ranks), unranked=kept)


def _exit_for(sig: Signature) -> int:
    return -int(getattr(signal, sig.signals[0], signal.SIGTERM))


def exits_from_lines(evidence: AttemptEvidence, taxonomy: Taxonomy) -> AttemptEvidence:
    """A rank whose exit no launcher tells but that printed an error failed: with the signal its line names
    (``Signal 9 (SIGKILL) received``, a segfault's banner), else status 1; its exit time is when its first
    error line says it was written. A rank the launcher stopped with no failure of its own was alive at the
    verdict; one that had failed on its own first (its exception, a line that is no symptom) was dying of it:
    it failed, and the launcher's signal is not its class."""
    ranks = {}
    changed = False
    for ev in evidence.ranks:
        sigs = [taxonomy.find(line.signature) for line in ev.lines]
        own = ev.exception is not None or any(s is not None and s.role_hint != "collateral" for s in sigs)
        new = ev
        if ev.stopped_by_agent and not own and not ev.alive_at_decision:
            new = replace(new, alive_at_decision=True)
        if ev.exit_code is None and not ev.alive_at_decision and (ev.lines or ev.exception is not None):
            by_signal = next((s for s in sigs if s is not None and s.signals), None)
            new = replace(new, exit_code=_exit_for(by_signal) if by_signal else 1, exit_seen=False)
        if new.exit_time is None and new.failed and (t := _first_time(ev)) is not None:
            new = replace(new, exit_time=t)
        changed = changed or new is not ev
        ranks[ev.rank] = new
    return _with_ranks(evidence, ranks) if changed else evidence

"""Classification: evidence in, :class:`Diagnosis` out. Pure: no torch, no I/O, no clock.

Two steps:

1. :func:`examine_rank` turns one rank's evidence into a :class:`RankFinding`: which signature its
   evidence matches (an exception type, a fatal signal, a signature line in its output), and
   whether that marks a cause (``initiating`` hint) or a symptom of a peer's failure
   (``collateral``: peer closed / reset, collective timeouts).
2. :func:`classify_attempt` attributes the attempt. Timeouts point AWAY from the ranks that report
   them: the initiating rank is the earliest rank that failed *differently* (its own exception,
   signal or exit); failing that, a rank that was alive outside any collective while its peers
   waited (``hang``); failing that, the one rank that neither failed nor reported a timeout.
   When the evidence cannot name a rank, ``initiating_rank`` is None and the summary says why.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from elastic_diag.evidence import AttemptEvidence, RankEvidence
from elastic_diag.flight_recorder import Finding, compare, lateness_samples
from elastic_diag.taxonomy import Signature, Taxonomy, load_taxonomy

ROLES = ("initiating", "collateral", "stopped", "healthy", "unknown")
MAX_EVIDENCE_LINES = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFinding:
    rank: int
    state: str  # "failed" | "alive" | "stopped" | "succeeded"
    signature: Signature | None = None
    failure_class: str = "unknown"
    hint: str = "either"  # initiating | collateral | either
    lines: tuple[str, ...] = ()
    time: float | None = None
    in_collective: bool | None = None
    named: tuple[tuple[int, Signature, str], ...] = ()  # ranks this rank's lines name as the cause


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    failure_class: str
    initiating_rank: int | None = None
    initiating_node: str | None = None
    exception_type: str | None = None
    signature_id: str | None = None
    summary: str = ""
    evidence: tuple[str, ...] = ()
    fix: str | None = None
    verify: str | None = None
    collateral_ranks: tuple[int, ...] = ()
    roles: dict[int, str] = field(default_factory=dict)
    retryable: bool | None = None
    collective: dict[str, object] | None = None  # where the schedules part (desync / mismatch / missing)

    def to_json(self) -> dict[str, object]:
        extra: dict[str, object] = {"collective": self.collective} if self.collective else {}
        return {
            "failure_class": self.failure_class,
            "initiating_rank": self.initiating_rank,
            "initiating_node": self.initiating_node,
            "exception_type": self.exception_type,
            "signature_id": self.signature_id,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "fix": self.fix,
            "verify": self.verify,
            "collateral_ranks": list(self.collateral_ranks),
            **extra,
        }


HEALTHY = Diagnosis(failure_class="healthy", summary="All ranks finished successfully.")


def _rank_lines(ev: RankEvidence) -> list[str]:
    lines: list[str] = []
    if ev.exception is not None:
        lines.append(ev.exception.last_line)
    lines.extend(ev.stderr_tail)
    lines.extend(ev.stdout_tail)
    return lines


def _best(
    candidates: list[tuple[Signature, str]],
) -> tuple[Signature, str] | None:
    best = None
    for sig, line in candidates:
        if best is None or sig.priority > best[0].priority:
            best = (sig, line)
    return best


def examine_rank(ev: RankEvidence, taxonomy: Taxonomy, decided_at: float | None = None) -> RankFinding:
    """What one rank's own evidence says about it.

    A rank still alive at the verdict whose uncaught exception was recorded BEFORE the verdict was
    dying of that exception on its own (interpreter teardown can take seconds): it counts as failed.
    """
    dying = (
        ev.exception is not None
        and ev.exception.time is not None
        and decided_at is not None
        and ev.exception.time < decided_at
    )
    if (ev.exit_code is None or ev.alive_at_decision) and not dying:
        state = "alive"
    elif ev.stopped_by_agent and not dying:
        state = "stopped"
    elif ev.exit_code == 0:
        return RankFinding(rank=ev.rank, state="succeeded", failure_class="healthy", time=ev.exit_time)
    else:
        state = "failed"

    candidates: list[tuple[Signature, str]] = []
    named: list[tuple[int, Signature, str]] = []
    for line in _rank_lines(ev):
        for sig, m in taxonomy.match_line(line):
            candidates.append((sig, line.strip()))
            groups = m.groupdict()
            for key in ("peers", "rank_a", "rank_b"):
                peers = groups.get(key)
                if peers:
                    named.extend((int(p), sig, line.strip()) for p in peers.replace(" ", "").split(",") if p.isdigit())
    if state == "failed":
        by_exception = taxonomy.for_exception(ev.exception.type) if ev.exception is not None else None
        if by_exception is not None and ev.exception is not None:
            candidates.append((by_exception, ev.exception.last_line))
        sig_name = ev.signal if not (ev.alive_at_decision or ev.stopped_by_agent) else None  # not the launcher's
        by_signal = taxonomy.for_signal(sig_name) if sig_name else None
        if by_signal is not None:
            candidates.append((by_signal, f"exit status {ev.exit_code} ({sig_name})"))
    # The generic "SomethingError: msg" line is a fallback: it never outranks a specific signature,
    # and without a traceback it only counts for a rank that failed.
    if state != "failed":
        candidates = [(s, line) for s, line in candidates if s.role_hint == "collateral"]
    best = _best(candidates)
    in_coll = ev.stack.in_collective() if ev.stack is not None else None

    if best is None:
        if state == "failed":
            sig = taxonomy.get("silent-exit")
            tail = [line for line in ev.stderr_tail if line.strip()][-3:]
            return RankFinding(
                rank=ev.rank, state=state, signature=sig, failure_class=sig.failure_class,
                hint="initiating", lines=(f"exit status {ev.exit_code}", *tail),
                time=ev.first_error_time, in_collective=in_coll,
            )  # fmt: skip
        return RankFinding(rank=ev.rank, state=state, time=ev.first_error_time, in_collective=in_coll)

    sig, line = best
    lines = [line]
    if ev.exception is not None and sig.role_hint != "collateral":
        loc = ev.exception.location()
        if loc:
            lines.append(f"at {loc}")
    return RankFinding(
        rank=ev.rank,
        state=state,
        signature=sig,
        failure_class=sig.failure_class,
        hint=sig.role_hint,
        lines=tuple(lines),
        time=ev.first_error_time,
        in_collective=in_coll,
        named=tuple(named),
    )


def _unattributed(
    sig: Signature | None,
    failure_class: str,
    summary: str,
    evidence: tuple[str, ...],
    roles: dict[int, str],
    collateral_ranks: tuple[int, ...] = (),
) -> Diagnosis:
    """A verdict that names no initiating rank, with the signature's fix and verification."""
    return Diagnosis(
        failure_class=failure_class,
        signature_id=sig.id if sig else None,
        summary=summary,
        evidence=evidence[:MAX_EVIDENCE_LINES],
        fix=sig.fix if sig else None,
        verify=sig.verify if sig else None,
        collateral_ranks=collateral_ranks,
        roles=roles,
        retryable=sig.retryable if sig else None,
    )


def format_ranks(ranks: list[int]) -> str:
    """``0-736, 738-1023``: runs of three or more consecutive ranks as ranges (summaries of big jobs)."""
    if not ranks:
        return "none"
    parts: list[str] = []
    values = sorted(set(ranks))
    start = prev = values[0]
    for r in [*values[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev - start >= 2 else ", ".join(str(x) for x in range(start, prev + 1)))
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def _ranks(ranks: list[int]) -> str:
    """``Rank 3`` or ``Ranks 0, 1, 3``: the subject of a summary's sentence; a scattered set (one local
    rank of every node) as ``895 ranks (0-6, 8-14, ...)``, so a summary stays a few lines long."""
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    listed = format_ranks(ranks)
    if len(listed) > 60:
        return f"{len(ranks)} ranks ({listed[:60].rsplit(',', 1)[0]}, ...)"
    return f"Ranks {listed}"


def _were(ranks: list[int]) -> str:
    return "was" if len(ranks) == 1 else "were"


def classify_attempt(
    evidence: AttemptEvidence,
    taxonomy: Taxonomy | None = None,
    extra_votes: list[tuple[int, Signature, str]] | None = None,
) -> Diagnosis:
    """Attribute one attempt: the initiating rank, its class, and every rank's role.

    ``extra_votes`` are (rank, signature, explanation) from checks across ranks that no single
    line shows (the analyzer's comparison of collective schedules).
    """
    tax = taxonomy or load_taxonomy()
    by_rank = {ev.rank: ev for ev in evidence.ranks}
    findings = {ev.rank: examine_rank(ev, tax, evidence.decided_at) for ev in evidence.ranks}

    failed = [f for f in findings.values() if f.state == "failed"]
    if not failed and all(f.state == "succeeded" for f in findings.values()):
        return Diagnosis(
            failure_class="healthy",
            summary=HEALTHY.summary,
            roles={r: "healthy" for r in findings},
        )

    records = {ev.rank: ev.flight_record for ev in evidence.ranks if ev.flight_record is not None}
    schedule = compare(records, sorted(by_rank)).finding if len(records) >= 2 else None
    offline_records = schedule is not None and all(f.state != "succeeded" for f in findings.values())
    if failed or evidence.hang or offline_records:
        nan = _nonfinite_verdict(evidence, findings, tax)
        if nan is not None:
            return nan
        if schedule is not None and schedule.kind in ("desync", "mismatch") and len(schedule.ranks) == 1:
            return _schedule_verdict(schedule, evidence, findings, tax)

    def order(f: RankFinding) -> tuple[float, int]:
        return (f.time if f.time is not None else float("inf"), f.rank)

    primary = sorted((f for f in failed if f.hint != "collateral"), key=order)
    collateral = sorted((f for f in failed if f.hint == "collateral"), key=order)
    alive = [f for f in findings.values() if f.state in ("alive", "stopped") and f.hint != "collateral"]
    alive_outside = sorted((f for f in alive if f.in_collective is False), key=lambda f: f.rank)

    votes: dict[int, list[tuple[Signature, str]]] = {}
    for f in findings.values():
        for r, vote_sig, line in f.named:
            if r != f.rank and r in findings:
                votes.setdefault(r, []).append((vote_sig, line))
    for r, vote_sig, line in extra_votes or ():
        if r in findings:
            votes.setdefault(r, []).append((vote_sig, line))
    named_rank = max(votes, key=lambda r: (len(votes[r]), -r)) if votes else None

    initiating: RankFinding | None = None
    reason = ""
    naming: tuple[Signature, str] | None = None
    if primary:
        initiating = primary[0]
        reason = "failed first on its own"
    elif named_rank is not None:
        initiating = findings[named_rank]
        naming = max(votes[named_rank], key=lambda v: v[0].priority)
        reason = f"is named by {len(votes[named_rank])} line(s) of its peers"
    elif (
        schedule is not None
        and schedule.kind == "missing"
        and len(schedule.ranks) == 1
        and not (findings[schedule.ranks[0]].in_collective and evidence.hang is None)
    ):
        initiating = findings[schedule.ranks[0]]
        reason = f"never entered collective #{schedule.seq} of process group {schedule.group} that its peers waited in"
    elif evidence.hang is not None and (watched := evidence.hang.get("rank")) in findings:
        initiating = findings[watched]
        reason = ""
    elif alive_outside:
        initiating = alive_outside[0]
        reason = ""
    elif (odd := _odd_location(evidence, findings)) is not None:
        return _schedule_verdict(None, evidence, findings, tax, odd_rank=odd)
    elif collateral and len(alive) == 1:
        initiating = alive[0]
        reason = "neither failed nor reported a timeout while every other rank did"
    elif collateral and not alive and len(early := [f for f in findings.values() if f.state == "succeeded"]) == 1:
        initiating = early[0]
        reason = "exited 0 while its peers still waited for it in a collective"

    roles: dict[int, str] = {}
    for r, f in findings.items():
        if initiating is not None and r == initiating.rank:
            roles[r] = "initiating"
        elif f.state == "succeeded":
            roles[r] = "healthy"
        elif f.state == "failed" and f.hint == "collateral":
            roles[r] = "collateral"
        elif f.state in ("alive", "stopped"):
            # after a hang alarm, a rank stopped while it waited inside a collective waited for the culprit
            roles[r] = "collateral" if evidence.hang is not None and f.in_collective else "stopped"
        else:
            roles[r] = "unknown"
    collateral_ranks = sorted(r for r, role in roles.items() if role == "collateral")
    other_primary = [f.rank for f in primary[1:]]

    if initiating is None:
        lead = collateral[0] if collateral else (failed[0] if failed else None)
        no_sig = lead.signature if lead else None
        cls = no_sig.failure_class if no_sig else "unknown"
        if cls not in ("collective_timeout", "network_error"):
            cls = "collective_timeout" if collateral else "unknown"
        summary = (
            f"{_ranks(collateral_ranks)} failed waiting for a peer, but the evidence names no "
            "rank that failed first (no rank failed differently, and none was seen alive outside a "
            "collective); the cause may be on a rank or node whose evidence is missing."
        )
        waiting = tuple(line for f in collateral[:2] for line in f.lines)
        return _unattributed(no_sig, cls, summary, waiting, roles, tuple(collateral_ranks))

    if initiating.failure_class == "rendezvous_timeout" and initiating.state == "failed":
        return _unattributed(
            initiating.signature,
            "rendezvous_timeout",
            "The rendezvous did not complete: ranks are assigned only after it does, so no rank can be named; "
            "the missing node(s) are the cause.",
            initiating.lines,
            {r: "unknown" for r in findings},
        )
    together = [f for f in primary[1:] if f.signature is initiating.signature and initiating.failure_class == "nan_inf"
                and (f.time is None or initiating.time is None or abs(f.time - initiating.time) < 30.0)]  # fmt: skip
    if together:
        return _unattributed(
            initiating.signature,
            "nan_inf",
            f"Ranks {format_ranks(sorted([initiating.rank] + [f.rank for f in together]))} became non-finite "
            "together (the check is all-reduced); these logs do not show whose LOCAL loss or gradients went "
            "non-finite first. Log each rank's local loss before the all_reduce to name it.",
            initiating.lines,
            {r: "unknown" for r in findings},
        )
    ev = by_rank[initiating.rank]
    sig: Signature | None
    if naming is not None:
        sig = naming[0]
        cls = sig.failure_class
        lines = [naming[1]]
    elif initiating.state == "succeeded":
        sig = tax.get("nccl-desync-report")
        cls = "collective_desync"
        lines = [f"rank {ev.rank} exited with status 0 while its peers waited for it in a collective"]
    elif initiating.state == "failed":
        sig = initiating.signature
        cls = initiating.failure_class
        lines = list(initiating.lines)
    elif collateral and all(f.failure_class == "rendezvous_timeout" for f in collateral):
        # its peers timed out waiting for it to join the process group: it never arrived
        sig = collateral[0].signature
        cls = "rendezvous_timeout"
        frame = ev.stack.user_frame() if ev.stack else None
        lines = [f"rank {ev.rank} never joined the process group" + (f"; it was at {frame}" if frame else "")]
    else:
        sig = tax.get("hang-outside-collective")
        cls = sig.failure_class
        frame = ev.stack.user_frame() if ev.stack else None
        lines = [
            f"rank {ev.rank} alive, main thread at {frame}"
            if frame
            else f"rank {ev.rank} reported no error of its own while its peers timed out (no stack was taken)"
        ]
    for f in collateral[:2]:
        lines.extend(f"rank {f.rank}: {line}" for line in f.lines[:1])

    what = {
        "python_exception": f"raised {ev.exception.last_line}" if ev.exception else "raised an exception",
        "host_oom": "ran out of host memory" + (f" ({ev.exception.type})" if ev.exception else ""),
        "segfault": f"died by {ev.signal or 'a fatal signal'} in native code",
        "abort": f"aborted ({ev.signal or 'SIGABRT'})",
        "killed": f"was killed by {ev.signal or 'a signal'} from outside the job",
        "silent_exit": f"exited with status {ev.exit_code} without a traceback",
        "hang": "was stuck outside any collective",
        "rendezvous_timeout": "never joined the process group its peers waited for",
    }.get(cls, f"failed ({sig.title if sig else cls})")
    if naming is not None:
        what = f"is named by its peers: {sig.title if sig else cls}"
    elif cls == "hang" and ev.stack is None:
        what = "never reached the collective its peers waited in (it reported no error of its own)"
    loc = ev.exception.location() if ev.exception and cls in ("python_exception", "host_oom") else None
    if cls in ("hang", "rendezvous_timeout") and ev.stack is not None and ev.stack.user_frame() is not None:
        loc = str(ev.stack.user_frame())
    where = f" on {ev.node}" if ev.node else ""
    summary = f"Rank {ev.rank}{where} {what}" + (f" at {loc}" if loc else "")
    summary += ", while its peers waited." if cls == "hang" and ev.stack is not None else "."
    if collateral_ranks and evidence.hang is not None and initiating.state != "failed":
        were = _were(collateral_ranks)
        summary += f" {_ranks(collateral_ranks)} waited for it inside a collective and {were} stopped."
    elif collateral_ranks:
        summary += f" {_ranks(collateral_ranks)} then failed waiting for it."
    stopped = sorted(r for r, role in roles.items() if role == "stopped")
    if stopped:
        summary += f" {_ranks(stopped)} {_were(stopped)} stopped by the launcher."
    if other_primary:
        their = "its" if len(other_primary) == 1 else "their"
        summary += f" {_ranks(other_primary)} also failed on {their} own, later."
    if reason and cls != "hang":
        summary += f" (Rank {ev.rank} {reason}.)"

    if schedule is not None and schedule.kind == "missing" and ev.rank in schedule.ranks:
        lines.append(schedule.summary)
    if evidence.hang is not None and initiating.state != "failed":
        lines.append(_hang_line(evidence.hang))
    return Diagnosis(
        failure_class=cls,
        initiating_rank=ev.rank,
        initiating_node=ev.node or None,
        exception_type=ev.exception.type if ev.exception and initiating.state == "failed" else None,
        signature_id=sig.id if sig else None,
        summary=summary,
        evidence=tuple(lines[:MAX_EVIDENCE_LINES]),
        fix=sig.fix if sig else None,
        verify=sig.verify if sig else None,
        collateral_ranks=tuple(collateral_ranks),
        roles=roles,
        retryable=sig.retryable if sig else None,
        collective=_finding_json(schedule, evidence) if schedule is not None and ev.rank in schedule.ranks else None,
    )


def _hang_line(hang: dict[str, object]) -> str:
    return (
        f"elastic_diag health monitor: no rank made progress for {hang.get('stalled_s')} s "
        f"(threshold {hang.get('threshold_s')} s, {hang.get('reason', 'hang timeout')})"
    )


def _roles_around(initiating: int, findings: dict[int, RankFinding]) -> dict[int, str]:
    roles = {}
    for r, f in findings.items():
        if r == initiating:
            roles[r] = "initiating"
        elif f.state == "succeeded":
            roles[r] = "healthy"
        elif f.state == "failed" or f.in_collective:
            roles[r] = "collateral"
        else:
            roles[r] = "stopped"
    return roles


def _finding_json(finding: Finding, evidence: AttemptEvidence) -> dict[str, object]:
    where = {ev.rank: ev.location() for ev in evidence.ranks}
    return {
        "kind": finding.kind,
        "process_group": finding.group,
        "seq": finding.seq,
        "ranks": list(finding.ranks),
        "sides": {str(r): v for r, v in finding.sides.items()},
        "source": {str(r): loc for r, loc in sorted(where.items()) if loc},
    }


def _locations_lines(evidence: AttemptEvidence, focus: int) -> list[str]:
    """``rank 2 at file:line``, then the other ranks grouped by where they were."""
    groups: dict[str, list[int]] = {}
    for ev in evidence.ranks:
        if ev.rank != focus and (loc := ev.location()):
            groups.setdefault(loc, []).append(ev.rank)
    own = next((ev.location() for ev in evidence.ranks if ev.rank == focus), None)
    lines = [f"rank {focus} was at {own}"] if own else []
    lines.extend(f"ranks {format_ranks(rs)} were at {loc}" for loc, rs in sorted(groups.items(), key=lambda kv: kv[1]))
    return lines


def _odd_location(evidence: AttemptEvidence, findings: dict[int, RankFinding]) -> int | None:
    """With every failure a symptom (peer closed, size mismatch, timeout): the one rank whose code was
    somewhere else than all its peers', which agree with each other (at least two of them)."""
    where = {ev.rank: ev.location() for ev in evidence.ranks if findings[ev.rank].state != "succeeded"}
    if len(where) < 3 or any(loc is None for loc in where.values()):
        return None
    counts: dict[str | None, list[int]] = {}
    for r, loc in where.items():
        counts.setdefault(loc, []).append(r)
    if len(counts) != 2:
        return None
    small, big = sorted(counts.values(), key=len)
    return small[0] if len(small) == 1 and len(big) >= 2 else None


def _schedule_verdict(
    finding: Finding | None,
    evidence: AttemptEvidence,
    findings: dict[int, RankFinding],
    tax: Taxonomy,
    odd_rank: int | None = None,
) -> Diagnosis:
    """The ranks' collective schedules part: from the flight recorders (``finding``), or from where
    each rank's code was (``odd_rank``)."""
    rank = finding.ranks[0] if finding is not None else odd_rank
    assert rank is not None
    ev = next(e for e in evidence.ranks if e.rank == rank)
    mismatch = finding is not None and finding.kind == "mismatch"
    sig = tax.get("collective-mismatch") if mismatch else tax.get("collective-schedule-diverged")
    cls = "collective_mismatch" if mismatch else "collective_desync"
    roles = _roles_around(rank, findings)
    where = f" on {ev.node}" if ev.node else ""
    loc = ev.location()
    if finding is not None:
        others = sorted(r for r in finding.sides if r != rank)
        theirs = next((finding.sides[r] for r in others), "?")
        what = "the same collective with other sizes, dtypes or op" if mismatch else "a different collective"
        summary = (
            f"Rank {rank}{where} issued {what} than its peers at collective #{finding.seq} of process group "
            f"{finding.group}: {finding.sides[rank]} against {theirs} on ranks {format_ranks(others)}"
        )
        lines = [
            f"elastic_diag: collective schedules part at process group {finding.group}, collective #{finding.seq}: "
            "the ranks did not join the same collective",
            *(f"rank {r}: #{finding.seq} {side}" for r, side in sorted(finding.sides.items())),
        ]
    else:
        summary = (
            f"Rank {rank}{where} was at another place in the code than all its peers when their collectives "
            "failed: its collective schedule parted from theirs"
        )
        if ev.flight_record is None:
            died = f", it died by {ev.signal}" if ev.signal else ""
            summary += f" (rank {rank} left no flight-recorder record{died})"
        lines = ["elastic_diag: collective schedules part: the ranks did not join the same collective"]
    summary += f"; rank {rank} was at {loc}." if loc else "."
    collateral = sorted(r for r, role in roles.items() if role == "collateral")
    if collateral:
        summary += f" {_ranks(collateral)} then failed in the collectives that no longer matched."
    lines.extend(_locations_lines(evidence, rank))
    for f in findings.values():
        if f.rank != rank and f.state == "failed" and f.lines:
            lines.append(f"rank {f.rank}: {f.lines[0]}")
            break
    if evidence.hang is not None:
        lines.append(_hang_line(evidence.hang))
    collective = _finding_json(finding, evidence) if finding is not None else None
    return _named(sig, cls, ev, summary, lines, roles, collective=collective)


def _nonfinite_verdict(evidence: AttemptEvidence, findings: dict[int, RankFinding], tax: Taxonomy) -> Diagnosis | None:
    """The rank whose own loss went non-finite first (by backward count, then time)."""
    marks = []
    for ev in evidence.ranks:
        nf = ev.nonfinite
        if isinstance(nf, dict) and isinstance(nf.get("backward"), int):
            t = nf.get("time")
            marks.append((nf["backward"], t if isinstance(t, int | float) else float("inf"), ev.rank))
    if not marks:
        return None
    marks.sort()
    first = [m for m in marks if m[0] == marks[0][0]]
    if len(first) > 1 and len(first) == len(evidence.ranks):
        return None  # every rank's own loss went non-finite at the same step: no rank to name
    backward, _, rank = marks[0]
    ev = next(e for e in evidence.ranks if e.rank == rank)
    sig = tax.get("nan-inf-loss")
    roles = _roles_around(rank, findings)
    nf = ev.nonfinite or {}
    where = f" on {ev.node}" if ev.node else ""
    summary = (
        f"Rank {rank}{where} backpropagated a non-finite loss first (its backward #{backward}, at {nf.get('where')}); "
        "the averaged gradients then carried it to every rank."
    )
    others = [m for m in marks[1:]]
    if others:
        summary += " Ranks " + format_ranks([m[2] for m in others]) + " had a non-finite loss only later."
    collateral = sorted(r for r, role in roles.items() if role == "collateral")
    if collateral:
        summary += f" {_ranks(collateral)} then failed on the non-finite values."
    lines = [f"rank {rank}: loss.backward() on a non-finite loss (backward #{backward}) at {nf.get('where')}"]
    lines.extend(f"rank {f.rank}: {f.lines[0]}" for f in findings.values() if f.rank != rank and f.lines)
    return _named(sig, "nan_inf", ev, summary, lines, roles,
                  exception_type=ev.exception.type if ev.exception else None)  # fmt: skip


def _named(
    sig: Signature,
    cls: str,
    ev: RankEvidence,
    summary: str,
    lines: list[str],
    roles: dict[int, str],
    *,
    exception_type: str | None = None,
    collective: dict[str, object] | None = None,
) -> Diagnosis:
    """A verdict naming ``ev``'s rank, with the signature's fix and verification."""
    return Diagnosis(
        failure_class=cls,
        initiating_rank=ev.rank,
        initiating_node=ev.node or None,
        exception_type=exception_type,
        signature_id=sig.id,
        summary=summary,
        evidence=tuple(lines[:MAX_EVIDENCE_LINES]),
        fix=sig.fix,
        verify=sig.verify,
        collateral_ranks=tuple(sorted(r for r, role in roles.items() if role == "collateral")),
        roles=roles,
        retryable=sig.retryable,
        collective=collective,
    )


STRAGGLER_MIN_S = 0.05
STRAGGLER_FRACTION = 0.1


def straggler_warnings(evidence: AttemptEvidence) -> list[dict[str, object]]:
    """Ranks that enter the collectives consistently later than the others (from the flight
    recorders' enqueue times): slow but alive, a warning and not a failure.

    A rank's delay per step is the sum of its lateness over the collectives, divided by the steps
    taken: with FSDP a step has a dozen collectives and a slow rank is late at only one of them (the
    first all-gather after its slow work), so a mean per collective would dilute it tenfold. A
    straggler delays its peers by at least 50 ms and a tenth of the median step per step, and is
    late at one collective in at least half of the steps (a one-off pause is not a straggler).
    Without step counts, the mean lateness per collective is used instead."""
    records = {ev.rank: ev.flight_record for ev in evidence.ranks if ev.flight_record is not None}
    samples = lateness_samples(records) if len(records) >= 3 else {}
    if not samples:
        return []
    durations = sorted(d for ev in evidence.ranks for d in ev.step_durations[3:])
    step = durations[len(durations) // 2] if durations else None
    floor = max(STRAGGLER_MIN_S, STRAGGLER_FRACTION * step) if step else STRAGGLER_MIN_S
    counts = sorted(ev.steps for ev in evidence.ranks if ev.steps)
    total_steps = counts[len(counts) // 2] if counts else None
    out: list[dict[str, object]] = []
    for rank, lags in sorted(samples.items()):
        if len(lags) < 5:
            continue
        # the recorder keeps the last entries only: the steps its samples cover, from the collectives
        # the rank issued in all (the highest sequence number of each group) per step
        issued = sum(max(seqs, default=0) for seqs in records[rank].groups.values())
        steps = len(lags) * total_steps / issued if total_steps and issued >= len(lags) else None
        if steps:
            lag = sum(lags) / steps
            consistent = sum(1 for x in lags if x >= floor / 2) >= steps / 2
        else:
            lag = statistics.fmean(lags)
            consistent = True
        if lag < floor or not consistent:
            continue
        node = next((ev.node for ev in evidence.ranks if ev.rank == rank), None)
        what = f"holds its peers up {lag * 1000:.0f} ms per step, entering the collectives after the median rank"
        if step:
            what += f" (median step {step * 1000:.0f} ms)"
        out.append({
            "class": "straggler",
            "rank": rank,
            "node": node,
            "lag_s": round(lag, 4),
            "step_s": round(step, 4) if step else None,
            "summary": f"rank {rank}{f' on {node}' if node else ''} {what} (attempt {evidence.attempt})",
        })  # fmt: skip
    return out


def classify_launch_error(
    text: str, taxonomy: Taxonomy | None = None, context: dict[str, object] | None = None
) -> Diagnosis:
    """Verdict on a launch that failed outside the workers (rendezvous, store, ports); ``context``: what
    a rendezvous that timed out knew (the nodes that joined, how many it needed, the timeout)."""
    tax = taxonomy or load_taxonomy()
    if context is not None and "RendezvousTimeoutError" in text:
        sig = tax.get("rendezvous-timeout")
        joined = context.get("joined")
        need, most = context.get("min_nodes"), context.get("max_nodes")
        nodes = f"{need}" if need == most else f"{need} to {most}"
        seen = (f"{len(joined)} joined ({', '.join(map(str, joined))})" if isinstance(joined, list)
                else "the joined nodes could not be read")  # fmt: skip
        missing = (f"{need - len(joined)} node(s) never joined" if isinstance(joined, list) and isinstance(need, int)
                   else "some node(s) never joined")  # fmt: skip
        summary = (f"The rendezvous timed out after {context.get('join_timeout_s')} s: it needed {nodes} node(s), "
                   f"{seen}; {missing}. Those nodes are the cause: they were not started, or cannot reach the "
                   "rendezvous endpoint.")  # fmt: skip
        return Diagnosis(failure_class="rendezvous_timeout", signature_id=sig.id, summary=summary,
                         evidence=(f"elastic_diag: rendezvous timed out: {missing} within join_timeout="
                                   f"{context.get('join_timeout_s')} s (needed {nodes}, {seen})",),
                         fix=sig.fix, verify=sig.verify, retryable=sig.retryable)  # fmt: skip
    best: tuple[Signature, str] | None = None
    for line in text.splitlines():
        for sig, _m in tax.match_line(line):
            if sig.id == "python-exception":
                continue
            if best is None or sig.priority > best[0].priority:
                best = (sig, line.strip())
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), text.strip())
    if best is None:
        return Diagnosis(
            failure_class="unknown",
            summary=f"The launcher failed before or between attempts: {first_line[:300]}",
            evidence=(first_line[:1000],),
        )
    sig, line = best
    return Diagnosis(
        failure_class=sig.failure_class,
        signature_id=sig.id,
        summary=f"The launch failed: {sig.title.lower()} ({line[:300]}).",
        evidence=(line[:1000],),
        fix=sig.fix,
        verify=sig.verify,
        retryable=sig.retryable,
    )

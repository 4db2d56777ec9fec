"""How a rule's decision becomes a :class:`~elastic_diag.core.verdict.Diagnosis`: every rank's role,
the summary a person reads first (the rank, what it did, where, and what its peers did then), the
decisive lines, the signature's fix and verify command; and the verdicts that name no rank, with why.
Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import re

from elastic_diag.core.context import Context
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.findings import RankFinding
from elastic_diag.core.flight_recorder import Divergence
from elastic_diag.core.stall import blocked_text, stall_line
from elastic_diag.core.taxonomy import Signature
from elastic_diag.core.verdict import MAX_EVIDENCE_LINES, Diagnosis, Role, format_ranks, ranks_phrase, were


def on_node(ev: RankEvidence) -> str:
    return f" on {ev.node}" if ev.node else ""


def stall_where(ctx: Context, ev: RankEvidence) -> str | None:
    """Where the stall snapshot saw the rank, outside any collective while its peers waited; None when it did
    not (no stall under way when the attempt failed, or the rank was inside the collective)."""
    stall = ctx.evidence.stall
    seen = stall.rank(ev.rank) if stall is not None else None
    if seen is None or seen.in_collective:
        return None
    return seen.where or "an unknown line (no stack)"


def roles_of(ctx: Context, initiating: int | None) -> dict[int, Role]:
    roles: dict[int, Role] = {}
    hang = ctx.evidence.hang
    for r, f in ctx.findings.items():
        if initiating is not None and r == initiating:
            roles[r] = "initiating"
        elif f.state == "succeeded":
            roles[r] = "healthy"
        elif f.state == "failed" and f.hint == "collateral" and not f.own:
            roles[r] = "collateral"
        elif f.state == "alive":
            # after a hang alarm, a rank stopped while it waited inside a collective waited for the culprit
            roles[r] = "collateral" if hang is not None and f.in_collective else "stopped"
        else:
            roles[r] = "unknown"
    return roles


def roles_around(initiating: int, findings: dict[int, RankFinding]) -> dict[int, Role]:
    roles: dict[int, Role] = {}
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


def unnamed_lead(ctx: Context) -> tuple[RankFinding | None, str]:
    """When no rank is named: the rank whose lines lead the verdict, and its class. Ranks that waited until
    their collective timed out come first (the resets and closed connections of the others follow from their
    exits); a rank that gloo killed for receiving more than its tensor holds before them (it proves a
    mismatch, whoever sent it). The class is a symptom's: a timeout, a network error or a mismatch."""
    failed = [f for f in ctx.findings.values() if f.state == "failed"]
    lead = ctx.symptoms[0] if ctx.symptoms else (failed[0] if failed else None)
    timed_out = [f for f in ctx.symptoms if f.failure_class == "collective_timeout"]
    if timed_out:
        lead = timed_out[0]
    received = [f for f in ctx.symptoms if f.failure_class == "collective_mismatch"]
    if received:
        lead = received[0]
    cls = lead.signature.failure_class if lead is not None and lead.signature is not None else "unknown"
    if cls not in ("collective_timeout", "network_error", "collective_mismatch"):
        cls = "collective_timeout" if ctx.symptoms else "unknown"
    return lead, cls


def unattributed(
    sig: Signature | None,
    failure_class: str,
    summary: str,
    evidence: tuple[str, ...],
    roles: dict[int, Role],
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


def named_verdict(
    sig: Signature,
    cls: str,
    ev: RankEvidence,
    summary: str,
    lines: list[str],
    roles: dict[int, Role],
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


def _hang_line(hang: dict[str, object]) -> str:
    return (
        f"elastic_diag health monitor: no rank made progress for {hang.get('stalled_s')} s "
        f"(threshold {hang.get('threshold_s')} s, {hang.get('reason', 'hang timeout')})"
    )


_DDP_UNUSED = re.compile(
    r"(?:Parameters|Parameter indices) which did not receive grad for rank (?P<rank>\d+): (?P<p>.+)"
)


def rank_verdict(
    ctx: Context, initiating: RankFinding, reason: str, naming: tuple[Signature, str] | None = None
) -> Diagnosis:
    """The verdict naming ``initiating``: its class, the lines that show it, and a summary of the
    roles of the others."""
    evidence = ctx.evidence
    ev = ctx.ev(initiating.rank)
    roles = roles_of(ctx, initiating.rank)
    collateral_ranks = sorted(r for r, role in roles.items() if role == "collateral")
    exc = initiating.exception
    sig, cls, lines = _class_and_lines(ctx, initiating, ev, naming)
    stall = evidence.stall
    if stall is not None and (seen := stall_line(stall, ev.rank)) is not None:
        lines.append(seen)
    for f in ctx.symptoms[:2]:
        lines.extend(f"rank {f.rank}: {line}" for line in f.lines[:1])
    summary = _summary(ctx, initiating, ev, sig, cls, naming, roles, reason, stall_where(ctx, ev))
    schedule = ctx.schedule
    if schedule is not None and schedule.kind == "missing" and ev.rank in schedule.ranks:
        lines.append(schedule.summary)
    if evidence.hang is not None and not initiating.own:
        lines.append(_hang_line(evidence.hang))
    return Diagnosis(
        failure_class=cls,
        initiating_rank=ev.rank,
        initiating_node=ev.node or None,
        exception_type=exc.type if exc is not None and initiating.own and naming is None else None,
        signature_id=sig.id if sig else None,
        summary=summary,
        evidence=tuple(lines[:MAX_EVIDENCE_LINES]),
        fix=sig.fix if sig else None,
        verify=sig.verify if sig else None,
        collateral_ranks=tuple(collateral_ranks),
        roles=roles,
        retryable=sig.retryable if sig else None,
        collective=divergence_json(schedule, evidence) if schedule is not None and ev.rank in schedule.ranks else None,
    )


def _class_and_lines(
    ctx: Context, initiating: RankFinding, ev: RankEvidence, naming: tuple[Signature, str] | None
) -> tuple[Signature | None, str, list[str]]:
    """The signature and class the named rank gets, and the first decisive lines: its own, the peers'
    line that names it, or what it was doing while its peers waited."""
    symptoms = ctx.symptoms
    if naming is not None:
        return naming[0], naming[0].failure_class, [naming[1]]
    if initiating.state == "succeeded":
        line = f"rank {ev.rank} exited with status 0 while its peers waited for it in a collective"
        return ctx.taxonomy.get("nccl-desync-report"), "collective_desync", [line]
    if initiating.own:
        return initiating.signature, initiating.failure_class, list(initiating.lines)
    frame = ev.stack.user_frame() if ev.stack else None
    if symptoms and all(f.failure_class == "rendezvous_timeout" for f in symptoms):
        # its peers timed out waiting for it to join the process group: it never arrived
        line = f"rank {ev.rank} never joined the process group" + (f"; it was at {frame}" if frame else "")
        return symptoms[0].signature, "rendezvous_timeout", [line]
    sig = ctx.taxonomy.get("hang-outside-collective")
    if frame is None and (at_stall := stall_where(ctx, ev)) is not None:
        if initiating.state == "failed" and initiating.hint == "collateral":
            # it left that line and reached the collective after its peers had timed out there
            sig = ctx.taxonomy.get("rank-outlasted-collective-timeout")
        return sig, sig.failure_class, [f"rank {ev.rank} outside any collective at {at_stall} when its peers had "
                                        "waited past the stall threshold (the stall snapshot)"]  # fmt: skip
    line = (f"rank {ev.rank} alive, main thread at {frame}" if frame else
            f"rank {ev.rank} reported no error of its own while its peers timed out (no stack was taken)")  # fmt: skip
    return sig, sig.failure_class, [line]


def _what(
    initiating: RankFinding,
    ev: RankEvidence,
    sig: Signature | None,
    cls: str,
    naming: tuple[Signature, str] | None,
    at_stall: str | None = None,
) -> str:
    """What the rank did, as a summary's verb phrase: ``raised ValueError: ...``, ``was stuck outside ...``."""
    exc = initiating.exception
    if naming is not None:
        return f"is named by its peers: {sig.title if sig else cls}"
    if sig is not None and sig.id == "rank-outlasted-collective-timeout":
        return "was busy outside any collective"
    if cls == "hang" and ev.stack is None and at_stall is not None:
        return "was stuck outside any collective"
    if cls == "hang" and ev.stack is None:
        return "never reached the collective its peers waited in (it reported no error of its own)"
    if cls == "collective_desync" and sig is not None and sig.id == "ddp-unfinished-reduction":
        what = "skipped parameters in its forward (DDP's reduction of the previous step never finished)"
        m = _DDP_UNUSED.search(exc.message if exc else " ".join(initiating.lines))
        return what + (f": {m['p'].strip()[:200]}" if m else "")
    if cls == "killed" and exc is not None and exc.type.endswith("KeyboardInterrupt"):
        return "was interrupted (SIGINT, KeyboardInterrupt) from outside the job"
    last = exc.last_line.splitlines()[0] if exc is not None and exc.last_line else None
    kernel = ev.kernel
    if cls == "host_oom" and kernel is not None and kernel.proven:
        return f"was killed by the kernel's OOM killer (proven: {kernel.line})"
    if cls == "killed" and ev.signal == "SIGKILL" and kernel is not None and kernel.looked_at:
        return (f"was killed by SIGKILL from outside the job; not proven an OOM kill ("
                f"{'; '.join(kernel.looked_at)})")  # fmt: skip
    return {
        "python_exception": f"raised {last}" if last else "raised an exception",
        "host_oom": "ran out of host memory" + (f" ({exc.type})" if exc else ""),
        "segfault": f"died by {ev.signal or 'a fatal signal'} in native code",
        "abort": f"aborted ({ev.signal or 'SIGABRT'})",
        "killed": f"was killed by {ev.signal or 'a signal'} from outside the job",
        "silent_exit": f"exited with status {ev.exit_code} without a traceback",
        "hang": "was stuck outside any collective",
        "rendezvous_timeout": "never joined the process group its peers waited for",
    }.get(cls, f"failed ({sig.title if sig else cls})")


def _where(initiating: RankFinding, ev: RankEvidence, cls: str, at_stall: str | None = None) -> str | None:
    """The line of the rank's own code: its exception's (the user's frame first), or its stack's for a hang
    (the one taken at the stall when there is no later one)."""
    exc = initiating.exception
    loc = exc.location() if exc is not None and initiating.own else None
    if exc is not None and initiating.own and (user := exc.user_location()):
        loc = user
    if cls in ("hang", "rendezvous_timeout") and ev.stack is not None and ev.stack.user_frame() is not None:
        loc = str(ev.stack.user_frame())
    elif cls == "hang" and ev.stack is None and at_stall is not None and not at_stall.startswith("an unknown"):
        loc = at_stall
    return loc


def _summary(
    ctx: Context,
    initiating: RankFinding,
    ev: RankEvidence,
    sig: Signature | None,
    cls: str,
    naming: tuple[Signature, str] | None,
    roles: dict[int, Role],
    reason: str,
    at_stall: str | None = None,
) -> str:
    """The sentence a person reads first: the rank, what it did and where, then what its peers did."""
    exc = initiating.exception
    loc = _where(initiating, ev, cls, at_stall)
    what = _what(initiating, ev, sig, cls, naming, at_stall)
    summary = f"Rank {ev.rank}{on_node(ev)} {what}" + (f" at {loc}" if loc else "")
    if exc is not None and exc.thread and initiating.own:
        summary += f" in thread {exc.thread!r}"
    if cls == "hang" and ev.stack is not None:
        summary += ", while its peers waited."
    elif sig is not None and sig.id == "rank-outlasted-collective-timeout":
        summary += (
            ", while its peers waited in the next collective (seen there by the stall snapshot); it reached "
            "the collective only after their timeout had expired, and failed there on the lost peers."
        )
    elif cls == "hang" and at_stall is not None:
        summary += ", while its peers waited (seen there by the stall snapshot, before any teardown)."
    else:
        summary += "."
    stall = ctx.evidence.stall
    if cls == "hang" and stall is not None and (blocked := blocked_text(stall, ev.rank)) is not None:
        summary += f" At the stall snapshot {blocked}."
    if initiating.own and initiating.printed and initiating.time is not None:
        lead = _lead(ctx, initiating)
        if initiating.state == "alive":
            summary += (f" It printed the error{f' {lead}' if lead else ''} and was still alive (cleaning up, or "
                        "stuck after it) when the launcher stopped it.")  # fmt: skip
        elif lead:
            summary += f" It printed the error {lead}, then exited only later."
    collateral_ranks = sorted(r for r, role in roles.items() if role == "collateral")
    if collateral_ranks and ctx.evidence.hang is not None and not initiating.own:
        summary += (
            f" {ranks_phrase(collateral_ranks)} waited for it inside a collective and {were(collateral_ranks)} stopped."
        )
    elif collateral_ranks:
        summary += f" {ranks_phrase(collateral_ranks)} then failed waiting for it."
    stopped = sorted(r for r, role in roles.items() if role == "stopped")
    if stopped:
        summary += f" {ranks_phrase(stopped)} {were(stopped)} stopped by the launcher."
    other_own = [f.rank for f in ctx.own if f.rank != initiating.rank]
    if other_own:
        their = "its" if len(other_own) == 1 else "their"
        summary += f" {ranks_phrase(other_own)} also failed on {their} own, later."
    if reason and cls != "hang" and reason != "failed first on its own":
        summary += f" (Rank {ev.rank} {reason}.)"
    return summary


def _lead(ctx: Context, initiating: RankFinding) -> str:
    """``14.2 s before its peers failed``: how far ahead of the others its printed error was."""
    others = [f.time for f in ctx.findings.values() if f.rank != initiating.rank and f.state == "failed" and f.time]
    if not others or initiating.time is None:
        return ""
    ahead = min(others) - initiating.time
    return f"{ahead:.1f} s before the first of its peers failed" if ahead > 0.05 else ""


def divergence_json(divergence: Divergence, evidence: AttemptEvidence) -> dict[str, object]:
    where = {ev.rank: ev.location() for ev in evidence.ranks}
    return {
        "kind": divergence.kind,
        "process_group": divergence.group,
        "seq": divergence.seq,
        "ranks": list(divergence.ranks),
        "sides": {str(r): v for r, v in divergence.sides.items()},
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


def schedule_verdict(ctx: Context, divergence: Divergence | None, rank: int) -> Diagnosis:
    """The ranks' collective schedules part: from the flight recorders (``divergence``), or from where
    each rank's code was (``divergence`` None)."""
    evidence, findings, tax = ctx.evidence, ctx.findings, ctx.taxonomy
    ev = ctx.ev(rank)
    mismatch = divergence is not None and divergence.kind == "mismatch"
    sig = tax.get("collective-mismatch") if mismatch else tax.get("collective-schedule-diverged")
    cls = "collective_mismatch" if mismatch else "collective_desync"
    roles = roles_around(rank, findings)
    loc = ev.location()
    if divergence is not None:
        others = sorted(r for r in divergence.sides if r != rank)
        theirs = next((divergence.sides[r] for r in others), "?")
        what = "the same collective with other sizes, dtypes or op" if mismatch else "a different collective"
        summary = (
            f"Rank {rank}{on_node(ev)} issued {what} than its peers at collective #{divergence.seq} of process group "
            f"{divergence.group}: {divergence.sides[rank]} against {theirs} on ranks {format_ranks(others)}"
        )
        lines = [
            f"elastic_diag: collective schedules part at process group {divergence.group}, collective "
            f"#{divergence.seq}: the ranks did not join the same collective",
            *(f"rank {r}: #{divergence.seq} {side}" for r, side in sorted(divergence.sides.items())),
        ]
    else:
        summary = (
            f"Rank {rank}{on_node(ev)} was at another place in the code than all its peers when their collectives "
            "failed: its collective schedule parted from theirs"
        )
        if ev.flight_record is None:
            died = f", it died by {ev.signal}" if ev.signal else ""
            summary += f" (rank {rank} left no flight-recorder record{died})"
        lines = ["elastic_diag: collective schedules part: the ranks did not join the same collective"]
    summary += f"; rank {rank} was at {loc}." if loc else "."
    collateral = sorted(r for r, role in roles.items() if role == "collateral")
    if collateral:
        summary += f" {ranks_phrase(collateral)} then failed in the collectives that no longer matched."
    lines.extend(_locations_lines(evidence, rank))
    for f in findings.values():
        if f.rank != rank and f.state == "failed" and f.lines:
            lines.append(f"rank {f.rank}: {f.lines[0]}")
            break
    if evidence.hang is not None:
        lines.append(_hang_line(evidence.hang))
    collective = divergence_json(divergence, evidence) if divergence is not None else None
    return named_verdict(sig, cls, ev, summary, lines, roles, collective=collective)

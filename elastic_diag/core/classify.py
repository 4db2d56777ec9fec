"""Classification: evidence in, :class:`~elastic_diag.core.verdict.Diagnosis` out. Pure: no torch, no I/O, no clock.

:func:`classify_attempt` is :func:`~elastic_diag.core.attribution.judge`: the steps that complete the
evidence, the votes, the ordered rules, the refinements and the suspect (docs/attribution.md). When the
evidence cannot name a rank, ``initiating_rank`` is None and the summary says why. Also here: the
stragglers of a run (warnings, not failures) and the verdict on a launch that failed outside the workers.
"""

from __future__ import annotations

import statistics

from elastic_diag.core.attribution import judge
from elastic_diag.core.context import Vote
from elastic_diag.core.evidence import AttemptEvidence
from elastic_diag.core.flight_recorder import lateness_samples
from elastic_diag.core.taxonomy import Signature, Taxonomy, load_taxonomy
from elastic_diag.core.verdict import Diagnosis

__all__ = ["classify_attempt", "classify_launch_error", "straggler_warnings"]


def classify_attempt(
    evidence: AttemptEvidence, taxonomy: Taxonomy | None = None, extra_votes: list[Vote] | None = None
) -> Diagnosis:
    """Attribute one attempt: the initiating rank (or the suspect), its class, every rank's role, and the rule
    that decided. ``extra_votes`` are (rank, signature, explanation) from checks a caller made across ranks."""
    return judge(evidence, taxonomy, extra_votes)


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

"""The offline verdict, as a function of what the logs showed (:class:`~elastic_diag.offline.records.LogFacts`):
torchrun's failure summary and DeepSpeed's exit lines give ranks their exit codes, pids and nodes; lines
known only by a pid go to their ranks; the watchdog's own fields (SeqNum, OpType) vote for a rank whose
timed-out collective differs from its peers'; then :func:`~elastic_diag.core.classify.classify_attempt`,
the live agent's classifier, decides. Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import re
import signal

from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.evidence import AttemptEvidence, ExceptionRecord, RankEvidence, parse_stack_dump
from elastic_diag.core.log_lines import SummaryFailure
from elastic_diag.core.taxonomy import Signature, Taxonomy
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.offline.records import EXC_LINE, MAX_FAILURE_LINES, Analysis, Hit, LogFacts, RankLog, distinct

_WATCHDOG = re.compile(r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)")


def reconcile(facts: LogFacts, taxonomy: Taxonomy) -> Analysis:
    """The verdict from what the logs showed: torchrun's summary and DeepSpeed's exits applied to the
    ranks, the lines known by pid given to their ranks, then the live agent's classifier. Pure (no I/O);
    it completes ``facts`` in place, which are the reconciler's from then on. The context lines around
    the decisive one are the reader's to add (they are read from the file)."""
    failures = facts.summary_failures
    root = next((f.rank for f in failures if f.root), None)
    for f in failures:
        if f.pid is not None and f.rank is not None:
            facts.pids.setdefault(f.pid, f.rank)
    for pid, hit in facts.pid_hits:
        if pid in facts.pids:
            facts.rank(facts.pids[pid]).hits.append(hit)
        else:
            facts.unranked.append(hit)
    _apply_summary(facts, failures)
    evidence = _evidence(facts)
    if not facts.ranks and facts.unranked:
        diagnosis = _unranked_diagnosis(facts.unranked)
    elif not any(r.failed for r in evidence.ranks) and not facts.unranked and not facts.flight_records:
        diagnosis = _no_rank_failed(facts)
    else:
        diagnosis = classify_attempt(evidence, taxonomy, extra_votes=_schedule_votes(facts, taxonomy))
        if diagnosis.failure_class == "healthy":
            diagnosis = _no_rank_failed(facts)
    decisive = _decisive(facts, diagnosis)
    seen = diagnosis.failure_class != "healthy" and (diagnosis.failure_class != "unknown" or bool(facts.failure_lines)
                                                     or any(r.failed for r in evidence.ranks))  # fmt: skip
    return Analysis(diagnosis=diagnosis, ranks=facts.ranks, files=facts.files, skipped=facts.skipped,
                    context=[], torchrun_root=root, decisive=decisive, failure_seen=seen)  # fmt: skip


def _apply_summary(facts: LogFacts, failures: list[SummaryFailure]) -> None:
    for f in failures:
        if f.rank is None:
            continue
        log = facts.rank(f.rank)
        log.exit_code = f.exit_code
        log.pid = f.pid
        if f.host and log.node is None:
            log.node = f.host
        if log.time is None:
            log.time = f.time
        if f.traceback and log.exception is None:
            for line in reversed(f.traceback):
                m = EXC_LINE.match(line.strip())
                if m:
                    log.exception = ExceptionRecord(type=m["type"], message=m["msg"] or "",
                                                    traceback="\n".join(f.traceback), time=f.time)  # fmt: skip
                    break
    for host, local, code in facts.ds_exits:
        ranks = facts.ds_mapping.get(host or "", [])
        if local < len(ranks):
            log = facts.rank(ranks[local])
            log.node = log.node or host
            if log.exit_code is None or code not in (0, 1):
                log.exit_code = code
    sigtermed_unknown = facts.sigtermed - set(facts.pids)
    if failures and not sigtermed_unknown:
        listed = {f.rank for f in failures}
        for log in facts.ranks.values():
            if log.rank not in listed and log.exit_code is None and not log.hits and log.exception is None:
                log.exit_code = 0  # torchrun lists every rank it did not see exit 0
    if not failures:
        # no summary: torch's "failed (exitcode: N) local_rank: R (pid: P)" lines (local rank = rank
        # for a single node), the first failure torch saw on that node
        for code, local, pid in facts.failed_lines:
            log = facts.rank(local)
            if log.exit_code is None:
                log.exit_code, log.pid = code, pid
    self_failed = any(f.exit_code not in (-15, -9, None) for f in failures)
    for f in failures:
        if f.rank is not None and f.exit_code in (-15,) and self_failed:
            facts.rank(f.rank).stopped = True


def _evidence(facts: LogFacts) -> AttemptEvidence:
    ranks = []
    for r in sorted(facts.ranks.values(), key=lambda r: r.rank):
        lines = [h.text for h in distinct(r.hits)]
        has_error = bool(r.hits) or r.exception is not None
        own = r.exception is not None or any(h.signature.role_hint != "collateral" for h in r.hits)
        stopped = r.stopped and not own  # SIGTERMed after its own failure: it was dying, not stopped
        exit_code = r.exit_code
        if exit_code is None and has_error:
            sig_hit = next((h for h in r.hits if h.signature.signals), None)
            exit_code = _exit_for(sig_hit.signature) if sig_hit else 1
        ranks.append(
            RankEvidence(
                rank=r.rank,
                local_rank=r.rank,
                node=r.node or "",
                pid=r.pid,
                exit_code=exit_code,
                exit_time=r.time if r.time is not None else _first_order(r),
                alive_at_decision=stopped,
                stopped_by_agent=stopped,
                exception=r.exception,
                stderr_tail=tuple(lines),
                stack=parse_stack_dump(r.stack) if r.stack else None,
                flight_record=facts.flight_records.get(r.rank),
            )
        )
    return AttemptEvidence(attempt=0, ranks=tuple(ranks))


def _schedule_votes(facts: LogFacts, taxonomy: Taxonomy) -> list[tuple[int, Signature, str]]:
    """Ranks whose timed-out collective differs from everyone else's at the same SeqNum."""
    seen: dict[int, tuple[int, str]] = {}
    for r in facts.ranks.values():
        for h in r.hits:
            m = _WATCHDOG.search(h.text)
            if m:
                seen.setdefault(r.rank, (int(m["seq"]), m["op"]))
                break
    if len(seen) < 3:
        return []
    by_seq: dict[int, dict[str, list[int]]] = {}
    for rank, (seq, op) in seen.items():
        by_seq.setdefault(seq, {}).setdefault(op, []).append(rank)
    votes = []
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


def _decisive(facts: LogFacts, diagnosis: Diagnosis) -> Hit | None:
    r = diagnosis.initiating_rank
    if r is None or r not in facts.ranks:
        return None
    log = facts.ranks[r]
    wanted = diagnosis.signature_id
    for h in log.hits:
        if h.signature.id == wanted:
            return h
    return log.exception_hit or (log.hits[0] if log.hits else None)


def _exit_for(sig: Signature) -> int:
    return -int(getattr(signal, sig.signals[0], signal.SIGTERM))


def _first_order(r: RankLog) -> float | None:
    hits = ([r.exception_hit] if r.exception_hit else []) + r.hits
    return float(min(h.order for h in hits)) if hits else None


def _unranked_diagnosis(hits: list[Hit]) -> Diagnosis:
    best = max(hits, key=lambda h: h.signature.priority)
    sig = best.signature
    return Diagnosis(
        failure_class=sig.failure_class,
        signature_id=sig.id,
        summary=f"{sig.title}; no line names a rank, so the initiating rank cannot be told ({best.text[:200]}).",
        evidence=(best.text,),
        fix=sig.fix,
        verify=sig.verify,
        retryable=sig.retryable,
    )


def _no_rank_failed(facts: LogFacts) -> Diagnosis:
    """No rank can be seen failing. ``healthy`` only when the logs say the run ended well and nothing in
    them shows a failure; a failure seen in lines no rule could use is ``unknown``, with those lines."""
    if facts.failure_lines:
        lines = tuple(facts.failure_lines[:MAX_FAILURE_LINES])
        return Diagnosis(
            failure_class="unknown",
            summary=(
                f"The logs show a failure ({lines[0][:200]}), but no rank can be named: no line of it says "
                "which rank failed or when, and no rank's own error is in these files. Add every rank's output "
                "(torchrun --tee 3, or the --log-dir folder) to tell the rank that failed first."
            ),
            evidence=lines,
            roles={r: "unknown" for r in facts.ranks},
        )
    if not facts.completion_lines:
        return Diagnosis(
            failure_class="unknown",
            summary=(
                "No rank reported an error in these logs, but nothing in them says the run ended well either "
                "(no completion line from torchrun's agent, the launcher or the training loop): the logs may "
                "be cut, or the job may still be running."
            ),
            roles={r: "unknown" for r in facts.ranks},
        )
    return Diagnosis(
        failure_class="healthy",
        summary=f"No rank reported an error in these logs, and the run ended well ({facts.completion_lines[0][:200]}).",
        evidence=tuple(facts.completion_lines[:2]),
        roles={r: "healthy" for r in facts.ranks},
    )

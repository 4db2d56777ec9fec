"""The offline verdict, as a function of what the logs showed (:class:`~elastic_diag.offline.records.LogFacts`):
torchrun's failure summary and DeepSpeed's exit lines give ranks their exit codes, pids and nodes; lines
known only by a pid go to their ranks; the watchdog's own fields (SeqNum, OpType) vote for a rank whose
timed-out collective differs from its peers'; then :func:`~elastic_diag.core.classify.classify_attempt`,
the live agent's classifier, decides. Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import re
import signal
from dataclasses import replace

from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.evidence import AttemptEvidence, ExceptionRecord, RankEvidence, parse_stack_dump
from elastic_diag.core.log_lines import FingerprintReport, SummaryFailure, parse_fingerprint_report
from elastic_diag.core.naming import unattributed
from elastic_diag.core.taxonomy import Signature, Taxonomy
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.offline.records import EXC_LINE, MAX_FAILURE_LINES, Analysis, Hit, LogFacts, RankLog, distinct

# the op must be followed by its comma or parenthesis: a line a terminal cut may end inside it
_WATCHDOG = re.compile(r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)(?:[,)]|$)(?: NumelIn=(?P<numel>\d+),)?")


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
    _watchdog_aborts(facts, taxonomy)
    named = _named_in_unranked_lines(facts, taxonomy)
    for r in {r for r, _sig, _line in named} | _named_in_ranked_lines(facts, taxonomy):
        facts.rank(r)  # a rank only its peers' lines speak of (it printed nothing, or its output is not here)
    evidence = _evidence(facts)
    if not facts.ranks and facts.unranked:
        diagnosis = _unranked_diagnosis(facts.unranked)
    elif not any(r.failed for r in evidence.ranks) and not facts.unranked and not facts.flight_records:
        diagnosis = _no_rank_failed(facts)
    else:
        votes = _schedule_votes(facts, taxonomy) + _seq_votes(facts, taxonomy) + named
        diagnosis = classify_attempt(evidence, taxonomy, extra_votes=votes)
        if diagnosis.failure_class == "healthy":
            diagnosis = _no_rank_failed(facts)
        elif diagnosis.failure_class == "collective_timeout" and diagnosis.initiating_rank is None:
            diagnosis = _schedules_part(facts, taxonomy) or diagnosis
    if diagnosis.failure_class == "hang" and diagnosis.initiating_rank is not None:
        diagnosis = _stuck_together(facts, taxonomy) or diagnosis
    if diagnosis.failure_class in _FINGERPRINT_OVERRIDES:
        diagnosis = _fingerprints(facts, taxonomy, diagnosis) or diagnosis
    if diagnosis.initiating_rank is None and diagnosis.failure_class in _WAITING_CLASSES:
        diagnosis = _with_suspect(facts, diagnosis)
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
    for rank, code in facts.launcher_exits:
        log = facts.rank(rank)
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
    seen = {r: (seq, op) for r, (seq, op, _) in _watchdog_fields(facts).items()}
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


def _watchdog_fields(facts: LogFacts) -> dict[int, tuple[int, str, int | None]]:
    """Per rank, the collective its watchdog timed out in: (SeqNum, OpType, NumelIn)."""
    seen: dict[int, tuple[int, str, int | None]] = {}
    for r in facts.ranks.values():
        for h in r.hits:
            m = _WATCHDOG.search(h.text)
            if m:
                seen.setdefault(r.rank, (int(m["seq"]), m["op"], int(m["numel"]) if m["numel"] else None))
                break
    return seen


def _one_collective_each(facts: LogFacts) -> dict[int, tuple[int, str, int | None]]:
    """Per rank, the collective its watchdog timed out in, for ranks whose every watchdog line names the
    same SeqNum (a rank with several timed-out SeqNums waits in several process groups: not comparable)."""
    seqs: dict[int, set[int]] = {}
    for r in facts.ranks.values():
        for h in r.hits:
            m = _WATCHDOG.search(h.text)
            if m:
                seqs.setdefault(r.rank, set()).add(int(m["seq"]))
    first = _watchdog_fields(facts)
    return {r: first[r] for r, found in seqs.items() if len(found) == 1 and r in first}


def _seq_votes(facts: LogFacts, taxonomy: Taxonomy) -> list[tuple[int, Signature, str]]:
    """One rank whose watchdog timed out at another SeqNum (ahead or behind) than the rest, when the rest
    agree on one collective and are more than half of the ranks (the world is at least the highest rank
    seen plus one): that rank left the schedule its peers follow."""
    seen = _one_collective_each(facts)
    if len(seen) < 3 or len({seq for seq, _, _ in seen.values()}) < 2:
        return []
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, (seq, op, _) in seen.items():
        groups.setdefault((seq, op), []).append(rank)
    (seq, op), agree = max(groups.items(), key=lambda kv: len(kv[1]))
    others = sorted(r for r in seen if r not in agree)
    world = max(facts.ranks) + 1
    if len(others) != 1 or 2 * len(agree) <= world:
        return []
    rank = others[0]
    theirs = seen[rank]
    where = "behind" if theirs[0] < seq else "ahead of"
    line = (f"rank {rank} timed out in {theirs[1]} #{theirs[0]}, {where} ranks {sorted(agree)} that all timed out "
            f"in {op} #{seq}: the collective schedules diverged")  # fmt: skip
    return [(rank, taxonomy.get("nccl-desync-report"), line)]


def _odd_one_out(seen: dict[int, tuple[int, str, int | None]]) -> tuple[int, str] | None:
    """The single rank whose collective differs from the one all the others agree on (at least two)."""
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, (seq, op, _) in seen.items():
        groups.setdefault((seq, op), []).append(rank)
    if len(groups) != 2:
        return None
    (key_a, a), (key_b, b) = sorted(groups.items(), key=lambda kv: len(kv[1]))
    if len(a) != 1 or len(b) < 2:
        return None
    reason = (f"rank {a[0]} alone timed out in {key_a[1]} #{key_a[0]} while ranks {sorted(b)} agree "
              f"on {key_b[1]} #{key_b[0]}; not proven: ranks whose lines are missing could side with it")  # fmt: skip
    return a[0], reason


_WAITING_CLASSES = ("collective_timeout", "collective_desync", "collective_mismatch", "hang")


def _with_suspect(facts: LogFacts, diagnosis: Diagnosis) -> Diagnosis:
    """A rank that stands out although none is proven (``suspected_rank``, additive): the odd one out of
    a desync with no majority, or the only rank missing among the ranks that waited."""
    seen = _one_collective_each(facts)
    odd = _odd_one_out(seen) if len(seen) >= 3 else None
    if odd is None:
        odd = _only_silent_rank(facts)
    if odd is None:
        odd = _rank_zero_path(facts, seen)
    if odd is None:
        return diagnosis
    rank, reason = odd
    return replace(diagnosis, suspected_rank=rank, suspected_reason=reason,
                   summary=f"{diagnosis.summary} Suspected, not proven: rank {rank} ({reason}).")  # fmt: skip


def _only_silent_rank(facts: LogFacts) -> tuple[int, str] | None:
    """Every rank from 0 to the highest seen waited in a collective except one that printed nothing at
    all: it is the natural suspect (it may never have reached the collective), but its output may also
    simply be missing from these logs."""
    waited = sorted(r for r, log in facts.ranks.items() if any(_waits(h) for h in log.hits))
    if len(waited) < 2:
        return None
    quiet = [r for r in range(max(waited) + 1) if r not in waited]
    if len(quiet) != 1:
        return None
    rank = quiet[0]
    log = facts.ranks.get(rank)
    if log is not None and (log.hits or log.exception is not None or log.exit_code not in (None, 0)):
        return None
    reason = (f"ranks {', '.join(map(str, waited))} timed out waiting in a collective and rank {rank} is the only "
              "rank among them that reported nothing: it may never have reached that collective, or its output "
              "is not in these logs")  # fmt: skip
    return rank, reason


CONTROL_NUMEL = 1024  # a collective this small carries a flag, a metric, a path: not gradients


def _rank_zero_path(facts: LogFacts, seen: dict[int, tuple[int, str, int | None]]) -> tuple[int, str] | None:
    """Every rank that timed out waits in the same collective, rank 0 is not among them, and either the
    collective is a BROADCAST (whose root is rank 0 in nearly every framework) or it is a small one right
    after a phase that frameworks run on rank 0 alone (a line "Saving checkpoint ...", "Evaluating" from
    rank 0 or from a logger with no rank prefix): rank 0 was most likely still in that path."""
    if not seen or 0 in seen or len({(seq, op) for seq, op, _ in seen.values()}) != 1:
        return None
    log0 = facts.ranks.get(0)
    if log0 is not None and (log0.hits or log0.exception is not None):
        return None
    seq, op, _ = next(iter(seen.values()))
    waiters = ", ".join(map(str, sorted(seen)))
    if op == "BROADCAST" and len(seen) >= 2:
        return 0, (f"ranks {waiters} timed out in BROADCAST #{seq}, whose root is rank 0 in nearly every "
                   "framework (sending a flag, a path, generated samples), and rank 0 reported no timeout")  # fmt: skip
    if any(numel is None or numel > CONTROL_NUMEL for _, _, numel in seen.values()):
        return None
    first = min((h.order for r in seen for h in facts.ranks[r].hits if _WATCHDOG.search(h.text)), default=None)
    before = [(rank, text) for rank, order, text in facts.phase_lines if first is not None and order < first]
    if not before or before[-1][0] not in (None, 0):
        return None
    who = "rank" if len(seen) == 1 else "ranks"
    phase = before[-1][1][:120]
    return 0, (f"{who} {waiters} timed out in a {op} of at most {CONTROL_NUMEL} elements (#{seq}) right after "
               f'"{phase}", a phase frameworks run on rank 0 alone; rank 0 reported no timeout')  # fmt: skip


def _waits(h: Hit) -> bool:
    return h.signature.failure_class == "collective_timeout" and h.signature.role_hint == "collateral"


def _schedules_part(facts: LogFacts, taxonomy: Taxonomy) -> Diagnosis | None:
    """Every rank only waited, and their watchdogs disagree on the collective they waited in: another op
    (or other sizes) at the same SeqNum. No majority names a rank (a majority would have:
    :func:`_schedule_votes`), so both sides are said and no rank is named."""
    seen = _watchdog_fields(facts)
    one_each = _one_collective_each(facts)
    # different SeqNums are compared only when every rank timed out in one collective: a rank with
    # several waits in several process groups (the old watchdog line does not say which), whose
    # counters run apart
    if len(seen) >= 2 and len(one_each) == len(seen) and len({seq for seq, _, _ in seen.values()}) > 1:
        return _seqs_part(one_each, facts, taxonomy)
    if len(seen) < 2 or len({seq for seq, _, _ in seen.values()}) != 1:
        return None
    if len({(op, numel) for _, op, numel in seen.values()}) < 2:
        return None
    seq = next(iter(seen.values()))[0]
    sides = [f"rank {r}: #{seq} {op}" + (f" ({numel} elements)" if numel is not None else "")
             for r, (seq, op, numel) in sorted(seen.items())]  # fmt: skip
    same_op = len({op for _, op, _ in seen.values()}) == 1
    cls = "collective_mismatch" if same_op else "collective_desync"
    what = "the same collective with other sizes" if same_op else "different collectives"
    sig = taxonomy.get("collective-mismatch" if same_op else "collective-schedule-diverged")
    summary = (
        f"The ranks' watchdogs disagree on the collective they waited in: at collective #{seq} they issued "
        f"{what} ({'; '.join(sides[:6])}). The collective schedules parted, but no majority tells which side "
        "left the schedule, so no rank is named: compare the code paths of the two sides at that point (a "
        "collective on one rank's path only: a checkpoint save, an evaluation, an epoch's end)."
    )
    return unattributed(sig, cls, summary, tuple(sides), {r: "unknown" for r in facts.ranks})


# what a verdict may say before the DETAIL check's own reports are read: they tell better
_FINGERPRINT_OVERRIDES = ("collective_mismatch", "collective_desync", "collective_timeout", "hang", "silent_exit",
                          "unknown", "python_exception", "abort")  # fmt: skip


def _fingerprint_reports(facts: LogFacts) -> list[FingerprintReport]:
    texts = [h.text for r in facts.ranks.values() for h in r.hits] + [h.text for h in facts.unranked]
    texts += [r.exception.message for r in facts.ranks.values() if r.exception is not None]
    reports = (parse_fingerprint_report(t) for t in texts if "CollectiveFingerPrint" in t)
    return list(dict.fromkeys(r for r in reports if r is not None))


def _fingerprints(facts: LogFacts, taxonomy: Taxonomy, diagnosis: Diagnosis) -> Diagnosis | None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL's reports ("Rank 4 is running collective: CollectiveFingerPrint(
    SequenceNumber=101, OpType=ALLGATHER ...), but Rank 7 is running ... SequenceNumber=0, OpType=REDUCE"):
    another op on the two sides is a desync, the same op (other sequence numbers or sizes) a mismatch.
    The rank is the one behind all the others (the lowest sequence number, alone), else the one that
    two or more reporting ranks all name; else no rank (two ranks that name each other)."""
    reports = _fingerprint_reports(facts)
    if not reports:
        return None
    seq: dict[int, int] = {}
    ops: dict[int, str] = {}
    for rep in reports:
        for rank, s, op in ((rep.rank, rep.seq, rep.op), (rep.other, rep.other_seq, rep.other_op)):
            if rank is not None and s is not None:
                seq.setdefault(rank, s)
            if rank is not None and op is not None:
                ops.setdefault(rank, op)
    desync = any(r.other_op is not None and r.op != r.other_op for r in reports) or any(
        r.other is None
        for r in reports  # torch 1.x "running inconsistent collective": one side only
    )
    cls = "collective_desync" if desync else "collective_mismatch"
    sig = taxonomy.get("collective-schedule-diverged" if desync else "collective-mismatch")
    culprit, why = None, ""
    lowest = min(seq.values()) if len(seq) >= 2 else None
    behind = [r for r, s in seq.items() if s == lowest]
    if lowest is not None and len(behind) == 1:
        culprit = behind[0]
        why = (f"rank {culprit} is at collective #{lowest} while ranks {sorted(r for r in seq if r != culprit)} are "
               f"at #{max(seq.values())}: it is behind them")  # fmt: skip
    else:
        named = {r.other for r in reports if r.other is not None}
        reporters = {r.rank for r in reports}
        if len(named) == 1 and len(reporters) >= 2 and not named & reporters:
            culprit = next(iter(named))
            why = f"ranks {sorted(reporters)} all found their collective differs from rank {culprit}'s"
    sides = [f"rank {r}: " + (f"#{seq[r]} " if r in seq else "") + ops.get(r, "?") for r in sorted(set(seq) | set(ops))]
    if culprit is None:
        summary = (
            "TORCH_DISTRIBUTED_DEBUG=DETAIL found the ranks calling different collectives ("
            + "; ".join(sides[:6])
            + "), but the reports do not tell which side left the schedule (the ranks name each other), so no "
            "rank is named: compare the code paths of the sides at that point (a collective on one rank's path "
            "only: a checkpoint save, an evaluation, a data-dependent branch)."
        )
        return unattributed(sig, cls, summary, tuple(r for r in sides), {r: "unknown" for r in facts.ranks})
    line = f"TORCH_DISTRIBUTED_DEBUG=DETAIL: {why} (" + "; ".join(sides[:6]) + ")"
    if diagnosis.initiating_rank == culprit and diagnosis.failure_class == cls:
        return diagnosis
    facts.rank(culprit)
    votes = [(culprit, sig, line)]
    named_verdict = classify_attempt(_evidence(facts), taxonomy, extra_votes=votes)
    if named_verdict.initiating_rank != culprit:
        return None
    return replace(named_verdict, failure_class=cls, signature_id=sig.id, fix=sig.fix, verify=sig.verify)


_GLOG_CLOCK = re.compile(r"\b[EWIF]\d{4} (?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?)\b")
TOGETHER_S = 5.0  # heartbeat monitors that fired this close fired together


def _stuck_together(facts: LogFacts, taxonomy: Taxonomy) -> Diagnosis | None:
    """Two or more ranks whose ProcessGroupNCCL watchdogs got stuck at the same moment (the heartbeat
    monitor's report, within a few seconds): the whole job stalled together, and which rank was first
    is not in the logs. No rank is named."""
    stuck: dict[int, float | None] = {}
    for r in facts.ranks.values():
        for h in r.hits:
            if h.signature.id == "nccl-heartbeat-stuck":
                m = _GLOG_CLOCK.search(h.text)
                stuck[r.rank] = 3600 * int(m["h"]) + 60 * int(m["m"]) + float(m["s"]) if m else None
                break
    if len(stuck) < 2:
        return None
    clocks = [c for c in stuck.values() if c is not None]
    if clocks and (len(clocks) < len(stuck) or max(clocks) - min(clocks) > TOGETHER_S):
        return None
    ranks = sorted(stuck)
    sig = taxonomy.get("nccl-heartbeat-stuck")
    summary = (
        f"The NCCL watchdogs of ranks {', '.join(map(str, ranks))} got stuck at the same moment (the heartbeat "
        "monitor's report, then the abort: exit -6): the whole job stalled together, and these logs do not "
        "show which rank stopped first (no collective timed out, no rank failed differently). No rank is "
        "named: take the stacks of every rank while it hangs (py-spy dump, or the flight recorder with "
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1) to see where each one is."
    )
    lines = tuple(next(h.text for h in facts.ranks[r].hits if h.signature.id == sig.id) for r in ranks)
    return unattributed(sig, "hang", summary, lines, {r: "unknown" for r in facts.ranks})


def _seqs_part(seen: dict[int, tuple[int, str, int | None]], facts: LogFacts, taxonomy: Taxonomy) -> Diagnosis:
    """The ranks' watchdogs timed out in collectives with different SeqNums (one each) and no majority of
    the ranks agrees: the schedules parted, no rank is named, every side is said."""
    sides = [f"rank {r}: #{seq} {op}" + (f" ({numel} elements)" if numel is not None else "")
             for r, (seq, op, numel) in sorted(seen.items())]  # fmt: skip
    summary = (
        f"The ranks' watchdogs timed out in different collectives ({'; '.join(sides[:6])}): each rank waits "
        "at another point of the same schedule, so the collective schedules parted. No majority of the ranks "
        "agrees on one collective, so no rank is named: compare the code paths of the sides at that point (a "
        "collective on one rank's path only: a checkpoint save, an evaluation, a data-dependent branch)."
    )
    sig = taxonomy.get("collective-schedule-diverged")
    return unattributed(sig, "collective_desync", summary, tuple(sides), {r: "unknown" for r in facts.ranks})


def _named_in_unranked_lines(facts: LogFacts, taxonomy: Taxonomy) -> list[tuple[int, Signature, str]]:
    """Ranks named by lines that belong to no rank themselves (an indented line of NCCL's desync report,
    a report pasted without its prefixes): the same votes a ranked line would give."""
    votes: list[tuple[int, Signature, str]] = []
    for hit in facts.unranked:
        for sig, m in taxonomy.match_line(hit.text):
            peers = m.groupdict().get("peers")
            if peers and not sig.wraps:
                votes.extend((int(p), sig, hit.text) for p in peers.replace(" ", "").split(",") if p.isdigit())
    return votes


def _watchdog_aborts(facts: LogFacts, taxonomy: Taxonomy) -> None:
    """A rank known only by its SIGABRT exit (torchrun's summary: ``exitcode: -6``, no line of its own)
    while its peers' watchdogs timed out died of the same watchdog: NCCL aborts a rank whose collective
    timed out. It waited too; torchrun's "first observed failure" is then not the culprit."""

    def waits(h: Hit) -> bool:
        return h.signature.failure_class == "collective_timeout" and h.signature.role_hint == "collateral"

    timed_out = [r for r in facts.ranks.values() if any(waits(h) for h in r.hits)]
    timed_out_lines = [h for h in facts.unranked if waits(h)]
    if not timed_out and not timed_out_lines:
        return
    sig = taxonomy.get("nccl-watchdog-abort")
    for log in facts.ranks.values():
        if log.exit_code == -6 and not log.hits and log.exception is None:
            peers = max(1, len(timed_out))
            text = ("exit status -6 (SIGABRT) in the launcher's summary and no line of its own, while "
                    f"{peers} of its peers' watchdogs timed out: the NCCL watchdog's abort")  # fmt: skip
            log.hits.append(Hit(sig, text, -1, 0, 0))


def _named_in_ranked_lines(facts: LogFacts, taxonomy: Taxonomy) -> set[int]:
    """Ranks that a rank's own lines name (NCCL's desync report on rank 0 naming rank 7): they must be
    among the ranks for the peers' vote to count, even when nothing of their own is in the logs."""
    named: set[int] = set()
    for log in list(facts.ranks.values()):
        for hit in log.hits:
            for sig, m in taxonomy.match_line(hit.text):
                peers = m.groupdict().get("peers")
                if peers and not sig.wraps:
                    named.update(int(p) for p in peers.replace(" ", "").split(",") if p.isdigit())
    return named

"""Attribution: which rank failed first, and why. Every decision of the verdict is here, in the order it is
taken, the same for the live agent and for ``elastic-diag analyze`` (whatever the evidence came from):

1. :data:`STEPS` complete the evidence where no launcher watched the ranks (each rank's exit from the
   launchers' lines, the exits the logs never show, the ranks only their peers speak of); on live
   evidence they change nothing.
2. :data:`VOTES` are checks across ranks that no single line shows (the watchdogs' sequence numbers
   compared, a line with no rank naming one); with the ranks named by their peers' own lines, they are the
   votes :func:`~elastic_diag.core.attribution.named_by_peers` counts.
3. :data:`RULES`, tried in order: each takes the attempt's :class:`~elastic_diag.core.context.Context` (the
   evidence, every rank's :class:`~elastic_diag.core.findings.RankFinding`, the comparison of the flight
   recorders, the votes) and returns a :class:`~elastic_diag.core.verdict.Diagnosis` or None. The first that
   returns one decides, and the verdict names it (``Diagnosis.rule``).
4. :data:`REFINEMENTS` may replace that verdict where evidence of a kind the rules read as something else
   tells more (several NCCL watchdogs stuck at once; TORCH_DISTRIBUTED_DEBUG=DETAIL's reports); the verdict
   then names the refinement.
5. The suspect (:mod:`~elastic_diag.core.suspects`): a verdict that names no rank while the ranks only
   waited gives the rank that stands out, without proof, as ``suspected_rank``.

The order is the product's contract; docs/attribution.md is generated from these tuples and each
function's docstring (``python tools/attribution_doc.py``). How a decision becomes a Diagnosis (roles,
summary, decisive lines) is :mod:`elastic_diag.core.naming`. Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from elastic_diag.core.busy import busy_while_peers_waited, waited_for_main_process
from elastic_diag.core.calls import compare_calls
from elastic_diag.core.context import Context, Rule, Vote, build_context
from elastic_diag.core.evidence import AttemptEvidence
from elastic_diag.core.findings import RankFinding
from elastic_diag.core.fingerprints import detail_fingerprints
from elastic_diag.core.launcher_exits import (
    exits_from_launchers,
    exits_from_lines,
    named_ranks_exist,
    unranked_cause_of_the_one_failed,
    watchdog_aborts,
)
from elastic_diag.core.naming import (
    divergence_json,
    named_verdict,
    on_node,
    rank_verdict,
    roles_around,
    roles_of,
    schedule_verdict,
    unattributed,
    unnamed_lead,
)
from elastic_diag.core.suspects import with_suspect
from elastic_diag.core.taxonomy import Signature, Taxonomy, load_taxonomy
from elastic_diag.core.verdict import MAX_EVIDENCE_LINES, Diagnosis, Role, format_ranks, ranks_phrase, were
from elastic_diag.core.watchdogs import stuck_together, watchdog_out_of_step, watchdogs_disagree_on_op, watchdogs_part

NAN_TOGETHER_S = 30.0

Step = Callable[[AttemptEvidence, Taxonomy], AttemptEvidence]
VoteCheck = Callable[[AttemptEvidence, Taxonomy], list[Vote]]
Refinement = Callable[[Context, Diagnosis, Callable[[Context], Diagnosis]], Diagnosis | None]


def settle(evidence: AttemptEvidence, taxonomy: Taxonomy | None = None) -> AttemptEvidence:
    """The evidence after :data:`STEPS` (what the rules see; idempotent)."""
    tax = taxonomy or load_taxonomy()
    for step in STEPS:
        evidence = step(evidence, tax)
    return evidence


def judge(
    evidence: AttemptEvidence, taxonomy: Taxonomy | None = None, extra_votes: list[Vote] | None = None
) -> Diagnosis:
    """The verdict on one attempt: the steps, the votes, the first rule that decides, the refinements, the
    suspect. ``extra_votes``: (rank, signature, explanation) of checks a caller made across ranks."""
    tax = taxonomy or load_taxonomy()
    return judge_settled(settle(evidence, tax), tax, extra_votes)


def judge_settled(evidence: AttemptEvidence, taxonomy: Taxonomy, extra_votes: list[Vote] | None = None) -> Diagnosis:
    """:func:`judge` of evidence the steps have completed already (:func:`settle`)."""
    tax = taxonomy
    votes = [vote for check in VOTES for vote in check(evidence, tax)] + list(extra_votes or ())
    ctx = build_context(evidence, tax, votes)
    verdict = attribute(ctx)
    for refine in REFINEMENTS:
        better = refine(ctx, verdict, attribute)
        if better is not None:
            verdict = replace(better, rule=refine.__name__)
    return with_suspect(ctx, verdict)


def attribute(ctx: Context, rules: tuple[Rule, ...] | None = None) -> Diagnosis:
    """The verdict of the first rule that gives one, named in ``rule``."""
    for rule in rules or RULES:
        verdict = rule(ctx)
        if verdict is not None:
            return replace(verdict, rule=rule.__name__)
    raise AssertionError("no_rank_named always decides")  # pragma: no cover


def named_in_unranked_lines(evidence: AttemptEvidence, taxonomy: Taxonomy) -> list[Vote]:
    """Ranks named by lines that belong to no rank themselves (an indented line of NCCL's desync report, a
    report pasted without its prefixes): the same votes a rank's own line naming them gives."""
    votes: list[Vote] = []
    for line in evidence.unranked:
        for sig, ranks in taxonomy.named_ranks(line.text, line.signature):
            if not sig.wraps:
                votes.extend((rank, sig, line.text) for rank in ranks)
    return votes


# --- the rules, in the order they are tried -----------------------------------------------------


def lines_without_rank(ctx: Context) -> Diagnosis | None:
    """No rank is known at all, and lines that belong to no rank show a failure (a line or two pasted from
    a log, a console without rank prefixes): their most specific signature, and no rank."""
    if ctx.evidence.ranks or not ctx.evidence.unranked:
        return None
    known = _unranked_signatures(ctx)
    if not known:
        return None
    (_, text), sig = max(known.items(), key=lambda kv: kv[1].priority)
    return Diagnosis(
        failure_class=sig.failure_class,
        signature_id=sig.id,
        summary=f"{sig.title}; no line names a rank, so the initiating rank cannot be told ({text[:200]}).",
        evidence=(text,),
        fix=sig.fix,
        verify=sig.verify,
        retryable=sig.retryable,
    )


def all_succeeded(ctx: Context) -> Diagnosis | None:
    """``healthy``: every rank's exit is known and was 0 (the launcher watched it, or a launcher's line says
    so). A failed job is never called healthy: any failure, alarm or comparable flight record skips it."""
    if ctx.failing or not ctx.findings or not all(f.state == "succeeded" for f in ctx.findings.values()):
        return None
    return Diagnosis(failure_class="healthy", summary="All ranks finished successfully.",
                     roles={r: "healthy" for r in ctx.findings})  # fmt: skip


def nothing_failed(ctx: Context) -> Diagnosis | None:
    """No rank is known to have failed, no line without a rank shows a failure and no flight record is there
    to compare, but not every exit is known to be 0 (logs): ``healthy`` only when a line says the run ended
    well and no line shows a failure; a failure seen in lines no rule could use is ``unknown``, with those
    lines; and with neither, ``unknown``: the logs may be cut, or the job still running."""
    ev = ctx.evidence
    if ctx.failing or ev.unranked or any(r.flight_record is not None or r.failed for r in ev.ranks):
        return None
    unknown: dict[int, Role] = {r: "unknown" for r in ctx.findings}
    if (died := _unranked_signal_exit(ctx)) is not None:
        return died
    if ev.failure_lines:
        lines = ev.failure_lines[:MAX_EVIDENCE_LINES]
        return Diagnosis(
            failure_class="unknown",
            summary=(
                f"The logs show a failure ({lines[0][:200]}), but no rank can be named: no line of it says "
                "which rank failed or when, and no rank's own error is in these files. Add every rank's output "
                "(torchrun --tee 3, or the --log-dir folder) to tell the rank that failed first."
            ),
            evidence=lines,
            roles=unknown,
        )
    if not ev.completions:
        return Diagnosis(
            failure_class="unknown",
            summary=(
                "No rank reported an error in these logs, but nothing in them says the run ended well either "
                "(no completion line from torchrun's agent, the launcher or the training loop): the logs may "
                "be cut, or the job may still be running."
            ),
            roles=unknown,
        )
    return Diagnosis(
        failure_class="healthy",
        summary=f"No rank reported an error in these logs, and the run ended well ({ev.completions[0][:200]}).",
        evidence=ev.completions[:2],
        roles={r: "healthy" for r in ctx.findings},
    )


def _unranked_signal_exit(ctx: Context) -> Diagnosis | None:
    """A launcher's line says a worker died by a signal but names no global rank (DeepSpeed's "exits with
    return code = -7" names the last process it started, whichever died; no rank mapping printed): the class
    of that signal, no rank."""
    exits = [e for e in ctx.evidence.launcher_exits if e.rank is None and e.exit_code not in (0, None)]
    codes = {e.exit_code for e in exits}
    if len(codes) != 1:
        return None
    name = exits[0].signal or f"exit status {exits[0].exit_code}"
    sig = ctx.taxonomy.for_signal(name) if exits[0].signal else ctx.taxonomy.get("silent-exit")
    if sig is None:
        return None
    text = next((line for line in ctx.evidence.failure_lines if str(exits[0].exit_code) in line), exits[0].text)
    return Diagnosis(
        failure_class=sig.failure_class,
        signature_id=sig.id,
        summary=(
            f"A worker {'died by' if exits[0].signal else 'exited with'} {name} (the launcher's line: exit "
            f"status {exits[0].exit_code}), but no line "
            "says which rank it was: the launcher's line names the last process it started, not the one that "
            "died, and no rank's own output is in these files. Add every rank's output to name it."
        ),
        evidence=tuple(t[-300:] for t in (text,) if t),
        fix=sig.fix,
        verify=sig.verify,
        retryable=sig.retryable,
        roles={r: "unknown" for r in ctx.findings},
    )


def nonfinite_first(ctx: Context) -> Diagnosis | None:
    """``nan_inf`` on the rank whose own ``loss.backward()`` saw a non-finite loss first (by backward count,
    then time), when no rank failed on its own before that. With data parallelism every rank then fails on
    the averaged gradients, the same way; only the beacon's record tells whose local loss went first."""
    if not ctx.failing:
        return None
    marks = []
    for ev in ctx.evidence.ranks:
        if ev.nonfinite is not None:
            t = ev.nonfinite.time
            marks.append((ev.nonfinite.backward, t if t is not None else float("inf"), ev.rank))
    if not marks:
        return None
    marks.sort()
    first = [m for m in marks if m[0] == marks[0][0]]
    if len(first) > 1 and len(first) == len(ctx.evidence.ranks):
        return None  # every rank's own loss went non-finite at the same step: no rank to name
    backward, t_first, rank = marks[0]
    earlier = [f for f in ctx.own if f.failure_class != "nan_inf" and f.time is not None and f.time < t_first]
    if earlier:
        return None
    ev = ctx.ev(rank)
    sig = ctx.taxonomy.get("nan-inf-loss")
    roles = roles_around(rank, ctx.findings)
    where = ev.nonfinite.where if ev.nonfinite is not None else None
    summary = (
        f"Rank {rank}{on_node(ev)} backpropagated a non-finite loss first (its backward #{backward}, at "
        f"{where}); the averaged gradients then carried it to every rank."
    )
    if marks[1:]:
        summary += " Ranks " + format_ranks([m[2] for m in marks[1:]]) + " had a non-finite loss only later."
    collateral = sorted(r for r, role in roles.items() if role == "collateral")
    if collateral:
        summary += f" {ranks_phrase(collateral)} then failed on the non-finite values."
    lines = [f"rank {rank}: loss.backward() on a non-finite loss (backward #{backward}) at {where}"]
    lines.extend(f"rank {f.rank}: {f.lines[0]}" for f in ctx.findings.values() if f.rank != rank and f.lines)
    return named_verdict(sig, "nan_inf", ev, summary, lines, roles,
                  exception_type=ev.exception.type if ev.exception else None)  # fmt: skip


def _bare_exits_alike(ctx: Context, told: list[RankFinding], bare: list[RankFinding]) -> bool:
    """Ranks known only by their exit (a pasted failure table, a log cut before their lines) count as failing
    the same way when they exited with the same distinctive status as the ranks whose lines show the failure
    (argparse's 2, a script's own sys.exit(3)); status 1 is every uncaught exception's, so it proves nothing."""
    if not bare:
        return True
    seen = {f.rank: ctx.ev(f.rank) for f in [*told, *bare] if ctx.ev(f.rank).exit_seen}  # not inferred from a line
    codes = {ev.exit_code for ev in seen.values()}
    return len(codes) == 1 and codes.pop() not in (0, 1, None) and all(f.rank in seen for f in bare)


def _unranked_signatures(ctx: Context, causes_only: bool = False) -> dict[tuple[int | None, str], Signature]:
    """Each line that belongs to no rank, by its most specific signature (a line matches several);
    ``causes_only``: no symptoms."""
    by_line: dict[tuple[int | None, str], Signature] = {}
    for line in ctx.evidence.unranked:
        sig = ctx.taxonomy.find(line.signature)
        if sig is None or (causes_only and sig.role_hint == "collateral"):
            continue
        key = (line.order, line.text)
        if key not in by_line or sig.priority > by_line[key].priority:
            by_line[key] = sig
    return by_line


def _unranked_cause(ctx: Context) -> tuple[Signature, str] | None:
    """The one cause that lines belonging to no rank show (tracebacks of several ranks interleaved without
    prefixes), when they show one: its most specific signature and line; None when they show none, or
    symptoms only, or causes of different kinds."""
    by_line = _unranked_signatures(ctx, causes_only=True)
    if not by_line or len({sig.failure_class for sig in by_line.values()}) != 1:
        return None
    (_, text), sig = max(by_line.items(), key=lambda kv: kv[1].priority)
    return sig, text


def _repeated_unranked_cause(ctx: Context) -> bool:
    """The one cause that lines belonging to no rank show was printed more than once, word for word: by as
    many processes (each rank prints its own copy; a rank's own log handlers do not print a traceback's
    last line twice)."""
    told = _unranked_cause(ctx)
    # one line matched by several signatures is kept once per signature: lines are counted by their place
    return told is not None and len({line.order for line in ctx.evidence.unranked if line.text == told[1]}) >= 2


def same_failure_everywhere(ctx: Context) -> Diagnosis | None:
    """No rank (``initiating_rank`` null, ``all_ranks`` true), the shared class and exception: every rank failed
    on its own the same way (numbers that differ by rank, like a shard's, do not count): an import error, a
    bad config, a missing file. Picking the earliest would blame a rank for the job's code."""
    findings = list(ctx.findings.values())
    # one process's exit known (a table cut to its first failure), the others' only by the same error line
    # that each printed without a rank prefix (the interpreter's "can't open file", an import error)
    printed_by_each = len(findings) == 1 and findings[0].exception is None and _repeated_unranked_cause(ctx)
    if (len(findings) < 2 and not printed_by_each) or not all(f.own for f in findings):
        return None
    # ranks known only by their exits (a failure table, a log cut before their lines): those exits compared
    told = [f for f in findings if f.failure_class != "silent_exit" or f.exception is not None] or findings
    if len({f.story() for f in told}) != 1 or not _bare_exits_alike(ctx, told, [f for f in findings if f not in told]):
        return None
    first = next(f for f in ctx.own if f in told)
    if first.failure_class == "nan_inf":
        return None  # every rank sees the all-reduced non-finite values: own_failure_first says so, with the remedy
    sig = first.signature
    exc = first.exception
    what = exc.last_line.splitlines()[0] if exc is not None and exc.last_line else (first.lines[0] if first.lines else
                                                                                     first.failure_class)  # fmt: skip
    cls = first.failure_class
    lines = list(first.lines[:3])
    if cls == "silent_exit" and exc is None and (told_by := _unranked_cause(ctx)) is not None:
        sig, what = told_by  # the ranks' exits only, and lines no rank is known for tell why: those lines' error
        cls, lines = sig.failure_class, [what]
    loc = exc.location() if exc is not None else None
    ranks = sorted(ctx.findings)
    summary = (
        f"Every rank failed the same way ({ranks_phrase(ranks).lower()}): {what[:300]}"
        + (f" at {loc}" if loc else "")
        + ". No rank is to blame before the others: the cause is the job's code, configuration or input, "
        "the same on every rank."
    )
    lines += [f"rank {f.rank}: {f.lines[0]}" for f in sorted(findings, key=lambda f: f.rank)[:4] if f.lines]
    return Diagnosis(
        failure_class=cls,
        exception_type=exc.type if exc is not None else None,
        signature_id=sig.id if sig else None,
        summary=summary,
        evidence=tuple(dict.fromkeys(lines))[:MAX_EVIDENCE_LINES],
        fix=sig.fix if sig else None,
        verify=sig.verify if sig else None,
        roles={r: "initiating" for r in ctx.findings},
        retryable=sig.retryable if sig else None,
        all_ranks=True,
    )


def own_failure_first(ctx: Context) -> Diagnosis | None:
    """The rank whose own failure began first, its class from its own evidence: its exception, fatal signal
    or exit, or the error it printed before cleaning up. A rank's own failure is the strongest evidence there
    is; every rule below is an inference from the others' view."""
    if not ctx.own:
        return None
    first = ctx.own[0]
    if first.failure_class == "rendezvous_timeout" and first.state == "failed":
        return unattributed(
            first.signature,
            "rendezvous_timeout",
            "The rendezvous did not complete: ranks are assigned only after it does, so no rank can be named; "
            "the missing node(s) are the cause.",
            first.lines,
            {r: "unknown" for r in ctx.findings},
        )
    together = [f for f in ctx.own[1:] if f.signature is first.signature and first.failure_class == "nan_inf"
                and (f.time is None or first.time is None or abs(f.time - first.time) < NAN_TOGETHER_S)]  # fmt: skip
    if together:
        return unattributed(
            first.signature,
            "nan_inf",
            f"Ranks {format_ranks(sorted([first.rank] + [f.rank for f in together]))} became non-finite "
            "together (the check is all-reduced); these logs do not show whose LOCAL loss or gradients went "
            "non-finite first. Log each rank's local loss before the all_reduce to name it.",
            first.lines,
            {r: "unknown" for r in ctx.findings},
        )
    return rank_verdict(ctx, first, "failed first on its own")


_RANK_IN_TEXT = re.compile(r"\(RANK (?P<rank>\d+)\)")
_INNER_EXC = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::|$)")


def named_in_exception(ctx: Context) -> Diagnosis | None:
    """The rank a framework's wrapper exception names, the class of the inner error; no rank when it names
    every rank. torch.distributed.checkpoint raises the same ``CheckpointException ranks:dict_keys([2])`` on
    every rank, with rank 2's own traceback in its ``(RANK 2)`` section: the named rank failed, the others
    only report it."""
    named: dict[int, list[tuple[RankFinding, Signature, str]]] = {}
    for f in ctx.findings.values():
        for r, sig, line in f.named:
            if sig.wraps:
                named.setdefault(r, []).append((f, sig, line))
    if not named:
        return None
    rank = max(named, key=lambda r: (len({f.rank for f, _s, _l in named[r]}), -r))
    wrapper = named[rank][0][1]
    line = named[rank][0][2].splitlines()[0]  # the wrapper's own line, not the tracebacks it quotes
    inner, inner_line, inner_type = _inner_error(ctx, rank)
    sig = inner or wrapper
    if len(ctx.findings) >= 2 and set(ctx.findings) <= set(named):
        # every rank's part failed (a load of a checkpoint that is incomplete for all): no rank to name
        what = inner_line or line
        summary = (f"Every rank's part failed ({wrapper.title}, naming ranks {format_ranks(sorted(named))}): "
                   f"{what[:300]}. No rank failed before the others: what they share (the checkpoint, its "
                   "storage) is the cause.")  # fmt: skip
        return Diagnosis(
            failure_class=sig.failure_class, exception_type=inner_type, signature_id=sig.id, summary=summary,
            evidence=tuple(x for x in (line[:1000], inner_line) if x), fix=sig.fix, verify=sig.verify,
            roles={r: "initiating" for r in ctx.findings}, retryable=sig.retryable, all_ranks=True,
        )  # fmt: skip
    if rank not in ctx.findings:
        return None
    ev = ctx.ev(rank)
    roles: dict[int, Role] = {r: ("initiating" if r == rank else "collateral" if f.state == "failed" else
                 "healthy" if f.state == "succeeded" else "stopped") for r, f in ctx.findings.items()}  # fmt: skip
    reporters = sorted({f.rank for f, _s, _l in named[rank]})
    what = inner_line or line
    summary = (
        f"Rank {rank}{on_node(ev)} failed: {what[:300]}. {ranks_phrase(reporters)} raised the same wrapper exception "
        f"({line[:160]}), naming rank {rank} as the rank whose part failed."
    )
    others = sorted(named)
    if len(others) > 1:
        summary += f" It also names rank(s) {format_ranks([r for r in others if r != rank])}."
    lines = [line[:1000]] + ([inner_line[:1000]] if inner_line else [])
    return named_verdict(sig, sig.failure_class, ev, summary, lines, roles, exception_type=inner_type)


def _inner_error(ctx: Context, rank: int) -> tuple[Signature | None, str | None, str | None]:
    """The error a wrapper exception carries for ``rank`` (its ``(RANK n)`` section): its most specific
    signature, its line, its exception type."""
    texts = []
    for ev in sorted(ctx.evidence.ranks, key=lambda e: e.rank != rank):
        if ev.exception is not None:
            texts.append(f"{ev.exception.message}\n{ev.exception.traceback}")
        texts.append("\n".join(dict.fromkeys([*(line.text for line in ev.lines), *ev.stderr_tail])))
    for text in texts:
        section = _section_of(text, rank)
        if section is None:
            continue
        best: Signature | None = None
        best_line = None
        exc_type = None
        for raw in section.splitlines():
            line = raw.strip()
            m = None if raw[:1].isspace() else _INNER_EXC.match(line)
            for sig, _m in ctx.taxonomy.match_line(line):
                if sig.wraps or sig.id == "python-exception" or sig.role_hint == "collateral":
                    continue
                if best is None or sig.priority > best.priority:
                    best, best_line = sig, line
            if m is not None:  # the inner traceback's last line (format_exception_only) ends it
                exc_type, best_line = m["type"], best_line if best is not None else line
                break
        if exc_type is not None or best is not None:
            return best, best_line, exc_type
    return None, None, None


def _section_of(text: str, rank: int) -> str | None:
    marks = list(_RANK_IN_TEXT.finditer(text))
    for i, m in enumerate(marks):
        if int(m["rank"]) == rank:
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            return text[m.end() : end]
    return None


def calls_differ(ctx: Context) -> Diagnosis | None:
    """``collective_desync`` where the ranks' own records of their calls (``calls.json``, core/calls.py)
    differ while their flight recorders look alike: another root in a broadcast, reduce, gather or scatter,
    or another ``new_group`` call, names the rank(s) in the minority; with no majority, or sends and receives
    that do not pair, no rank is named and both sides are said."""
    if not ctx.failing:
        return None
    split = compare_calls({ev.rank: ev.calls for ev in ctx.evidence.ranks if ev.calls is not None})
    if split is None:
        return None
    sig = ctx.taxonomy.get("collective-call-differs")
    text = split.summary[:1].upper() + split.summary[1:] + "."
    lines = (f"elastic_diag: {split.summary}", *split.lines)
    if len(split.ranks) == 1:
        rank = split.ranks[0]
        roles = roles_around(rank, ctx.findings)
        collateral = sorted(r for r, role in roles.items() if role == "collateral")
        if collateral:
            text += f" {ranks_phrase(collateral)} then failed in the collectives that no longer matched."
        return named_verdict(sig, "collective_desync", ctx.ev(rank), text, list(lines), roles)
    return unattributed(sig, "collective_desync", text + " No single rank can be named.", lines,
                        {r: "unknown" for r in ctx.findings})  # fmt: skip


def schedule_parted(ctx: Context) -> Diagnosis | None:
    """``collective_desync`` / ``collective_mismatch`` on the one rank whose flight recorder parts from the
    majority's: with no rank failed on its own, the first collective where one rank issued another op (a
    skipped or extra collective) or other sizes (a mismatch) names it. Collectives whose arguments differ by
    design are compared on what every rank passes (a scatter on its output, a gather on its input, an
    all_to_all on its op and dtypes). gloo kills the rank that RECEIVES more bytes than its tensor holds before
    it can leave a record; such a rank had the smaller side, which breaks a one-against-one tie."""
    s = ctx.schedule
    if not ctx.failing or s is None or s.kind not in ("desync", "mismatch") or len(s.ranks) != 1:
        return None
    rank = s.ranks[0]
    ev = ctx.ev(rank)
    if s.kind == "mismatch" and ev.flight_record is None:
        # no record of what it issued (gloo killed it receiving): its own code tells whether it was at the
        # same call as its peers (other sizes) or at another one (a collective they did not issue)
        # (only when that collective is the peers' last one: they failed in it, so their code is at its call;
        # gloo counts a failed collective as completed, so the last one entered tells, not pg_status)
        peers = [e for e in ctx.evidence.ranks if e.rank != rank and e.rank in s.sides]
        waiting = all(e.flight_record is not None and max(e.flight_record.groups.get(s.group) or [0]) == s.seq
                      for e in peers)  # fmt: skip
        mine = ev.location()
        theirs = {e.location() for e in peers}
        if waiting and mine is not None and len(theirs) == 1 and None not in theirs and mine not in theirs:
            sides = {r: (v if r != rank else f"another collective, at {mine} (no record: it aborted receiving more "
                         "bytes than its tensor holds)") for r, v in s.sides.items()}  # fmt: skip
            s = replace(s, kind="desync", sides=sides)
    return schedule_verdict(ctx, s, rank)


def named_by_peers(ctx: Context) -> Diagnosis | None:
    """The rank the votes name most: the peers' own lines (monitoredBarrier, NCCL's desync report) and the
    checks across ranks of :data:`VOTES` (the watchdogs' sequence numbers compared). An explicit statement by
    the peers, weaker than a rank's own failure."""
    if not ctx.votes:
        return None
    rank = max(ctx.votes, key=lambda r: (len(ctx.votes[r]), -r))
    naming = max(ctx.votes[rank], key=lambda v: v[0].priority)
    return rank_verdict(ctx, ctx.findings[rank], f"is named by {len(ctx.votes[rank])} line(s) of its peers",
                         naming=naming)  # fmt: skip


def missing_from_collective(ctx: Context) -> Diagnosis | None:
    """The rank that never entered the collective its peers wait in: the flight recorders of the waiting ranks
    are ahead of it."""
    s = ctx.schedule
    if s is None or s.kind != "missing" or len(s.ranks) != 1:
        return None
    f = ctx.findings[s.ranks[0]]
    if f.in_collective and ctx.evidence.hang is None:
        return None
    return rank_verdict(ctx, f, f"never entered collective #{s.seq} of process group {s.group} that its peers "
                                 "waited in")  # fmt: skip


def hang_alarm(ctx: Context) -> Diagnosis | None:
    """The rank past its own ``elastic_diag.watch(...)`` timeout: the health monitor's alarm names it."""
    hang = ctx.evidence.hang
    if hang is None or (watched := hang.get("rank")) not in ctx.findings:
        return None
    assert isinstance(watched, int)
    return rank_verdict(ctx, ctx.findings[watched], "")


def alive_outside_collective(ctx: Context) -> Diagnosis | None:
    """``hang``: a rank alive outside any collective while its peers waited, at the frame it was stuck (of
    several, the one the stall snapshot saw the others blocked on). Its stack was taken before anything was
    killed."""
    outside = sorted((f for f in ctx.alive if f.in_collective is False), key=lambda f: f.rank)
    stall = ctx.evidence.stall
    holder = stall.holder if stall is not None else None
    seen = {r.rank for r in stall.outside} if stall is not None else set()
    # the rank the other blocked ranks waited on (core/blocked.py), then those the stall snapshot already saw
    # outside (a rank that came to wait outside only later, on a lock the first one holds, is not the cause)
    outside.sort(key=lambda f: (f.rank != holder, f.rank not in seen))
    return rank_verdict(ctx, outside[0], "") if outside else None


def outside_collective_at_stall(ctx: Context) -> Diagnosis | None:
    """``hang``: the rank the stall snapshot saw outside any collective while its peers waited in one, at the
    frame it was then; of several, the one the others were blocked on (a lock it held: core/blocked.py). The
    snapshot was taken while every rank was still stuck, before any watchdog or
    teardown; the culprit has since died, been stopped or entered the collective late (core/stall.py)."""
    stall = ctx.evidence.stall
    if stall is None or not stall.waiting:
        return None
    outside = [r for r in stall.holders_first() if r in ctx.findings]
    return rank_verdict(ctx, ctx.findings[outside[0]], "") if outside else None


def odd_location(ctx: Context) -> Diagnosis | None:
    """``collective_desync`` on the one rank whose code was somewhere else than all its peers' (at least two,
    who agree), when every failure is a symptom and no flight record of the culprit exists (it died by a
    signal)."""
    where = {ev.rank: ev.location() for ev in ctx.evidence.ranks if ctx.findings[ev.rank].state != "succeeded"}
    if len(where) < 3 or any(loc is None for loc in where.values()):
        return None
    counts: dict[str | None, list[int]] = {}
    for r, loc in where.items():
        counts.setdefault(loc, []).append(r)
    if len(counts) != 2:
        return None
    small, big = sorted(counts.values(), key=len)
    if len(small) != 1 or len(big) < 2:
        return None
    return schedule_verdict(ctx, None, small[0])


def only_rank_without_error(ctx: Context) -> Diagnosis | None:
    """``hang``: the one rank that neither failed nor reported a timeout while every other rank reported a
    timeout or a lost peer."""
    if not ctx.symptoms or len(ctx.alive) != 1:
        return None
    return rank_verdict(ctx, ctx.alive[0], "neither failed nor reported a timeout while every other rank did")


def exited_while_peers_waited(ctx: Context) -> Diagnosis | None:
    """``collective_desync``: the one rank that exited 0 while its peers still waited for it in a collective
    (an early ``return`` or ``sys.exit(0)`` on one rank)."""
    early = [f for f in ctx.findings.values() if f.state == "succeeded"]
    if not ctx.symptoms or ctx.alive or len(early) != 1:
        return None
    return rank_verdict(ctx, early[0], "exited 0 while its peers still waited for it in a collective")


def schedules_disagree(ctx: Context) -> Diagnosis | None:
    """No rank, ``collective_mismatch`` / ``collective_desync``, both sides: the flight recorders disagree at
    one collective and no majority tells which side parted (two ranks, or one against one)."""
    s = ctx.schedule
    if not ctx.failing or s is None or s.kind not in ("desync", "mismatch") or s.ranks:
        return None
    mismatch = s.kind == "mismatch"
    sig = ctx.taxonomy.get("collective-mismatch" if mismatch else "collective-schedule-diverged")
    sides = "; ".join(f"rank {r}: {v}" for r, v in sorted(s.sides.items()))
    what = "the same collective with different sizes or dtypes" if mismatch else "different collectives"
    summary = (
        f"The ranks issued {what} at collective #{s.seq} of process group {s.group} ({sides}), and no majority "
        "tells which side parted: with as many ranks on each side, the evidence cannot name one. Compare the two "
        "sides' code at that step."
    )
    roles: dict[int, Role] = {
        r: ("collateral" if f.state == "failed" else "healthy" if f.state == "succeeded" else "stopped")
        for r, f in ctx.findings.items()
    }
    return Diagnosis(
        failure_class="collective_mismatch" if mismatch else "collective_desync",
        signature_id=sig.id,
        summary=summary,
        evidence=(s.summary, *(f"rank {r}: #{s.seq} {v}" for r, v in sorted(s.sides.items())))[:MAX_EVIDENCE_LINES],
        fix=sig.fix,
        verify=sig.verify,
        collateral_ranks=tuple(sorted(r for r, role in roles.items() if role == "collateral")),
        roles=roles,
        retryable=sig.retryable,
        collective=divergence_json(s, ctx.evidence),
    )


def no_rank_named(ctx: Context) -> Diagnosis:
    """No rank, ``collective_timeout`` or ``unknown``, and why: the evidence cannot name a rank, and the
    summary says what was seen and what is missing."""
    roles = roles_of(ctx, None)
    collateral_ranks = sorted(r for r, role in roles.items() if role == "collateral")
    lead, cls = unnamed_lead(ctx)
    no_sig = lead.signature if lead else None
    # a rank that gloo killed for receiving more than its tensor holds proves a mismatch, whoever sent it
    # (send/recv leave no flight record to compare)
    received = [f for f in ctx.symptoms if f.failure_class == "collective_mismatch"]
    if received:
        summary = (
            f"{ranks_phrase([f.rank for f in received])} {were([f.rank for f in received])} killed by gloo for "
            "receiving more bytes than {its} tensor holds: the ranks passed different sizes or dtypes to the same "
            "send/recv or collective, but no flight record of that operation tells which side differed (gloo "
            "records no point-to-point operation), so no rank can be named."
        ).replace("{its}", "its" if len(received) == 1 else "their")
    elif collateral_ranks:
        summary = (
            f"{ranks_phrase(collateral_ranks)} failed waiting for a peer, but the evidence names no "
            "rank that failed first (no rank failed differently, and none was seen alive outside a "
            "collective); the cause may be on a rank or node whose evidence is missing."
        )
    else:
        summary = (
            "The job failed, but the evidence names no rank that failed first: no rank recorded an error of its "
            "own or a peer's symptom, and none was seen alive outside a collective."
        )
    waiting = tuple(line for f in ctx.symptoms[:2] for line in f.lines)
    return unattributed(no_sig, cls, summary, waiting, roles, tuple(collateral_ranks))


STEPS: tuple[Step, ...] = (
    exits_from_launchers,
    unranked_cause_of_the_one_failed,
    watchdog_aborts,
    named_ranks_exist,
    exits_from_lines,
)
VOTES: tuple[VoteCheck, ...] = (watchdogs_disagree_on_op, watchdog_out_of_step, named_in_unranked_lines)
RULES: tuple[Rule, ...] = (
    waited_for_main_process,
    lines_without_rank,
    all_succeeded,
    nothing_failed,
    nonfinite_first,
    same_failure_everywhere,
    own_failure_first,
    named_in_exception,
    calls_differ,
    schedule_parted,
    named_by_peers,
    missing_from_collective,
    hang_alarm,
    alive_outside_collective,
    outside_collective_at_stall,
    odd_location,
    only_rank_without_error,
    exited_while_peers_waited,
    schedules_disagree,
    busy_while_peers_waited,
    watchdogs_part,
    no_rank_named,
)


def local_coordinates(ctx: Context, verdict: Diagnosis, _: Callable[[Context], Diagnosis]) -> Diagnosis | None:
    """A verdict that names a process the log knows only by a local index (torch's agent's ``local_rank: K``
    with no failure table, an mp.spawn process index) says so: the index is the global rank when the job ran on
    one node, which most such jobs do and a line may show (``--nnodes 1``, ``num_machines=1``, the agent's
    rendezvous block); on several nodes it is rank K of the node that printed the line."""
    rank = verdict.initiating_rank
    if rank is None or rank not in ctx.findings or ctx.ev(rank).coordinate != "local":
        return None
    proof = ctx.evidence.single_node
    note = (f" (The log names this process by its local index {rank}; the job ran on one node ({proof[:120]}), so "
            f"that is its global rank.)" if proof else  # fmt: skip
            f" (The log names this process only by its local index {rank}, torch's agent's local_rank or an "
            f"mp.spawn process index, and no line shows how many nodes the job ran on: it is global rank {rank} on "
            f"one node, else local rank {rank} of the node that printed the line.)")  # fmt: skip
    return replace(verdict, summary=verdict.summary + note)


REFINEMENTS: tuple[Refinement, ...] = (stuck_together, detail_fingerprints, local_coordinates)

__all__ = [
    "REFINEMENTS",
    "RULES",
    "STEPS",
    "VOTES",
    "Context",
    "Rule",
    "attribute",
    "build_context",
    "judge",
    "judge_settled",
    "settle",
]

"""What one rank's own evidence says about it: :func:`examine_rank` turns a
:class:`~elastic_diag.core.evidence.RankEvidence` into a :class:`RankFinding`.

A finding says which signature the rank's evidence matches (an exception type or one of its bases,
a fatal signal, a line of its output) and whether the rank **failed on its own** (``own``) or only
shows the symptom of a peer's failure (``hint == "collateral"``: a peer closed the connection, a
collective timed out, gloo aborted it as the receiver of mismatched data). Own evidence is, in
order of strength:

* its uncaught exception: of its chain, the first exception that is not a symptom (what the except
  or finally block raised while handling it, or a wrapper re-raised from it, is not the failure); a
  chain that began as a symptom is one;
* the first error of its own it printed (a traceback it logged before cleaning up, a fatal signal's
  banner), stamped by the launcher's line clock, when it made no progress after it;
* the uncaught exception of one of its threads, when the rank made no progress after it;
* its own fatal signal or non-zero exit, when no symptom line explains it.

``time`` is when its own failure began: the earliest of those. Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from elastic_diag.core.evidence import RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.log_lines import GENERIC_EXCEPTION
from elastic_diag.core.taxonomy import RoleHint, Signature, Taxonomy

_DIGITS = re.compile(r"0x[0-9a-fA-F]+|\d+")


# where a rank stood at the verdict (the launcher's stop of a rank alive then is its evidence's stopped_by_agent)
RankState = Literal["failed", "alive", "succeeded"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFinding:
    rank: int
    state: RankState
    signature: Signature | None = None
    failure_class: str = "unknown"
    hint: RoleHint = "either"
    lines: tuple[str, ...] = ()
    time: float | None = None
    in_collective: bool | None = None
    named: tuple[tuple[int, Signature, str], ...] = ()  # ranks this rank's lines name as the cause
    own: bool = False  # it failed on its own (not only a symptom of a peer's failure)
    exception: ExceptionRecord | None = None  # the exception its own failure is, when there is one
    printed: bool = False  # its own failure is known from what it printed before its excepthook or exit
    order: int | None = None  # where its first error line was read, for logs whose lines carry no time

    def story(self) -> tuple[str, ...]:
        """What its failure was, without the numbers that differ by rank (shard 2 vs shard 3): two
        ranks with the same story failed the same way."""
        sig = self.signature.id if self.signature else ""
        if self.exception is not None:
            first = self.exception.message.splitlines()[0] if self.exception.message else ""
            return (sig, self.exception.type.rsplit(".", 1)[-1], _DIGITS.sub("#", first)[:300])
        return (sig, self.failure_class, _DIGITS.sub("#", self.lines[0])[:300] if self.lines else "")


def _rank_lines(ev: RankEvidence) -> list[str]:
    """Its lines, each once: the kernel's proof of an OOM kill, its exception's last line, the error lines it
    printed, its streams' tails."""
    return list(dict.fromkeys(ev.texts()))


def _best(candidates: list[tuple[Signature, str]]) -> tuple[Signature, str] | None:
    best = None
    for sig, line in candidates:
        if best is None or sig.priority > best[0].priority:
            best = (sig, line)
    return best


def _exception_signature(
    etype: str, message: str, mro: tuple[str, ...], taxonomy: Taxonomy
) -> tuple[Signature, str] | None:
    line = (f"{etype}: {message}" if message else etype).strip()
    candidates = [(s, line) for s, _m in taxonomy.match_line(line)]
    by_type = taxonomy.for_exception(etype, mro)
    if by_type is not None:
        candidates.append((by_type, line))
    return _best(candidates)


def _judge_exception(exc: ExceptionRecord, taxonomy: Taxonomy) -> tuple[Signature, str, ExceptionRecord] | None:
    """The failure an uncaught exception is, or None when it is a symptom of a peer's failure. Of a chain
    ("During handling of the above exception, another exception occurred", "The above exception was the
    direct cause of the following exception") the FIRST exception that is no symptom is the failure: what
    was raised while handling it (a save, a close, a cleanup's collective that found the peers gone) or
    re-raised from it (a framework's wrapper) is not. Only a later exception of a kind the taxonomy knows
    (an out-of-memory, a CUDA error) overrides a first one that is a plain, unrecognised error. A chain that
    began with a symptom (the collective that found a peer gone) is a symptom, whatever its handler raised."""
    own: list[tuple[Signature, str, ExceptionRecord]] = []
    for i, (etype, message) in enumerate(exc.chain):  # oldest first
        cause = _exception_signature(etype, message, (), taxonomy)
        if i == 0 and cause is not None and cause[0].role_hint == "collateral":
            return None  # it began as a symptom (a peer gone): what it raised while handling that is one too
        if cause is not None and cause[0].role_hint != "collateral":
            own.append((cause[0], cause[1], ExceptionRecord(type=etype, message=message, traceback=exc.section(i),
                                                            time=exc.time, thread=exc.thread)))  # fmt: skip
    best = _exception_signature(exc.type, exc.message, exc.mro, taxonomy)
    if best is not None and best[0].role_hint != "collateral":
        own.append((best[0], best[1], exc))
    if not own:
        return None
    first = own[0]
    if first[0].id == GENERIC_EXCEPTION:
        return next((o for o in own[1:] if o[0].id != GENERIC_EXCEPTION), first)
    return first


@dataclass(frozen=True, slots=True)
class _Own:
    """One piece of evidence that the rank failed on its own."""

    signature: Signature
    line: str
    time: float | None
    exception: ExceptionRecord | None
    printed: bool  # known from what the rank printed (or a thread's record), not its excepthook


def _own_evidence(
    ev: RankEvidence,
    taxonomy: Taxonomy,
    candidates: list[tuple[Signature, str]],
    before_verdict: Callable[[float | None], bool],
    failed: bool,
) -> list[_Own]:
    """The rank's own failure, strongest evidence first: its uncaught exception (or the cause in its
    chain), the first error it printed, a thread's uncaught exception."""
    own: list[_Own] = []
    if failed and ev.exception is not None:
        judged = _judge_exception(ev.exception, taxonomy)
        if judged is not None:
            own.append(_Own(judged[0], judged[1], ev.exception.time, judged[2], False))
    printed = ev.own_error_line()
    if printed is not None and _same_exception(printed.exception, ev.exception):
        # the traceback it printed IS the exception its excepthook recorded (logged, then re-raised): the
        # complete record judges it; the printed line only tells when the failure began
        if own and printed.time is not None:
            hook = own[0]
            own[0] = _Own(hook.signature, hook.line, min(printed.time, hook.time or printed.time), hook.exception,
                          True)  # fmt: skip
        printed = None
    if printed is not None and before_verdict(printed.time):
        judged_line = _judge_line(printed.text, printed.exception, taxonomy)
        # a native line with no traceback ("terminate called ...") that a symptom among the rank's
        # lines outranks (gloo's what(): of a receiver of mismatched data) is that symptom's consequence
        symptom = _best([c for c in candidates if c[0].role_hint == "collateral"])
        if judged_line is not None and (
            printed.exception is not None or symptom is None or symptom[0].priority < judged_line[0].priority
        ):
            own.append(_Own(judged_line[0], printed.text, printed.time, printed.exception, True))
    thread = ev.own_thread_exception()
    if thread is not None and before_verdict(thread.time):
        judged = _judge_exception(thread, taxonomy)
        if judged is not None:
            line = f"{judged[1]} (in thread {thread.thread})" if thread.thread else judged[1]
            own.append(_Own(judged[0], line, thread.time, judged[2], True))
    return own


def _same_exception(printed: ExceptionRecord | None, recorded: ExceptionRecord | None) -> bool:
    if printed is None or recorded is None or printed.type.rsplit(".", 1)[-1] != recorded.type.rsplit(".", 1)[-1]:
        return False
    first = printed.message.splitlines()[0] if printed.message else ""
    return recorded.message.startswith(first[:200])


def _judge_line(text: str, exc: ExceptionRecord | None, taxonomy: Taxonomy) -> tuple[Signature, str] | None:
    candidates = [(s, text) for s, _m in taxonomy.match_line(text)]
    if exc is not None and (by_type := taxonomy.for_exception(exc.type, exc.mro)) is not None:
        candidates.append((by_type, text))
    best = _best(candidates)
    return best if best is not None and best[0].role_hint != "collateral" else None


def examine_rank(ev: RankEvidence, taxonomy: Taxonomy, decided_at: float | None = None) -> RankFinding:
    """What one rank's own evidence says about it.

    A rank still alive at the verdict whose uncaught exception was recorded BEFORE the verdict was
    dying of that exception on its own (interpreter teardown can take seconds): it counts as failed.
    A rank alive or stopped at the verdict that printed an error of its own before it (and made no
    progress after) failed on its own too, while it was still cleaning up or stuck after it.
    """
    finding = _examine(ev, taxonomy, decided_at)
    return replace(finding, order=ev.order) if ev.order is not None else finding


def _examine(ev: RankEvidence, taxonomy: Taxonomy, decided_at: float | None) -> RankFinding:
    state = _state_of(ev, decided_at)
    if state == "succeeded":
        return RankFinding(rank=ev.rank, state="succeeded", failure_class="healthy", time=ev.exit_time)

    def before_verdict(t: float | None) -> bool:
        return state == "failed" or decided_at is None or (t is not None and t < decided_at)

    candidates, named = _line_candidates(ev, taxonomy)
    own = _own_evidence(ev, taxonomy, candidates, before_verdict, state == "failed")
    if state == "failed":
        candidates.extend(
            _exit_candidates(ev, taxonomy, waited=any(c[0].role_hint == "collateral" for c in candidates))
        )
    # The generic "SomethingError: msg" line is a fallback: it never outranks a specific signature,
    # and without a traceback it only counts for a rank that failed.
    if state != "failed":
        candidates = [(s, line) for s, line in candidates if s.role_hint == "collateral"]
    in_coll = ev.stack.in_collective() if ev.stack is not None else None
    if own:
        return _own_finding(ev, state, own, candidates, named, in_coll)
    return _inferred_finding(ev, state, candidates, named, in_coll, taxonomy)


def _state_of(ev: RankEvidence, decided_at: float | None) -> RankState:
    """alive, succeeded or failed, at the verdict. A rank alive at the verdict whose exception was recorded
    before it was dying of it. A rank the launcher's signal ended that was not alive at the verdict (a log
    shows it failing on its own first) failed: its exit signal is the launcher's, never its class."""
    dying = (
        ev.exception is not None
        and ev.exception.time is not None
        and decided_at is not None
        and ev.exception.time < decided_at
    )
    if (ev.exit_code is None or ev.alive_at_decision) and not dying:
        return "alive"
    return "succeeded" if ev.exit_code == 0 else "failed"


def _line_candidates(
    ev: RankEvidence, taxonomy: Taxonomy
) -> tuple[list[tuple[Signature, str]], list[tuple[int, Signature, str]]]:
    """The signatures the rank's lines match, and the ranks those lines name (monitoredBarrier's, ...)."""
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
    return candidates, named


def _exit_candidates(ev: RankEvidence, taxonomy: Taxonomy, waited: bool = False) -> list[tuple[Signature, str]]:
    """A failed rank's exception type and its own fatal signal (not the launcher's), as signatures. A
    SIGABRT after the rank's own lines showed it waiting (a watchdog timeout, a lost peer) is the NCCL
    watchdog tearing the process down, not a failure of its own: it is left out."""
    out: list[tuple[Signature, str]] = []
    if ev.exception is not None:
        by_exception = taxonomy.for_exception(ev.exception.type, ev.exception.mro)
        if by_exception is not None:
            out.append((by_exception, ev.exception.last_line))
    sig_name = ev.signal if not (ev.alive_at_decision or ev.stopped_by_agent) else None
    if sig_name == "SIGABRT" and waited:
        sig_name = None
    by_signal = taxonomy.for_signal(sig_name) if sig_name else None
    if by_signal is not None:
        out.append((by_signal, f"exit status {ev.exit_code} ({sig_name})"))
    return out


def _own_finding(
    ev: RankEvidence,
    state: RankState,
    own: list[_Own],
    candidates: list[tuple[Signature, str]],
    named: list[tuple[int, Signature, str]],
    in_coll: bool | None,
) -> RankFinding:
    """The rank failed on its own: the most specific signature among its own evidence, and the time
    its failure began."""
    strongest = max(own, key=lambda o: o.signature.priority)
    sig, line = strongest.signature, strongest.line
    exc = strongest.exception or next((o.exception for o in own if o.exception is not None), None)
    timed = [o for o in own if o.time is not None]
    earliest = min(timed, key=lambda o: o.time or 0.0) if timed else None
    own_times = [o.time for o in timed if o.time is not None]
    if state == "failed" and ev.exit_time is not None:
        own_times.append(ev.exit_time)
    hook_time = ev.exception.time if ev.exception is not None and ev.exception.time is not None else float("inf")
    printed_first = earliest is not None and earliest.printed and (earliest.time or 0.0) < hook_time
    # a better signature for the same failure among its other lines (a CUDA error's text in its
    # stderr, a kernel OOM line): never a symptom
    specific = _best([c for c in candidates if c[0].role_hint != "collateral" and c[0].priority > sig.priority])
    if specific is not None and not _teardown_abort(ev, specific[0]):
        sig, line = specific
    lines = [line]
    loc = (exc.user_location() or exc.location()) if exc is not None else None  # the user's line first
    if loc:
        lines.append(f"at {loc}")
    return RankFinding(
        rank=ev.rank, state=state, signature=sig, failure_class=sig.failure_class,
        hint="initiating" if sig.role_hint == "either" else sig.role_hint, lines=tuple(lines),
        time=min(own_times) if own_times else ev.first_error_time, in_collective=in_coll,
        named=tuple(named), own=True, exception=exc, printed=printed_first,
    )  # fmt: skip


TEARDOWN_ABORT = "terminate called without an active exception"


def _teardown_abort(ev: RankEvidence, sig: Signature) -> bool:
    """A SIGABRT after the rank's own uncaught exception, from a native thread still joinable when the
    interpreter tore down (``terminate called without an active exception``: a process group never destroyed):
    the exception recorded first is the failure, the abort its consequence."""
    return (sig.failure_class == "abort" and ev.exception is not None
            and any(TEARDOWN_ABORT in line for line in ev.stderr_tail[-MAX_TEARDOWN_LINES:]))  # fmt: skip


MAX_TEARDOWN_LINES = 40


def _inferred_finding(
    ev: RankEvidence,
    state: RankState,
    candidates: list[tuple[Signature, str]],
    named: list[tuple[int, Signature, str]],
    in_coll: bool | None,
    taxonomy: Taxonomy,
) -> RankFinding:
    """No evidence of the rank's own: its best line (a symptom, for a rank that did not fail), or a
    silent exit, or nothing at all."""
    best = _best(candidates)
    if best is None:
        if state == "failed":
            sig = taxonomy.get("silent-exit")
            tail = [line for line in ev.stderr_tail if line.strip()][-3:]
            return RankFinding(
                rank=ev.rank, state=state, signature=sig, failure_class=sig.failure_class,
                hint="initiating", lines=(f"exit status {ev.exit_code}", *tail),
                time=ev.first_error_time, in_collective=in_coll, own=True,
            )  # fmt: skip
        return RankFinding(rank=ev.rank, state=state, time=ev.first_error_time, in_collective=in_coll)
    sig, line = best
    lines = [line]
    if ev.exception is not None and sig.role_hint != "collateral":
        loc = ev.exception.location()
        if loc:
            lines.append(f"at {loc}")
    own = state == "failed" and sig.role_hint != "collateral"
    return RankFinding(
        rank=ev.rank, state=state, signature=sig, failure_class=sig.failure_class, hint=sig.role_hint,
        lines=tuple(lines), time=ev.first_error_time, in_collective=in_coll, named=tuple(named), own=own,
        exception=ev.exception if own else None,
    )  # fmt: skip


# The classes of a rank's own failure that a restart normally cures (the service answers again, the
# storage is back): a connection or timeout error of its own code, a network error, an I/O error.
RETRYABLE_OWN_CLASSES = ("python_exception", "network_error", "io_error")


def retryable_own_failure(ev: RankEvidence, taxonomy: Taxonomy) -> Signature | None:
    """The retryable signature of the rank's own exception (raised, printed or in a thread), if it has
    one: the restart gate trusts it over any inference from the other ranks (a comparison of
    collective schedules that calls a rank that died fetching data a desync)."""
    printed = ev.own_error_line()
    records = [ev.exception, printed.exception if printed is not None else None, ev.own_thread_exception()]
    for exc in records:
        if exc is None:
            continue
        judged = _judge_exception(exc, taxonomy)
        if judged is not None and judged[0].retryable and judged[0].failure_class in RETRYABLE_OWN_CLASSES:
            return judged[0]
    return None

"""What the log reader gathers while it reads, and what ``elastic-diag analyze`` returns.

:class:`LogRead` collects, line by line, the lines of each rank (:class:`RankLines`) and of the launchers;
:meth:`LogRead.evidence` turns them into the core's evidence model (an
:class:`~elastic_diag.core.evidence.AttemptEvidence` of ``source="logs"``): the lines known only by a pid
given to their ranks, DeepSpeed's local ranks turned global by its printed mapping, torchrun's summary and
the other launchers' exit lines as :class:`~elastic_diag.core.evidence.LauncherExit` records. It decides
nothing: every decision is the core's (:mod:`elastic_diag.core.attribution`). :class:`Analysis` is the
verdict, the evidence it was taken on and what was read (``elastic-diag analyze --json``'s document).
Plain data, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_diag.core.calls import calls_from_lines
from elastic_diag.core.evidence import AttemptEvidence, LauncherExit, LogLine, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.log_lines import EXC_LINE, SummaryFailure
from elastic_diag.core.schema_ids import ANALYSIS_SCHEMA
from elastic_diag.core.values import MAX_RANK
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.core.verification import render_diagnosis

SCHEMA = ANALYSIS_SCHEMA
TAIL_LINES = 20
PHASE_LINES = 32
MAX_FAILURE_LINES = 8

MAX_CALL_LINES = 64  # the fact lines of the ranks' calls read from one console


@dataclass(slots=True)
class RankLines:
    """One rank's part of the read: its error lines (one per signature a line matched, in order), the
    exception its lines show, the last lines of its files, its host and pid when a prefix tells them."""

    rank: int
    node: str | None = None
    lines: list[LogLine] = field(default_factory=list)
    exception: ExceptionRecord | None = None
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    printed: int = 0  # chunks it printed something in (a rank that printed anything is one of the job's)
    pid: int | None = None
    global_seen: bool = False  # a line of it carried a global rank (a prefix, its file, torchrun's table)
    local_seen: bool = False  # a line named it by a local index only (an mp.spawn process index)

    def evidence(self) -> RankEvidence:
        return RankEvidence(rank=self.rank, local_rank=self.rank, node=self.node or "", pid=self.pid,
                            exception=self.exception, stderr_tail=tuple(self.last_lines), lines=tuple(self.lines),
                            order=min((line.order for line in self.lines), default=None),
                            coordinate="local" if self.local_seen and not self.global_seen else "global")  # fmt: skip


@dataclass(slots=True)
class LogRead:
    """Everything the read found, before anything is concluded from it."""

    ranks: dict[int, RankLines] = field(default_factory=dict)
    summary_failures: list[SummaryFailure] = field(default_factory=list)  # torchrun's failure summary
    failed_lines: list[tuple[int, int, int]] = field(default_factory=list)  # torch's "failed (exitcode...)" lines
    files: list[str] = field(default_factory=list)  # what was read, in order
    skipped: list[str] = field(default_factory=list)  # what was not, and why
    unranked: list[LogLine] = field(default_factory=list)  # error lines no rank could be found for
    ds_mapping: dict[str, list[int]] = field(default_factory=dict)  # DeepSpeed: host -> its global ranks
    pids: dict[int, int] = field(default_factory=dict)  # pid -> rank
    sigtermed: set[int] = field(default_factory=set)  # pids torch's agent sent a closing signal: alive at teardown
    # lines that say a rank-local phase began (saving a checkpoint, evaluating), the last few
    phase_lines: deque[LogLine] = field(default_factory=lambda: deque(maxlen=PHASE_LINES))
    pid_lines: list[tuple[int, LogLine]] = field(default_factory=list)  # error lines known only by a pid
    # DeepSpeed: (host, local rank or None, exit)
    ds_exits: list[tuple[str | None, int | None, int]] = field(default_factory=list)
    launcher_exits: list[tuple[int, int, str]] = field(default_factory=list)  # others: (global rank, exit, launcher)
    failure_lines: list[str] = field(default_factory=list)  # lines that show a failure (the first few)
    completion_lines: list[str] = field(default_factory=list)  # lines that say the run ended well
    all_exited_ok: list[str] = field(default_factory=list)  # a launcher's word that every rank exited 0
    flight_records: dict[int, Any] = field(default_factory=dict)  # rank -> RankRecord
    call_lines: list[str] = field(default_factory=list)  # torchrun-diag's printed facts of the ranks' calls
    single_node: str | None = None  # a line that shows the job ran on one node
    global_ranks: set[int] = field(default_factory=set)  # ranks some line named by a global rank
    table_ranks: dict[int, int] = field(default_factory=dict)  # torchrun's table rows: local rank -> global rank

    def rank(self, r: int) -> RankLines:
        """Rank ``r``'s part of the read; a number no rank can have (junk a line's digits gave) is kept apart,
        never made a rank of the job (its lines still count as failures seen: ``failure_lines``)."""
        if not 0 <= r <= MAX_RANK:
            return RankLines(rank=r)
        if r not in self.ranks:
            self.ranks[r] = RankLines(rank=r)
        return self.ranks[r]

    def evidence(self) -> AttemptEvidence:
        """The read as the core's evidence model. Which line belongs to which rank is settled here (a line
        known by its pid, a DeepSpeed local rank); what the ranks' exits were is the core's to settle."""
        for f in self.summary_failures:
            if f.pid is not None and f.rank is not None:
                self.pids.setdefault(f.pid, f.rank)
            if f.rank is not None:
                self.global_ranks.add(f.rank)  # torchrun's table gives global ranks
        for pid, line in self.pid_lines:
            if pid in self.pids:
                self.rank(self.pids[pid]).lines.append(line)
            else:
                self.unranked.append(line)
        self.pid_lines.clear()
        exits: list[LauncherExit] = [_summary_exit(f) for f in self.summary_failures]
        for host, local, code in self.ds_exits:
            mapped = self.ds_mapping.get(host or "", [])
            # without the mapping the local rank is kept, no global rank: DeepSpeed's line names the last process
            # it started, whichever failed
            rank = mapped[local] if local is not None and local < len(mapped) else None
            exits.append(LauncherExit(exit_code=code, launcher="deepspeed", rank=rank, local_rank=local,
                                      host=host))  # fmt: skip
        exits += [
            LauncherExit(exit_code=code, launcher=name, rank=rank)  # type: ignore[arg-type]
            for rank, code, name in self.launcher_exits
        ]
        exits += [LauncherExit(exit_code=code, launcher="torch-agent", local_rank=local, pid=pid,
                               rank=self.table_ranks.get(local))
                  for code, local, pid in self.failed_lines]  # fmt: skip
        exits += [LauncherExit(exit_code=0, launcher="torchrun-diag", text=text) for text in self.all_exited_ok[-1:]]
        exits = [e if e.rank is None or 0 <= e.rank <= MAX_RANK else replace(e, rank=None) for e in exits]
        for e in exits:
            if e.rank is not None:
                self.rank(e.rank)
        records = self.flight_records
        calls = calls_from_lines(self.call_lines[:MAX_CALL_LINES]) if self.call_lines else {}
        for r in calls:
            self.rank(r)
        ranks: list[RankEvidence] = []
        for r in sorted(self.ranks):
            self.ranks[r].global_seen = self.ranks[r].global_seen or r in self.global_ranks
            ev = self.ranks[r].evidence()
            ev = ev if r not in records else _with_record(ev, records[r])
            ranks.append(ev if r not in calls else replace(ev, calls=calls[r]))
        for r in sorted(set(records) - set(self.ranks)):
            ranks.append(RankEvidence(rank=r, local_rank=r, node="", flight_record=records[r]))
        return AttemptEvidence(
            attempt=0,
            ranks=tuple(sorted(ranks, key=lambda ev: ev.rank)),
            source="logs",
            launcher_exits=tuple(exits),
            unranked=tuple(self.unranked),
            phases=tuple(self.phase_lines),
            completions=tuple(self.completion_lines),
            failure_lines=tuple(self.failure_lines[:MAX_FAILURE_LINES]),
            single_node=self.single_node,
            signalled_unknown=len(self.sigtermed - set(self.pids)),
        )


def _with_record(ev: RankEvidence, record: Any) -> RankEvidence:
    return replace(ev, flight_record=record)


def _summary_exit(f: SummaryFailure) -> LauncherExit:
    """An entry of torchrun's summary: the exception its traceback ends with, if one does."""
    exception = None
    for line in reversed(f.traceback):
        m = EXC_LINE.match(line.strip())
        if m:
            exception = ExceptionRecord(type=m["type"], message=m["msg"] or "", traceback="\n".join(f.traceback),
                                        time=f.time)  # fmt: skip
            break
    return LauncherExit(exit_code=f.exit_code, launcher="torchrun", rank=f.rank,
                        local_rank=f.local_rank, host=f.host, pid=f.pid, time=f.time, root=f.root,
                        exception=exception)  # fmt: skip


@dataclass(slots=True)
class Analysis:
    """The verdict, the evidence it was taken on (after the core's steps), what was read and skipped, the
    lines of the log around the decisive one, and the problems of an evidence folder read."""

    diagnosis: Diagnosis
    evidence: AttemptEvidence
    files: list[str]
    skipped: list[str]
    context: list[str] = field(default_factory=list)
    decisive: LogLine | None = None
    failure_seen: bool = True  # the logs show a failure (False: healthy, or no failure and no sign of the end)
    known_good: dict[str, Any] | None = None  # the comparison with a known-good run (offline/divergence.py)

    @property
    def torchrun_root(self) -> int | None:
        return self.evidence.torchrun_root

    @property
    def ranks(self) -> dict[int, RankEvidence]:
        return {ev.rank: ev for ev in self.evidence.ranks}

    def _ranks_shown(self) -> list[RankEvidence]:
        """The ranks of the evidence, and any the verdict gives a role without evidence of its own (a rank that
        only a check across ranks names)."""
        known = {ev.rank for ev in self.evidence.ranks}
        extra = [RankEvidence(rank=r, local_rank=r, node="") for r in self.diagnosis.roles if r not in known]
        return sorted([*self.evidence.ranks, *extra], key=lambda ev: ev.rank)

    def to_json(self) -> dict[str, Any]:
        roles = self.diagnosis.roles
        return {
            "schema": SCHEMA,
            "diagnosis": render_diagnosis(self.diagnosis.to_json(), None, live=False),
            "ranks": [
                {
                    "rank": ev.rank,
                    "node": ev.node or None,
                    "role": roles.get(ev.rank, "unknown"),
                    "exit_code": ev.exit_code if ev.exit_seen else None,
                    "signal": ev.signal if ev.exit_seen else None,
                    "first_error_time": ev.first_error_time if ev.failed or ev.alive_at_decision else None,
                    "last_lines": list(ev.stderr_tail[-TAIL_LINES:]),
                    "stack": ev.stack.text if ev.stack is not None else None,
                    "errors": distinct_texts(ev.lines)[:8],
                }
                for ev in self._ranks_shown()
            ],
            "context": self.context,
            "torchrun_root_cause_rank": self.torchrun_root,
            "files": self.files,
            "skipped": self.skipped,
            **self._known_good_json(),
        }

    def _known_good_json(self) -> dict[str, Any]:
        if self.known_good is None:
            return {}
        rows = self.known_good.get("first_divergence", [])
        return {"known_good": {k: v for k, v in self.known_good.items() if k != "first_divergence"},
                "first_divergence": rows}  # fmt: skip


def distinct_texts(lines: tuple[LogLine, ...] | list[LogLine]) -> list[str]:
    """The text of the first line of each signature, in order."""
    seen: set[str | None] = set()
    out = []
    for line in lines:
        if line.signature not in seen:
            seen.add(line.signature)
            out.append(line.text)
    return out

"""What the offline analyzer gathers from the logs, and what it returns: one :class:`Hit` per error line
that matched a signature, one :class:`RankLog` per rank, the :class:`LogFacts` of the whole read (the
input of :func:`~elastic_diag.offline.reconcile.reconcile`) and the :class:`Analysis` (its output,
``elastic-diag analyze --json``'s document). Plain data, no I/O.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from elastic_diag.core.evidence import ExceptionRecord, signal_name
from elastic_diag.core.flight_recorder import RankRecord
from elastic_diag.core.log_lines import SummaryFailure
from elastic_diag.core.taxonomy import Signature
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.core.verification import render_diagnosis
from elastic_diag.layout import ANALYSIS_SCHEMA

SCHEMA = ANALYSIS_SCHEMA
TAIL_LINES = 20
PHASE_LINES = 32
MAX_FAILURE_LINES = 8
# an exception's last line: `module.SomeError: message` (shared by the reader and the reconciler), also
# as an excepthook logs it (OLMo: "Uncaught OLMoThreadError: ...")
EXC_LINE = re.compile(
    r"^(?:(?:Uncaught|Unhandled) (?:exception:? )?)?"
    r"(?P<type>(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit))(?::\s?(?P<msg>.*))?$"
)


@dataclass(slots=True)
class Hit:
    signature: Signature
    text: str
    source: int  # index into LogFacts.files; -1 for a line the reconciler inferred
    offset: int
    order: int  # position in the whole read, to order hits of one file


@dataclass(slots=True)
class RankLog:
    rank: int
    node: str | None = None
    hits: list[Hit] = field(default_factory=list)
    exception: ExceptionRecord | None = None
    exception_hit: Hit | None = None
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    lines: int = 0
    time: float | None = None
    pid: int | None = None
    exit_code: int | None = None
    stopped: bool = False
    stack: str | None = None


@dataclass(slots=True)
class LogFacts:
    """Everything the read found, before anything is concluded from it."""

    ranks: dict[int, RankLog] = field(default_factory=dict)
    summary_failures: list[SummaryFailure] = field(default_factory=list)  # torchrun's failure summary
    failed_lines: list[tuple[int, int, int]] = field(default_factory=list)  # torch's "failed (exitcode...)" lines
    files: list[str] = field(default_factory=list)  # what was read, in order (Hit.source indexes it)
    skipped: list[str] = field(default_factory=list)  # what was not, and why
    unranked: list[Hit] = field(default_factory=list)  # error lines no rank could be found for
    ds_mapping: dict[str, list[int]] = field(default_factory=dict)  # DeepSpeed: host -> its global ranks
    pids: dict[int, int] = field(default_factory=dict)  # pid -> rank
    sigtermed: set[int] = field(default_factory=set)  # pids torch's agent sent a closing signal: alive at teardown
    # lines that say a rank-local phase began (saving a checkpoint, evaluating): (rank or None, read order,
    # text); the last few are kept, for the suspect of a timeout that follows one
    phase_lines: deque[tuple[int | None, int, str]] = field(default_factory=lambda: deque(maxlen=PHASE_LINES))
    pid_hits: list[tuple[int, Hit]] = field(default_factory=list)  # error lines known only by a pid
    ds_exits: list[tuple[str | None, int, int]] = field(default_factory=list)  # DeepSpeed: (host, local rank, exit)
    launcher_exits: list[tuple[int, int]] = field(default_factory=list)  # other launchers: (global rank, exit)
    flight_records: dict[int, RankRecord] = field(default_factory=dict)
    failure_lines: list[str] = field(default_factory=list)  # lines that show a failure (the first few)
    completion_lines: list[str] = field(default_factory=list)  # lines that say the run ended well

    def rank(self, r: int) -> RankLog:
        if r not in self.ranks:
            self.ranks[r] = RankLog(rank=r)
        return self.ranks[r]


@dataclass(slots=True)
class Analysis:
    diagnosis: Diagnosis
    ranks: dict[int, RankLog]
    files: list[str]
    skipped: list[str]
    context: list[str]
    torchrun_root: int | None
    decisive: Hit | None
    failure_seen: bool = True  # the logs show a failure (False: healthy, or no failure and no sign of the end)

    def to_json(self) -> dict[str, Any]:
        roles = self.diagnosis.roles
        return {
            "schema": SCHEMA,
            "diagnosis": render_diagnosis(self.diagnosis.to_json(), None, live=False),
            "ranks": [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "role": roles.get(r.rank, "unknown"),
                    "exit_code": r.exit_code,
                    "signal": signal_name(r.exit_code),
                    "first_error_time": r.time,
                    "last_lines": list(r.last_lines),
                    "stack": None,
                    "errors": [h.text for h in distinct(r.hits)][:8],
                }
                for r in sorted(self.ranks.values(), key=lambda r: r.rank)
            ],
            "context": self.context,
            "torchrun_root_cause_rank": self.torchrun_root,
            "files": self.files,
            "skipped": self.skipped,
        }


def distinct(hits: list[Hit]) -> list[Hit]:
    seen: set[str] = set()
    out = []
    for h in hits:
        if h.signature.id not in seen:
            seen.add(h.signature.id)
            out.append(h)
    return out

"""The seed's checklist, in its order, for a signature (``elastic-diag explain``, docs/signatures/) and
for a failed run (report.json ``checklist``, the page, the terminal summary):

1. the first occurrence of the signature, with the 100 lines before it on that rank;
2. which rank / node / device printed the first related error;
3. the flight-recorder state at the failure;
4. the verification command (core/verification.py);
5. the resume command from the newest verified checkpoint (``ELASTIC_DIAG_RESUME_FROM``).

Each item says what is known, or why it is not. Reading a rank's log is bounded (its last
``READ_LIMIT`` bytes); nothing here raises.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.taxonomy import Signature, load_taxonomy
from elastic_diag.core.verification import PLACEHOLDERS, JobFacts, render
from elastic_diag.layout import ENV_RESUME_FROM, STDERR_FILE, STDOUT_FILE, read_window

CONTEXT_LINES = 100
LINE_CHARS = 500
READ_LIMIT = 2 * 1024 * 1024  # a report is rewritten at every event: each read stays in milliseconds
TITLES = (
    ("first_occurrence", "First occurrence of the signature, and the 100 lines before it"),
    ("first_error", "Which rank, node and device printed the first related error"),
    ("flight_recorder", "The flight recorder at the failure"),
    ("verify", "Verify: repeat the same input after the change; the signature must disappear"),
    ("resume", "Resume from the newest checkpoint, only after the verification passes"),
)


def _patterns(signature_id: str | None) -> list[re.Pattern[str]]:
    if not signature_id:
        return []
    try:
        return list(load_taxonomy().get(signature_id).patterns)
    except KeyError:
        return []


def _first_occurrence(ev: RankEvidence, signature_id: str | None, evidence: Sequence[str]) -> dict[str, Any]:
    if not ev.evidence_dir:
        return {"found": False, "rank": ev.rank, "why": f"rank {ev.rank} has no evidence folder"}
    patterns = _patterns(signature_id)
    needles = [
        n.strip()
        for n in ((ev.error_line.text.splitlines()[-1:] if ev.error_line else []) + list(evidence))
        if n and n.strip()
    ]
    for stream in (STDERR_FILE, STDOUT_FILE):
        path = Path(ev.evidence_dir) / stream
        read = read_window(path, READ_LIMIT)
        if read is None:
            continue
        lines, whole = read
        hit = None
        for i, line in enumerate(lines):
            head = line[:4096]
            if any(p.search(head) for p in patterns) or any(n[:300] in head for n in needles):
                hit = i
                break
        if hit is None:
            continue
        before = [x[:LINE_CHARS] for x in lines[max(0, hit - CONTEXT_LINES) : hit]]
        return {
            "found": True,
            "rank": ev.rank,
            "node": ev.node,
            "file": str(path),
            "line_number": hit + 1 if whole else None,
            "line": lines[hit][:LINE_CHARS],
            "before": before,
        }
    return {
        "found": False,
        "rank": ev.rank,
        "why": f"no line of rank {ev.rank}'s stderr or stdout shows the "
        "signature (it was seen in its exception record or its exit status)",
    }


def _first_error(evidence: AttemptEvidence) -> dict[str, Any]:
    timed = [ev for ev in evidence.ranks if ev.error_line is not None]
    if not timed:
        failed = [ev for ev in evidence.ranks if ev.failed]
        if not failed:
            return {"found": False, "why": "no rank printed an error line of its own"}
        ev = min(failed, key=lambda e: (e.exit_time or float("inf"), e.rank))
        return {
            "found": True,
            "rank": ev.rank,
            "node": ev.node,
            "local_rank": ev.local_rank,
            "time": ev.exit_time,
            "line": None,
            "how": "no rank printed an error line; this one exited first",
        }
    ev = min(timed, key=lambda e: (e.error_line.time if e.error_line else 0.0, e.rank))
    assert ev.error_line is not None
    return {
        "found": True,
        "rank": ev.rank,
        "node": ev.node,
        "local_rank": ev.local_rank,
        "time": ev.error_line.time,
        "line": ev.error_line.text.splitlines()[-1][:LINE_CHARS] if ev.error_line.text else None,
        "device": f"local rank {ev.local_rank} (cuda:{ev.local_rank} with one GPU per local rank)",
        "how": "the first error line any rank printed, by the launcher's clock",
    }


def _flight_recorder(evidence: AttemptEvidence) -> dict[str, Any]:
    ranks = []
    for ev in evidence.ranks:
        fr = ev.flight_record
        if fr is None:
            continue
        for group, (enqueued, completed) in sorted(fr.status.items()):
            # the collective enqueued last (the dump's groups are keyed by name, its status by id)
            op = next((g[enqueued] for g in fr.groups.values() if enqueued in g), None)
            ranks.append(
                {
                    "rank": ev.rank,
                    "group": group,
                    "last_enqueued": enqueued,
                    "last_completed": completed,
                    "op": op.describe() if op else None,
                    "in_flight": enqueued > completed,
                }
            )
    if not ranks:
        return {
            "found": False,
            "why": "no rank left a flight-recorder dump; set TORCH_FR_BUFFER_SIZE=2000 (and "
            "TORCH_NCCL_DUMP_ON_TIMEOUT=1 with NCCL) and the launcher takes one from every rank",
        }
    return {"found": True, "ranks": ranks}


def _resume(job: JobFacts | None) -> dict[str, Any]:
    if job is None or not job.checkpoint_dir:
        return {
            "found": False,
            "why": "no --diag-checkpoint-dir: elastic_diag does not know where the checkpoints "
            "are; with it, the restart gate resumes from the newest one only after its controls pass, and "
            f"passes it to the script as {ENV_RESUME_FROM}",
        }
    if not job.checkpoint:
        return {"found": False, "why": f"no checkpoint under {job.checkpoint_dir} yet: the job starts from scratch"}
    command = None
    if job.launch_command:
        command = f"{ENV_RESUME_FROM}={shlex.quote(job.checkpoint)} {job.launch_command}"
        if job.cwd:
            command = f"cd {shlex.quote(job.cwd)} && {command}"
    return {
        "found": True,
        "checkpoint": job.checkpoint,
        "command": command,
        "when": "only after `elastic-diag verify` on this diag dir passes (exit 0)",
    }


def run_checklist(
    evidence: AttemptEvidence, diagnosis: dict[str, Any], job: JobFacts | None
) -> dict[str, dict[str, Any]]:
    """The checklist of a failed attempt (report.json ``checklist``), its items in the seed's order."""
    initiating = diagnosis.get("initiating_rank")
    by_rank = {ev.rank: ev for ev in evidence.ranks}
    first = _first_error(evidence)
    subject = by_rank.get(initiating) if isinstance(initiating, int) else None
    if subject is None and isinstance(first.get("rank"), int):
        subject = by_rank.get(first["rank"])
    occurrence = (
        _first_occurrence(subject, diagnosis.get("signature_id"), diagnosis.get("evidence") or [])
        if subject is not None
        else {"found": False, "why": "no rank to look at: none failed on its own"}
    )
    plan = dict(diagnosis.get("verify_plan") or {})
    verify = (
        {"found": True, "command": plan.get("command") or diagnosis.get("verify"), "expect": plan.get("expect")}
        if plan or diagnosis.get("verify")
        else {"found": False, "why": "the verdict has no verification"}
    )
    items = {
        "first_occurrence": occurrence,
        "first_error": first,
        "flight_recorder": _flight_recorder(evidence),
        "verify": verify,
        "resume": _resume(job),
    }
    return {key: {"title": title, **items[key]} for key, title in TITLES}


def signature_checklist(sig: Signature) -> list[tuple[str, list[str]]]:
    """The same items for a signature in general (``elastic-diag explain``, the reference pages):
    commands with shell variables, each explained."""
    grep = None
    if sig.literals:  # fixed strings every match holds (grep -F: any grep)
        grep = f"grep -n -m 1 -B {CONTEXT_LINES} -F " + " ".join(f"-e {shlex.quote(x)}" for x in sig.literals)
    elif sig.patterns:  # the pattern is Python's regex syntax: GNU grep -P reads it
        grep = f"grep -n -m 1 -B {CONTEXT_LINES} -P {shlex.quote(sig.patterns[0].pattern)}"
    if grep:
        grep += ' "$LOG_FILE"'
    plan = render(sig.verify, None, live=False)
    variables = dict(plan.variables) if plan else {}
    if grep:
        variables.setdefault("$LOG_FILE", "one rank's log file")
    first = (
        [grep, "on each rank's log: the rank whose match comes first (by time) is the one to read"]
        if grep
        else [
            f"this signature is recognised by {'an exception' if sig.exception_types else 'a signal'}, "
            "not a line: the rank's exception.json or exit status holds it"
        ]
    )
    return [
        (TITLES[0][1], first),
        (
            TITLES[1][1],
            [
                'elastic-diag analyze "$LOG_DIR"  # names the rank and node whose error came first, and '
                "the ranks that only waited"
            ],
        ),
        (
            TITLES[2][1],
            [
                "export TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1  # in the job's environment",
                "then torchrun-diag takes every rank's dump at the failure and compares the collective schedules",
            ],
        ),
        (TITLES[3][1], [plan.command if plan else sig.verify, plan.expect if plan else ""]),
        (
            TITLES[4][1],
            [
                f'{ENV_RESUME_FROM}="$CHECKPOINT" $LAUNCH  # only after the verification exits 0',
                f"with --diag-checkpoint-dir DIR the restart gate does this itself: it passes the newest checkpoint "
                f"as {ENV_RESUME_FROM} once its controls pass",
            ],
        ),
        (
            "Where",
            [
                f"{var}: {meaning}"
                for var, meaning in {
                    **variables,
                    "$LOG_DIR": PLACEHOLDERS["logs"][1],
                    "$CHECKPOINT": PLACEHOLDERS["ckpt"][1],
                    "$LAUNCH": "the job's launch command",
                }.items()
            ],
        ),
    ]

"""Verification commands you can paste: a signature's ``verify`` template filled in with what is known
about the job (live: the launch command, the interpreter, the checkpoint; offline: the log files), and
the judgement of a verification run (did the signature disappear?). Pure: no torch, no I/O.

A template is shell text with placeholders from :data:`PLACEHOLDERS` (``<relaunch>``, ``<python>``,
``<port>``...). Every template means the same thing: run after the fix, it exits 0 when the fix worked and
non-zero while the failure is still there (most of them re-run the job as it was launched, with a new
diag dir and no restarts: the seed's "repeat the same input after the targeted change and require the
signature to disappear"). A step joined with `` && `` whose value is not known on a live machine is left
out (a probe of a URL the evidence does not name); where a value cannot be known at all (someone else's
log, offline) it is written as a shell variable, and :func:`render` says what to set it to.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# placeholder -> (the shell variable it becomes where the value is unknown, what to set it to)
PLACEHOLDERS: dict[str, tuple[str, str]] = {
    "relaunch": (
        "RELAUNCH",
        "the job's launch command as you ran it (torchrun-diag or torchrun and its "
        "options, the script and its arguments), with --max-restarts 0",
    ),
    "python": ("PYTHON", "the Python interpreter the job runs with"),
    "logs": ("LOG_DIR", "the job's log files or folder"),
    "port": ("MASTER_PORT", "the port the error names (the job's master or rendezvous port)"),
    "path": ("FAILED_PATH", "the file or folder the error names"),
    "url": ("URL", "the address in the error message"),
    "ckpt": ("CHECKPOINT", "the newest checkpoint (the file or folder the next attempt resumes from)"),
}
PLACEHOLDER = re.compile(r"<([a-z][a-z-]*)>")
# what the page says of every verification command
EXPECT = ("Run it after the fix: exit 0 means the fix worked; a non-zero exit means the failure is still there "
          "(before any change it fails the same way)")  # fmt: skip
RETRYABLE_EXPECT = " A retryable failure may pass a re-run with no change: that is the check that it was transient."


@dataclass(frozen=True, slots=True)
class JobFacts:
    """What the launcher knows of the job, for filling in templates (report.json ``launch``).

    ``relaunch``: the launch command again as a shell command, with a new diag dir (``verify_dir``) and
    ``--max-restarts 0``; None where the job was not started by a command line (the Python API).
    """

    cwd: str | None = None
    python: str | None = None
    relaunch: str | None = None
    launch_command: str | None = None  # the launch command as it was (a new default diag dir): what a resume runs
    verify_dir: str | None = None  # the diag dir of the relaunch: its report.json tells whether the signature is gone
    master_port: int | None = None
    logs: str | None = None
    checkpoint: str | None = None  # the newest checkpoint now
    checkpoint_dir: str | None = None
    nnodes: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"cwd": self.cwd, "python": self.python, "relaunch": self.relaunch, "verify_dir": self.verify_dir,
                "launch_command": self.launch_command,
                "master_port": self.master_port, "nnodes": self.nnodes}  # fmt: skip


@dataclass(frozen=True, slots=True)
class VerifyPlan:
    """A rendered verification: the command, where it runs, what its exit means, the shell variables
    the reader must set (offline), and the steps left out for want of a value."""

    command: str
    expect: str
    cwd: str | None = None
    verify_dir: str | None = None
    variables: dict[str, str] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()
    every_node: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "expect": self.expect, "cwd": self.cwd, "verify_dir": self.verify_dir,
                "variables": dict(self.variables), "left_out": list(self.left_out),
                "every_node": self.every_node}  # fmt: skip


def placeholders(template: str) -> list[str]:
    return PLACEHOLDER.findall(template)


def unknown_placeholders(template: str) -> list[str]:
    """Placeholders a template uses that :data:`PLACEHOLDERS` does not define (the taxonomy's test)."""
    return [p for p in placeholders(template) if p not in PLACEHOLDERS]


_PORT = re.compile(r"(?:port[\s:=]+|:)(\d{2,5})\b", re.IGNORECASE)
_URL = re.compile(r"https?://[^\s'\"<>)\]]+")
_PATH = re.compile(r"""['"](/[^'"]+)['"]|(?:^|\s)(/(?:[\w.@+-]+/)*[\w.@+-]+)(?=[\s:,]|$)""")
_NOT_PATHS = ("/dev/null", "/proc/", "/usr/lib", "/lib", "/opt/conda/lib", "/usr/local/lib")


def evidence_values(lines: Iterable[str]) -> dict[str, str]:
    """``port``, ``url`` and ``path`` as the decisive lines name them (the first of each)."""
    found: dict[str, str] = {}
    for line in lines:
        if "url" not in found and (m := _URL.search(line)):
            found["url"] = m.group(0).rstrip(".,;")
        if "port" not in found and ("in use" in line.lower() or "port" in line.lower()):
            m2 = _PORT.search(line)
            if m2 and 0 < int(m2.group(1)) < 65536:
                found["port"] = m2.group(1)
        if "path" not in found and "http" not in line:
            for m3 in _PATH.finditer(line):
                path = m3.group(1) or m3.group(2)
                if path and not path.startswith(_NOT_PATHS) and not path.endswith((".py", ".cc", ".cpp", ".h")):
                    found["path"] = path
                    break
    return found


def _values(facts: JobFacts | None, evidence: Sequence[str]) -> dict[str, str]:
    """Every placeholder's value that is known, shell-quoted where it is one word."""
    values: dict[str, str] = {}
    ev = evidence_values(evidence)
    if facts is not None:
        if facts.relaunch:
            values["relaunch"] = facts.relaunch
        if facts.python:
            values["python"] = shlex.quote(facts.python)
        if facts.logs:
            values["logs"] = shlex.quote(facts.logs)
        if facts.checkpoint:
            values["ckpt"] = shlex.quote(facts.checkpoint)
        if facts.master_port:
            values["port"] = str(facts.master_port)
        # the folder a write failed in: the one the error names, else where checkpoints go, else the job's cwd
        path = ev.get("path") or facts.checkpoint_dir or facts.cwd
        if path:
            values["path"] = shlex.quote(path)
    elif ev.get("path"):
        values["path"] = shlex.quote(ev["path"])
    if "port" in ev:
        values["port"] = ev["port"]
    if "url" in ev:
        values["url"] = shlex.quote(ev["url"])
    return values


def render(template: str | None, facts: JobFacts | None, *, evidence: Sequence[str] = (), live: bool,
           retryable: bool | None = None) -> VerifyPlan | None:  # fmt: skip
    """The template with every known value filled in. Live, a ``&&`` step whose value is unknown is left
    out (unless it is the only step); what remains unknown becomes a shell variable, listed in
    ``variables`` with what to set it to. The command starts with ``cd <cwd> &&`` when the cwd is known."""
    if not template:
        return None
    if not placeholders(template):  # nothing to fill in (or filled in already, by another node's report)
        return VerifyPlan(command=template, expect=EXPECT + ".")
    body, sep, comment = template.partition("  # ")
    values = _values(facts, evidence)
    steps = re.split(r"\s+&&\s+", body.strip())
    left_out: list[str] = []
    if live and len(steps) > 1:
        kept = []
        for step in steps:
            missing = [p for p in placeholders(step) if p not in values]
            if missing:
                what = ", ".join(PLACEHOLDERS[p][1] for p in missing if p in PLACEHOLDERS)
                left_out.append(f"{step.strip()} (no {what} known)")
            else:
                kept.append(step)
        steps = kept or steps
    variables: dict[str, str] = {}

    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in values:
            return values[name]
        var, meaning = PLACEHOLDERS.get(name, (name.upper().replace("-", "_"), name))
        variables[f"${var}"] = meaning
        return f"${var}" if name == "relaunch" else f'"${var}"'

    command = " && ".join(PLACEHOLDER.sub(fill, step) for step in steps)
    if facts is not None and facts.cwd and live:
        command = f"cd {shlex.quote(facts.cwd)} && {command}"
    if sep:
        command += f"  # {comment.strip()}"
    expect = EXPECT + "." + (RETRYABLE_EXPECT if retryable else "")
    every_node = bool(facts is not None and facts.nnodes > 1 and "relaunch" in placeholders(template))
    if every_node:
        expect += " The job has several nodes: run it on every node, as the job was launched."
    uses_relaunch = "relaunch" in placeholders(" && ".join(steps)) and "relaunch" in values
    return VerifyPlan(command=command, expect=expect, cwd=facts.cwd if facts else None,
                      verify_dir=facts.verify_dir if facts is not None and uses_relaunch else None,
                      variables=variables, left_out=tuple(left_out), every_node=every_node)  # fmt: skip


def render_diagnosis(diagnosis: dict[str, Any], facts: JobFacts | None, *, live: bool) -> dict[str, Any]:
    """A report's ``diagnosis`` dict with ``verify`` filled in and ``verify_plan`` beside it (additive).
    A diagnosis already rendered is left as it is."""
    template = diagnosis.get("verify_template") or diagnosis.get("verify")
    if not template or diagnosis.get("verify_plan"):
        return diagnosis
    plan = render(str(template), facts, evidence=[str(x) for x in diagnosis.get("evidence") or []], live=live,
                  retryable=bool(diagnosis.get("retryable")))  # fmt: skip
    if plan is None:
        return diagnosis
    return {**diagnosis, "verify": plan.command, "verify_plan": plan.to_json()}


# ---- judging a verification run -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Judgement:
    passed: bool
    summary: str
    signature_seen: str | None = None  # the line (or the re-run's verdict) that shows the signature is still there


def signature_line(patterns: Sequence[str], text: str) -> str | None:
    """The first line of ``text`` that one of the signature's patterns matches (None: absent). Long
    lines are looked at in their first 4 KiB only: a log of GBs costs a bounded time per line."""
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p, re.MULTILINE))
        except re.error:
            continue
    for line in text.splitlines():
        head = line[:4096]
        for rx in compiled:
            if rx.search(head):
                return head.strip()[:300]
    return None


def judge(*, exit_code: int | None, timed_out: bool, timeout_s: float, signature_id: str | None,
          seen_line: str | None, rerun_report: Mapping[str, Any] | None,
          initiating_rank: int | None = None) -> Judgement:  # fmt: skip
    """Passed only when the command exited 0 within its deadline and the signature is gone (from its
    output and, for a relaunch, from the re-run's own verdict). A re-run that fails on the same rank
    under another signature (a verify that turns on TORCH_DISTRIBUTED_DEBUG=DETAIL makes a schedule
    desync fail fast as a mismatch) is the same failure, still there."""
    rerun = dict((rerun_report or {}).get("diagnosis") or {})
    rerun_failed = rerun_report is not None and rerun_report.get("status") != "succeeded"
    same = bool(rerun_failed and signature_id and rerun.get("signature_id") == signature_id)
    if same:
        who = rerun.get("initiating_rank")
        return Judgement(False, f"the signature {signature_id} is still there: the re-run failed the same way"
                         + (f" (rank {who})" if who is not None else "") + f": {rerun.get('summary', '')}"[:600],
                         signature_seen=str(rerun.get("summary") or signature_id))  # fmt: skip
    if rerun_failed and initiating_rank is not None and rerun.get("initiating_rank") == initiating_rank:
        now = f"{rerun.get('failure_class')} ({rerun.get('signature_id')}): {rerun.get('summary', '')}"
        return Judgement(False, f"the failure is still there: the re-run fails on rank {initiating_rank} again, "
                         f"now as {now}"[:600], signature_seen=str(rerun.get("summary") or ""))  # fmt: skip
    if seen_line is not None:
        return Judgement(False, f"the signature {signature_id or ''} is still in the output: {seen_line}",
                         signature_seen=seen_line)  # fmt: skip
    if timed_out:
        return Judgement(False, f"did not finish within {timeout_s:g} s (killed): no proof the fix worked")
    if rerun_failed:
        return Judgement(False, f"the signature {signature_id} is gone, but the re-run fails another way: "
                         f"{rerun.get('failure_class')}: {rerun.get('summary', '')}"[:600])  # fmt: skip
    if exit_code != 0:
        return Judgement(False, f"exit status {exit_code}")
    return Judgement(True, "exit status 0" + (", the re-run succeeded" if rerun_report is not None else "")
                     + (f"; the signature {signature_id} is gone" if signature_id else ""))  # fmt: skip

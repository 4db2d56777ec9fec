"""A verdict as the ledger keeps it: one row per attempt of a report.json, with what it is blamed on, how well
the initiating rank is proved, and a fingerprint that is the same for the same failure in two jobs.

Pure: a report (the dict of report.json, untrusted: any field may be missing or of the wrong type) in,
:class:`Verdict` rows out. No database, no file, no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from elastic_diag.core.taxonomy import BLAMES, Taxonomy, load_taxonomy

# how well the initiating rank is proved, by the rule that named it (docs/attribution.md's order)
PROOF_OF_RULE = {
    "own_failure_first": "own", "same_failure_everywhere": "own", "nonfinite_first": "own",
    "named_in_exception": "own", "hang_alarm": "own", "waited_for_main_process": "own", "lines_without_rank": "own",
    "calls_differ": "schedule", "schedule_parted": "schedule", "missing_from_collective": "schedule",
    "watchdogs_part": "schedule",
    "named_by_peers": "inferred", "alive_outside_collective": "inferred", "outside_collective_at_stall": "inferred",
    "odd_location": "inferred", "only_rank_without_error": "inferred", "exited_while_peers_waited": "inferred",
    "busy_while_peers_waited": "inferred",
}  # fmt: skip
PROOFS = ("own", "schedule", "inferred", "none")

# what a class is blamed on when no signature says (a verdict from the rules alone)
BLAME_OF_CLASS = {
    "python_exception": "job", "collective_desync": "job", "collective_mismatch": "job", "cuda_oom": "job",
    "nan_inf": "job", "silent_exit": "job", "hang": "job",
    "rendezvous_timeout": "infra", "port_conflict": "infra", "io_error": "infra",
}  # fmt: skip
# NVIDIA's Xid codes that the application itself causes (a bad address, an engine exception, a stopped
# context): the job's, not the GPU's (NVIDIA's Xid catalogue)
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 69})
_XID = re.compile(r"\bXid\b(?:\s*\([^)]*\))?:?\s*(\d+)")  # NVRM: Xid (PCI:0000:3b:00): 79, ...

# the parts of a line that differ between two runs of the same failure
_VOLATILE = re.compile(
    # a PCI address (0000:3b:00.0), an IPv6 address or InfiniBand GID (fe80::...:ff21): the host's, not the failure's
    r"\b[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?\b|\b[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{0,4}){2,}|"
    r"0x[0-9a-fA-F]+|\b[0-9a-f]{8,}\b|(?<![A-Za-z])\d+(?:\.\d+)?(?:e[-+]?\d+)?|\[[^\]]*\]:\d+|/tmp/[^\s:'\"]+|"
    r"pid[=: ]\d+"
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One attempt's verdict, as the ledger stores it (the columns of ``verdicts``, docs/fleet.md)."""

    recorded_at: float
    run_id: str
    attempt: int
    source: str  # torchrun-diag | exec | analyze
    status: str  # failed | succeeded | stopped
    job_id: str = ""
    failure_class: str | None = None
    blame: str = "unknown"
    signature: str | None = None
    rule: str | None = None
    proof: str = "none"
    initiating_rank: int | None = None
    initiating_host: str | None = None
    exception_type: str | None = None
    fingerprint: str | None = None
    hosts: tuple[str, ...] = ()
    rank_hosts: tuple[tuple[int, str], ...] = ()
    summary: str = ""
    command: str | None = None
    report_path: str | None = None

    def to_row(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict: it deep-copies the rank map
        row["hosts"] = json.dumps(list(self.hosts))
        row["rank_hosts"] = json.dumps({str(r): h for r, h in self.rank_hosts})
        return row


def _text(value: object, limit: int = 512) -> str | None:
    return value[:limit] if isinstance(value, str) and value else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def template(line: str) -> str:
    """A line with what differs between two runs of one failure (numbers, addresses, pids, temp paths) as ``#``."""
    return " ".join(_VOLATILE.sub("#", line).split())[:300]


def blame_of(diagnosis: Mapping[str, Any], taxonomy: Taxonomy | None = None) -> str:
    """``node`` / ``job`` / ``infra`` / ``unknown``: the signature's, else the class's; an Xid the application
    causes (13, 31, 43, ...) is the job's even though the Xid signature is the node's."""
    tax = taxonomy or load_taxonomy()
    sid = diagnosis.get("signature_id")
    blame = "unknown"
    sig = tax.find(sid) if isinstance(sid, str) else None
    if sig is not None:
        blame = sig.blame
    elif isinstance(cls := diagnosis.get("failure_class"), str):
        blame = BLAME_OF_CLASS.get(cls, "unknown")
    if blame == "node":
        raw = diagnosis.get("evidence")
        lines = raw if isinstance(raw, list) else []
        xids = {int(m.group(1)) for line in lines if isinstance(line, str) for m in _XID.finditer(line)}
        if xids and xids <= APPLICATION_XIDS:
            blame = "job"
    return blame if blame in BLAMES else "unknown"


def fingerprint(diagnosis: Mapping[str, Any]) -> str | None:
    """The same for the same failure in two jobs: the signature (else the class), the exception type, the first
    decisive line and the culprit's source location, with numbers, addresses and temp paths taken out; None for a
    verdict that is not a failure."""
    cls = diagnosis.get("failure_class")
    if not isinstance(cls, str) or cls == "healthy":
        return None
    lines = [x for x in diagnosis.get("evidence") or [] if isinstance(x, str)] if isinstance(
        diagnosis.get("evidence"), list) else []  # fmt: skip
    collective = diagnosis.get("collective") if isinstance(diagnosis.get("collective"), Mapping) else {}
    source = collective.get("source") if isinstance(collective, Mapping) else None
    where = ""
    if isinstance(source, Mapping) and (r := diagnosis.get("initiating_rank")) is not None:
        where = str(source.get(str(r), ""))
    parts = [str(diagnosis.get("signature_id") or cls), str(diagnosis.get("exception_type") or ""),
             template(lines[0]) if lines else "", template(where)]  # fmt: skip
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "replace")).hexdigest()[:16]


def proof_of(diagnosis: Mapping[str, Any]) -> str:
    if diagnosis.get("initiating_rank") is None:
        return "none"
    return PROOF_OF_RULE.get(str(diagnosis.get("rule")), "inferred")


def verdicts_of_report(report: Mapping[str, Any], *, source: str, job_id: str = "", report_path: str | None = None,
                       recorded_at: float, taxonomy: Taxonomy | None = None) -> list[Verdict]:  # fmt: skip
    """One row per attempt of ``report`` (its diagnosis, its ranks' hosts); a report with no attempts (a launch
    that failed before any worker, an analysis) gives one row of its top-level diagnosis."""
    tax = taxonomy or load_taxonomy()
    run_id = _text(report.get("run_id"), 128) or "unknown"
    status = _text(report.get("status"), 32) or "failed"
    launch = report.get("launch") if isinstance(report.get("launch"), Mapping) else {}
    command = _text(launch.get("launch_command"), 2048) if isinstance(launch, Mapping) else None
    attempts = [a for a in report.get("attempts") or [] if isinstance(a, Mapping)] if isinstance(
        report.get("attempts"), list) else []  # fmt: skip
    top = report.get("diagnosis") if isinstance(report.get("diagnosis"), Mapping) else {}
    if not attempts:
        attempts = [{"attempt": 0, "status": status, "diagnosis": top, "ranks": report.get("ranks") or []}]
    out = []
    for a in attempts:
        d = a.get("diagnosis") if isinstance(a.get("diagnosis"), Mapping) else {}
        assert isinstance(d, Mapping)
        ranks = [r for r in a.get("ranks") or [] if isinstance(r, Mapping)] if isinstance(a.get("ranks"), list) else []
        rank_hosts = tuple(sorted({(rk, h) for r in ranks if (rk := _int(r.get("rank"))) is not None
                                   and (h := _text(r.get("node"), 255))}))  # fmt: skip
        attempt_status = _text(a.get("status"), 32) or status
        failed = attempt_status != "succeeded"
        cls = _text(d.get("failure_class"), 64)
        rank = _int(d.get("initiating_rank"))
        host = _text(d.get("initiating_node"), 255) or dict(rank_hosts).get(rank) if rank is not None else None
        out.append(Verdict(
            recorded_at=recorded_at, run_id=run_id, attempt=_int(a.get("attempt")) or 0, source=source,
            status=attempt_status, job_id=job_id or run_id, failure_class=cls if failed else "healthy",
            blame=blame_of(d, tax) if failed else "none", signature=_text(d.get("signature_id"), 128),
            rule=_text(d.get("rule"), 64), proof=proof_of(d) if failed else "none", initiating_rank=rank,
            initiating_host=host, exception_type=_text(d.get("exception_type"), 255),
            fingerprint=fingerprint(d) if failed else None, hosts=tuple(sorted({h for _, h in rank_hosts})),
            rank_hosts=rank_hosts, summary=(_text(d.get("summary"), 400) or "").split("\n")[0], command=command,
            report_path=report_path,
        ))  # fmt: skip
    return out


def job_id_from_env(env: Mapping[str, str]) -> str:
    """The job as the scheduler names it: ``ELASTIC_DIAG_JOB_ID``, else ``slurm:<SLURM_JOB_ID>``, else the
    Kubernetes job (a PyTorchJob's pods are ``<job>-master-0`` / ``<job>-worker-N``), else '' (the run id)."""
    if own := env.get("ELASTIC_DIAG_JOB_ID", "").strip():
        return own[:128]
    if slurm := env.get("SLURM_JOB_ID", "").strip():
        return f"slurm:{slurm[:64]}"
    if env.get("KUBERNETES_SERVICE_HOST"):
        pod = env.get("HOSTNAME", "").strip()
        m = re.match(r"(.+)-(?:master|worker|launcher)-\d+$", pod)
        if m:
            return f"k8s:{m.group(1)[:120]}"
    return ""

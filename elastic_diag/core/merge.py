"""Many nodes, one verdict: each agent's failure record, exchanged through the rendezvous store.

Every node's agent sees only its own ranks. After its local verdict, each agent publishes a compact
record (schema ``elastic_diag.node_record/1``: its ranks' exits, exceptions, decisive lines and
stacks, with times on the LEADER's clock) under one key per node, reads every other node's, and
classifies the merged evidence with the same classifier: every node writes the same global verdict.

Times in a record are on the leader's clock (each agent measures its offset when the attempt starts:
:mod:`elastic_diag.agent.cluster`), so a node whose clock is seconds off does not look like the first to
fail. A node whose record never comes (its agent killed, its host gone) is named: its ranks are the
initiating ones, the survivors' timeouts are collateral.

Pure: records in, one merged attempt out. The store exchange lives in :mod:`elastic_diag.agent.cluster`.
A record from a newer schema or a garbled one is ignored and reported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.error_lines import error_line_from_json, error_line_to_json
from elastic_diag.core.evidence import AttemptEvidence, ErrorLine, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord, exception_from_json, exception_to_json
from elastic_diag.core.progress import Progress, kernel_from_json, nonfinite_from_json
from elastic_diag.core.schema_ids import NODE_RECORD_SCHEMA, NODE_VERDICT_SCHEMA
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.stall import StallRecord, stall_from_json, stall_to_json
from elastic_diag.core.values import as_count, as_seconds
from elastic_diag.core.verdict import Diagnosis, Role, as_role

SCHEMA = NODE_RECORD_SCHEMA
VERDICT_SCHEMA = NODE_VERDICT_SCHEMA
TAIL = 8
STACK_CHARS = 3000


def node_label(host: str, group_rank: int, group_world_size: int) -> str:
    """``host-a`` for a single node; ``host-a (node 1)`` with several (two agents may share a host)."""
    return host if group_world_size <= 1 else f"{host} (node {group_rank})"


def _shift(t: float | None, offset: float) -> float | None:
    return t + offset if t is not None else None


def _exception_json(exc: ExceptionRecord | None, offset: float) -> dict[str, Any] | None:
    return (
        exception_to_json(exc, message_chars=2000, traceback_chars=4000, time=_shift(exc.time, offset)) if exc else None
    )


def _error_line_json(line: ErrorLine | None, offset: float) -> dict[str, Any] | None:
    if line is None:
        return None
    data = error_line_to_json(line)
    for key in ("time", "arrival", "logged"):
        data[key] = _shift(data[key], offset)
    if data["exception"]:
        data["exception"]["traceback"] = data["exception"]["traceback"][-4000:]
    return data


def record_of(evidence: AttemptEvidence, *, node: str, group_rank: int, offset: float) -> dict[str, Any]:
    """This node's part of the attempt, times moved onto the leader's clock (``+ offset``)."""
    ranks = []
    for ev in evidence.ranks:
        exc = ev.exception
        ranks.append({
            "rank": ev.rank,
            "local_rank": ev.local_rank,
            "pid": ev.pid,
            "exit_code": ev.exit_code,
            "exit_time": _shift(ev.exit_time, offset),
            "start_time": _shift(ev.start_time, offset),
            "progress_time": _shift(ev.progress_time, offset),
            "steps": ev.steps,
            "alive_at_decision": ev.alive_at_decision,
            "stopped_by_agent": ev.stopped_by_agent,
            "exception": _exception_json(exc, offset),
            "thread_exception": _exception_json(ev.thread_exception, offset),
            "error_line": _error_line_json(ev.error_line, offset),
            "stderr_tail": list(ev.stderr_tail[-TAIL:]),
            "stack": ev.stack.text[:STACK_CHARS] if ev.stack else None,
            "nonfinite": ev.nonfinite.to_json() if ev.nonfinite else None,
            "kernel": ev.kernel.to_json() if ev.kernel else None,
        })  # fmt: skip
    return {
        "schema": SCHEMA,
        "node": node,
        "group_rank": group_rank,
        "attempt": evidence.attempt,
        "clock_offset_s": offset,
        "decided_at": _shift(evidence.decided_at, offset),
        "hang": evidence.hang,
        "ranks": ranks,
        # additive: this node's stall under way when the attempt began to fail (core/stall.py), on the leader's clock
        "stall": _stall_json(evidence.stall, offset),
    }


def _stall_json(stall: StallRecord | None, offset: float) -> dict[str, Any] | None:
    if stall is None:
        return None
    return stall_to_json(replace(stall, since=stall.since + offset, detected_at=stall.detected_at + offset,
                                 ended_at=_shift(stall.ended_at, offset)))  # fmt: skip


def merged_stall(stalls: list[StallRecord]) -> StallRecord | None:
    """The nodes' records of the stall the attempt failed in, as one: every node saw its own ranks (the one that
    held the others outside the collective, the rest waiting in it)."""
    if not stalls:
        return None
    ended = [s.ended_at for s in stalls]
    return StallRecord(
        number=stalls[0].number, node=", ".join(s.node for s in stalls), since=min(s.since for s in stalls),
        detected_at=min(s.detected_at for s in stalls), threshold_s=min(s.threshold_s for s in stalls),
        ranks=tuple(sorted((r for s in stalls for r in s.ranks), key=lambda r: r.rank)),
        ended_at=None if None in ended else max(e for e in ended if e is not None), outcome="failed",
    )  # fmt: skip


def parse_record(raw: bytes | str) -> dict[str, Any]:
    """A record, or ValueError naming what is wrong (garbled, another schema)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's stack
        raise ValueError(f"garbled record ({str(e)[:200]})") from e
    if not isinstance(data, dict):
        raise ValueError("garbled record (not an object)")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise ValueError(f"record of schema {schema!r}, this agent reads {SCHEMA!r}")
    if not isinstance(data.get("ranks"), list) or not isinstance(data.get("group_rank"), int):
        raise ValueError("garbled record (no ranks or group rank)")
    return data


def verdict_of(merged: Merge) -> dict[str, Any]:
    """The leader's verdict as published: the diagnosis without its per-rank lists (each node reads
    its own ranks' roles from its own key), so every agent reads a few kB whatever the job's size."""
    d = {**merged.diagnosis.to_json(), "retryable": merged.diagnosis.retryable}
    d.pop("collateral_ranks", None)
    return {"schema": VERDICT_SCHEMA, "diagnosis": d, "nodes": merged.nodes[:64], "node_count": len(merged.nodes),
            "missing": merged.missing}  # fmt: skip


def diagnosis_from_json(d: dict[str, Any], roles: dict[str, str]) -> Diagnosis:
    """The leader's verdict as this node's Diagnosis (``roles``: this node's ranks)."""
    return Diagnosis(
        failure_class=str(d.get("failure_class") or "unknown"),
        initiating_rank=d.get("initiating_rank"),
        initiating_node=d.get("initiating_node"),
        exception_type=d.get("exception_type"),
        signature_id=d.get("signature_id"),
        summary=str(d.get("summary") or ""),
        evidence=tuple(str(x) for x in d.get("evidence") or ()),
        fix=d.get("fix"),
        verify=d.get("verify"),
        collateral_ranks=tuple(sorted(int(r) for r, role in roles.items() if role == "collateral")),
        roles={int(r): as_role(role) for r, role in roles.items()},
        retryable=d.get("retryable"),
        collective=d.get("collective"),
        rule=d.get("rule") if isinstance(d.get("rule"), str) else None,
        all_ranks=d.get("all_ranks") is True,
    )


def _rank_evidence(node: str, r: dict[str, Any]) -> RankEvidence:
    exc = r.get("exception")
    stack = r.get("stack")
    return RankEvidence(
        rank=int(r["rank"]),
        local_rank=int(r.get("local_rank", 0)),
        node=node,
        pid=r.get("pid"),
        exit_code=r.get("exit_code"),
        exit_time=r.get("exit_time"),
        start_time=as_seconds(r.get("start_time")),
        progress=Progress(progress_time=as_seconds(r.get("progress_time")), steps=as_count(r.get("steps")))
        if r.get("progress_time") is not None or r.get("steps") is not None
        else None,
        alive_at_decision=bool(r.get("alive_at_decision")),
        stopped_by_agent=bool(r.get("stopped_by_agent")),
        exception=exception_from_json(exc),
        thread_exception=exception_from_json(r.get("thread_exception")),
        error_line=error_line_from_json(r.get("error_line")),
        stderr_tail=tuple(str(x) for x in r.get("stderr_tail") or ()),
        stack=parse_stack_dump(stack) if isinstance(stack, str) and stack else None,
        nonfinite=nonfinite_from_json(r.get("nonfinite")),
        kernel=kernel_from_json(r.get("kernel")),
    )  # fmt: skip


@dataclass(slots=True)
class Merge:
    diagnosis: Diagnosis
    evidence: AttemptEvidence
    nodes: list[str]
    missing: list[int] = field(default_factory=list)  # group ranks that published nothing
    problems: list[str] = field(default_factory=list)


def merge(
    attempt: int,
    records: dict[int, dict[str, Any]],
    world: int,
    hellos: dict[int, dict[str, Any]] | None = None,
    problems: Sequence[str] = (),
) -> Merge:
    """The global verdict from every node's record; nodes with no record are named as lost."""
    hellos = hellos or {}
    ranks: list[RankEvidence] = []
    decided = []
    hang = None
    stalls: list[StallRecord] = []
    for g in sorted(records):
        rec = records[g]
        node = str(rec.get("node") or f"node {g}")
        for r in rec["ranks"]:
            try:
                ranks.append(_rank_evidence(node, r))
            except (KeyError, TypeError, ValueError):
                continue
        if isinstance(rec.get("decided_at"), int | float):
            decided.append(rec["decided_at"])
        hang = hang or rec.get("hang")
        if (stall := stall_from_json(rec.get("stall"))) is not None:
            stalls.append(stall)
    missing = [g for g in range(world) if g not in records]
    for g in missing:  # the lost nodes' ranks, known from the hello each agent published at start
        hello = hellos.get(g) or {}
        for i, r in enumerate(hello.get("ranks") or []):
            if isinstance(r, int):
                ranks.append(RankEvidence(rank=r, local_rank=i, node=str(hello.get("node") or f"node {g}"),
                                          notes=("its node did not report",)))  # fmt: skip
    stall = merged_stall(stalls)
    evidence = AttemptEvidence(attempt=attempt, ranks=tuple(sorted(ranks, key=lambda e: e.rank)),
                               decided_at=min(decided) if decided else None, hang=hang,
                               stalls=(stall,) if stall is not None else ())  # fmt: skip
    nodes = [str(records[g].get("node")) for g in sorted(records)]
    if missing:
        return Merge(_lost_nodes(missing, hellos, evidence), evidence, nodes, missing, list(problems))
    return Merge(classify_attempt(evidence), evidence, nodes, [], list(problems))


def _lost_nodes(missing: list[int], hellos: dict[int, dict[str, Any]], evidence: AttemptEvidence) -> Diagnosis:
    """A node that published nothing: its agent was killed or its host is gone. Its ranks went first;
    the survivors' failures (lost peers, timeouts) are collateral."""
    first = missing[0]
    hello = hellos.get(first) or {}
    node = str(hello.get("node") or f"node {first}")
    lost_ranks = sorted(int(r) for g in missing for r in (hellos.get(g) or {}).get("ranks") or [])
    rank = lost_ranks[0] if lost_ranks else None
    names = ", ".join(str((hellos.get(g) or {}).get("node") or f"node {g}") for g in missing)
    roles: dict[int, Role] = {
        ev.rank: ("collateral" if ev.failed or ev.alive_at_decision else "healthy") for ev in evidence.ranks
    }
    for r in lost_ranks:
        roles[r] = "initiating" if r == rank else "unknown"
    collateral = tuple(sorted(r for r, role in roles.items() if role == "collateral"))
    what = f"ranks {', '.join(map(str, lost_ranks))}" if lost_ranks else "its ranks"
    summary = (
        f"Node {names} disappeared: its agent published no failure record (killed, or its host is gone), "
        f"so {what} stopped with it; the other nodes' ranks then lost their peers."
    )
    evidence_lines = [f"elastic_diag: node {names} (group rank(s) {', '.join(map(str, missing))}) did not report: "
                      "its agent was killed or its host is gone"]  # fmt: skip
    for ev in evidence.ranks:
        if ev.failed and ev.stderr_tail:
            evidence_lines.append(f"rank {ev.rank}: {ev.stderr_tail[-1]}")
            break
    return Diagnosis(
        failure_class="killed",
        initiating_rank=rank,
        initiating_node=node,
        signature_id="node-lost",
        summary=summary,
        evidence=tuple(evidence_lines),
        fix="Find why the node went away: its kernel log (OOM killer, reboots), the scheduler's events "
        "(preemption, node failure), its network.",
        verify="<relaunch>  # on a healthy node set, the job must pass this step",
        collateral_ranks=collateral,
        roles=roles,
        retryable=True,
    )

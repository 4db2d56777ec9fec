"""Several nodes' agents, through the rendezvous store: who is where, each node's clock against the
leader's, heartbeats, the exchange of failure records, and one verdict for all nodes.

The records and their merge are pure (:mod:`elastic_diag.core.merge`); this module holds the effects:
the store (``worker_group.store``, shared by every agent) and the clock are injected, every wait is
bounded, and a node whose record never comes is named by the merge.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_diag import redaction
from elastic_diag.core.evidence import AttemptEvidence
from elastic_diag.core.merge import (
    VERDICT_SCHEMA,
    Merge,
    diagnosis_from_json,
    merge,
    parse_record,
    record_of,
    verdict_of,
)
from elastic_diag.core.verdict import AttemptStatus, Diagnosis
from elastic_diag.report.session import DiagSession

BEAT_S = 1.0  # each agent's heartbeat in the store


BEAT_LOST_S = 5.0  # an agent silent this long is gone


def offset_from_ping(t_send: float, t_leader: float, t_recv: float) -> tuple[float, float]:
    """(offset to add to local times to get leader times, round trip): NTP's midpoint estimate."""
    return t_leader - (t_send + t_recv) / 2, t_recv - t_send


class StoreExchange:
    """The keys of one run in the rendezvous store (``worker_group.store``, shared by all agents)."""

    def __init__(self, store: Any, run_id: str, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.store = store
        self.prefix = f"elastic_diag/{run_id}"
        self.clock = clock
        self.sleep = sleep
        self.bytes_sent = 0
        self.bytes_read = 0

    def _set(self, key: str, value: dict[str, Any]) -> None:
        raw = redaction.current().text(json.dumps(value, separators=(",", ":"), default=str))
        self.bytes_sent += len(raw)
        self.store.set(f"{self.prefix}/{key}", raw)

    def _get(self, key: str) -> bytes:
        raw: bytes = self.store.get(f"{self.prefix}/{key}")
        self.bytes_read += len(raw)
        return raw

    def _present(self, keys: list[str]) -> bool:
        return bool(self.store.check([f"{self.prefix}/{k}" for k in keys]))

    def gather(self, keys: dict[int, str], timeout_s: float) -> dict[int, bytes]:
        """Whatever of ``keys`` (group rank -> key) is there within ``timeout_s``; polls, never blocks longer."""
        deadline = self.clock() + timeout_s
        got: dict[int, bytes] = {}
        while True:
            for g, key in keys.items():
                if g not in got and self._present([key]):
                    got[g] = self._get(key)
            if len(got) == len(keys) or self.clock() >= deadline:
                return got
            self.sleep(0.1)

    # -- start of an attempt: who is where, and the clocks ------------------------------------------
    def hello(self, group_rank: int, data: dict[str, Any]) -> None:
        self._set(f"hello/{group_rank}", data)

    def hellos(self, world: int, timeout_s: float) -> dict[int, dict[str, Any]]:
        out = {}
        for g, raw in self.gather({g: f"hello/{g}" for g in range(world)}, timeout_s).items():
            try:
                out[g] = json.loads(raw)
            except (ValueError, RecursionError):  # a record that is not ours: that node is unheard
                continue
        return out

    def answer_pings(self, world: int, attempt: int, timeout_s: float, rounds: int = 3) -> None:
        """The leader: answer each other node's pings with its own clock (runs in a thread)."""
        pending = {f"{attempt}/{g}/{i}" for g in range(1, world) for i in range(rounds)}
        deadline = self.clock() + timeout_s
        while pending and self.clock() < deadline:
            for key in sorted(pending):
                if self._present([f"ping/{key}"]):
                    self._set(f"pong/{key}", {"t": self.clock()})
                    pending.discard(key)
            self.sleep(0.002)

    def measure_offset(self, group_rank: int, attempt: int, timeout_s: float, rounds: int = 3) -> float | None:
        """This node's offset to the leader's clock: the ping with the shortest round trip wins."""
        best: tuple[float, float] | None = None
        deadline = self.clock() + timeout_s
        for i in range(rounds):
            key = f"{attempt}/{group_rank}/{i}"
            t_send = self.clock()
            self._set(f"ping/{key}", {"t": t_send})
            while not self._present([f"pong/{key}"]):
                if self.clock() >= deadline:
                    return best[0] if best else None
                self.sleep(0.002)
            t_recv = self.clock()
            offset, rtt = offset_from_ping(t_send, float(json.loads(self._get(f"pong/{key}"))["t"]), t_recv)
            if best is None or rtt < best[1]:
                best = (offset, rtt)
        return best[0] if best else None

    # -- end of an attempt: the records ----------------------------------------------------------
    def publish(self, attempt: int, group_rank: int, record: dict[str, Any]) -> None:
        self._set(f"record/{attempt}/{group_rank}", record)

    # -- the leader's verdict ------------------------------------------------------------------------
    def publish_verdict(self, attempt: int, merged: Merge, hellos: dict[int, dict[str, Any]]) -> None:
        """The verdict (one key) and each node's roles (one key per node, its own ranks only)."""
        d = merged.diagnosis
        self._set(f"verdict/{attempt}", verdict_of(merged))
        by_node: dict[int, dict[str, str]] = {}
        for g, hello in hellos.items():
            ranks = [r for r in hello.get("ranks") or [] if isinstance(r, int)]
            by_node[g] = {str(r): d.roles.get(r, "unknown") for r in ranks}
        for g, roles in by_node.items():
            self._set(f"roles/{attempt}/{g}", roles)

    def verdict(self, attempt: int, group_rank: int, timeout_s: float, offset: float = 0.0) -> dict[str, Any] | None:
        """The leader's verdict and this node's roles, or None when they do not come (or the leader
        stopped beating) within ``timeout_s``."""
        deadline = self.clock() + timeout_s
        keys = {0: f"verdict/{attempt}", 1: f"roles/{attempt}/{group_rank}"}
        while True:
            got = self.gather(keys, 0.0)
            if len(got) == 2:
                try:
                    verdict = json.loads(got[0])
                    roles = json.loads(got[1])
                except (ValueError, RecursionError):
                    return None
                if not isinstance(verdict, dict) or verdict.get("schema") != VERDICT_SCHEMA:
                    return None
                verdict["roles"] = roles
                return verdict
            silent = self.silent_for(0, offset)
            if self.clock() >= deadline or (silent is not None and silent > BEAT_LOST_S):
                return None
            self.sleep(0.1)

    def done(self, attempt: int, group_rank: int) -> None:
        self._set(f"done/{attempt}/{group_rank}", {"t": self.clock()})

    def wait_done(self, attempt: int, group_ranks: Sequence[int], timeout_s: float) -> None:
        self.gather({g: f"done/{attempt}/{g}" for g in group_ranks}, timeout_s)

    # -- liveness: every agent beats once a second while its attempt runs ------------------------------
    def beat(self, group_rank: int, offset: float) -> None:
        """This agent's heartbeat, on the leader's clock."""
        self.store.set(f"{self.prefix}/beat/{group_rank}", repr(self.clock() + offset))

    def silent_for(self, group_rank: int, offset: float) -> float | None:
        """Seconds since that agent's last heartbeat (None: it never beat)."""
        key = f"{self.prefix}/beat/{group_rank}"
        if not self.store.check([key]):
            return None
        return self.clock() + offset - float(self.store.get(key))

    def records(
        self, attempt: int, world: int, timeout_s: float, offset: float = 0.0, lost_after_s: float = BEAT_LOST_S
    ) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """Every node's record, waiting at most ``timeout_s``; a node whose agent stopped beating
        ``lost_after_s`` ago is not waited for."""
        keys = {g: f"record/{attempt}/{g}" for g in range(world)}
        deadline = self.clock() + timeout_s
        raw: dict[int, bytes] = {}
        while True:
            raw.update(self.gather({g: k for g, k in keys.items() if g not in raw}, 0.0))
            waiting = [g for g in keys if g not in raw]
            if not waiting or self.clock() >= deadline:
                break
            silent = [self.silent_for(g, offset) for g in waiting]
            if all(s is not None and s > lost_after_s for s in silent):
                break  # every node still missing has stopped beating: it is gone
            self.sleep(0.1)
        out, problems = {}, []
        for g, value in raw.items():
            try:
                out[g] = parse_record(value)
            except ValueError as e:
                problems.append(f"node {g}: {e}; left out of the global verdict")
        return out, problems


@dataclass(slots=True)
class Cluster:
    exchange: StoreExchange
    group_rank: int
    world: int
    offset: float  # add to this node's times to get the leader's
    stopped: threading.Event = field(default_factory=threading.Event)

    def beat_forever(self) -> None:
        """The agent's heartbeat in the store (a daemon thread), so the others can tell it is gone."""
        while not self.stopped.wait(BEAT_S):
            try:
                self.exchange.beat(self.group_rank, self.offset)
            except Exception:
                return  # the store is gone: nothing to tell anyone


def global_verdict(c: Cluster, session: DiagSession, *, attempt: int, node: str, evidence: AttemptEvidence,
                   local: Diagnosis, status: AttemptStatus) -> Diagnosis:  # fmt: skip
    """One verdict for all nodes: every agent publishes its record; the agent of group rank 0 reads
    them all (bounded), merges, and publishes the verdict (one key) and each node's roles (one key
    per node); the others read those two keys. O(nodes) keys per failure. If the leader's verdict
    does not come, an agent merges the records itself."""
    n = attempt
    grace_s = session.config.grace_s
    c.exchange.publish(n, c.group_rank, record_of(evidence, node=node, group_rank=c.group_rank,
                                                        offset=c.offset))  # fmt: skip
    info: dict[str, Any] = {"clock_offset_s": round(c.offset, 6), "local_diagnosis": local.to_json()}
    if c.group_rank != 0:
        verdict = c.exchange.verdict(n, c.group_rank, grace_s + 25.0, offset=c.offset)
        if verdict is not None:
            diagnosis = diagnosis_from_json(verdict["diagnosis"], verdict["roles"])
            info.update(decided_by="group rank 0", nodes=verdict.get("nodes"),
                        missing_group_ranks=verdict.get("missing"), store_bytes_sent=c.exchange.bytes_sent,
                        store_bytes_read=c.exchange.bytes_read)  # fmt: skip
            session.record_attempt(evidence, diagnosis, status=status, final=True, cluster=info)
            c.exchange.done(n, c.group_rank)
            return diagnosis
        session.note(f"attempt {n}: no verdict from group rank 0; merged the nodes' records here")
    records, problems = c.exchange.records(n, c.world, grace_s + 15.0, offset=c.offset)
    hellos = c.exchange.hellos(c.world, 2.0)
    merged = merge(n, records, c.world, hellos, problems)
    for p in merged.problems:
        session.note(f"attempt {n}: {p}")
    if len(records) <= 1 and not merged.missing:
        return local
    if c.group_rank == 0:
        c.exchange.publish_verdict(n, merged, hellos)
    info.update(decided_by=f"group rank {c.group_rank}", nodes=merged.nodes, missing_group_ranks=merged.missing,
                store_bytes_sent=c.exchange.bytes_sent, store_bytes_read=c.exchange.bytes_read)  # fmt: skip
    session.record_attempt(merged.evidence, merged.diagnosis, status=status, final=True, cluster=info)
    # the leader hosts the store: it stays until every node has read the verdict (bounded)
    c.exchange.done(n, c.group_rank)
    if c.group_rank == 0:
        c.exchange.wait_done(n, sorted(records), 10.0)  # not for nodes that are gone
    return merged.diagnosis

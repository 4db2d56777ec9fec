"""Many nodes' records into one attempt (core/merge.py): garbled and newer records left out, the nodes'
stall records merged into one verdict. Pure."""

from __future__ import annotations

import json
import time

from elastic_diag.agent.cluster import StoreExchange
from elastic_diag.core import merge as nodes


def record(g: int, rank: int, **extra) -> dict:
    rec = {"schema": nodes.SCHEMA, "node": f"h{g}", "group_rank": g, "attempt": 0, "clock_offset_s": 0.0,
           "decided_at": 100.0, "hang": None,
           "ranks": [{"rank": rank, "local_rank": 0, "exit_code": 1, "exit_time": 100.0 + rank,
                      "exception": {"type": "ValueError", "message": "bad", "traceback": "", "time": 100.0 + rank},
                      "stderr_tail": ["ValueError: bad"]}]}  # fmt: skip
    rec.update(extra)
    return rec


def test_garbled_and_newer_records_are_left_out_and_the_wait_is_bounded():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ex = StoreExchange(store, "run1")
    ex.publish(0, 0, record(0, 0))
    store.set("elastic_diag/run1/record/0/1", "{not json")
    store.set("elastic_diag/run1/record/0/2", json.dumps(record(2, 2, schema="elastic_diag.node_record/9")))
    t0 = time.monotonic()
    records, problems = ex.records(0, 4, timeout_s=1.0)  # node 3 never publishes
    assert time.monotonic() - t0 < 3
    assert list(records) == [0]
    assert any("node 1: garbled record" in p for p in problems)
    assert any("node 2: record of schema 'elastic_diag.node_record/9'" in p for p in problems)
    m = nodes.merge(0, records, 4, {3: {"node": "h3", "ranks": [6, 7]}}, problems)
    assert m.missing == [1, 2, 3]


def test_the_nodes_stall_records_merge_into_one_verdict():
    """Rank 0 (node 0) saved a checkpoint past the collective timeout while ranks 1 (node 0) and 2, 3 (node 1)
    waited in the barrier; then it reached the barrier and failed there like them. Each node's stall record
    saw its own ranks; merged, the stall names rank 0 and where it was. Node 1's clock is 2 s behind."""
    from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
    from elastic_diag.core.exceptions import ExceptionRecord
    from elastic_diag.core.stall import StallRank, StallRecord

    closed = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:4000"
    timed_out = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms "
                 "for recv operation to complete")  # fmt: skip

    def rank(r: int, node: str, line: str, t: float) -> RankEvidence:
        etype, _, msg = line.partition(": ")
        return RankEvidence(rank=r, local_rank=r % 2, node=node, exit_code=1, exit_time=t + 0.2,
                            exception=ExceptionRecord(type=etype, message=msg, traceback=line, time=t))  # fmt: skip

    def stall(node: str, outside: dict[int, str], waiting: tuple[int, ...], at: float) -> StallRecord:
        ranks = [StallRank(rank=r, local_rank=r % 2, in_collective=False, where=w) for r, w in outside.items()]
        ranks += [StallRank(rank=r, local_rank=r % 2, in_collective=True, collective="barrier #9 (process group 0)")
                  for r in waiting]  # fmt: skip
        return StallRecord(number=1, node=node, since=at, detected_at=at + 2.0, threshold_s=2.0,
                           ranks=tuple(sorted(ranks, key=lambda x: x.rank)), ended_at=at + 9.0)  # fmt: skip

    save = "/job/train.py:27 in save_checkpoint"
    node0 = AttemptEvidence(attempt=0, ranks=(rank(0, "h0", closed, 109.0), rank(1, "h0", timed_out, 106.0)),
                            stalls=(stall("h0", {0: save}, (1,), 100.0),))  # fmt: skip
    node1 = AttemptEvidence(attempt=0, ranks=(rank(2, "h1", timed_out, 104.0), rank(3, "h1", timed_out, 104.0)),
                            stalls=(stall("h1", {}, (2, 3), 98.0),))  # fmt: skip
    records = {0: nodes.record_of(node0, node="h0", group_rank=0, offset=0.0),
               1: nodes.record_of(node1, node="h1", group_rank=1, offset=2.0)}  # fmt: skip
    m = nodes.merge(0, {g: json.loads(json.dumps(r)) for g, r in records.items()}, 2)
    d = m.diagnosis
    assert (d.initiating_rank, d.rule, d.signature_id) == (0, "outside_collective_at_stall",
                                                           "rank-outlasted-collective-timeout")  # fmt: skip
    assert save in d.summary and d.collateral_ranks == (1, 2, 3)
    merged = m.evidence.stall
    assert merged is not None and [r.rank for r in merged.outside] == [0] and merged.since == 100.0

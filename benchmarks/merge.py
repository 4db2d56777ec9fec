"""Global-verdict merge at scale (not a timed test): prints the merge time and the bytes exchanged.

    python benchmarks/merge.py [--nodes 1024] [--ranks-per-node 8]

Builds every node's failure record as its agent would publish it (elastic_diag.core.merge.record_of):
every rank of every node timed out in an NCCL collective (the watchdog line, a stack), except the
culprit (node 613, local rank 5), which died of a CUDA out-of-memory error a second earlier. Then,
as every agent does after a failure: parse every node's record (JSON as read from the store) and
classify the merged evidence. Checks the verdict names the culprit. The store traffic is one key
per node; its size is the sum of the records.
"""

from __future__ import annotations

import argparse
import json
import time

from elastic_diag.core import merge as nodes
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.stacks import parse_stack_dump

WATCHDOG = ("[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=90210, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600071 milliseconds before timing out.")  # fmt: skip
STACK = "\n".join([
    "Thread 0x00007f0000000001 (most recent call first):",
    '  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
    '  File "/job/train.py", line 211 in train_step',
    '  File "/job/train.py", line 300 in main',
])  # fmt: skip


def node_evidence(g: int, per_node: int, culprit: tuple[int, int]) -> AttemptEvidence:
    ranks = []
    for lr in range(per_node):
        r = g * per_node + lr
        if (g, lr) == culprit:
            msg = "CUDA out of memory. Tried to allocate 20.00 GiB"
            exc = ExceptionRecord(type="torch.OutOfMemoryError", message=msg,
                                  traceback='File "/job/train.py", line 198, in forward\n', time=1000.0)  # fmt: skip
            ranks.append(RankEvidence(rank=r, local_rank=lr, node=f"host-{g}", exit_code=1, exit_time=1000.2,
                                      exception=exc, stderr_tail=(f"{exc.type}: {exc.message}",)))  # fmt: skip
        else:
            ranks.append(RankEvidence(rank=r, local_rank=lr, node=f"host-{g}", exit_code=-6, exit_time=1601 + lr / 100,
                                      stderr_tail=(WATCHDOG.format(r=r), "Fatal Python error: Aborted"),
                                      stack=parse_stack_dump(STACK)))  # fmt: skip
    return AttemptEvidence(attempt=0, ranks=tuple(ranks), decided_at=1602.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    a = ap.parse_args()
    culprit = (min(613, a.nodes - 1), min(5, a.ranks_per_node - 1))
    raws = {}
    for g in range(a.nodes):
        rec = nodes.record_of(node_evidence(g, a.ranks_per_node, culprit), node=f"host-{g}", group_rank=g, offset=0.0)
        raws[g] = json.dumps(rec, separators=(",", ":")).encode()
    total = sum(len(v) for v in raws.values())
    t0 = time.perf_counter()
    records = {g: nodes.parse_record(v) for g, v in raws.items()}
    t1 = time.perf_counter()
    merged = nodes.merge(0, records, a.nodes)
    t2 = time.perf_counter()
    d = merged.diagnosis
    verdict = json.dumps(nodes.verdict_of(merged), separators=(",", ":"))
    per = a.ranks_per_node
    roles = [json.dumps({str(g * per + i): d.roles.get(g * per + i, "unknown") for i in range(per)})
             for g in range(a.nodes)]  # fmt: skip
    per_agent = len(verdict) + max(len(r) for r in roles)
    in_all = total * 2 + len(verdict) * a.nodes + sum(map(len, roles)) * 2
    want = culprit[0] * per + culprit[1]
    print(
        f"{a.nodes} nodes x {per} ranks: {2 * a.nodes + 1} store keys per failure ({a.nodes} records of "
        f"{total / a.nodes / 1e3:.1f} kB, 1 verdict of {len(verdict) / 1e3:.1f} kB, {a.nodes} role maps)"
    )
    print(
        f"bytes: each agent writes its record and reads {per_agent / 1e3:.1f} kB; the leader reads "
        f"{total / 1e6:.2f} MB; {in_all / 1e6:.1f} MB through the store in all"
    )
    print(f"leader: parse {t1 - t0:.3f} s + merge and classify {t2 - t1:.3f} s = {t2 - t0:.3f} s (target < 1 s)")
    ok = d.initiating_rank == want and d.failure_class == "cuda_oom"
    print(f"verdict: rank {d.initiating_rank} on {d.initiating_node}, {d.failure_class} ({'right' if ok else 'WRONG'})")


if __name__ == "__main__":
    main()

"""Which hosts to keep out (not a timed test): four exclusion policies over one simulated fleet, then the ledger.

    python benchmarks/fleet.py [--jobs 20000] [--hosts 1000] [--days 60] [--seed 7] [--seeds 3] [--json OUT]
                               [--ledger PATH]
    python benchmarks/fleet.py --verdicts 1000000 [--hosts 1000] [--seed 7] [--json OUT]

**The fleet.** ``--hosts`` hosts of 8 GPUs; 10 of them intermittently bad: 6 with a failing GPU (kernel-log Xid
79, 48 or 94 on one fixed PCI bus) and 4 with a flaky NIC seen only as NCCL network errors (no kernel line, and
only by jobs of 2 nodes or more). Each bad host fails an attempt that lands on it with its own probability,
drawn in 0.25-0.40. ``--jobs`` jobs arrive uniformly over ``--days`` days: 1, 2, 4, 8, 16 or 32 nodes (45, 20,
15, 10, 7, 3 %), lognormal hours (median 4 h, 0.2-96 h); placement is uniform over the hosts the policy allows
(occupancy is not modelled). A failed attempt is restarted 10 minutes later, from the start, on a new
allocation (the policy's exclusions of that moment apply), up to 3 attempts per job.

**What fails that is not the node** (rates per job, or per attempt; about 14 % of the attempts fail):

* a user's bug, 3 % of jobs: deterministic (every attempt fails at the same point of the run), initiated by a
  rank on whatever host it lands: a Python exception (70 %, its text and source file the job's own), the
  model's CUDA OOM (20 %), a collective desync (10 %); blamed on the job;
* an Xid the application causes (13, 31 or 43), 0.5 % of jobs: deterministic, a kernel-log line on the
  initiating host and on each other host of the allocation with probability 0.5 (every rank runs the bad
  kernel): a FACT-like rule is fooled, elastic_diag blames the job (verdicts.APPLICATION_XIDS);
* a NCCL misconfiguration, 0.2 % of jobs (2 nodes or more): deterministic NCCL network errors, initiated on a
  random host of each allocation: blamed on the node, with the same fingerprint on every attempt;
* infrastructure, 1.5 % of attempts (transient): a rendezvous timeout at the start (no rank named) or a
  checkpoint write on a full disk (a rank's host);
* unknown, 0.8 % + 0.15 % per node of attempts (transient): SIGKILL or a segfault on a random host.

A flaky NIC's error is named first on the peer instead of the bad host in 15 % of its failures. Every verdict's
blame and fingerprint come from elastic_diag itself (``blame_of`` and ``fingerprint`` of
elastic_diag.ledger.verdicts, over the evidence line the failure leaves).

**The policies**, each run on the same seeded job stream (each attempt draws its outcome and placement from its
own seeded generator, so the policies differ only where an exclusion moved a job), every window 14 days counted
in whole UTC days as ``elastic-diag fleet`` counts them (the day of the moment and the 14 before):

* ``none``: no exclusion;
* ``naive``: a host with 2 failures of any kind that it initiated in the window is kept out (and held as below);
* ``fact``: modelled on NVIDIA's resiliency tooling: a host with kernel-log evidence (any Xid or ECC line) in 2
  failed attempts in the window is avoided, at most one new host per failure (restart);
* ``elastic_diag``: the ledger's rule, :func:`node_failures`, :func:`recommended` and :func:`held` of
  elastic_diag.ledger.fleet with :class:`ExclusionRule`, over the window's node-blamed failures (host, job,
  fingerprint, time) and the hold's before it.

Every policy re-reads its window at each allocation. ``naive`` and ``elastic_diag`` hold a host they kept out
for ``hold_days`` (30) after the last failure that kept it out (an excluded host runs nothing, so without the
hold it comes back when its failures age out and must fail two more jobs to go again); ``fact`` lets a host
back when its evidence ages out of the window, as described.
``--seeds K`` (3): the table of ``--seed``, then the mean of the figures over K seeds (one seed's snapshot at
the end is noisy: a bad host may be between two of its exclusions).

**Figures per policy**: hosts kept out at the end, precision and recall of that set against the 10 bad hosts;
the share of the bad hosts' time they were kept out, and the GPU-hours of good hosts kept out; failures a bad
host caused, and the repeats among them (a bad host that had already failed a job before), with their
GPU-hours (a failed attempt's GPUs times its hours up to the failure); the jobs delayed (at least one attempt
failed by a bad host). Then the ledger: the elastic_diag policy's whole verdict stream (every attempt, each a
:class:`Verdict` row) written to a SQLite ledger with ``insert_many`` (``--ledger PATH`` keeps it), and
``fleet_view(...)["exclude"]`` at the simulation's end compared with the policy's last recommendation.

``--verdicts N``: N verdict rows of the same mix (about 14 % failures; a user's bug has its own fingerprint,
a node fault one of a few) over the 14.5 days of one window on ``--hosts`` hosts (no exclusion, so the flaky
NICs' errors named on their peers pile up: many good hosts reach 2), inserted with ``insert_many`` in batches of
200,000 into a fresh SQLite file in a temp dir (``--ledger PATH`` keeps it); then ``fleet_view`` is timed (best
of 3, warm page cache). Target < 1 s.

The default run takes 15 s on 2 idle cores (35 s on busy ones); ``--verdicts 1000000`` 6 to 15 minutes, nearly
all of it building the rows (``Verdict.to_row`` copies each rank -> host map) and inserting them (a 1.3 GB file).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic_diag.core.taxonomy import load_taxonomy  # noqa: E402
from elastic_diag.ledger.fleet import DAY_S, ExclusionRule, fleet_view, held, node_failures, recommended  # noqa: E402
from elastic_diag.ledger.store import Ledger  # noqa: E402
from elastic_diag.ledger.verdicts import Verdict, blame_of, fingerprint, proof_of  # noqa: E402

GPUS = 8
HOUR = 3600.0
T0 = 20_700 * DAY_S  # a UTC midnight (2026-09-05)
MAX_ATTEMPTS = 3
RESTART_S = 600.0
SIZES = ((1, 0.45), (2, 0.20), (4, 0.15), (8, 0.10), (16, 0.07), (32, 0.03))
P_USER_BUG, P_APP_XID, P_MISCONFIG = 0.03, 0.005, 0.002  # per job
P_INFRA, P_UNKNOWN, P_UNKNOWN_NODE = 0.015, 0.008, 0.0015  # per attempt
P_APP_XID_OTHER_HOST = 0.5
P_PEER_NAMED = 0.15  # a flaky NIC's error named first on its peer
BAD_GPU, BAD_NIC = 6, 4
P_BAD = (0.25, 0.40)
POLICIES = ("none", "naive", "fact", "elastic_diag")

XID_TEXT = {
    79: "GPU has fallen off the bus.",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 1.",
    94: "Contained ECC error.",
    13: "Graphics SM Warp Exception on (GPC 2, TPC 0, SM 1): Out Of Range Address",
    31: "Ch 00000018, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x7f3a_5c000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000010, engmask 00000101, intr 10000000",
}  # fmt: skip
XID_LINE = "NVRM: Xid (PCI:0000:{bus}:00): {code}, pid={pid}, name=python, {text}"
BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")  # an HGX board's eight GPUs
NCCL_NET = ("NCCL WARN NET/IB : Got completion from peer 10.1.{a}.{b}<{port}> with status=12 opcode=0 len=0 "
            "vendor err 129")  # fmt: skip
NCCL_MISCONFIG = "NCCL WARN NET/IB : ibv_modify_qp failed with error Connection timed out, NCCL_IB_GID_INDEX={n}"
PY_BUGS = (
    ("KeyError", "KeyError: '{w}'"),
    ("AttributeError", "AttributeError: 'NoneType' object has no attribute '{w}'"),
    ("ValueError", "ValueError: {w} must be positive, got -1"),
    ("RuntimeError", "RuntimeError: The size of tensor a (4096) must match the size of tensor b (1024) at "
                     "non-singleton dimension 1"),
    ("FileNotFoundError", "FileNotFoundError: [Errno 2] No such file or directory: '/data/{w}/shard-00042.tar'"),
    ("AssertionError", "AssertionError: {w} is not divisible by the world size"),
)  # fmt: skip
WORDS = ("input", "label", "attention", "token", "image", "text", "loss", "pos", "vocab", "audio", "frame", "patch",
         "prompt", "reward", "teacher", "student", "ema", "optim", "sched", "expert", "router",
         "cache", "latent")  # fmt: skip
PARTS = ("ids", "mask", "embeds", "weights", "scale", "dim", "len", "state", "bias", "map", "table", "index", "proj",
         "norm", "steps", "heads", "groups", "shards", "buckets", "ratio")  # fmt: skip
USERS = tuple(f"{a}{b}" for a in ("ana", "ben", "chen", "dev", "eli", "fay", "gus", "hui", "ivo", "jan")
              for b in ("", "k", "m", "r", "s"))  # fmt: skip


@dataclass(frozen=True, slots=True)
class BadHost:
    kind: str  # gpu | nic
    p_fail: float
    code: int  # the Xid of a failing GPU, 0 for a NIC
    bus: str


@dataclass(frozen=True)
class Fleet:
    names: tuple[str, ...]
    bad: dict[int, BadHost]
    order: tuple[int, ...]  # the bad hosts, in the order their draws are made

    @property
    def size(self) -> int:
        return len(self.names)


@dataclass(frozen=True, slots=True)
class Job:
    idx: int
    name: str
    arrive: float
    nodes: int
    hours: float
    bug: str | None  # user | appxid | misconfig: the job's own failure, on every attempt
    bug_at: float  # the fraction of the run at which it strikes
    detail: tuple[str, ...]  # user: (signature, class, exception, line, source); appxid: (code,); misconfig: (n,)


@dataclass(slots=True)
class Attempt:
    job: Job
    attempt: int
    start: float
    end: float
    alloc: tuple[int, ...]
    cause: str | None  # None (succeeded), gpu, nic, user, appxid, misconfig, rdzv, storage, killed, segfault
    rank: int | None = None  # the initiating rank (its host: alloc[rank // GPUS])
    bad_host: int | None = None  # the bad host that caused it
    kernel: tuple[int, ...] = ()  # hosts whose kernel log has an Xid line of this attempt
    pid: int = 0
    blame: str = "none"
    fp: str | None = None
    diagnosis: dict[str, Any] = field(default_factory=dict)

    @property
    def host(self) -> int | None:
        return None if self.rank is None else self.alloc[self.rank // GPUS]


def make_fleet(hosts: int, seed: int) -> Fleet:
    rng = random.Random(f"fleet:{seed}")
    names = tuple(f"gpu{i:04d}" for i in range(hosts))
    picked = rng.sample(range(hosts), BAD_GPU + BAD_NIC)
    bad = {}
    for i, h in enumerate(picked):
        gpu = i < BAD_GPU
        bad[h] = BadHost("gpu" if gpu else "nic", round(rng.uniform(*P_BAD), 2), (79, 48, 94)[i % 3] if gpu else 0,
                         rng.choice(BUSES))  # fmt: skip
    return Fleet(names, bad, tuple(picked))


def new_job(idx: int, arrive: float, rng: random.Random) -> Job:
    nodes = rng.choices([s for s, _ in SIZES], [w for _, w in SIZES])[0]
    hours = min(96.0, max(0.2, rng.lognormvariate(math.log(4.0), 1.1)))
    u, bug_at = rng.random(), rng.random() ** 2  # a bug mostly strikes early
    bug: str | None = None
    detail: tuple[str, ...] = ()
    if u < P_USER_BUG:
        bug = "user"
        word, src = f"{rng.choice(WORDS)}_{rng.choice(PARTS)}", f"/home/{rng.choice(USERS)}/{rng.choice(WORDS)}"
        v = rng.random()
        if v < 0.7:
            exc, line = rng.choice(PY_BUGS)
            where = f"{src}/train.py:{rng.randint(40, 900)}"
            detail = ("python-exception", "python_exception", exc, line.format(w=word), where)
        elif v < 0.9:
            detail = ("cuda-oom", "cuda_oom", "torch.OutOfMemoryError", "torch.OutOfMemoryError: CUDA out of memory. "
                      "Tried to allocate 2.50 GiB. GPU 3 has a total capacity of 79.10 GiB of which 1.02 GiB is free.",
                      f"{src}/model.py:{rng.randint(40, 900)}")  # fmt: skip
        else:
            ops = rng.sample(("ALLREDUCE", "BROADCAST", "ALLGATHER", "REDUCE_SCATTER"), 2)
            detail = ("collective-call-differs", "collective_desync", "RuntimeError",
                      f"Detected mismatch between collectives on ranks. Rank 3 is running collective: "
                      f"CollectiveFingerPrint(OpType={ops[0]}) but Rank 0 is running collective: "
                      f"CollectiveFingerPrint(OpType={ops[1]})", f"{src}/train.py:{rng.randint(40, 900)}")  # fmt: skip
    elif u < P_USER_BUG + P_APP_XID:
        bug, detail = "appxid", (str(rng.choice((13, 31, 43))),)
    elif u < P_USER_BUG + P_APP_XID + P_MISCONFIG and nodes > 1:
        bug, detail = "misconfig", (str(rng.randint(0, 7)),)
    return Job(idx, f"slurm:{100_000 + idx}", arrive, nodes, hours, bug, bug_at, detail)


def make_jobs(n: int, days: float, seed: int, t0: float = T0) -> list[Job]:
    rng = random.Random(f"jobs:{seed}")
    arrivals = sorted(t0 + rng.random() * days * DAY_S for _ in range(n))
    return [new_job(i, t, rng) for i, t in enumerate(arrivals)]


def place(rng: random.Random, nodes: int, hosts: int, excluded: frozenset[int]) -> tuple[int, ...]:
    """Uniform over the allowed hosts, drawn one at a time (two policies' allocations differ only where one of
    them excludes a drawn host)."""
    if hosts - len(excluded) < nodes:  # the policy keeps out too many: the job runs anyway
        excluded = frozenset()
    chosen: dict[int, None] = {}
    while len(chosen) < nodes:
        h = rng.randrange(hosts)
        if h not in excluded:
            chosen[h] = None
    return tuple(chosen)


def run_attempt(job: Job, attempt: int, start: float, fleet: Fleet, seed: int, excluded: frozenset[int]) -> Attempt:
    """One attempt's allocation and outcome, from the attempt's own generator: the placement first, then a fixed
    sequence of draws for that allocation (two policies that give an attempt the same hosts give it the same
    outcome)."""
    rng = random.Random((seed * 1_000_003 + job.idx) * 8 + attempt)
    alloc = place(rng, job.nodes, fleet.size, excluded)
    r = rng.random
    u_infra, u_infra_kind, t_infra, u_unknown, u_unknown_kind, t_unknown = r(), r(), r(), r(), r(), r()
    u_rank, u_peer, u_peer_rank, u_other, pid = r(), r(), r(), r(), 1000 + int(r() * 4_000_000)
    where = {h: i for i, h in enumerate(alloc)}
    bad_u = [(h, r(), r()) for h in fleet.order if h in where]
    n, hours = len(alloc), job.hours
    ranks = n * GPUS
    any_rank = min(ranks - 1, int(u_rank * ranks))
    cands: list[tuple[float, str, int | None, int | None]] = []  # (hours in, cause, rank, bad host)
    for h, u, t in bad_u:
        b = fleet.bad[h]
        if u < b.p_fail and (b.kind == "gpu" or n > 1):
            named = where[h] * GPUS + int(t * 997) % GPUS
            if b.kind == "nic" and u_peer < P_PEER_NAMED:
                others = [i for i in range(n) if alloc[i] != h]
                named = others[int(u_peer_rank * len(others))] * GPUS + int(t * 991) % GPUS
            cands.append((t * hours, b.kind, named, h))
    if job.bug is not None:
        cands.append((job.bug_at * hours, job.bug, any_rank, None))
    if u_infra < P_INFRA:
        cands.append((min(0.25, hours), "rdzv", None, None) if u_infra_kind < 0.5 else (
            t_infra * hours, "storage", any_rank, None))  # fmt: skip
    if u_unknown < P_UNKNOWN + P_UNKNOWN_NODE * n:
        cands.append((t_unknown * hours, "killed" if u_unknown_kind < 0.6 else "segfault", any_rank, None))
    if not cands:
        return Attempt(job, attempt, start, start + hours * HOUR, alloc, None, pid=pid)
    at, cause, rank, bad_host = min(cands, key=lambda c: c[0])
    kernel: tuple[int, ...] = ()
    if cause == "gpu":
        assert bad_host is not None
        kernel = (bad_host,)
    elif cause == "appxid" and rank is not None:
        other = random.Random(int(u_other * 2**53))
        kernel = tuple(h for i, h in enumerate(alloc) if i == rank // GPUS or other.random() < P_APP_XID_OTHER_HOST)
    a = Attempt(job, attempt, start, start + at * HOUR, alloc, cause, rank, bad_host, kernel, pid)
    a.diagnosis = diagnosis_of(a, fleet)
    a.blame, a.fp = blame_of(a.diagnosis, TAXONOMY), fingerprint(a.diagnosis)
    return a


TAXONOMY = load_taxonomy()
OTHER = {  # signature, class, exception, line
    "rdzv": ("rendezvous-timeout", "rendezvous_timeout", "torch.distributed.DistStoreError",
             "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. {k}/{n} clients "
             "joined."),
    "storage": ("checkpoint-write-failed", "io_error", "OSError",
                "OSError: [Errno 28] No space left on device: '/checkpoints/{job}/step_{k}/__{r}_0.distcp'"),
    "killed": ("killed", "killed", "", "failed (exitcode: -9) local_rank: {r} (pid: {pid}) of binary: /usr/bin/python"),
    "segfault": ("segfault", "segfault", "", "Fatal Python error: Segmentation fault"),
}  # fmt: skip


def diagnosis_of(a: Attempt, fleet: Fleet) -> dict[str, Any]:
    """The diagnosis a failed attempt's report.json would carry (the fields the ledger reads)."""
    job, rank, pid = a.job, a.rank, a.pid
    source: str | None = None
    if a.cause in ("gpu", "appxid"):
        if a.cause == "gpu":
            assert a.bad_host is not None
            code, bus = fleet.bad[a.bad_host].code, fleet.bad[a.bad_host].bus
        else:
            code, bus = int(job.detail[0]), BUSES[(rank or 0) % GPUS]
        sig, cls, exc = "gpu-xid-ecc", "cuda_error", "torch.AcceleratorError"
        line = XID_LINE.format(bus=bus, code=code, pid=pid, text=XID_TEXT[code])
    elif a.cause == "nic":
        sig, cls, exc = "nccl-network-error", "network_error", "torch.distributed.DistBackendError"
        line = NCCL_NET.format(a=pid % 250, b=pid % 13, port=pid % 60000)
    elif a.cause == "misconfig":
        sig, cls, exc = "nccl-network-error", "network_error", "torch.distributed.DistBackendError"
        line = NCCL_MISCONFIG.format(n=job.detail[0])
    elif a.cause == "user":
        sig, cls, exc, line, source = job.detail
    else:
        assert a.cause is not None
        sig, cls, exc, line = OTHER[a.cause]
        line = line.format(k=pid % 31, n=len(a.alloc), job=job.name, r=rank, pid=pid)
    d: dict[str, Any] = {"failure_class": cls, "signature_id": sig, "exception_type": exc or None,
                         "evidence": [line], "initiating_rank": rank,
                         "rule": "own_failure_first" if rank is not None else None}  # fmt: skip
    if a.cause in ("killed", "segfault"):
        d["rule"] = "exited_while_peers_waited"
    if a.cause == "nic":
        d["rule"] = "named_by_peers"
    if source is not None and rank is not None:
        d["collective"] = {"source": {str(rank): source}}
    return d


def verdict_of(a: Attempt, fleet: Fleet, *, rank_hosts: bool = True) -> Verdict:
    names, job = fleet.names, a.job
    hosts = [names[h] for h in a.alloc]
    run_id = f"{job.name.split(':')[1]}-{job.idx:06x}"
    command = (f"torchrun-diag --nnodes {job.nodes} --nproc-per-node {GPUS} --rdzv-backend diag+c10d "
               f"--rdzv-endpoint {hosts[0]}:29500 /home/{USERS[job.idx % len(USERS)]}/train.py "
               f"--config configs/run{job.idx % 97}.yaml")  # fmt: skip
    ranks = tuple((r, hosts[r // GPUS]) for r in range(len(hosts) * GPUS)) if rank_hosts else ()
    common: dict[str, Any] = {
        "recorded_at": a.end, "run_id": run_id, "attempt": a.attempt, "source": "torchrun-diag", "job_id": job.name,
        "hosts": tuple(sorted(hosts)), "rank_hosts": ranks,
        "command": command, "report_path": f"/scratch/elastic_diag_runs/{run_id}/report.json"}  # fmt: skip
    if a.cause is None:
        return Verdict(status="succeeded", failure_class="healthy", blame="none",
                       summary=f"all {len(hosts) * GPUS} ranks finished", **common)  # fmt: skip
    d, host = a.diagnosis, (names[a.host] if a.host is not None else None)
    summary = f"Rank {a.rank} on {host}: {d['evidence'][0]}" if a.rank is not None else d["evidence"][0]
    return Verdict(status="failed", failure_class=d["failure_class"], blame=a.blame, signature=d["signature_id"],
                   rule=d["rule"], proof=proof_of(d), initiating_rank=a.rank, initiating_host=host,
                   exception_type=d["exception_type"], fingerprint=a.fp, summary=summary[:400], **common)  # fmt: skip


# -- the policies ------------------------------------------------------------------------------------------
def window_start(t: float, rule: ExclusionRule) -> float:
    """The first second of the window at ``t`` (whole UTC days, as fleet_view counts them)."""
    return int((t - rule.window_days * DAY_S) // DAY_S) * DAY_S


class Policy:
    name = "none"

    def __init__(self, fleet: Fleet, rule: ExclusionRule) -> None:
        self.fleet, self.rule = fleet, rule
        self.current: frozenset[int] = frozenset()

    def excluded(self, t: float) -> frozenset[int]:
        return self.current

    def observe(self, a: Attempt) -> None:
        """A failed attempt, at its end."""


class Naive(Policy):
    """2 failures of any kind initiated on the host in the window (and the same hold as elastic_diag's rule)."""

    name = "naive"

    def __init__(self, fleet: Fleet, rule: ExclusionRule) -> None:
        super().__init__(fleet, rule)
        self.events: deque[tuple[float, int]] = deque()
        self._key: tuple[float, int] = (-1.0, -1)
        self._changes = 0

    def observe(self, a: Attempt) -> None:
        if a.host is not None:
            self.events.append((a.end, a.host))
            self._changes += 1

    def excluded(self, t: float) -> frozenset[int]:
        since = window_start(t, self.rule)
        if (since, self._changes) != self._key:
            while self.events and self.events[0][0] < since - self.rule.hold_days * DAY_S:
                self.events.popleft()
            counts = Counter(h for at, h in self.events if at >= since)
            kept = held(((h, f"event{i}", None, at) for i, (at, h) in enumerate(self.events)), self.rule, t)
            now = frozenset([h for h, c in counts.items() if c >= self.rule.min_node_failures] + list(kept))
            self._key = (since, self._changes)
            if now != self.current:
                self.current = now
        return self.current


class Fact(Policy):
    """Kernel-log evidence (any Xid or ECC line) on the host in 2 failed attempts in the window: avoided, at
    most one new host per failure."""

    name = "fact"

    def __init__(self, fleet: Fleet, rule: ExclusionRule) -> None:
        super().__init__(fleet, rule)
        self.events: deque[tuple[float, int]] = deque()
        self.counts: Counter[int] = Counter()
        self.avoid: set[int] = set()

    def _expire(self, t: float) -> None:
        since = window_start(t, self.rule)
        while self.events and self.events[0][0] < since:
            self.counts[self.events.popleft()[1]] -= 1
        self.avoid = {h for h in self.avoid if self.counts[h] >= self.rule.min_node_failures}

    def observe(self, a: Attempt) -> None:
        for h in a.kernel:
            self.events.append((a.end, h))
            self.counts[h] += 1
        self._expire(a.end)
        pending = [h for h, c in self.counts.items() if c >= self.rule.min_node_failures and h not in self.avoid]
        if pending:
            self.avoid.add(max(pending, key=lambda h: (self.counts[h], -h)))

    def excluded(self, t: float) -> frozenset[int]:
        self._expire(t)
        if self.avoid != self.current:
            self.current = frozenset(self.avoid)
        return self.current


class ElasticDiag(Policy):
    """The ledger's rule over the window's node-blamed failures."""

    name = "elastic_diag"

    def __init__(self, fleet: Fleet, rule: ExclusionRule) -> None:
        super().__init__(fleet, rule)
        self.rows: deque[tuple[str | None, str, str | None, float]] = deque()  # host, job, fingerprint, time
        self.index = {name: i for i, name in enumerate(fleet.names)}
        self._key: tuple[float, int] = (-1.0, -1)
        self._changes = 0

    def observe(self, a: Attempt) -> None:
        if a.blame == "node":
            self.rows.append((self.fleet.names[a.host] if a.host is not None else None, a.job.name, a.fp, a.end))
            self._changes += 1

    def recommendation(self, t: float) -> list[str]:
        since = window_start(t, self.rule)
        while self.rows and self.rows[0][3] < since - self.rule.hold_days * DAY_S:
            self.rows.popleft()
            self._changes += 1
        counted, _ = node_failures(r for r in self.rows if r[3] >= since)
        out = recommended(counted, self.rule)
        return out + sorted(set(held(self.rows, self.rule, t)) - set(out))

    def excluded(self, t: float) -> frozenset[int]:
        if (window_start(t, self.rule), self._changes) != self._key:
            now = frozenset(self.index[h] for h in self.recommendation(t))
            self._key = (window_start(t, self.rule), self._changes)
            if now != self.current:
                self.current = now
        return self.current


POLICY_OF: dict[str, type[Policy]] = {"none": Policy, "naive": Naive, "fact": Fact, "elastic_diag": ElasticDiag}


@dataclass
class Result:
    policy: str
    end: float
    excluded: list[str]
    bad: list[str]
    attempts: int = 0
    failed: int = 0
    causes: Counter[str] = field(default_factory=Counter)
    node_failures: int = 0
    node_gpu_h: float = 0.0
    repeat_failures: int = 0
    repeat_gpu_h: float = 0.0
    jobs_delayed: int = 0
    bad_time_out: float = 0.0  # the share of the bad hosts' time they were kept out
    good_gpu_h_out: float = 0.0
    good_ever_out: int = 0
    ever_excluded: list[str] = field(default_factory=list)
    recommendation: list[str] = field(default_factory=list)
    history: list[Attempt] = field(default_factory=list)

    @property
    def true_pos(self) -> int:
        return len(set(self.excluded) & set(self.bad))

    @property
    def precision(self) -> float:
        return self.true_pos / len(self.excluded) if self.excluded else 1.0

    @property
    def recall(self) -> float:
        return self.true_pos / len(self.bad)

    def figures(self) -> dict[str, Any]:
        return {
            "excluded": len(self.excluded), "true_positives": self.true_pos, "precision": round(self.precision, 4),
            "recall": round(self.recall, 4), "bad_host_time_kept_out": round(self.bad_time_out, 4),
            "good_host_gpu_hours_kept_out": round(self.good_gpu_h_out, 1),
            "good_hosts_ever_kept_out": self.good_ever_out,
            "node_failures": self.node_failures, "node_gpu_hours_lost": round(self.node_gpu_h, 1),
            "repeat_failures": self.repeat_failures, "repeat_gpu_hours_lost": round(self.repeat_gpu_h, 1),
            "jobs_delayed": self.jobs_delayed, "attempts": self.attempts, "failed_attempts": self.failed,
            "failures_by_cause": dict(sorted(self.causes.items())), "excluded_hosts": self.excluded,
        }  # fmt: skip


def simulate(policy_name: str, jobs: list[Job], fleet: Fleet, *, seed: int, end: float,
             rule: ExclusionRule | None = None, keep: bool = False) -> Result:  # fmt: skip
    """Every attempt of ``jobs`` that ends by ``end``, in time order, under one policy."""
    rule = rule or ExclusionRule()
    policy = POLICY_OF[policy_name](fleet, rule)
    res = Result(policy_name, end, [], sorted(fleet.names[h] for h in fleet.bad))
    queue: list[tuple[float, int, int, int, Attempt | None]] = [(j.arrive, 1, i, 0, None) for i, j in enumerate(jobs)]
    heapq.heapify(queue)  # (time, 0 end / 1 start, job, attempt, the attempt at its end)
    failed_before: set[int] = set()
    delayed: set[int] = set()
    ever: set[int] = set()
    good = [h not in fleet.bad for h in range(fleet.size)]
    last_t, prev = jobs[0].arrive if jobs else end, policy.excluded(0.0)
    out_good = out_bad = 0.0

    def account(t: float, excl: frozenset[int]) -> None:
        nonlocal last_t, prev, out_good, out_bad
        n_good = sum(good[h] for h in prev)
        out_good += (t - last_t) * n_good
        out_bad += (t - last_t) * (len(prev) - n_good)
        last_t = t
        if excl is not prev:
            prev = excl
            ever.update(excl)

    while queue:
        t, kind, j, attempt, done = heapq.heappop(queue)
        if t > end:
            break
        if kind == 1:
            excl = policy.excluded(t)
            account(t, excl)
            a = run_attempt(jobs[j], attempt, t, fleet, seed, excl)
            heapq.heappush(queue, (a.end, 0, j, attempt, a))
            continue
        assert done is not None
        res.attempts += 1
        if keep:
            res.history.append(done)
        if done.cause is None:
            continue
        res.failed += 1
        res.causes[done.cause] += 1
        policy.observe(done)
        if done.bad_host is not None:
            gpu_h = len(done.alloc) * GPUS * (done.end - done.start) / HOUR
            res.node_failures += 1
            res.node_gpu_h += gpu_h
            delayed.add(j)
            if done.bad_host in failed_before:
                res.repeat_failures += 1
                res.repeat_gpu_h += gpu_h
            failed_before.add(done.bad_host)
        if attempt + 1 < MAX_ATTEMPTS:
            heapq.heappush(queue, (t + RESTART_S, 1, j, attempt + 1, None))
    final = policy.excluded(end)
    account(end, final)
    span = end - (jobs[0].arrive if jobs else end)
    res.excluded = sorted(fleet.names[h] for h in final)
    res.jobs_delayed = len(delayed)
    res.bad_time_out = out_bad / (span * len(fleet.bad)) if span > 0 else 0.0
    res.good_gpu_h_out = out_good * GPUS / HOUR
    res.good_ever_out = sum(good[h] for h in ever)
    res.ever_excluded = sorted(fleet.names[h] for h in ever)
    if isinstance(policy, ElasticDiag):
        res.recommendation = policy.recommendation(end)
    return res


def run_all(*, jobs: int, hosts: int, days: float, seed: int, keep_ledger_stream: bool = True,
            policies: tuple[str, ...] = POLICIES) -> tuple[Fleet, dict[str, Result]]:  # fmt: skip
    fleet = make_fleet(hosts, seed)
    stream = make_jobs(jobs, days, seed)
    end = T0 + days * DAY_S
    return fleet, {p: simulate(p, stream, fleet, seed=seed, end=end, keep=keep_ledger_stream and p == "elastic_diag")
                   for p in policies}  # fmt: skip


def ledger_check(res: Result, fleet: Fleet, path: Path, *, rank_hosts: bool = True) -> dict[str, Any]:
    """The policy's whole verdict stream into a SQLite ledger; fleet_view's exclusion list at the end against the
    policy's last recommendation. ``rank_hosts=False``: the rows without their rank -> host maps (which the fleet
    never reads, and which ``Verdict.to_row`` copies slowly)."""
    rows = [verdict_of(a, fleet, rank_hosts=rank_hosts).to_row() for a in res.history]
    ledger = Ledger(f"sqlite:///{path}")
    t = time.perf_counter()
    ledger.insert_many(rows)
    inserted = time.perf_counter() - t
    t = time.perf_counter()
    view = fleet_view(ledger, ExclusionRule(), now=res.end)
    viewed = time.perf_counter() - t
    ledger.close()
    return {"verdicts": len(rows), "failed": sum(r["status"] != "succeeded" for r in rows),
            "node_blamed": sum(r["blame"] == "node" for r in rows), "insert_s": round(inserted, 3),
            "fleet_view_s": round(viewed, 3), "fleet_view_exclude": view["exclude"],
            "policy_recommendation": res.recommendation, "agree": set(view["exclude"]) == set(res.recommendation),
            "same_order": view["exclude"] == res.recommendation,
            "widespread": [(w["signature"], w["blame"], w["hosts"], w["jobs"])
                           for w in view["widespread"]]}  # fmt: skip


# -- many verdicts -----------------------------------------------------------------------------------------
def verdict_rows(n: int, hosts: int, seed: int, days: float = 14.0) -> Iterator[dict[str, Any]]:
    """``n`` verdict rows of the simulation's mix (no exclusion) over ``days`` days ending at the middle of the last
    day; an attempt still running then is left out."""
    fleet = make_fleet(hosts, seed)
    rng = random.Random(f"verdicts:{seed}")
    now = T0 + (days + 0.5) * DAY_S
    made, idx = 0, 0
    while made < n:
        job = new_job(idx, T0 + rng.random() * (now - T0), rng)
        idx += 1
        start = job.arrive
        for attempt in range(MAX_ATTEMPTS):
            a = run_attempt(job, attempt, start, fleet, seed, frozenset())
            if a.end > now or made >= n:
                break
            yield verdict_of(a, fleet).to_row()
            made += 1
            if a.cause is None:
                break
            start = a.end + RESTART_S


def many_verdicts(n: int, hosts: int, seed: int, batch: int = 200_000, keep: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = keep or Path(tmp) / "ledger.sqlite"
        for old in (path, *path.parent.glob(path.name + "-*")):
            old.unlink(missing_ok=True)
        return _many_verdicts(n, hosts, seed, batch, path)


def _many_verdicts(n: int, hosts: int, seed: int, batch: int, path: Path) -> dict[str, Any]:
    now = T0 + 14.5 * DAY_S
    build = insert = 0.0
    failed = 0
    fps: set[str] = set()
    node_rows: list[tuple[Any, ...]] = []
    ledger = Ledger(f"sqlite:///{path}")
    rows = verdict_rows(n, hosts, seed)
    while True:
        t = time.perf_counter()
        chunk = [r for _, r in zip(range(batch), rows, strict=False)]
        build += time.perf_counter() - t
        if not chunk:
            break
        failed += sum(r["status"] != "succeeded" for r in chunk)
        node_rows += [(r["initiating_host"], r["job_id"], r["fingerprint"], r["recorded_at"]) for r in chunk
                      if r["blame"] == "node" and r["status"] != "succeeded"]  # fmt: skip
        fps.update(r["fingerprint"] for r in chunk if r["fingerprint"])
        t = time.perf_counter()
        ledger.insert_many(chunk)
        insert += time.perf_counter() - t
    ledger.close()  # the writer gone (its WAL checkpointed): what `elastic-diag fleet` in another process reads
    size = sum(p.stat().st_size for p in (path, *path.parent.glob(path.name + "-*")))
    ledger = Ledger(f"sqlite:///{path}")
    times = []
    view: dict[str, Any] = {}
    for _ in range(3):
        t = time.perf_counter()
        view = fleet_view(ledger, ExclusionRule(), now=now)
        times.append(time.perf_counter() - t)
    ledger.close()
    rule = sorted(
        set(recommended(node_failures(node_rows)[0], ExclusionRule())) | set(held(node_rows, ExclusionRule(), now))
    )
    bad = {make_fleet(hosts, seed).names[h] for h in make_fleet(hosts, seed).bad}
    return {"verdicts": n, "failed": failed, "node_blamed": len(node_rows), "fingerprints": len(fps), "hosts": hosts,
            "build_s": round(build, 1), "insert_s": round(insert, 1), "file_mb": round(size / 1e6),
            "fleet_view_s": [round(x, 3) for x in times], "fleet_view_best_s": round(min(times), 3),
            "window_verdicts": view["verdicts"], "window_failed": view["failed"], "exclude": view["exclude"],
            "exclude_bad": len(set(view["exclude"]) & bad), "rule_agrees": set(rule) == set(view["exclude"]),
            "widespread": len(view["widespread"])}  # fmt: skip


# -- output ------------------------------------------------------------------------------------------------
def table(results: dict[str, Result]) -> list[str]:
    head = ("policy", "out", "bad", "prec", "recall", "bad time", "good ever", "good GPU-h",
            "node fail", "node GPU-h", "repeats", "repeat GPU-h", "jobs delayed")  # fmt: skip
    rows = [head]
    for name, r in results.items():
        rows.append((name, str(len(r.excluded)), str(r.true_pos), f"{r.precision:.2f}", f"{r.recall:.2f}",
                     f"{100 * r.bad_time_out:.0f}%", str(r.good_ever_out), f"{r.good_gpu_h_out:,.0f}",
                     str(r.node_failures), f"{r.node_gpu_h:,.0f}", str(r.repeat_failures), f"{r.repeat_gpu_h:,.0f}",
                     str(r.jobs_delayed)))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in rows]  # fmt: skip


MEAN_FIGURES = ("precision", "recall", "bad_host_time_kept_out", "good_host_gpu_hours_kept_out", "node_failures",
                "repeat_failures", "repeat_gpu_hours_lost", "jobs_delayed")  # fmt: skip


def means(runs: list[dict[str, Result]]) -> dict[str, dict[str, float]]:
    """Per policy, the mean of each figure over the seeds' runs."""
    return {p: {k: round(sum(run[p].figures()[k] for run in runs) / len(runs), 3) for k in MEAN_FIGURES}
            for p in runs[0]}  # fmt: skip


def mean_table(m: dict[str, dict[str, float]]) -> list[str]:
    head = ("policy", "prec", "recall", "bad time", "good GPU-h", "node fail", "repeats", "repeat GPU-h",
            "jobs delayed")  # fmt: skip
    rows = [head] + [(p, f"{f['precision']:.2f}", f"{f['recall']:.2f}", f"{100 * f['bad_host_time_kept_out']:.0f}%",
                      f"{f['good_host_gpu_hours_kept_out']:,.0f}", f"{f['node_failures']:.1f}",
                      f"{f['repeat_failures']:.1f}", f"{f['repeat_gpu_hours_lost']:,.0f}", f"{f['jobs_delayed']:.1f}")
                     for p, f in m.items()]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in rows]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--hosts", type=int, default=1_000)
    ap.add_argument("--days", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=3, help="also the mean over this many seeds (seed, seed+1, ...)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--ledger", type=Path, help="keep the SQLite ledger here (else a temp file; replaced if there)")
    ap.add_argument("--verdicts", type=int, help="instead: time fleet_view over a ledger of this many verdicts")
    a = ap.parse_args()
    started = time.perf_counter()
    if a.verdicts:
        out = many_verdicts(a.verdicts, a.hosts, a.seed, keep=a.ledger)
        print(f"{out['verdicts']:,} verdicts ({out['failed']:,} failed, {out['node_blamed']:,} blamed on the node, "
              f"{out['fingerprints']:,} fingerprints) on {a.hosts} hosts over 14 days: rows built in "
              f"{out['build_s']} s, insert_many {out['insert_s']} s ({out['file_mb']} MB)")  # fmt: skip
        print(f"fleet_view: {', '.join(f'{x:.3f}' for x in out['fleet_view_s'])} s, best "
              f"{out['fleet_view_best_s']:.3f} s (target < 1 s); {len(out['exclude'])} hosts to exclude "
              f"({out['exclude_bad']} of the 10 bad; {'the same as' if out['rule_agrees'] else 'NOT'} the rule over "
              f"the node rows in Python), {out['widespread']} widespread fingerprints listed")  # fmt: skip
        ok = out["fleet_view_best_s"] < 1.0 and out["rule_agrees"]
    else:
        fleet, results = run_all(jobs=a.jobs, hosts=a.hosts, days=a.days, seed=a.seed)
        base = results["none"]
        print(f"{a.hosts} hosts x {GPUS} GPUs, {a.jobs:,} jobs over {a.days:g} days, seed {a.seed}; bad hosts: "
              + ", ".join(f"{fleet.names[h]} ({b.kind}{f' Xid {b.code}' if b.code else ''}, p={b.p_fail})"
                          for h, b in sorted(fleet.bad.items())))  # fmt: skip
        share = base.failed / base.attempts if base.attempts else 0.0
        print(f"no exclusion: {base.attempts:,} attempts, {base.failed:,} failed ({100 * share:.1f}%): "
              + ", ".join(f"{c} {n}" for c, n in base.causes.most_common()))  # fmt: skip
        print()
        for line in table(results):
            print(line)
        print("\nout/bad: hosts kept out at the end / of them bad; bad time: the share of the bad hosts' time kept "
              "out; good ever / GPU-h: good hosts ever kept out, their GPU-hours kept out; repeats: failures by a bad "
              "host that had failed a job before")  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            path = a.ledger or Path(tmp) / "ledger.sqlite"
            if path.exists():
                path.unlink()
            check = ledger_check(results["elastic_diag"], fleet, path)
        print(f"\nledger: {check['verdicts']:,} verdicts ({check['failed']:,} failed, {check['node_blamed']} on the "
              f"node) inserted in {check['insert_s']} s; fleet_view {check['fleet_view_s']} s")  # fmt: skip
        print(f"  fleet_view exclude:        {check['fleet_view_exclude']}")
        print(f"  the policy's last verdict: {check['policy_recommendation']}")
        print(
            f"  {'the same hosts' if check['agree'] else 'DIFFERENT HOSTS'}"
            f"{'' if check['same_order'] else ' (fleet_view orders ties by all their failures, the rule by name)'}; "
            f"{len(check['widespread'])} widespread fingerprints listed"
        )
        ed, naive, fact = results["elastic_diag"], results["naive"], results["fact"]
        ok = check["agree"] and ed.precision >= max(naive.precision, fact.precision) and ed.recall >= fact.recall
        out = {"params": {"jobs": a.jobs, "hosts": a.hosts, "days": a.days, "seed": a.seed},
               "bad_hosts": {fleet.names[h]: {"kind": b.kind, "p_fail": b.p_fail, "xid": b.code or None}
                             for h, b in sorted(fleet.bad.items())},
               "policies": {name: r.figures() for name, r in results.items()}, "ledger": check}  # fmt: skip
        if a.seeds > 1:
            runs = [results] + [run_all(jobs=a.jobs, hosts=a.hosts, days=a.days, seed=s, keep_ledger_stream=False)[1]
                                for s in range(a.seed + 1, a.seed + a.seeds)]  # fmt: skip
            out["means"] = means(runs)
            print(f"\nthe mean over seeds {a.seed}-{a.seed + a.seeds - 1}:")
            for line in mean_table(out["means"]):
                print(line)
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(f"\n{out['seconds']} s")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2, default=list) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

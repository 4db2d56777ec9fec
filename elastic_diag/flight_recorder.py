"""Flight-recorder dumps of every rank, compared: where the collective schedules part.

Pure (no torch). Reads torch's flight-recorder JSON (``_dump_fr_trace_json``, version 2.x), the
same wrapped in elastic_diag's ``fr_trace.json``, or torch's pickle dumps through an unpickler that
only builds plain containers. Robust to what torch 2.13 gets wrong: gloo's ``pg_config`` (empty
names, ``'[]'`` ranks) is never used; groups are keyed by the entries' own ``process_group``.

For one attempt, :func:`compare` looks at each process group's collectives by sequence number:

* the first sequence number where the ranks disagree on the op, the sizes or the dtypes: the rank
  (or ranks) in the minority is where the schedules part. It is ``collective_desync`` when what the
  minority issued there is a collective the majority also issues elsewhere in its schedule (a
  collective skipped or added), ``collective_mismatch`` when it is not (a shape, dtype or op that
  the others never use);
* otherwise, a collective the others entered and never completed while one rank never entered it:
  that rank is missing from it (``missing``).

Dumps can be truncated, of another version, or absent for a rank that died by a signal; what
cannot be read is reported in ``problems`` and the rest is still compared.
"""

from __future__ import annotations

import io
import json
import pickle
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MAX_ENTRIES = 20_000


@dataclass(frozen=True, slots=True)
class Collective:
    seq: int
    op: str
    sizes: str  # input sizes, as text: "[[1]]"
    dtypes: str
    time_ns: int | None

    @property
    def shape(self) -> tuple[str, str, str]:
        return (self.op, self.sizes, self.dtypes)

    def describe(self) -> str:
        return f"{self.op} sizes {self.sizes} {self.dtypes}"


@dataclass(frozen=True, slots=True)
class RankRecord:
    rank: int
    groups: dict[str, dict[int, Collective]]  # process group -> seq -> collective
    status: dict[str, tuple[int, int]]  # process group id -> (last enqueued, last completed)
    version: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # "desync" | "mismatch" | "missing"
    ranks: tuple[int, ...]  # where the schedules part (the minority), or the ranks missing
    group: str
    seq: int
    sides: dict[int, str]  # rank -> what it issued at that sequence number ("-" for nothing)
    summary: str


@dataclass(slots=True)
class Comparison:
    finding: Finding | None = None
    lags: dict[int, float] = field(default_factory=dict)  # rank -> median lateness entering collectives, s
    problems: list[str] = field(default_factory=list)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flight-recorder dump")


def load_dump(raw: bytes) -> dict[str, Any]:
    """One dump file's content as a dict (JSON, elastic_diag's wrapper, or a plain-data pickle)."""
    text = raw.lstrip()
    data = json.loads(raw) if text[:1] == b"{" else _SafeUnpickler(io.BytesIO(raw)).load()
    if not isinstance(data, dict):
        raise ValueError("not a flight-recorder dump (no top-level object)")
    if isinstance(data.get("trace"), dict):
        inner = dict(data["trace"])
        inner.setdefault("_reason", data.get("reason"))
        data = inner
    if "entries" not in data and "pg_status" not in data:
        raise ValueError("not a flight-recorder dump (no entries, no pg_status)")
    return data


def _group_key(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, list | tuple) and pg:
        return str(pg[1] if len(pg) > 1 and pg[1] else pg[0])
    return str(entry.get("pg_id", "?"))


def parse_record(rank: int, data: dict[str, Any]) -> RankRecord:
    groups: dict[str, dict[int, Collective]] = {}
    entries = data.get("entries") or []
    if not isinstance(entries, list):
        entries = []
    for e in entries[-MAX_ENTRIES:]:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        seq = e.get("collective_seq_id")
        if not isinstance(seq, int) or seq <= 0:
            continue
        t = e.get("time_created_ns")
        groups.setdefault(_group_key(e), {})[seq] = Collective(
            seq=seq,
            op=str(e.get("profiling_name") or "?").split(":")[-1],
            sizes=json.dumps(e.get("input_sizes"), separators=(",", ":")),
            dtypes=",".join(str(d) for d in e.get("input_dtypes") or []),
            time_ns=t if isinstance(t, int) else None,
        )
    status: dict[str, tuple[int, int]] = {}
    for pg, st in (data.get("pg_status") or {}).items():
        if isinstance(st, dict):
            try:
                status[str(pg)] = (
                    int(st.get("last_enqueued_collective", -1)),
                    int(st.get("last_completed_collective", -1)),
                )
            except (TypeError, ValueError):
                continue
    reason = data.get("_reason")
    return RankRecord(rank=rank, groups=groups, status=status, version=str(data.get("version")),
                      reason=str(reason) if reason else None)  # fmt: skip


def _join(ranks: list[int] | tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def compare(records: dict[int, RankRecord], expected: list[int] | None = None) -> Comparison:
    """Compare the ranks' schedules; ``expected``: every rank of the attempt (to name missing dumps)."""
    out = Comparison()
    if expected is not None:
        absent = [r for r in expected if r not in records]
        if absent:
            out.problems.append(f"no flight-recorder dump from rank(s) {_join(absent)}")
    if len(records) < 2:
        return out
    group_names = sorted({g for rec in records.values() for g in rec.groups})
    for group in group_names:
        finding = _first_divergence(group, records)
        if finding is not None:
            out.finding = finding
            break
    if out.finding is None:
        for group in group_names:
            finding = _missing_from_collective(group, records)
            if finding is not None:
                out.finding = finding
                break
    out.lags = lateness(records)
    return out


def _first_divergence(group: str, records: dict[int, RankRecord]) -> Finding | None:
    by_rank = {r: rec.groups.get(group, {}) for r, rec in records.items()}
    if sum(1 for s in by_rank.values() if s) < 2:
        return None
    # only the window every rank still holds (ring buffers forget the oldest entries)
    low = max(min(s) for s in by_rank.values() if s)
    seqs = sorted({q for s in by_rank.values() for q in s if q >= low})
    for seq in seqs:
        present = {r: s[seq] for r, s in by_rank.items() if seq in s}
        if len(present) < 2:
            continue
        counts = Counter(c.shape for c in present.values())
        if len(counts) < 2:
            continue
        majority_shape, majority_n = counts.most_common(1)[0]
        if list(counts.values()).count(majority_n) > 1:
            continue  # no majority (e.g. 2 ranks against 2): cannot say who parted
        minority = sorted(r for r, c in present.items() if c.shape != majority_shape)
        majority_shapes = {c.shape for r, s in by_rank.items() if r not in minority for c in s.values()}
        desync = all(present[r].shape in majority_shapes for r in minority)
        sides = {r: c.describe() for r, c in sorted(present.items())}
        kind = "desync" if desync else "mismatch"
        what = "issued a different collective" if desync else "issued the same collective with other sizes/dtypes/op"
        example = next(c for c in present.values() if c.shape == majority_shape)
        summary = (
            f"process group {group}, collective #{seq}: rank(s) {_join(minority)} {what} "
            f"({present[minority[0]].describe()}) than the other {majority_n} rank(s) ({example.describe()})"
        )
        return Finding(kind=kind, ranks=tuple(minority), group=group, seq=seq, sides=sides, summary=summary)
    return None


def _missing_from_collective(group: str, records: dict[int, RankRecord]) -> Finding | None:
    last = {r: max(rec.groups.get(group, {}) or [0]) for r, rec in records.items()}
    top = max(last.values())
    if top <= 0:
        return None
    behind = sorted(r for r, q in last.items() if q < top)
    if not behind or len(behind) * 2 >= len(last):
        return None
    ahead = [r for r in last if r not in behind]
    pending = [r for r in ahead if _pending(records[r], group, top)]
    if not pending:
        return None
    op = next(records[r].groups[group][top] for r in ahead).describe()
    sides = {r: (records[r].groups[group][top].describe() if r in ahead else "-") for r in sorted(last)}
    summary = (
        f"process group {group}, collective #{top} ({op}): rank(s) {_join(ahead)} entered it and wait; "
        f"rank(s) {_join(behind)} never entered it (last entered #{', #'.join(str(last[r]) for r in behind)})"
    )
    return Finding(kind="missing", ranks=tuple(behind), group=group, seq=top, sides=sides, summary=summary)


def _pending(rec: RankRecord, group: str, seq: int) -> bool:
    """Entered ``seq`` and not completed it (from pg_status when the group's id is known)."""
    if not rec.status:
        return True
    return any(enq >= seq > done for enq, done in rec.status.values())


def lateness(records: dict[int, RankRecord]) -> dict[int, float]:
    """Per rank, the mean over collectives of how late it entered them against the median rank
    (seconds): a straggler enters every collective late. Empty with fewer than 3 ranks."""
    return {r: statistics.fmean(v) for r, v in lateness_samples(records).items() if len(v) >= 5}


def lateness_samples(records: dict[int, RankRecord]) -> dict[int, list[float]]:
    """Per rank, how late it entered each collective that every rank recorded, against the median
    rank (seconds). Empty with fewer than 3 ranks (no median to speak of)."""
    if len(records) < 3:
        return {}
    lags: dict[int, list[float]] = {r: [] for r in records}
    for group in {g for rec in records.values() for g in rec.groups}:
        seqs = set.intersection(*(set(rec.groups.get(group, {})) for rec in records.values()))
        for seq in seqs:
            times = {r: rec.groups[group][seq].time_ns for r, rec in records.items()}
            if any(t is None for t in times.values()):
                continue
            mid = statistics.median(t for t in times.values() if t is not None)
            for r, t in times.items():
                if t is not None:
                    lags[r].append((t - mid) / 1e9)
    return lags

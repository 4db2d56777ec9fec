"""The ranks' collective calls compared by what the flight recorder does not keep: roots, peers and groups.

Each rank's beacon records (``worker/calls.py``, ``calls.json`` in the rank folder) the root of every
broadcast, reduce, gather and scatter, the peer of every send and recv, and every ``new_group`` call.
Three ways a rank's call differs from its peers' while every flight-recorder entry looks the same:

* **root**: the k-th rooted collective of a process group has the same op on every rank but another root
  on some (a ``src`` computed from rank-local data: the rank with the best checkpoint, a stale config);
* **new_group**: every rank must call ``new_group`` with the same ranks in the same order, members or not;
  a rank that skipped one (``if rank in ranks: new_group(ranks)``) names every later group differently;
* **p2p**: the sends from A to B and the receives on B from A do not pair (a pipeline stage that skipped
  its send; a rank receiving from the wrong peer). When no rank sent anything at all (every rank waits in a
  receive: a cycle), no pairing explains it and this says nothing.

For root and new_group the rank (or ranks) in the minority is where the call differs; with no majority
(two ranks, or two sides of equal size) no rank is named, and both sides are said. Unpaired sends and
receives name no rank: the two sides are given (which one is wrong depends on the program).

Pure: no torch, no I/O. ``calls.json`` is untrusted input: anything else than the documented shape is
skipped.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_diag.core.verdict import format_ranks

ROOTED = ("broadcast", "reduce", "gather", "scatter")
MAX_READ = 4096  # calls read from one rank's file


@dataclass(frozen=True, slots=True)
class Call:
    op: str
    group: str
    root: int | None  # the root of a rooted collective, the peer of a send or recv (group ranks)
    where: str | None = None
    time: float | None = None


@dataclass(frozen=True, slots=True)
class RankCalls:
    """One rank's record: its last calls, its send/recv counts by (op, group, peer), its new_group calls."""

    calls: tuple[Call, ...] = ()
    p2p: Mapping[tuple[str, str, int], int] = field(default_factory=dict)
    new_groups: tuple[tuple[tuple[int, ...] | None, str | None], ...] = ()
    complete: bool = True  # the calls were not cut to the last MAX_CALLS


@dataclass(frozen=True, slots=True)
class CallSplit:
    """Where the ranks' calls differ. ``ranks``: the minority (empty: no majority, or p2p); ``sides``: what
    each side called, as said in the verdict."""

    kind: str  # root | new_group | p2p
    ranks: tuple[int, ...]
    summary: str
    lines: tuple[str, ...]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and -1 <= value < 1 << 31 else None


def _text(value: Any, limit: int = 300) -> str | None:
    return value[:limit] if isinstance(value, str) and value else None


def calls_from_json(data: Any) -> RankCalls | None:
    """A ``calls.json`` as a record; None for anything that is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("calls"), list):
        return None
    calls = []
    for c in data["calls"][:MAX_READ]:
        if not isinstance(c, dict) or not isinstance(c.get("op"), str) or not isinstance(c.get("group"), str):
            continue
        t = c.get("time")
        when = float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None
        calls.append(Call(op=c["op"][:40], group=c["group"][:200], root=_int(c.get("root")),
                          where=_text(c.get("where")), time=when))  # fmt: skip
    p2p: dict[tuple[str, str, int], int] = {}
    counts = data.get("p2p_counts")
    for key, n in counts.items() if isinstance(counts, dict) else ():
        parts = key.split("|") if isinstance(key, str) else []
        if len(parts) == 3 and parts[0] in ("send", "recv") and parts[2].isdigit() and _int(n) is not None:
            p2p[(parts[0], parts[1][:200], int(parts[2]))] = int(n)
    groups = []
    for g in data.get("new_groups") or [] if isinstance(data.get("new_groups"), list) else []:
        if not isinstance(g, dict):
            continue
        ranks = g.get("ranks")
        listed = tuple(r for r in ranks if _int(r) is not None)[:4096] if isinstance(ranks, list) else None
        groups.append((listed, _text(g.get("where"))))
    maximum = _int(data.get("max_calls"))
    return RankCalls(calls=tuple(calls), p2p=p2p, new_groups=tuple(groups)[:MAX_READ],
                     complete=maximum is None or len(calls) < maximum)  # fmt: skip


# the fact lines a verdict prints (CallSplit.lines): read back from a console, they are the same evidence
_ROOT_LINE = re.compile(
    r"^rank (?P<rank>\d+): (?P<op>broadcast|reduce|gather|scatter)\(root=(?P<root>-?\d+|None)\) "
    r"#(?P<k>\d+) of process group (?P<group>\S+?)(?: at (?P<where>.+))?$"
)
_GROUP_LINE = re.compile(
    r"^rank (?P<rank>\d+): new_group call #(?P<k>\d+): (?:new_group\((?P<ranks>\[[\d, ]*\]|None)\)"
    r"|none)(?: at (?P<where>.+))?$"
)
_P2P_LINE = re.compile(r"^rank (?P<rank>\d+): (?P<calls>(?:(?:send\(dst|recv\(src)=\d+\) x\d+(?:, )?)+)$")
_P2P_CALL = re.compile(r"(send|recv)\((?:dst|src)=(\d+)\) x(\d+)")
MAX_INDEX = 4096


def calls_from_lines(lines: list[str], world_group: str = "0") -> dict[int, RankCalls]:
    """The calls a verdict's fact lines show, per rank (``rank 2: broadcast(root=2) #1 of process group 0 at
    ...``, ``rank 2: new_group call #1: new_group([1, 2])``, ``rank 1: send(dst=2) x2``): a console pasted
    whole carries what the rank folders had. The calls before the one shown are unknown and alike."""
    found: dict[int, dict[str, Any]] = {}
    for text in lines:
        text = text.strip()
        if (m := _ROOT_LINE.match(text)) and int(m["k"]) <= MAX_INDEX:
            k, group, root = int(m["k"]), m["group"], m["root"]
            calls = [Call(op=m["op"], group=group, root=None) for _ in range(k - 1)]
            calls.append(Call(op=m["op"], group=group, root=int(root) if root != "None" else None, where=m["where"]))
            found.setdefault(int(m["rank"]), {})["calls"] = tuple(calls)
        elif (m := _GROUP_LINE.match(text)) and int(m["k"]) <= MAX_INDEX:
            known: list[tuple[tuple[int, ...] | None, str | None]] = [((), None)] * (int(m["k"]) - 1)
            if m["ranks"] is not None:
                ranks = tuple(int(r) for r in re.findall(r"\d+", m["ranks"])) if m["ranks"] != "None" else None
                known.append((ranks, m["where"]))
            found.setdefault(int(m["rank"]), {})["new_groups"] = tuple(known)
        elif m := _P2P_LINE.match(text):
            p2p = {(op, world_group, int(peer)): int(n) for op, peer, n in _P2P_CALL.findall(m["calls"])}
            found.setdefault(int(m["rank"]), {})["p2p"] = p2p
    return {rank: RankCalls(**fields) for rank, fields in found.items()}


def _majority(values: Mapping[int, Any]) -> tuple[Any, list[int]] | None:
    """The value most ranks share and the ranks that differ from it; None when no value has a majority
    (two sides of equal size)."""
    counts = Counter(values.values())
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:
        return None
    return top, sorted(r for r, v in values.items() if v != top)


def _sides(values: Mapping[int, Any], say: Any) -> str:
    by: dict[Any, list[int]] = {}
    for r, v in values.items():
        by.setdefault(v, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(sorted(rs))} {say(v)}" for v, rs in by.items())


def _where(record: RankCalls, index: int, group: str) -> str | None:
    mine = [c for c in record.calls if c.group == group and c.op in ROOTED]
    return mine[index].where if index < len(mine) else None


def _roots(by_rank: Mapping[int, RankCalls]) -> CallSplit | None:
    """The first rooted collective of a group whose root differs between ranks."""
    groups = sorted({c.group for rc in by_rank.values() for c in rc.calls if c.op in ROOTED})
    for group in groups:
        seqs = {r: [c for c in rc.calls if c.group == group and c.op in ROOTED] for r, rc in by_rank.items()
                if rc.complete}  # fmt: skip
        seqs = {r: s for r, s in seqs.items() if s}
        if len(seqs) < 2:
            continue
        for k in range(max(len(s) for s in seqs.values())):
            at = {r: (s[k].op, s[k].root) for r, s in seqs.items() if k < len(s)}
            if len(at) < 2 or len({op for op, _ in at.values()}) != 1 or len(set(at.values())) == 1:
                continue
            op = next(iter(at.values()))[0]
            say = lambda v: f"called {v[0]} with root {v[1]}"  # noqa: E731
            sides = _sides(at, say)
            where = {r: _where(by_rank[r], k, group) for r in at}
            lines = tuple(f"rank {r}: {op}(root={at[r][1]}) #{k + 1} of process group {group}"
                          + (f" at {where[r]}" if where[r] else "") for r in sorted(at))  # fmt: skip
            found = _majority(at)
            if found is None:
                return CallSplit("root", (), f"the ranks did not join the same {op} #{k + 1} of process group {group}: "
                                 f"they passed different roots, with no majority ({sides})", lines)  # fmt: skip
            _, odd = found
            return CallSplit("root", tuple(odd), f"rank{'s' if len(odd) > 1 else ''} {format_ranks(odd)} did not join "
                             f"the others' {op} #{k + 1} of process group {group}: {'it' if len(odd) == 1 else 'they'} "
                             f"passed another root ({sides})", lines)  # fmt: skip
    return None


def _new_groups(by_rank: Mapping[int, RankCalls]) -> CallSplit | None:
    """The first ``new_group`` call that differs between ranks (a rank that skipped one, or passed other
    ranks)."""
    seqs = {r: rc.new_groups for r, rc in by_rank.items()}
    if len(seqs) < 2 or not any(seqs.values()):
        return None
    for k in range(max(len(s) for s in seqs.values())):
        at = {r: (s[k][0] if k < len(s) else "none") for r, s in seqs.items()}
        if len(set(at.values())) == 1:
            continue

        def say(v: Any) -> str:
            return "made no such call" if v == "none" else f"called new_group({list(v) if v is not None else 'None'})"

        sides = _sides(at, say)
        lines = tuple(f"rank {r}: new_group call #{k + 1}: "
                      + (f"new_group({list(v) if v is not None else None})" if v != "none" else "none")
                      + (f" at {seqs[r][k][1]}" if k < len(seqs[r]) and seqs[r][k][1] else "")
                      for r, v in sorted(at.items()))  # fmt: skip
        found = _majority(at)
        rule = ("every rank must make the same new_group calls in the same order, members or not, or the groups "
                "after it get other names on it")  # fmt: skip
        if found is None:
            return CallSplit("new_group", (), f"the ranks did not join the same new_group call #{k + 1}, with no "
                             f"majority ({sides}); {rule}", lines)  # fmt: skip
        _, odd = found
        return CallSplit("new_group", tuple(odd), f"rank{'s' if len(odd) > 1 else ''} {format_ranks(odd)} did not "
                         f"join the others' new_group call #{k + 1} ({sides}); {rule}", lines)  # fmt: skip
    return None


def _p2p(by_rank: Mapping[int, RankCalls]) -> CallSplit | None:
    """Sends from A to B that B's receives from A do not match in number (the world group only: its group
    ranks are the global ranks)."""
    world = _world_group(by_rank)
    if world is None or not any(op == "send" and n for rc in by_rank.values() for (op, _, _), n in rc.p2p.items()):
        return None  # no rank sent anything: every rank waits in a receive, a deadlock no pairing explains
    for a in sorted(by_rank):
        for b in sorted(by_rank):
            if a == b:
                continue
            sent = by_rank[a].p2p.get(("send", world, b), 0)
            received = by_rank[b].p2p.get(("recv", world, a), 0)
            if sent == received:
                continue
            summary = (f"ranks {a} and {b} did not join the same transfer: rank {a}'s sends to rank {b} and rank "
                       f"{b}'s receives from rank {a} do not pair (rank {a} called send(dst={b}) {sent} time(s), rank "
                       f"{b} called recv(src={a}) {received} time(s)); one side skipped its call or addressed another "
                       "peer")  # fmt: skip
            lines = tuple(f"rank {r}: " + ", ".join(f"{op}({'dst' if op == 'send' else 'src'}={peer}) x{n}"
                                                     for (op, g, peer), n in sorted(by_rank[r].p2p.items())
                                                     if g == world) for r in (a, b))  # fmt: skip
            return CallSplit("p2p", (), summary, lines)
    return None


def _world_group(by_rank: Mapping[int, RankCalls]) -> str | None:
    """The name of the default group: the one with p2p calls that every rank's record has (torch names it
    "0")."""
    names = {g for rc in by_rank.values() for (_, g, _) in rc.p2p}
    if "0" in names:
        return "0"
    return next(iter(names)) if len(names) == 1 else None


def compare_calls(by_rank: Mapping[int, RankCalls]) -> CallSplit | None:
    """Where the ranks' calls differ, first by new_group (a skipped one shifts everything after it), then by
    root, then by send/recv pairing; None when they agree or fewer than two ranks recorded calls."""
    if len(by_rank) < 2:
        return None
    return _new_groups(by_rank) or _roots(by_rank) or _p2p(by_rank)

"""The taxonomy of failure signatures: frozen records loaded from the TOML files beside this module.

A :class:`Signature` is knowledge, not code (the signature entry of docs/report.md): the lines that mark a failure
(``patterns``, with ``near_misses`` that must not match), or the exception types and signals that
do, what it means, how to confirm it, the fix, a command that verifies the fix, and its look-alikes.
``docs/signatures/`` is generated from the same records.

This package never imports torch.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Literal, cast, get_args

from elastic_diag.core.literal_set import LiteralSet
from elastic_diag.errors import TaxonomyError

FAILURE_CLASSES = (
    "python_exception",
    "segfault",
    "abort",
    "killed",
    "host_oom",
    "cuda_oom",
    "cuda_error",
    "silent_exit",
    "hang",
    "collective_desync",
    "collective_mismatch",
    "collective_timeout",
    "network_error",
    "io_error",
    "rendezvous_timeout",
    "port_conflict",
    "nan_inf",
    "straggler",
    "healthy",
    "unknown",
)
RoleHint = Literal["initiating", "collateral", "either"]  # what a matching line says of its rank
ROLE_HINTS: tuple[RoleHint, ...] = get_args(RoleHint)
# what a failure of the signature can be blamed on (the ledger, docs/fleet.md): only ``node`` counts against a host
Blame = Literal["node", "job", "infra", "unknown"]
BLAMES: tuple[Blame, ...] = get_args(Blame)


@dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    id: str
    failure_class: str
    title: str
    role_hint: RoleHint
    retryable: bool
    blame: Blame
    meaning: str
    confirm: tuple[str, ...]
    fix: str
    verify: str
    sources: tuple[str, ...] = ()  # the patterns' texts: compiled on first use (:attr:`patterns`)
    near_misses: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    exception_types: tuple[str, ...] = ()
    signals: tuple[str, ...] = ()
    siblings: tuple[str, ...] = ()
    priority: int = 0  # higher wins when several signatures match one rank's evidence
    literals: tuple[str, ...] = field(default=())  # cheap substrings that every match must contain
    # a framework's wrapper exception, raised on every rank, whose text names the rank(s) that failed
    # (groups ``peers``): that rank is the culprit and the inner error gives the class
    wraps: bool = False
    _compiled: list[tuple[re.Pattern[str], ...]] = field(default_factory=list, repr=False, compare=False, hash=False)

    @property
    def patterns(self) -> tuple[re.Pattern[str], ...]:
        """The lines that mark the failure, compiled the first time they are needed: a log rarely admits more
        than a few signatures (see :meth:`Taxonomy.match_line`), and compiling all of them is most of the
        start-up of ``elastic-diag analyze``."""
        if not self._compiled:
            self._compiled.append(tuple(re.compile(p) for p in self.sources))
        return self._compiled[0]

    def __post_init__(self) -> None:
        if self.failure_class not in FAILURE_CLASSES:
            raise TaxonomyError(f"signature {self.id!r}: unknown class {self.failure_class!r}")
        if self.role_hint not in ROLE_HINTS:
            raise TaxonomyError(f"signature {self.id!r}: role_hint must be one of {ROLE_HINTS}")
        if self.blame not in BLAMES:
            raise TaxonomyError(f"signature {self.id!r}: blame must be one of {BLAMES}")

    def search(self, line: str) -> re.Match[str] | None:
        """The first pattern match in ``line``, or None."""
        if self.literals:  # a plain loop: this runs for every signature on every line (no generator)
            for lit in self.literals:
                if lit in line:
                    break
            else:
                return None
        for pattern in self.patterns:
            m = pattern.search(line)
            if m:
                return m
        return None


_FIELDS = {
    "id", "class", "title", "role_hint", "retryable", "blame", "meaning", "confirm", "fix", "verify",
    "patterns", "near_misses", "examples", "exception_types", "signals", "siblings", "priority",
    "literals", "wraps",
}  # fmt: skip


def _signature_from_table(table: dict[str, object], source: str, *, checked: bool = False) -> Signature:
    """A signature from its TOML table; ``checked``: the table comes from the compiled taxonomy, whose patterns
    compiled when it was written (they are compiled on first use)."""
    unknown = set(table) - _FIELDS
    sid = str(table.get("id", "?"))
    if unknown:
        raise TaxonomyError(f"{source}: signature {sid!r} has unknown fields {sorted(unknown)}")
    sources = tuple(str(p) for p in table.get("patterns", ()))  # type: ignore[attr-defined]
    compiled = []
    if not checked:
        try:
            compiled.append(tuple(re.compile(p) for p in sources))
        except re.error as e:
            raise TaxonomyError(f"{source}: signature {sid!r} has a bad pattern: {e}") from e

    def strings(name: str) -> tuple[str, ...]:
        value = table.get(name, ())
        if not isinstance(value, list | tuple):
            raise TaxonomyError(f"{source}: signature {sid!r}: {name} must be a list")
        return tuple(str(v) for v in value)

    try:
        return Signature(
            id=sid,
            failure_class=str(table["class"]),
            title=str(table["title"]),
            role_hint=cast("RoleHint", str(table["role_hint"])),  # checked in __post_init__
            retryable=bool(table["retryable"]),
            blame=cast("Blame", str(table["blame"])),  # checked in __post_init__
            meaning=str(table["meaning"]).strip(),
            confirm=strings("confirm"),
            fix=str(table["fix"]).strip(),
            verify=str(table["verify"]).strip(),
            sources=sources,
            _compiled=compiled,
            near_misses=strings("near_misses"),
            examples=strings("examples"),
            exception_types=strings("exception_types"),
            signals=strings("signals"),
            siblings=strings("siblings"),
            priority=int(table.get("priority", 0)),  # type: ignore[call-overload]
            literals=strings("literals"),
            wraps=bool(table.get("wraps", False)),
        )
    except KeyError as e:
        raise TaxonomyError(f"{source}: signature {sid!r} lacks the required field {e}") from e


def parse_signatures(text: str, source: str = "<string>") -> list[Signature]:
    return [_signature_from_table(t, source) for t in _tables(text, source)]


def _tables(text: str, source: str) -> list[dict[str, object]]:
    import tomllib  # only where the compiled taxonomy is missing or stale (a file edited, a test's own TOML)

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TaxonomyError(f"{source}: not valid TOML: {e}") from e
    tables = data.get("signature", [])
    if not isinstance(tables, list):
        raise TaxonomyError(f"{source}: expected [[signature]] tables")
    return tables


MEMO_LINES = 8192


@dataclass(frozen=True, slots=True)
class Taxonomy:
    signatures: tuple[Signature, ...]
    # literal -> positions of the signatures that need it; positions of those with no literal
    _by_literal: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), repr=False, compare=False)
    _unfiltered: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    _by_id_map: dict[str, Signature] = field(default_factory=dict, repr=False, compare=False, hash=False)
    _literals: LiteralSet | None = field(default=None, repr=False, compare=False, hash=False)  # built on first use
    _digit_needs: list[tuple[str, ...] | None] = field(default_factory=list, repr=False, compare=False, hash=False)
    # identical lines are common across ranks ("Fatal Python error: Aborted", tracebacks): matched once
    _memo: dict[str, tuple[list[tuple[Signature, re.Match[str]]], bool]] = field(
        default_factory=dict, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        index: dict[str, list[int]] = {}
        for i, sig in enumerate(self.signatures):
            for lit in sig.literals:
                index.setdefault(lit, []).append(i)
        object.__setattr__(self, "_by_literal", tuple((lit, tuple(ix)) for lit, ix in index.items()))
        object.__setattr__(
            self, "_unfiltered", frozenset(i for i, sig in enumerate(self.signatures) if not sig.literals)
        )
        seen: set[str] = set()
        for s in self.signatures:
            if s.id in seen:
                raise TaxonomyError(f"duplicate signature id {s.id!r}")
            seen.add(s.id)
            self._by_id_map[s.id] = s
        for s in self.signatures:
            for sib in s.siblings:
                if sib not in seen:
                    raise TaxonomyError(f"signature {s.id!r} names an unknown sibling {sib!r}")

    def __iter__(self) -> Iterator[Signature]:
        return iter(self.signatures)

    def __len__(self) -> int:
        return len(self.signatures)

    def get(self, sid: str) -> Signature:
        found = self.find(sid)
        if found is None:
            raise KeyError(sid)
        return found

    def named_ranks(self, text: str, signature_id: str | None = None) -> list[tuple[Signature, list[int]]]:
        """The ranks ``text`` names as the ones that failed (its ``peers`` group: NCCL's desync report,
        monitoredBarrier, a wrapper exception), by the signature naming them. ``signature_id``: the one
        signature the line is known to match (a front-end matched it): only that one is tried."""
        if signature_id is not None:
            sig = self.find(signature_id)
            if sig is None or not any("peers" in p.groupindex for p in sig.patterns):
                return []
            found = [(sig, m)] if (m := sig.search(text)) is not None else []
        else:
            found = self.match_line(text)
        out = []
        for sig, m in found:
            peers = m.groupdict().get("peers")
            if peers:
                out.append((sig, [int(p) for p in peers.replace(" ", "").split(",") if p.isdigit()]))
        return out

    def find(self, sid: str | None) -> Signature | None:
        """The signature of that id; None for None or an id this taxonomy does not have (an older report's)."""
        return self._by_id_map.get(sid) if sid is not None else None

    def match_line(self, line: str) -> list[tuple[Signature, re.Match[str]]]:
        """Every signature matching ``line``, in taxonomy order. The literals are checked once per line
        (about 70 C-level substring tests), then only the signatures they admit run their regexes."""
        return self.match_line_digits(line)[0]

    def match_line_digits(self, line: str) -> tuple[list[tuple[Signature, re.Match[str]]], bool]:
        """:meth:`match_line`, and whether the answer is the same for every line that differs from ``line`` in
        its digits alone: no signature the literals admit has a pattern that tells digits apart (``signal
        11``, ``[Errno 13]``) and could match, nor one naming another process by number (``rank``,
        ``pid``, ``peers``). The offline reader skips such a line's repeats."""
        memo = self._memo.get(line)
        if memo is not None:
            return list(memo[0]), memo[1]
        candidates = set(self._unfiltered)
        if self._literals is None:
            object.__setattr__(self, "_literals", LiteralSet(tuple(lit for lit, _ in self._by_literal)))
            object.__setattr__(self, "_digit_needs", [None] * len(self.signatures))
        for i in self._literals.find(line):  # type: ignore[union-attr]  # set just above
            candidates.update(self._by_literal[i][1])
        hits = []
        same_for_digits = True
        for i in sorted(candidates):
            s = self.signatures[i]
            if same_for_digits:
                needs = self._digit_needs[i]
                if needs is None:
                    needs = self._digit_needs[i] = _digit_needs(s)  # compiles its patterns: a candidate only
                if any(need == "" or need in line for need in needs):
                    same_for_digits = False
            for pattern in s.patterns:
                m = pattern.search(line)
                if m:
                    hits.append((s, m))
                    break
        if len(self._memo) >= MEMO_LINES:
            self._memo.clear()
        self._memo[line] = (hits, same_for_digits)
        return list(hits), same_for_digits

    def for_exception(self, type_name: str, mro: tuple[str, ...] = ()) -> Signature | None:
        """The signature an exception type maps to: its own name first, then its bases (``mro``, the
        qualified names the bootstrap recorded: numpy's ``_ArrayMemoryError`` is a ``MemoryError``);
        ``"*"`` in exception_types is the fallback."""
        for name in (type_name, *mro):
            short = name.rsplit(".", 1)[-1]
            if short in ("BaseException", "Exception", "object"):
                break
            best = None
            for s in self.signatures:
                if (name in s.exception_types or short in s.exception_types) and (
                    best is None or s.priority > best.priority
                ):
                    best = s
            if best is not None:
                return best
        return next((s for s in self.signatures if "*" in s.exception_types), None)

    def for_signal(self, signal_name: str) -> Signature | None:
        best = None
        for s in self.signatures:
            if signal_name in s.signals and (best is None or s.priority > best.priority):
                best = s
        return best


_PROCESS_GROUPS = frozenset({"rank", "pid", "peers"})


def _digit_needs(sig: Signature) -> tuple[str, ...]:
    """Of each pattern of ``sig`` that may match a line with other digits and not as it is, or names another
    process by the digits it captures: the literal a line must hold for it to match ("": none known). See
    :meth:`Taxonomy.match_line_digits`."""
    needs = (_digit_need(p.pattern, bool(_PROCESS_GROUPS.intersection(p.groupindex))) for p in sig.patterns)
    return tuple(need for need in needs if need is not None)


@cache
def _digit_need(source: str, names_process: bool = False) -> str | None:
    """None when the pattern treats every digit alike (``\\d``, ``[0-9]``, counts in braces) and captures no
    process number; else the longest literal without digits that every match of it holds ("" when it has
    none of 4 characters or more), so that a line without it cannot match whatever its digits."""
    bare = re.sub(r"\\[dDwWsS]|\{\d*,?\d*\}|0-9|\(\?P[<=]\w+>?|\\x[0-9a-fA-F]{2}", "", source)
    if not names_process and not re.search(r"\d", bare):
        return None
    try:
        from re import _parser  # type: ignore[attr-defined]  # the standard library's own parser of patterns

        items = list(_parser.parse(source))
    except Exception:  # noqa: BLE001 - another Python's internals: the pattern counts as telling digits apart
        return ""
    runs: list[str] = []
    run: list[str] = []
    for op, arg in items:  # the top-level sequence: its literals are in every match
        if str(op) == "LITERAL" and not chr(arg).isdigit():
            run.append(chr(arg))
            continue
        runs.append("".join(run))
        run = []
    runs.append("".join(run))
    best = max(runs, key=len)
    return best if len(best) >= 4 else ""


def _data_files() -> Iterable[tuple[str, str]]:
    root = resources.files(__name__)
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            yield entry.name, entry.read_text(encoding="utf-8")


COMPILED_FILE = "compiled.json"  # the TOML files' tables as JSON, with the digest of the files they came from


def _digest(files: list[tuple[str, str]]) -> str:
    """Tells an edited TOML file from the one the compiled taxonomy came from (CRC-32 and sizes: hashlib's
    import alone costs more than reading the compiled file)."""
    crc = 0
    sizes = []
    for name, text in files:
        data = name.encode() + b"\0" + text.encode()
        crc = zlib.crc32(data, crc)
        sizes.append(str(len(data)))
    return f"{crc:08x}-{'-'.join(sizes)}"


def compiled_taxonomy() -> str:
    """The text of :data:`COMPILED_FILE` for the TOML files as they are (``python tools/compile_taxonomy.py``
    writes it; a test checks it is current). Every pattern is compiled once here, so a bad one fails now."""
    files = list(_data_files())
    out = []
    for name, text in files:
        parse_signatures(text, source=name)
        out.append([name, _tables(text, name)])
    return json.dumps({"digest": _digest(files), "files": out}, indent=0, sort_keys=True) + "\n"


@cache
def load_taxonomy() -> Taxonomy:
    """The built-in taxonomy (cached). Read from the compiled taxonomy when its digest is the TOML files' (the
    JSON parser is C: 1 ms, against 30 ms for the TOML parser); else from the TOML files themselves."""
    files = list(_data_files())
    try:
        compiled = json.loads((resources.files(__name__) / COMPILED_FILE).read_text(encoding="utf-8"))
        current = compiled.get("digest") == _digest(files)
    except (OSError, ValueError, AttributeError):
        compiled, current = None, False
    signatures: list[Signature] = []
    if current:
        for name, tables in compiled["files"]:
            signatures.extend(_signature_from_table(t, name, checked=True) for t in tables)
    else:
        for name, text in files:
            signatures.extend(parse_signatures(text, source=name))
    return Taxonomy(tuple(signatures))


__all__ = ["FAILURE_CLASSES", "ROLE_HINTS", "RoleHint", "Signature", "Taxonomy", "load_taxonomy", "parse_signatures"]

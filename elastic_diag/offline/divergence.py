"""The first line that differs from a known-good run: ``elastic-diag analyze FAILED... --known-good GOOD...``.

The good run's lines are reduced to templates (:mod:`elastic_diag.core.templates`) and kept as a set; the
failed run's lines whose template is not in it are **novel**. Per rank, the first novel line before that rank's
first error (from the analysis of the failed run) is its **first divergence**: a warning only the failing run
printed, a new host, a fallback, a retry. When that first line is only information, the rank's first novel
warning (before its error) is given too. They are ranked: the initiating rank's first; warnings and errors above
information; a line only one rank printed above one that every rank printed; then the earliest.

Everything is streamed in chunks (both sides' bytes are read once; Python touches each *distinct* line shape,
not each line): ``benchmarks/known_good.py`` has the speed. Memory is bounded by the number of distinct
templates, capped at :data:`MAX_TEMPLATES` (a note says so when a log has more).

The comparison reads files only; what it concludes is plain data for the analysis' JSON, the terminal and the
page. When no rule named a rank, a divergence on one rank only, before any error, makes that rank the suspect
(:func:`suspect_of`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_diag.core.log_lines import parse_line, rank_from_path
from elastic_diag.core.templates import pre_templates, shape_key, template
from elastic_diag.offline.files import binary_kind, iter_files, open_log

MAX_TEMPLATES = 50_000  # distinct templates kept of a side (real logs have hundreds to a few thousand)
MAX_SHAPES = 100_000  # distinct pre-templates remembered as already judged (a cache: beyond, judged again)
MAX_OCCURRENCES = 4_096  # occurrences of one novel template read for their rank (beyond: counted only)
MAX_NOVEL = 10_000  # novel templates kept (beyond: their lines counted in ``Novel.dropped``, a note)
FEW_HITS = 32  # novel shapes in a chunk found one by one (list.index); more: one pass over the chunk
MAX_SHOWN = 64  # first divergences kept in the result
TEXT_MAX = 400
NOT_LOGS = (".json", ".pkl", ".pickle", ".tmp", ".html", ".sqlite", ".pt", ".bin", ".safetensors")
FEW_SHARED = 0.2  # below this share of the failed run's templates in the good run: another script

_LEVEL = re.compile(
    r"\b(?:(?P<error>ERROR|CRITICAL|FATAL|[A-Z]\w*Error|[A-Z]\w*Exception|Traceback)"
    r"|(?P<warning>WARN(?:ING)?|[A-Z]\w*Warning|warning:|retrying|falling back|fallback|mismatch|deprecated))\b"
    r"|^(?P<glog>[EWF])\d{4} ",
    re.IGNORECASE,
)


@dataclass(slots=True)
class Side:
    """What was read of one run."""

    paths: list[str]
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    n_bytes: int = 0
    lines: int = 0
    templates: set[bytes] = field(default_factory=set)
    capped: bool = False
    ranks: set[int] = field(default_factory=set)  # ranks its files are named by
    seconds: float = 0.0


@dataclass(slots=True)
class Occurrence:
    """The first line of a novel template on one rank."""

    rank: int | None
    file: str
    line: int  # 1-based, counted by LF as an editor does
    offset: int
    text: str
    raw: str  # the line as printed (its template is what a verification looks for again)
    time: float | None
    level: str  # error / warning / info
    template: bytes
    order: int  # the read's order: the file's place in the read (bits 40 and up), then the byte offset


def is_rank_output(f: Path) -> bool:
    """Whether a file is what a run printed: not elastic_diag's own records in a diag dir (a rank folder holds
    stacks, progress and markers beside the rank's ``stdout.log`` / ``stderr.log``; ``filtered_*.log`` repeat
    the ranks' lines), nor a file of a kind that is never a log."""
    name = f.name.removesuffix(".gz")
    if f.suffix in NOT_LOGS or name.endswith(".tmp") or name.startswith("filtered_std"):
        return False
    if re.fullmatch(r"rank_\d+", f.parent.name):
        return name in ("stdout.log", "stderr.log")
    return not name.endswith((".done", ".pid", ".lock"))


def _files(paths: Iterable[str | Path], skipped: list[str]) -> Iterable[tuple[Path, Any]]:
    """(path, open file) of every log under ``paths``; what is not a log is skipped, said so."""
    for f in iter_files(paths, skipped):
        if not is_rank_output(f):
            continue
        try:
            fp = open_log(f)
        except OSError as e:
            skipped.append(f"{f}: {e.strerror or e}")
            continue
        with fp:
            try:
                head = fp.read(8192)
                kind = binary_kind(head)
                if kind is not None:
                    skipped.append(f"{f}: not a log ({kind}), skipped")
                    continue
                fp.seek(0)
                yield f, fp
            except (OSError, EOFError) as e:
                skipped.append(f"{f}: {getattr(e, 'strerror', None) or e}")


def _chunks(fp: Any) -> Iterable[tuple[bytes, int]]:
    """Whole lines with their offsets, as the analyzer reads them (a gzipped log cut short: what was read)."""
    from elastic_diag.offline.analyze import chunks_of

    def read(n: int) -> bytes:
        try:
            return bytes(fp.read(n))
        except EOFError:
            return b""

    return chunks_of(read, None)


class Shapes:
    """:func:`template` once per :func:`shape_key` (pre-templates that differ only in their numbers' lengths)."""

    def __init__(self) -> None:
        self.of: dict[bytes, bytes] = {}

    def template(self, pre: bytes) -> bytes:
        key = shape_key(pre)
        t = self.of.get(key)
        if t is None:
            t = template(pre)
            if len(self.of) < MAX_SHAPES:
                self.of[key] = t
        return t


def learn(paths: Sequence[str | Path]) -> Side:
    """The good run: the set of its templates."""
    started = time.perf_counter()
    side = Side(paths=[str(p) for p in paths])
    seen: set[bytes] = set()
    known = side.templates
    shapes = Shapes()
    for f, fp in _files(paths, side.skipped):
        side.files.append(str(f))
        r = rank_from_path(f)
        if r is not None:
            side.ranks.add(r)
        for chunk, _base in _chunks(fp):
            side.n_bytes += len(chunk)
            pre = pre_templates(chunk)
            side.lines += len(pre) - 1
            new = set(pre)
            new -= seen
            if not new:
                continue
            for p in new:
                if len(known) >= MAX_TEMPLATES:
                    side.capped = True
                    break
                known.add(shapes.template(p))
            if len(seen) < MAX_SHAPES:
                seen |= new
    known.add(b"")
    side.seconds = time.perf_counter() - started
    return side


@dataclass(slots=True)
class Novel:
    """The failed run's novel lines: per (template, rank) the first occurrence, and per template how often and
    on how many ranks."""

    side: Side
    first: dict[tuple[bytes, int | None], Occurrence] = field(default_factory=dict)
    count: dict[bytes, int] = field(default_factory=dict)
    ranks: dict[bytes, set[int | None]] = field(default_factory=dict)
    templates_seen: int = 0  # distinct templates of the failed run
    shared: int = 0  # of them, in the good run
    dropped: int = 0  # lines of novel templates beyond MAX_NOVEL


def find_novel(paths: Sequence[str | Path], good: Side) -> Novel:
    """Read the failed run; keep the novel lines (their first occurrence per rank)."""
    started = time.perf_counter()
    side = Side(paths=[str(p) for p in paths])
    novel = Novel(side)
    known = good.templates
    ok: set[bytes] = set()  # pre-templates whose template the good run printed
    bad: dict[bytes, bytes] = {}  # pre-template -> its novel template
    failed_templates: set[bytes] = set()
    shapes = Shapes()
    for f, fp in _files(paths, side.skipped):
        side.files.append(str(f))
        file_rank = rank_from_path(f)
        if file_rank is not None:
            side.ranks.add(file_rank)
        line_base = 0
        for chunk, base in _chunks(fp):
            side.n_bytes += len(chunk)
            pre = pre_templates(chunk)
            side.lines += len(pre) - 1
            uniq = set(pre)
            unknown = uniq - ok
            unknown.difference_update(bad)
            hits = {p: bad[p] for p in uniq.intersection(bad)}  # this chunk's novel shapes: pre-template -> template
            if len(novel.count) >= MAX_NOVEL:  # a log mostly unlike the good one: what is left is only counted
                novel.dropped += len(unknown)
                unknown = set()
            for n, p in enumerate(unknown):
                if len(hits) + len(novel.count) >= MAX_NOVEL:  # mostly unlike the good run: the rest only counted
                    novel.dropped += len(unknown) - n
                    break
                t = shapes.template(p)
                if len(failed_templates) < MAX_TEMPLATES:
                    failed_templates.add(t)
                else:
                    side.capped = True
                if t in known:
                    if len(ok) < MAX_SHAPES:
                        ok.add(p)
                    continue
                hits[p] = t
                if len(bad) < MAX_SHAPES:
                    bad[p] = t
            if hits:
                _occurrences(chunk, pre, hits, novel, str(f), file_rank, base, line_base, len(side.files))
            line_base += len(pre) - 1
    novel.templates_seen = len(failed_templates)
    novel.shared = len(failed_templates & known)
    side.seconds = time.perf_counter() - started
    return novel


def _occurrences(chunk: bytes, pre: list[bytes], hits: Mapping[bytes, bytes], novel: Novel, source: str,
                 file_rank: int | None, base: int, line_base: int, file_seq: int) -> None:  # fmt: skip
    """The chunk's lines of novel shapes (``hits``: pre-template -> template): counted, and read for their rank.
    A few shapes are found with ``list.count`` / ``list.index`` (C speed; Python reads only the lines it keeps);
    many (a log of garbage, another script) in one pass over the chunk. In a rank's own file the first occurrence
    is the rank's first, unless its lines carry rank prefixes of their own."""
    if len(hits) > FEW_HITS:
        pos = 0
        for i, p in enumerate(pre):
            t = hits.get(p)
            if t is not None and _keep(novel, t, 1):
                _read(novel, t, chunk, p, pos, i, source, file_rank, base, line_base, file_seq)
            pos += len(p) + 1
        return
    for p, t in hits.items():
        n = pre.count(p)
        if not _keep(novel, t, n):
            continue
        i = -1
        for _ in range(min(n, MAX_OCCURRENCES)):
            i = pre.index(p, i + 1)
            pos = sum(map(len, pre[:i])) + i  # pre-templates have their raw lines' lengths
            parsed_rank = _read(novel, t, chunk, p, pos, i, source, file_rank, base, line_base, file_seq)
            if file_rank is not None and parsed_rank is None:
                break  # a rank's own file: its later lines of this shape are the same rank's


def _keep(novel: Novel, t: bytes, n: int) -> bool:
    """Count ``n`` more lines of novel template ``t``; whether to read them (a bounded number of templates and of
    lines of each)."""
    seen = novel.count.get(t)
    if seen is None:
        if len(novel.count) >= MAX_NOVEL:
            novel.dropped += n
            return False
        seen = 0
    novel.count[t] = seen + n
    return seen < MAX_OCCURRENCES


def _read(novel: Novel, t: bytes, chunk: bytes, p: bytes, pos: int, i: int, source: str, file_rank: int | None,
          base: int, line_base: int, file_seq: int) -> int | None:  # fmt: skip
    """One line of a novel shape read for its rank; its first on that rank kept. The rank its prefix gave."""
    text = chunk[pos : pos + len(p)].decode("utf-8", "replace")
    parsed = parse_line(text)
    rank = parsed.rank if parsed.rank is not None else file_rank
    ranks = novel.ranks.setdefault(t, set())
    if len(ranks) < MAX_OCCURRENCES:
        ranks.add(rank)
    key = (t, rank)
    if key not in novel.first:
        novel.first[key] = Occurrence(rank=rank, file=source, line=line_base + i + 1, offset=base + pos,
                                      text=parsed.text.strip()[:TEXT_MAX] or text.strip()[:TEXT_MAX],
                                      raw=text[:TEXT_MAX], time=parsed.time, level=level_of(text), template=t,
                                      order=(file_seq << 40) + base + pos)  # fmt: skip
    return parsed.rank


def level_of(text: str) -> str:
    m = _LEVEL.search(text)
    if m is None:
        return "info"
    if m.group("error") or m.group("glog") in ("E", "F", "e", "f"):
        return "error"
    return "warning"


@dataclass(frozen=True, slots=True)
class FirstError:
    """Where a rank's first error is: its file and byte offset, its time."""

    source: str | None
    offset: int | None
    time: float | None
    line: int | None = None  # a diag dir's rank log is read by line: its line number (no offset)


def first_errors(evidence: Any) -> dict[int, FirstError]:
    """Each rank's first error line of the failed run's analysis (its evidence's lines, by read order)."""
    out: dict[int, FirstError] = {}
    for ev in getattr(evidence, "ranks", ()):
        lines = [ln for ln in ev.lines if ln.source is not None or ln.time is not None]
        if not lines:
            if getattr(ev, "first_error_time", None) is not None:  # an exception record's time, no line
                out[ev.rank] = FirstError(None, None, ev.first_error_time)
            continue
        first = min(lines, key=lambda ln: ln.order)
        line = first.order + 1 if first.offset is None and first.source and "/" not in first.source else None
        when = first.time if first.time is not None else getattr(ev, "first_error_time", None)
        out[ev.rank] = FirstError(_norm(first.source) if line is None else first.source, first.offset, when,
                                  line)  # fmt: skip
    return out


def _norm(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve())
    except OSError:
        return path


def before(occ: Occurrence, err: FirstError | None) -> bool | None:
    """Whether the novel line came before the rank's first error: the same file by offset, else by time; None
    when it cannot be told."""
    if err is None:
        return True  # no error on the rank: every novel line of it is before any error
    if err.source is not None and err.offset is not None and _norm(occ.file) == err.source:
        return occ.offset < err.offset
    if err.line is not None and err.source == Path(occ.file).name:  # a rank folder's log, by its line number
        return occ.line < err.line
    if err.time is not None and occ.time is not None:
        return occ.time < err.time
    return None


def first_divergences(novel: Novel, errors: Mapping[int, FirstError], initiating: int | None) -> list[dict[str, Any]]:
    """Per rank, the first novel line before its first error; ranked (the module's docstring)."""
    # per rank its first novel line, and its first novel warning when that first line is only information (a
    # warning is what a person looks for; the first line is what changed first)
    per_rank: dict[tuple[int | None, bool], Occurrence] = {}
    when: dict[tuple[int | None, bool], bool | None] = {}
    ended: set[tuple[int | None, str]] = set()  # (rank, file) past a novel error line: the rest is after an error
    for (_t, rank), occ in sorted(novel.first.items(), key=lambda kv: kv[1].order):
        if (rank, occ.file) in ended:
            continue
        if occ.level == "error":  # the error itself (a traceback's first line, an error record), not what led to it
            ended.add((rank, occ.file))
            continue
        b = before(occ, errors.get(rank) if rank is not None else None)
        if b is False:
            continue
        key = (rank, occ.level != "info")
        if key in per_rank and not (when[key] is None and b is True):
            continue
        per_rank[key] = occ
        when[key] = b
    for rank, _warning in list(per_rank):  # a warning that is also the rank's first novel line: one row
        first, warned = per_rank.get((rank, False)), per_rank.get((rank, True))
        if first is not None and warned is not None and warned.order < first.order:
            del per_rank[(rank, False)]
    rows: list[dict[str, Any]] = []
    for (rank, warning), occ in per_rank.items():
        err = errors.get(rank) if rank is not None else None
        n_ranks = len(novel.ranks.get(occ.template, ()))
        ahead = None
        if err is not None and err.time is not None and occ.time is not None:
            ahead = round(err.time - occ.time, 3)
        rows.append({
            "rank": rank, "file": occ.file, "line": occ.line, "text": occ.text, "raw": occ.raw, "time": occ.time,
            "seconds_before_error": ahead, "before_error": when[(rank, warning)], "level": occ.level,
            "ranks_printing": n_ranks, "count": novel.count.get(occ.template, 1),
        })  # fmt: skip
    rows.sort(key=lambda r: (r["rank"] != initiating or initiating is None, r["rank"] is None,
                             r["level"] == "info", r["ranks_printing"] > 1, r["before_error"] is not True,
                             r["time"] if r["time"] is not None else float("inf"), r["file"], r["line"]))  # fmt: skip
    return rows[:MAX_SHOWN]


def suspect_of(rows: Sequence[Mapping[str, Any]]) -> tuple[int, str] | None:
    """The one rank whose log diverges, before any error, with a line no other rank printed: the suspect when no
    rule named a rank; None when no rank or several do."""
    alone = [r for r in rows if r["rank"] is not None and r["ranks_printing"] == 1 and r["before_error"] is True]
    ranks = {r["rank"] for r in alone}
    if len(ranks) != 1:
        return None
    row = alone[0]
    where = f"{Path(row['file']).name}:{row['line']}"
    ahead = f", {row['seconds_before_error']:g} s before its first error" if row["seconds_before_error"] else ""
    return int(row["rank"]), (f"the only rank whose log diverges from the known-good run before any error: "
                              f"{row['text'][:160]!r} ({where}{ahead})")  # fmt: skip


def layout(failed: Any, good: Any) -> dict[str, Any]:
    """The two runs' ranks and hosts (from their analyses' evidence), and whether they differ."""

    def of(analysis: Any) -> tuple[list[int], list[str]]:
        ranks = sorted(ev.rank for ev in analysis.evidence.ranks)
        hosts = sorted({ev.node for ev in analysis.evidence.ranks if ev.node})
        return ranks, hosts

    fr, fh = of(failed)
    gr, gh = of(good)
    changes = []
    if fr and gr and len(fr) != len(gr):
        changes.append(f"{len(fr)} ranks against {len(gr)} in the good run")
    unknown = {"localhost", "127.0.0.1", "?", ""}  # a host that says nothing (a console log's stand-in)
    fh = [h for h in fh if h not in unknown]
    gh = [h for h in gh if h not in unknown]
    new_hosts = sorted(set(fh) - set(gh))
    if new_hosts and gh:
        changes.append(f"host(s) the good run did not have: {', '.join(new_hosts[:8])}")
    return {"failed_ranks": len(fr), "good_ranks": len(gr), "failed_hosts": fh[:64], "good_hosts": gh[:64],
            "changed": bool(changes), "changes": changes}  # fmt: skip


def compare(failed_paths: Sequence[str | Path], good_paths: Sequence[str | Path], failed_analysis: Any,
            good_analysis: Any | None, *, good_side: Side | None = None) -> dict[str, Any]:  # fmt: skip
    """The known-good comparison as plain data (``analyze --json``'s ``known_good`` and ``first_divergence``)."""
    good = good_side if good_side is not None else learn(good_paths)
    notes: list[str] = []
    result: dict[str, Any] = {
        "runs": {"failed": [str(p) for p in failed_paths], "good": [str(p) for p in good_paths]},
        "good_files": len(good.files), "good_bytes": good.n_bytes, "good_lines": good.lines,
        "good_templates": len(good.templates) - 1, "notes": notes,
    }  # fmt: skip
    notes.extend(good.skipped[:10])
    if good.lines == 0:
        notes.append("the known-good run has no readable line: nothing to compare with (the verdict stands alone)")
        result.update(first_divergence=[], failed_templates=0, shared_templates=0, novel_templates=0,
                      seconds=round(good.seconds, 3), layout=None)  # fmt: skip
        return result
    novel = find_novel(failed_paths, good)
    errors = first_errors(failed_analysis.evidence)
    d = failed_analysis.diagnosis
    rows = first_divergences(novel, errors, d.initiating_rank)
    # of the good run's line shapes, how many the failed run printed too (a failure adds shapes of its own, so
    # the good run's side is the one to measure): few, and it is another script
    good_shapes = len(good.templates) - 1
    share = novel.shared / good_shapes if good_shapes else 1.0
    if good_shapes >= 8 and share < FEW_SHARED:
        notes.append(f"the two runs have few line shapes in common: the failed run printed only {100 * share:.0f} % of "
                     f"the good run's ({novel.shared} of {good_shapes}); the known-good run looks like another script "
                     "(or the logs are excerpts of different parts of the runs)")  # fmt: skip
    if novel.dropped:
        notes.append(f"more than {MAX_NOVEL:,} novel line shapes: the rest (at least {novel.dropped:,} lines) were "
                     "counted, not read (the failed run is mostly unlike the good one)")  # fmt: skip
    if good.capped or novel.side.capped:
        notes.append(f"more than {MAX_TEMPLATES:,} distinct line shapes: the comparison kept the first "
                     f"{MAX_TEMPLATES:,} (lines of the shapes beyond were not all judged)")  # fmt: skip
    result.update(
        failed_files=len(novel.side.files), failed_bytes=novel.side.n_bytes, failed_lines=novel.side.lines,
        failed_templates=novel.templates_seen, shared_templates=novel.shared, novel_templates=len(novel.count),
        seconds=round(good.seconds + novel.side.seconds, 3),
        layout=layout(failed_analysis, good_analysis) if good_analysis is not None else None,
        first_divergence=rows,
    )  # fmt: skip
    return result


def with_known_good(analysis: Any, failed_paths: Sequence[str | Path], good_paths: Sequence[str | Path], *,
                    insist: bool = False, progress: Any = None) -> Any:  # fmt: skip
    """The analysis with its comparison against the good run (``analysis.known_good``), and, when no rule named
    a rank, the suspect a divergence on one rank gives. A good run that is itself a failure is refused (the
    reason in ``known_good.refused``) unless ``insist``."""
    from dataclasses import replace

    from elastic_diag.offline.analyze import analyze_paths

    good_analysis = analyze_paths(good_paths, progress=progress)
    refused = None
    if good_analysis.failure_seen and good_analysis.files:
        gd = good_analysis.diagnosis
        who = f"rank {gd.initiating_rank}" if gd.initiating_rank is not None else "no rank named"
        refused = f"the known-good run is itself a failure ({gd.failure_class}, {who})"
    if refused is not None and not insist:
        analysis.known_good = {"runs": {"failed": [str(p) for p in failed_paths], "good": [str(p) for p in good_paths]},
                               "refused": refused + ": not compared (--known-good-anyway compares all the same)",
                               "notes": [], "first_divergence": []}  # fmt: skip
        return analysis
    result = compare(failed_paths, good_paths, analysis, good_analysis)
    if refused is not None:
        result["notes"].insert(0, refused + ": compared all the same, as asked")
    analysis.known_good = result
    d = analysis.diagnosis
    if analysis.failure_seen and d.initiating_rank is None and d.suspected_rank is None:
        found = suspect_of(result["first_divergence"])
        if found is not None:
            rank, reason = found
            summary = f"{d.summary} Suspect: rank {rank}, {reason}.".strip()
            analysis.diagnosis = replace(d, suspected_rank=rank, suspected_reason=reason, summary=summary)
            result["suspect"] = {"rank": rank, "reason": reason}
    return analysis


__all__ = [
    "Side",
    "compare",
    "find_novel",
    "first_divergences",
    "learn",
    "suspect_of",
    "with_known_good",
]

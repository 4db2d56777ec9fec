"""Which rank a log line belongs to: its prefix (``[rank3]:``; torchrun's ``[default2]:`` is a LOCAL rank,
turned global by the offset learnt from the same file), else its file's path, else a ``[Rank N]`` in the
message; and what lines tell about which process is which rank (pids, NCCL's ``rank N nRanks M``,
DeepSpeed's rank mapping, torch's "closing signal" to a pid), recorded in the read's
:class:`~elastic_diag.offline.records.LogRead`.
"""

from __future__ import annotations

import re
from typing import Any

from elastic_diag.core.log_lines import message_rank, parse_deepspeed_mapping
from elastic_diag.core.values import MAX_RANK
from elastic_diag.offline.files import CHUNK
from elastic_diag.offline.records import LogRead

# a rank is a C int: at most 10 digits (a longer number is junk and matches none of these)
_RANK_PREFIX = re.compile(rb"^(?:([a-z0-9][a-z0-9.-]*\d[a-z0-9.-]*): )?\[(rank|default)(\d{1,10})\]:", re.M)
_LINE_RANK_PREFIX = re.compile(rb"\n\[(rank|default)(\d{1,10})\]:")
_BOTH_PREFIXES = re.compile(rb"^(?:([a-z0-9][a-z0-9.-]*\d[a-z0-9.-]*): )?\[default(\d{1,10})\]:\[rank(\d{1,10})\]:",
                            re.M)  # fmt: skip
_SUMMARY_RANK = re.compile(rb"rank\s+: (\d{1,10}) \(local_rank: (\d{1,10})\)")
_CLOSING = re.compile(r"Sending process (\d+) closing signal")
_NCCL_RANK = re.compile(r"NCCL INFO .*?\brank (\d+) n[Rr]anks \d+")
_PID = re.compile(r"\bpid[=: ]\s?(\d{2,})\b")


def learn_local_offsets(fp: Any, head: bytes) -> dict[str | None, int]:
    """torchrun's ``[defaultN]:`` is a LOCAL rank: per host prefix (None: none), global - local,
    learnt from lines that carry both ``[defaultL]:`` and ``[rankG]:``, or torchrun's summary
    (``rank : 10 (local_rank: 2)``). Only for files that have such prefixes at all."""
    if b"[default" not in head:
        return {}
    found: dict[str | None, set[int]] = {}
    fp.seek(0)
    carry = b""
    while block := fp.read(CHUNK):
        data = carry + block
        cut = data.rfind(b"\n") + 1
        chunk, carry = data[:cut], data[cut:]
        for m in _BOTH_PREFIXES.finditer(chunk):
            host = m.group(1).decode(errors="replace") if m.group(1) else None
            found.setdefault(host, set()).add(int(m.group(3)) - int(m.group(2)))
        for m in _SUMMARY_RANK.finditer(chunk):
            found.setdefault(None, set()).add(int(m.group(1)) - int(m.group(2)))
    # an offset is used only when it is the only one seen for that host
    return {host: next(iter(v)) for host, v in found.items() if len(v) == 1}


class RankResolver:
    """The ranks of one read: the local-rank offsets of the file being read, and the facts it adds to."""

    def __init__(self, facts: LogRead) -> None:
        self.facts = facts
        self.local_offsets: dict[str | None, int] = {}

    def start_file(self, fp: Any, head: bytes, file_rank: int | None) -> None:
        """A new file: the offsets of its ``[defaultN]:`` prefixes (none when its path names its rank)."""
        self.local_offsets = learn_local_offsets(fp, head) if file_rank is None else {}

    def count_lines(self, chunk: bytes, file_rank: int | None) -> None:
        """The ranks that printed something in ``chunk`` ("printed something" is all that is used)."""
        if file_rank is not None:
            if chunk:
                self.facts.rank(file_rank).printed += 1
            return
        # each prefix once (a chunk holds thousands of lines); a prefix at a line's start after a newline is found
        # by its literal, fast; the slow general pattern runs only where a host prefixes them
        found = {(b"", kind, number) for kind, number in _LINE_RANK_PREFIX.findall(chunk)}
        if (first := _RANK_PREFIX.match(chunk)) is not None:
            found.add(first.groups())  # type: ignore[arg-type]
        if b": [rank" in chunk or b": [default" in chunk:
            found.update(_RANK_PREFIX.findall(chunk))
        for host_bytes, kind, number in found:
            host = host_bytes.decode(errors="replace") if host_bytes else None
            offset = self.local_offsets.get(host, self.local_offsets.get(None, 0)) if kind == b"default" else 0
            if 0 <= int(number) + offset <= MAX_RANK:
                self.facts.rank(int(number) + offset).printed += 1

    def global_rank(self, parsed: Any) -> int | None:
        if parsed.rank is None or not parsed.local:
            return parsed.rank  # type: ignore[no-any-return]
        offset = self.local_offsets.get(parsed.host, self.local_offsets.get(None, 0))
        return int(parsed.rank) + offset

    def line_rank(self, parsed: Any, text: str, file_rank: int | None) -> int | None:
        """The line's global rank: its prefix, else its file's, else a default-group [Rank N] in it."""
        rank = self.global_rank(parsed)
        if rank is None:
            rank = file_rank
        rank = rank if rank is not None else message_rank(text)
        return rank if rank is None or 0 <= rank <= MAX_RANK else None  # junk (a local offset gone wrong): no rank

    def record_mappings(self, parsed: Any, text: str, rank: int | None) -> None:
        """What a line tells about which process is which rank (both passes use it)."""
        if parsed.pid is not None and (nm := _NCCL_RANK.search(text)):
            self.facts.pids.setdefault(parsed.pid, int(nm.group(1)))
        if rank is not None:
            if parsed.pid is not None:
                self.facts.pids.setdefault(parsed.pid, rank)
            for pm in _PID.finditer(text):
                self.facts.pids.setdefault(int(pm.group(1)), rank)
        if "global_rank_mapping" in text:
            self.facts.ds_mapping.update(parse_deepspeed_mapping(text) or {})
        if "closing signal" in text and (cm := _CLOSING.search(text)):
            self.facts.sigtermed.add(int(cm.group(1)))

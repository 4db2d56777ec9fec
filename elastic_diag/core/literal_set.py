"""Which of many literal strings a line holds, in one pass.

The taxonomy admits a signature's regexes only when the line holds one of its literals (about 130 in all):
tested one by one that is 130 substring tests a line, most of the time of matching a new line. With Hyperscan
installed (a dependency on Linux x86_64/aarch64) all of them are found in one vectorised pass; else the
substring tests. Both give the same answer (tests/core/test_literal_set.py).
"""

from __future__ import annotations

import re
from typing import Any


class LiteralSet:
    """``find(text)``: the indexes of ``literals`` that occur in ``text``, sorted."""

    def __init__(self, literals: tuple[str, ...], *, use_hyperscan: bool = True) -> None:
        self.literals = literals
        self._encoded = [lit.encode("utf-8", "surrogatepass") for lit in literals]
        self._db: Any = _database(self._encoded) if use_hyperscan and literals else None

    def find(self, text: str) -> list[int]:
        if self._db is None:
            return [i for i, lit in enumerate(self.literals) if lit in text]
        found: set[int] = set()
        self._db.scan(text.encode("utf-8", "surrogatepass"), match_event_handler=_collect, context=found)
        return sorted(found)


def _collect(pattern: int, _start: int, _end: int, _flags: int, found: set[int]) -> None:
    found.add(pattern)


def _database(literals: list[bytes]) -> Any:
    """A Hyperscan block-mode database reporting each literal once a scan; None without Hyperscan (or on a CPU it
    cannot run on): the caller tests substrings instead."""
    try:
        import hyperscan  # type: ignore[import-not-found,import-untyped,unused-ignore]

        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        db.compile(expressions=[re.escape(lit) for lit in literals], ids=list(range(len(literals))),
                   elements=len(literals), flags=[hyperscan.HS_FLAG_SINGLEMATCH] * len(literals))  # fmt: skip
        return db
    except Exception:  # noqa: BLE001 - ImportError, hyperscan.error, a CPU without SSSE3: the fallback
        return None

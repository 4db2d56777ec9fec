"""LiteralSet: the same indexes with Hyperscan and with substring tests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.core.literal_set import LiteralSet
from elastic_diag.core.taxonomy import load_taxonomy

LITERALS = tuple(lit for lit, _ in load_taxonomy()._by_literal)
FAST, SLOW = LiteralSet(LITERALS), LiteralSet(LITERALS, use_hyperscan=False)


def test_the_taxonomy_literals_are_found_alike():
    assert FAST._db is not None  # Hyperscan is a dependency here
    for sig in load_taxonomy():
        for line in (*sig.examples, *sig.near_misses):
            assert FAST.find(line) == SLOW.find(line), line


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*LITERALS[:40], "é", "\u2588", " ", "x"]), max_size=12).map("".join))
def test_any_text_gives_the_same_indexes(text):
    assert FAST.find(text) == SLOW.find(text)

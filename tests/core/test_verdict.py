"""The verdict's phrases (core/verdict.py): rank lists as ranges, the subject of a summary's sentence."""

from __future__ import annotations


def test_rank_lists_in_summaries_are_ranges() -> None:
    from elastic_diag.core.verdict import format_ranks

    assert format_ranks([]) == "none"
    assert format_ranks([2, 1]) == "1, 2"
    assert format_ranks([0, 1, 2, 3, 5, 7, 8, 10, 11, 12]) == "0-3, 5, 7, 8, 10-12"
    assert format_ranks([*range(737), *range(738, 1024)]) == "0-736, 738-1023"

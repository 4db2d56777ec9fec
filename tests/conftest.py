"""pytest's hooks. What the tests share is in helpers.py."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-process tests first: with two xdist workers the quick ones then fill the gaps at the
    end instead of one worker finishing a long job alone."""
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)

"""benchmarks/known_good.py, small: 16 + 16 MB of 32 ranks' realistic chatter, the comparison in a fresh process.
The planted warning is the first divergence; the throughput and the peak RSS hold with a margin for a loaded CI
machine (docs/benchmarks.md has the 400 MB figures: 175 to 240 MB/s, 34 MB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_comparison_finds_the_planted_line_fast_and_in_little_memory(tmp_path):
    out = tmp_path / "out.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "known_good.py"), "--mb", "16", "--ranks", "32", "--culprit",
            "13", "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    figures = json.loads(out.read_text())
    assert figures["planted_first"], (figures, done.stdout)
    assert figures["first"]["rank"] == 13 and figures["first"]["level"] == "warning"
    assert figures["peak_rss_mb"] < 200, figures
    assert figures["mb_per_s"] > 30, figures  # about 150 on a quiet machine at this size; the goal is 100 at 400 MB
    # the chatter has many shapes; the few novel ones are the failure's and rare shapes the good run never drew
    assert figures["novel_templates"] < 40 and figures["good_templates"] > 200

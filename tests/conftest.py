"""Shared helpers: run torchrun-diag / torchrun for real, and leave no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    diag_dir: Path
    seconds: float

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.diag_dir / "report.json").read_text())

    def rank(self, rank: int) -> dict[str, Any]:
        return next(r for r in self.report["ranks"] if r["rank"] == rank)


def _kill_leftovers(diag_dir: Path) -> None:
    """Kill any worker still alive after the launcher ended (pids from the bootstrap's worker.json)."""
    for info in diag_dir.glob("attempt_*/rank_*/worker.json"):
        try:
            pid = json.loads(info.read_text())["pid"]
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def launch(argv: list[str], diag_dir: Path, timeout: float = 100, env: dict[str, str] | None = None) -> Run:
    """Run a launcher command line to completion under a hard timeout; kill everything it left."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the agent tears its workers down on SIGTERM
        try:
            out, err = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _kill_leftovers(diag_dir)
        pytest.fail(f"launcher timed out after {timeout}s:\n{err[-5000:]}")
    finally:
        _kill_leftovers(diag_dir)
    return Run(proc.returncode, out, err, diag_dir, time.monotonic() - start)


def torchrun_diag(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic_diag.run", *args]


def plain_torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-process tests first: with two xdist workers the quick ones then fill the gaps at the
    end instead of one worker finishing a long job alone."""
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)

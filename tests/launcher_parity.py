"""The same failure under each launcher: the verdict of a scenario script (tests/scenarios/) under
``torchrun-diag`` (test_scenarios.py) and started by ``srun``, ``mpirun`` or ``torch.multiprocessing.spawn``
under ``elastic-diag exec`` (tests/launch/test_exec_parity.py). Each run writes one record to
``test-artifacts/launcher_parity/`` (shared by the xdist workers, cleared at the start of a session);
conftest.py prints the table at the end; docs/launchers.md keeps a copy of it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "test-artifacts" / "launcher_parity"
LAUNCHERS = ("torchrun-diag", "srun", "mpirun", "mp.spawn")


def clear() -> None:
    shutil.rmtree(FOLDER, ignore_errors=True)


def record(case: str, launcher: str, diagnosis: dict[str, Any], status: str, expected: tuple[int | None, str]) -> None:
    FOLDER.mkdir(parents=True, exist_ok=True)
    got = (diagnosis.get("initiating_rank"), diagnosis.get("failure_class"))
    data = {"case": case, "launcher": launcher, "rank": got[0], "class": got[1], "status": status,
            "expected": list(expected), "same": list(got) == list(expected)}  # fmt: skip
    path = FOLDER / f"{case}.{launcher}.{os.getpid()}.json"
    path.write_text(json.dumps(data))


def load() -> list[dict[str, Any]]:
    if not FOLDER.is_dir():
        return []
    out = []
    for p in sorted(FOLDER.glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def table(records: list[dict[str, Any]]) -> list[str]:
    """One row per case run under an exec launcher; a cell per launcher: ``rank class`` and ``=`` when it is the
    expected verdict (the one test_scenarios.py asserts under torchrun-diag), ``≠`` when not."""
    cases = sorted({r["case"] for r in records if r["launcher"] != "torchrun-diag"})
    if not cases:
        return []
    cell: dict[tuple[str, str], str] = {}
    for r in records:
        rank = "-" if r["rank"] is None else str(r["rank"])
        cell[(r["case"], r["launcher"])] = f"{rank} {r['class']} {'=' if r['same'] else '≠'}"
    rows = [("case", *LAUNCHERS)] + [(c, *(cell.get((c, lc), "(not run)") for lc in LAUNCHERS)) for c in cases]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    runs = [r for r in records if r["launcher"] != "torchrun-diag"]
    lines.append(f"launcher parity: {sum(1 for r in runs if r['same'])} of {len(runs)} exec runs give the verdict "
                 "expected under torchrun-diag")  # fmt: skip
    return lines

"""Plain torchrun against torchrun-diag on the same injected failures (not a timed test).

    python benchmarks/compare.py [--write docs/comparison.md] [--only hang,exception]

Each scenario is a 4-rank CPU job of the examples (gloo) in which rank 2 fails; it runs under plain
``torchrun`` and under ``torchrun-diag`` with the same flags and the same script arguments, and
records for each launcher: the rank it names as root cause (torchrun: the first entry of its "Root
Cause" section; torchrun-diag: report.json's initiating rank) and whether that is the rank that was
made to fail; what it says the failure was; whether the culprit's own error message or stack is in
what the launcher kept; how many ranks' stacks were taken before teardown; and the wall time.

With ``--write`` the table goes into a Markdown page (docs/comparison.md), with the command and the
machine, so the page is this program's output and nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CULPRIT = 2
COMMON = ["--standalone", "--nproc-per-node", "4"]


@dataclass(frozen=True)
class Scenario:
    name: str
    script: str
    inject: str
    what: str  # the failure, in words
    culprit_text: str  # a string from the culprit's own error (or stack) that proves it was kept
    extra: tuple[str, ...] = ()  # script arguments, both launchers
    diag_flags: tuple[str, ...] = ()  # torchrun-diag settings, shown in the table


SCENARIOS = (
    Scenario("exception", "train_ddp.py", "exception", "ValueError on rank 2", "injected failure: bad batch"),
    Scenario("exception during cleanup", "train_ddp.py", "exception-after-cleanup",
             "ValueError on rank 2, which cleans up for 14 s before re-raising; its peers time out after 8 s",
             "injected failure: bad batch", ("--cleanup-seconds", "14", "--pg-timeout", "8"), ("--diag-grace", "10")),
    Scenario("segfault", "train_ddp.py", "segfault", "SIGSEGV in native code on rank 2", "Segmentation fault"),
    Scenario("killed", "train_ddp.py", "sigkill", "rank 2 SIGKILLed (as by the OOM killer)", "injecting sigkill"),
    Scenario("hang", "train_ddp.py", "hang", "rank 2 stuck outside any collective", "in inject_now",
             ("--pg-timeout", "10")),
    Scenario("skipped collective", "train_ddp.py", "skip-collective", "rank 2 skips one all_reduce",
             "train_ddp.py", ("--pg-timeout", "10")),
    Scenario("shape mismatch", "train_ddp.py", "shape-mismatch", "rank 2 all_reduces 2 values, its peers 1",
             "sizes [[2]]", ("--pg-timeout", "10")),
    Scenario("NaN (FSDP2)", "train_fsdp2.py", "nan", "a NaN in rank 2's batch; every rank raises the same error",
             "train_fsdp2.py"),
    Scenario("late join", "train_ddp.py", "late-join", "rank 2 never reaches init_process_group",
             "before_init", ("--pg-timeout", "10")),
    Scenario("CUDA OOM (simulated)", "train_ddp.py", "cuda-oom", "torch.OutOfMemoryError on rank 2",
             "CUDA out of memory"),
)  # fmt: skip

_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):\n\[0\]:\n(?:.*\n)*?\s+rank\s+: (\d+).*\n"
    r"\s+exitcode\s+: (-?\d+)(?: \(pid: \d+\))?(?:\s+\((\w+)\))?"
)
_SUMMARY = re.compile(r"Root Cause \(first observed failure\):(?:.*\n)*?={20,}", re.M)


@dataclass
class Outcome:
    named: int | None
    said: str
    kept_culprit_error: bool
    stacks: int
    seconds: float
    exit_code: int


def run(argv: list[str], timeout: float = 400) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, check=False)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def script_args(s: Scenario) -> list[str]:
    return [str(ROOT / "examples" / s.script), "--inject", s.inject, "--culprit-rank", str(CULPRIT), *s.extra]


def plain(s: Scenario) -> Outcome:
    code, out, secs = run([sys.executable, "-m", "torch.distributed.run", *COMMON, *script_args(s)])
    m = _ROOT_CAUSE.search(out)
    summary = _SUMMARY.search(out)
    named = int(m.group(1)) if m else None
    said = f"exitcode {m.group(2)}" + (f" ({m.group(3)})" if m and m.group(3) else "") if m else "no summary"
    # torchrun keeps only what the console showed; its summary has a traceback only with @record
    kept = bool(summary and s.culprit_text in summary.group(0))
    return Outcome(named, said, kept, 0, secs, code)


def diag(s: Scenario, work: Path) -> Outcome:
    d = work / s.inject
    argv = [sys.executable, "-m", "elastic_diag.run", *COMMON, *s.diag_flags, "--diag-dir", str(d), *script_args(s)]
    code, _out, secs = run(argv)
    report = json.loads((d / "report.json").read_text())
    dx = report["diagnosis"]
    culprit = next((r for r in report["ranks"] if r["rank"] == CULPRIT), {})
    kept_text = json.dumps(culprit) + json.dumps(dx)
    stacks = sum(1 for r in report["ranks"] if r.get("stack"))
    said = dx["failure_class"] + (f" ({dx['exception_type']})" if dx.get("exception_type") else "")
    return Outcome(dx["initiating_rank"], said, s.culprit_text in kept_text, stacks, secs, code)


def mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def table(rows: list[tuple[Scenario, Outcome, Outcome]]) -> list[str]:
    out = [
        "| failure (culprit: rank 2) | torchrun names | torchrun says | culprit's error in torchrun's summary "
        "| torchrun-diag names | torchrun-diag says | culprit's error or stack in report.json | stacks taken "
        "before teardown | seconds (torchrun / diag) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s, p, d in rows:
        pn = "none" if p.named is None else f"rank {p.named}" + ("" if p.named == CULPRIT else " (waited)")
        dn = "none" if d.named is None else f"rank {d.named}" + ("" if d.named == CULPRIT else " (wrong)")
        flags = f" (`{' '.join(s.diag_flags)}`)" if s.diag_flags else ""
        out.append(
            f"| {s.name}: {s.what} | {pn} | {p.said} | {mark(p.kept_culprit_error)} | {dn}{flags} | `{d.said}` | "
            f"{mark(d.kept_culprit_error)} | {d.stacks} of 4 | {p.seconds:.0f} / {d.seconds:.0f} |"
        )
    return out


def page(rows: list[tuple[Scenario, Outcome, Outcome]], command: str) -> str:
    right_p = sum(1 for _s, p, _d in rows if p.named == CULPRIT)
    right_d = sum(1 for _s, _p, d in rows if d.named == CULPRIT)
    lines = [
        "<!-- generated by benchmarks/compare.py; edit that program, not this page -->",
        "",
        "# Compared with plain torchrun",
        "",
        f"The same {len(rows)} injected failures, each a 4-rank CPU job of the examples on gloo in which rank 2",
        "fails, run under plain `torchrun` and under `torchrun-diag` with the same flags and script arguments.",
        f"Plain torchrun named the failing rank in **{right_p} of {len(rows)}**; torchrun-diag in "
        f"**{right_d} of {len(rows)}**.",
        "",
        "- *names*: torchrun's first \"Root Cause\" entry; torchrun-diag's `initiating_rank`.",
        "- *culprit's error*: whether the failing rank's own message (or, for a hang, its stack) is in what",
        "  the launcher kept: torchrun's error summary (it carries a traceback only when the script uses",
        "  `@record`, and no stderr unless `--redirects`/`--tee` were given), torchrun-diag's report.json.",
        "- *stacks taken before teardown*: ranks still alive when the failure began whose stacks were",
        "  dumped before they were stopped (torchrun takes none).",
        "",
        *table(rows),
        "",
        "torchrun-diag also keeps every rank's full stdout and stderr, the flight recorder of each rank that",
        "was alive, and report.html; its exit status is torchrun's. Settings: each launcher's defaults (no",
        "`--diag-hang-timeout`: silent failures wait for the process-group timeout, 10 s here), except where",
        "the table shows a torchrun-diag flag.",
        "",
        f"Produced by `{command}` on {datetime.date.today().isoformat()}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {_torch_version()}.",
    ]
    return "\n".join(lines) + "\n"


def _torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                         text=True, check=False)  # fmt: skip
    return out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="PAGE", help="write the table into this Markdown page")
    ap.add_argument("--only", help="comma-separated scenario injections to run")
    a = ap.parse_args()
    chosen = [s for s in SCENARIOS if not a.only or s.inject in a.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in chosen:
            p = plain(s)
            d = diag(s, Path(tmp))
            rows.append((s, p, d))
            print(f"{s.name:28} torchrun: rank {p.named} ({p.said}, {p.seconds:.0f} s)   "
                  f"torchrun-diag: rank {d.named} ({d.said}, {d.seconds:.0f} s)", flush=True)  # fmt: skip
    print("\n".join(table(rows)))
    if a.write:
        command = "python benchmarks/compare.py" + (f" --only {a.only}" if a.only else "") + f" --write {a.write}"
        Path(a.write).write_text(page(rows, command))
        print(f"wrote {a.write}")


if __name__ == "__main__":
    main()

"""Every report the product writes, normalised, in one folder: to show a refactor changed no output.

    python tools/report_snapshot.py OUT            # write the snapshot
    python tools/report_snapshot.py --compare A B  # list what differs (exit 1 if anything does)

It writes, for each fixture under tests/fixtures (logs, torchrun log dirs, flight-recorder dumps, diag
dirs), `elastic-diag analyze --json` and the text summary; report.html of every diag dir fixture; every
signature's `explain` page and the generated docs; and, with ``--live``, the report.json, report.html
and terminal summary of real `torchrun-diag` runs of examples/train_ddp.py (3 ranks, a few injections).
Times, durations, pids, ports, host names and paths are replaced by placeholders, so two snapshots of
the same code are equal.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
LIVE = ("exception", "segfault", "sigkill", "hang", "skip-collective")

_RULES = [
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<datetime>"),
    (re.compile(r"\b1[6-9]\d{8}(?:\.\d+)?\b"), "<epoch>"),
    (re.compile(r"\b\d+(?:\.\d+)?(?:e-?\d+)? ?(?:s|ms|us|ns|min)\b"), "<dur>"),
    (re.compile(r"\"(duration|wall|elapsed|started|ended|time|t|at|since|cost)[a-z_]*\": [0-9.e+-]+"), r'"\1": <n>'),
    (re.compile(r"\b(pid|port|PID)([ =:\"]+)\d+"), r"\1\2<n>"),
    (re.compile(r"127\.0\.0\.1\]?:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"(/tmp|/var/tmp)/[^\s\"'<>]*"), "<tmp>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uuid>"),
    (re.compile(r"\b0x[0-9a-f]{8,16}\b"), "<addr>"),
    # a frame in the package: where a module lives and its line numbers are what a refactor moves
    (re.compile(r'<root>/elastic_diag/(?:[a-z_]+/)*([a-z_]+\.py)(\\?"?,? line |:)\d+'), r"<pkg>/\1\2<n>"),
]


ROOTS = sorted({str(ROOT), "/work/main"}, key=len, reverse=True)  # the checkout, and where the fixtures were recorded


def normalise(text: str) -> str:
    for root in ROOTS:
        text = text.replace(root, "<root>")
    host = os.uname().nodename
    if host:
        text = text.replace(host, "<host>")
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    return text


def _run(argv: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def _write(out: Path, name: str, text: str) -> None:
    path = out / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(normalise(text))


def offline(out: Path) -> None:
    cli = [sys.executable, "-m", "elastic_diag.cli"]
    for kind in ("logs", "fr", "runs", "reports"):
        for case in sorted((FIXTURES / kind).iterdir()):
            if case.name == "README.md":
                continue
            _write(out, f"analyze/{kind}/{case.name}.json", _run([*cli, "analyze", "--json", str(case)]))
            _write(out, f"analyze/{kind}/{case.name}.txt", _run([*cli, "analyze", str(case)]))
    for case in sorted([*(FIXTURES / "reports").iterdir(), *(FIXTURES / "runs").glob("diag_*")]):
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / case.name
            shutil.copytree(case, copy)
            _run([*cli, "report", str(copy)])
            html = copy / "report.html"
            _write(out, f"html/{case.name}.html", html.read_text() if html.exists() else "(none)")
    listing = _run([*cli, "signatures"])
    _write(out, "signatures.txt", listing)
    for line in listing.split("--- stdout\n", 1)[1].split("\n--- stderr", 1)[0].splitlines():
        if line.strip():
            sid = line.split()[0]
            _write(out, f"explain/{sid}.txt", _run([*cli, "explain", sid]))
    with tempfile.TemporaryDirectory() as tmp:
        _run([*cli, "signatures", "--write-docs", tmp])
        for page in sorted(Path(tmp).iterdir()):
            _write(out, f"signature_docs/{page.name}", page.read_text())


def live(out: Path) -> None:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONWARNINGS": "ignore"}
    for inject in LIVE:
        with tempfile.TemporaryDirectory() as tmp:
            diag = Path(tmp) / "diag"
            flags = ["--diag-hang-timeout", "5"] if inject in ("hang",) else []
            argv = [sys.executable, "-m", "elastic_diag.run", "--standalone", "--nproc-per-node", "3",
                    "--diag-dir", str(diag), "--diag-grace", "2", *flags, str(ROOT / "examples" / "train_ddp.py"),
                    "--inject", inject, "--culprit-rank", "1", "--pg-timeout", "20"]  # fmt: skip
            console = _run(argv, env=env, timeout=240)
            _write(out, f"live/{inject}/summary.txt", console)
            report = diag / "report.json"
            _write(out, f"live/{inject}/report.json", report.read_text() if report.exists() else "(none)")


def _comparable(path: Path) -> list[str]:
    """The file as compared: normalised again (so a snapshot taken with older rules still compares), and of a
    live run's console only the summary the launcher prints last (the ranks' own lines interleave at random)."""
    if not path.exists():
        return ["(missing)"]
    text = normalise(path.read_text())
    if path.name == "summary.txt":
        text = text[text.rfind("=" * 60) :]
    return text.splitlines()


def compare(a: Path, b: Path) -> int:
    names = sorted({p.relative_to(a) for p in a.rglob("*") if p.is_file()}
                   | {p.relative_to(b) for p in b.rglob("*") if p.is_file()})  # fmt: skip
    differ = 0
    for name in names:
        left, right = _comparable(a / name), _comparable(b / name)
        if left != right:
            differ += 1
            print(f"=== {name}")
            print("\n".join(list(difflib.unified_diff(left, right, lineterm="", n=1))[:40]))
    print(f"{len(names)} files compared, {differ} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--live", action="store_true", help="also real torchrun-diag runs of the example")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give OUT or --compare A B")
    args.out.mkdir(parents=True, exist_ok=True)
    offline(args.out)
    if args.live:
        live(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the tests share: run torchrun-diag / torchrun for real under a hard timeout and leave no process
behind, the example script's command lines, and every report a run writes checked against its schema."""

from __future__ import annotations

import codecs
import importlib.util
import json
import locale
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import parity
import pytest

from elastic_diag.report.schema import validate

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
EXAMPLE = ROOT / "examples" / "train_ddp.py"


PLACEHOLDER = re.compile(r"<[a-z][a-z-]*>")


def worker_env(rank_dir: Path, extra_path: str = "") -> dict[str, str]:
    """The environment the launcher gives a rank: its evidence folder and the bootstrap first on PYTHONPATH."""
    from elastic_diag import layout
    from elastic_diag.agent.logs_specs import BOOT_DIR

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env[layout.ENV_RANK_DIR] = str(rank_dir)
    env[layout.ENV_BOOT_PATH] = BOOT_DIR
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOT_DIR, extra_path) if p)
    env["TORCHELASTIC_ERROR_FILE"] = str(rank_dir / "error.json")
    return env


def commands(report: dict[str, Any]) -> list[str]:
    """Every command a report prints for a person to run: verify (the run's and each attempt's), resume."""
    found = [report["diagnosis"].get("verify")]
    found += [a["diagnosis"].get("verify") for a in report.get("attempts", [])]
    checklist = report.get("checklist") or {}
    found += [checklist.get(k, {}).get("command") for k in ("verify", "resume")]
    return [c for c in found if c]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    diag_dir: Path
    seconds: float
    console: str = ""  # stdout and stderr interleaved as they arrived, as a terminal shows ``cmd 2>&1``

    @property
    def report(self) -> dict[str, Any]:
        """report.json, checked against the schema it names (elastic_diag/report/schemas/); a live report's
        verification and resume commands must hold no ``<...>`` placeholder (they run as printed)."""
        data: dict[str, Any] = json.loads((self.diag_dir / "report.json").read_text())
        validate(data)
        fifos = [p for p in self.diag_dir.glob("attempt_*/rank_*/dump.wake") if p.is_fifo()]
        assert not fifos, f"the beacons' FIFOs were left in the evidence folder: {fifos}"
        if "launch" in data:
            left = [c for c in commands(data) if PLACEHOLDER.search(c)]
            assert not left, left
        return data

    def verify(self, timeout: float = 120) -> tuple[int, dict[str, Any], str]:
        """``elastic-diag verify`` on this run, as a user would after it: (exit status, report.json's
        ``verification``, its stdout). Kills what the re-run left behind."""
        argv = [sys.executable, "-m", "elastic_diag.cli", "verify", str(self.diag_dir), "--timeout", str(timeout),
                "--yes"]  # fmt: skip
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 60, cwd=ROOT,
                               stdin=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)  # fmt: skip
        finally:
            kill_leftovers(Path(str(self.diag_dir) + ".verify"))
        return p.returncode, self.report.get("verification", {}), p.stdout + p.stderr

    def assert_verify_reproduces(self, timeout: float = 120) -> dict[str, Any]:
        """The report's verification, run as printed on the unchanged job, fails the way the page says
        (exit 1: the signature is still there), and the outcome is recorded."""
        code, v, out = self.verify(timeout)
        assert code == 1 and v and not v["passed"], out[-3000:]
        assert v["rerun_status"] == "failed" and "still there" in v["summary"], v["summary"]
        return v

    def rank(self, rank: int) -> dict[str, Any]:
        return next(r for r in self.report["ranks"] if r["rank"] == rank)


def report_dir(d: Path, command: str, *, cwd: Path | None = None, signature_id: str | None = "python-exception",
               status: str = "failed", **fields: Any) -> Path:  # fmt: skip
    """A diag dir whose report.json (a valid elastic_diag.report/1) asks ``elastic-diag verify`` to run
    ``command``; ``fields`` replace the report's top-level entries (run_id, node, ...)."""
    d.mkdir(parents=True, exist_ok=True)
    report = {"schema": "elastic_diag.report/1", "run_id": "r", "status": status, "ranks": [], "warnings": [],
              "attempts": [], "node": "n", "diag_dir": str(d), "internal_errors": [], "notes": [],
              "diagnosis": {"failure_class": "python_exception", "initiating_rank": 1, "initiating_node": "n",
                            "exception_type": "ValueError", "signature_id": signature_id, "summary": "s",
                            "evidence": [], "fix": "f", "verify": command, "collateral_ranks": [0],
                            "verify_plan": {"command": command, "expect": "e", "cwd": str(cwd or d)}},
              **fields}  # fmt: skip
    (d / "report.json").write_text(json.dumps(report))
    return d


def kill_leftovers(diag_dir: Path) -> None:
    """Kill any worker still alive after the launcher ended (pids from the bootstrap's worker.json)."""
    for info in diag_dir.glob("attempt_*/rank_*/worker.json"):
        try:
            pid = json.loads(info.read_text())["pid"]
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


class _Capture:
    """The launcher's two pipes read by a thread each: every byte of each stream, and both together in the
    order the chunks arrived (what a terminal shows of ``cmd 2>&1``)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.encoding = locale.getpreferredencoding(False)  # what text=True decoded with
        self.lock = threading.Lock()
        self.chunks: list[str] = []
        self.raw: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.threads = [
            threading.Thread(target=self._read, args=(name, stream), name=f"launch-{name}", daemon=True)
            for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))
        ]
        for t in self.threads:
            t.start()

    def _read(self, name: str, stream: Any) -> None:
        decoder = codecs.getincrementaldecoder(self.encoding)(errors="replace")
        try:
            while chunk := stream.read1(65536):
                with self.lock:
                    self.raw[name].append(chunk)
                    self.chunks.append(decoder.decode(chunk))
            with self.lock:
                self.chunks.append(decoder.decode(b"", final=True))
        except (OSError, ValueError):  # the pipe closed under us: what was read is kept
            pass
        finally:
            stream.close()

    def finished(self, proc: subprocess.Popen[bytes], deadline: float | None) -> bool:
        """True once both streams reached their end and the launcher exited, before ``deadline`` (None: no
        limit), what ``communicate(timeout)`` waits for."""

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for t in self.threads:
            t.join(left())
        if any(t.is_alive() for t in self.threads):
            return False
        try:
            proc.wait(timeout=left())
        except subprocess.TimeoutExpired:
            return False
        return True

    def text(self, name: str) -> str:
        """One stream as ``text=True`` gives it: decoded, universal newlines."""
        with self.lock:
            data = b"".join(self.raw[name])
        return data.decode(self.encoding).replace("\r\n", "\n").replace("\r", "\n")

    @property
    def console(self) -> str:
        with self.lock:
            return "".join(self.chunks)


def launch(argv: list[str], diag_dir: Path, timeout: float = 100, env: dict[str, str] | None = None) -> Run:
    """Run a launcher command line to completion under a hard timeout; kill everything it left. Then the
    same run is analysed offline and compared with its live verdict (parity.py)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    capture = _Capture(proc)
    try:
        if not capture.finished(proc, start + timeout):
            os.killpg(proc.pid, signal.SIGTERM)  # the agent tears its workers down on SIGTERM
            if not capture.finished(proc, time.monotonic() + 40):
                os.killpg(proc.pid, signal.SIGKILL)
                capture.finished(proc, None)
            kill_leftovers(diag_dir)
            pytest.fail(f"launcher timed out after {timeout}s:\n{capture.text('stderr')[-5000:]}")
    finally:
        kill_leftovers(diag_dir)
    run = Run(proc.returncode, capture.text("stdout"), capture.text("stderr"), diag_dir, time.monotonic() - start,
              capture.console)  # fmt: skip
    parity.check(run, argv)
    return run


def torchrun_diag(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic_diag.run", *args]


def plain_torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


# --- the example's fault matrix: 3 CPU ranks on gloo, the culprit is rank 2 ---------------------------
CULPRIT = 2
COMMON = ["--standalone", "--nproc-per-node", "3"]  # 3: a 4th rank costs 45% more CPU on 2 cores


def script_args(inject: str, pg_timeout: float = 8) -> list[str]:
    return [str(EXAMPLE), "--inject", inject, "--culprit-rank", str(CULPRIT), "--pg-timeout", str(pg_timeout)]


# The two cases (docs/how-it-works.md, "Where torchrun loses the evidence") where plain torchrun names a
# rank that was only waiting: the fault matrix runs them under torchrun-diag,
# test_plain_torchrun_blames_a_waiting_rank the same job under plain torchrun (one job each, not two:
# the suite's time is shared).
# exception-after-cleanup: the culprit's cleanup (14 s) outlasts the collective timeout (8 s), so its
# waiting peers fail first; a grace of 10 s lets it finish and raise within our capture (margins of
# 3 s or more both ways). hang: stuck outside any collective until the peers' collective timeout.
COMPARED = {"exception-after-cleanup": (["--cleanup-seconds", "14"], ["--diag-grace", "10"]), "hang": ([], [])}


def load_example(name: str) -> ModuleType:
    """examples/<name>.py as a module (the scripts import their sibling faults.py)."""
    folder = ROOT / "examples"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", folder / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(folder))


def injection_tables() -> dict[str, dict[str, str]]:
    """script name -> {--inject value: the failure class it gives}, from the examples themselves."""
    return {f"{name}.py": load_example(name).INJECTIONS for name in ("train_ddp", "train_fsdp2")}

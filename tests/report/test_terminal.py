"""What a person sees in a terminal: colour, a compact table and a progress line on a TTY; the same
words with no escape codes in a pipe or a log file (a real pseudo-terminal, a real subprocess)."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time

from helpers import FIXTURES

from elastic_diag.report.summary import format_summary, print_summary
from elastic_diag.report.terminal import Paint, Progress, is_tty, table, wants_colour

REPORT = json.loads((FIXTURES / "reports" / "desync" / "report.json").read_text())
LOGS = FIXTURES / "logs" / "52_slurm_keyerror_rank3_collateral_timeouts"


def run_in_pty(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; everything it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, close_fds=True,
                            env={**os.environ, "TERM": "xterm", **(env or {})})  # fmt: skip
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)
    return out.decode("utf-8", errors="replace")


def test_summary_on_a_terminal_has_colour_and_a_table_and_in_a_pipe_neither():
    coloured = format_summary(REPORT, "/r/report.json", paint=Paint(True), compact_table=True)
    assert "\x1b[1;31m" in coloured  # FAILED and the initiating rank in bold red
    lines = [line for line in coloured.splitlines() if "rank 2 (vm)" in line]
    assert lines and "initiating" in lines[0] and lines[0].startswith("  \x1b[1;31m")
    assert "ranks" in coloured and "ended" in coloured and "train_ddp.py:174 in train" in coloured
    plain = format_summary(REPORT, "/r/report.json")
    assert "\x1b" not in plain and "roles: collateral 0, 1, 3; initiating 2" in plain
    assert "page: /r/report.html" in plain


def test_print_summary_picks_the_style_from_the_stream(monkeypatch):
    buf = io.StringIO()
    print_summary(REPORT, "/r/report.json", buf)
    assert "\x1b" not in buf.getvalue() and not is_tty(buf)


def test_no_color_and_dumb_terminals_get_no_colour(monkeypatch):
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as tty:
        monkeypatch.delenv("NO_COLOR", raising=False)
        monkeypatch.setenv("TERM", "xterm")
        assert wants_colour(tty)
        monkeypatch.setenv("NO_COLOR", "1")
        assert not wants_colour(tty)
        monkeypatch.delenv("NO_COLOR")
        monkeypatch.setenv("TERM", "dumb")
        assert not wants_colour(tty)
    os.close(leader)


def test_table_aligns_and_clips():
    out = table(["a", "bb"], [["xxx", "y"], ["z" * 80, "w"]], max_width=10)
    assert out[1].index("y") == out[2].index("w") == 12
    assert "\u2026" in out[2]


def test_progress_redraws_one_line_on_a_terminal_and_is_silent_elsewhere():
    quiet = io.StringIO()
    with Progress("working", quiet, interval=0.01) as p:
        p.update("half")
        time.sleep(0.05)
    assert quiet.getvalue() == ""
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as tty, Progress("working", tty, interval=0.01) as p:
        p.update("half way")
        time.sleep(0.1)
    drawn = b""
    while select.select([leader], [], [], 0.2)[0]:
        try:
            drawn += os.read(leader, 65536)
        except OSError:  # EIO: everything written has been read and the other end is closed
            break
    os.close(leader)
    drawn = drawn.decode()
    assert "\r\x1b[Kworking: half way (" in drawn and drawn.endswith("\r\x1b[K")


def test_analyze_in_a_real_terminal_and_in_a_pipe():
    argv = [sys.executable, "-m", "elastic_diag.cli", "analyze", str(LOGS)]
    on_tty = run_in_pty(argv)
    assert "\x1b[1;31melastic-diag analyze:" in on_tty, on_tty
    assert "\r\x1b[Kelastic-diag analyze" in on_tty  # the progress line, then cleared
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert piped.returncode == 1 and "\x1b" not in piped.stdout + piped.stderr  # 1: a failure was diagnosed
    assert "elastic-diag analyze:" in piped.stdout


# what a hostile (or merely colourful) worker may print: a title change, an OSC 8 hyperlink, a screen clear,
# a cursor move, a bell, a carriage return that overwrites the line, an 8-bit CSI and a direction override
HOSTILE = ("\x1b]0;pwned\x07", "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\", "\x1b[2J", "\x1b[10A",
           "\x07", "\rERASED", "\x9b31m", "\u202egnp.exe")  # fmt: skip
ACTING = ("\x1b", "\x07", "\r", "\x9b", "\u202e")


def _acts_on_a_terminal(text: str) -> list[str]:
    return [c for c in ACTING if c in text]


def test_what_the_ranks_printed_never_acts_on_the_readers_terminal(tmp_path):
    """Issue 30 item 5: escape sequences in evidence are shown escaped by the summary, `analyze` (text and
    JSON) and the page; the summary's own colour codes stay real."""
    hostile = "".join(HOSTILE)
    report = json.loads(json.dumps(REPORT))
    d = report["diagnosis"]
    d["summary"] = "rank 2 raised " + hostile
    d["evidence"] = [f"[rank2]: RuntimeError: {hostile}"]
    d["verify"] = "python train.py --api-key s3cretApiKey " + hostile
    plain = format_summary(report, "/r/\x1b]0;x\x07/report.json")
    assert not _acts_on_a_terminal(plain), plain
    assert "\\x1b]0;pwned\\x07" in plain and "\\rERASED" in plain and "\\u202egnp" in plain and "\\x9b31m" in plain
    assert "s3cretApiKey" not in plain and "--api-key ***" in plain  # the verify line (issue 30 item 3)
    coloured = format_summary(report, "/r/report.json", paint=Paint(True), compact_table=True)
    assert "\x1b[1;31m" in coloured and "\x1b]" not in coloured and "\x1b[2J" not in coloured and "\x07" not in coloured

    log = tmp_path / "train.log"
    log.write_text("[rank0]: step 1\n" + f"[rank1]: RuntimeError: CUDA error: an illegal memory access {hostile}\n"
                   + "[rank0]: Watchdog caught collective operation timeout " + hostile + "\n")  # fmt: skip
    for extra in ([], ["--json"]):
        out = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "analyze", *extra, str(log)],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert out.returncode == 1 and "rank" in out.stdout, out.stderr
        assert not _acts_on_a_terminal(out.stdout + out.stderr), out.stdout

    from elastic_diag.report.html import render_html

    page = render_html(report, problems=["missing \x1b[2J file"])
    assert not _acts_on_a_terminal(page) and "s3cretApiKey" not in page


def test_printable_escapes_only_what_acts():
    from elastic_diag.report.terminal import printable, shown_data

    kept = "tab\there\nnext \u00e9t\u00e9 \u4e2d\u6587 \U0001f600"
    assert printable(kept) == kept
    assert printable("a\x1b[31mb\x00c\x7fd\u200fe") == "a\\x1b[31mb\\x00c\\x7fd\\u200fe"
    nested: object = "x\x1b"
    for _ in range(5000):
        nested = [nested]
    assert "not shown" in json.dumps(shown_data(nested))

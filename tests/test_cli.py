"""Command-line contract: usage errors before any worker starts, --no-diag, the taxonomy commands."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import EXAMPLE, FIXTURES, ROOT


def cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})  # fmt: skip


def in_process(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
               env: dict[str, str] | None = None) -> tuple[int, str]:  # fmt: skip
    """torchrun-diag's main() in this process (a usage error ends before any worker: no need to pay
    a torch import in a new process for each); its exit status and stderr."""
    from elastic_diag.launch.run import main

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def test_missing_script_is_a_usage_error(tmp_path):
    p = cli("-m", "elastic_diag.run", "--nproc-per-node", "2", "--diag-dir", str(tmp_path), "no_such_script.py")
    assert p.returncode == 2
    assert "no_such_script.py" in p.stderr and "does not exist" in p.stderr
    assert not (tmp_path / "attempt_0").exists()


def test_unknown_diag_flag_is_a_usage_error(capsys, monkeypatch):
    code, err = in_process(["--diag-bogus", "1", str(EXAMPLE)], capsys, monkeypatch)
    assert code == 2 and "--diag-bogus" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; covered by the file below")
def test_unwritable_diag_dir_is_a_usage_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    p = cli("-m", "elastic_diag.run", "--diag-dir", str(ro / "x"), str(EXAMPLE))
    assert p.returncode == 2 and "not writable" in p.stderr


def test_diag_dir_that_is_a_file_is_a_usage_error(tmp_path, capsys, monkeypatch):
    f = tmp_path / "file"
    f.write_text("")
    code, err = in_process(["--diag-dir", str(f / "sub"), str(EXAMPLE)], capsys, monkeypatch)
    assert code == 2 and "not writable" in err and str(f) in err


def test_env_diag_dir_and_bad_grace(tmp_path, capsys, monkeypatch):
    env = {"ELASTIC_DIAG_GRACE": "soon", "ELASTIC_DIAG_DIR": str(tmp_path)}
    code, err = in_process([str(EXAMPLE)], capsys, monkeypatch, env)
    assert code == 2 and "ELASTIC_DIAG_GRACE" in err


def test_help_lists_torchrun_and_diag_flags():
    p = cli("-m", "elastic_diag.run", "--help")
    assert p.returncode == 0
    for flag in ("--nproc-per-node", "--rdzv-backend", "--max-restarts", "--standalone", "--no-python",
                 "--diag-dir", "--diag-grace", "--no-diag"):  # fmt: skip
        assert flag in p.stdout


def test_elastic_diag_run_is_the_same_command(tmp_path):
    p = cli("-m", "elastic_diag.cli", "run", "--diag-dir", str(tmp_path), "nope.py")
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_signatures_and_explain():
    p = cli("-m", "elastic_diag.cli", "signatures")
    assert p.returncode == 0 and "gloo-timeout" in p.stdout and "segfault" in p.stdout
    p = cli("-m", "elastic_diag.cli", "explain", "gloo-timeout")
    assert p.returncode == 0
    for part in (
        "Checklist (in this order):",
        "4. Verify",
        "5. Resume",
        "What it means:",
        "How to confirm:",
        "Fix:",
        "Look-alikes:",
    ):
        assert part in p.stdout
    p = cli("-m", "elastic_diag.cli", "explain", "no-such-thing")
    assert p.returncode == 2 and "no signature" in p.stderr


def test_logs_specs_from_the_environment_as_every_other_torchrun_flag(tmp_path, capsys, monkeypatch):
    """torch's parser reads PET_<FLAG> for every flag but --logs-specs; torchrun-diag reads it too."""
    env = {"PET_LOGS_SPECS": "no-such-logs-specs", "ELASTIC_DIAG_DIR": str(tmp_path)}
    code, err = in_process(["--nproc-per-node", "1", str(EXAMPLE)], capsys, monkeypatch, env)
    assert code == 2 and "no-such-logs-specs" in err, err


# ---- elastic-diag report / verify on diag dirs that are not what they should be --------------------------


def test_report_of_another_schema_or_shape_renders_what_it_can_without_a_traceback(tmp_path):
    base = json.loads((FIXTURES / "runs" / "diag_segfault" / "report.json").read_text())
    shapes = {
        "list": ("[1, 2]", "holds a JSON list"),
        "string": ('"x"', "holds a JSON str"),
        "nan": ("NaN", "holds a JSON float"),
        "deep": ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        "deep-object": ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deep"),
        "schema-9": (json.dumps({**base, "schema": "elastic_diag.report/9"}), "has schema 'elastic_diag.report/9'"),
        "odd-values": (
            json.dumps(
                {
                    **base,
                    "run_id": float("inf"),
                    "node": -1e308,
                    "notes": [[[[[]]]]] * 3,
                    "ranks": [{"rank": float("nan"), "exit_code": 1e308}, "x", None],
                    "attempts": [1, "x", {}],
                }
            ),
            "",
        ),  # fmt: skip
    }
    for name, (text, said) in shapes.items():
        d = tmp_path / name
        d.mkdir()
        (d / "report.json").write_text(text)
        p = cli("-m", "elastic_diag.cli", "report", str(d))
        assert p.returncode == 0 and "Traceback" not in p.stderr, (name, p.stderr[-2000:])
        assert said in p.stderr and (d / "report.html").is_file(), (name, p.stderr)


def _mount(*args: str) -> None:
    p = subprocess.run(["mount", *args], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount here ({p.stderr.strip()}): needs root with CAP_SYS_ADMIN")


@pytest.mark.timeout(120)
def test_report_and_verify_in_a_read_only_or_full_diag_dir(tmp_path):
    source = FIXTURES / "runs" / "diag_segfault" / "report.json"
    writable, ro, full = tmp_path / "writable", tmp_path / "ro", tmp_path / "full"
    for d in (writable, ro, full):
        d.mkdir()
    shutil.copy(source, writable / "report.json")
    data = json.loads(source.read_text())
    data["diagnosis"]["verify"], data["diagnosis"]["verify_plan"] = "df .", None
    (writable / "report.json").write_text(json.dumps(data))
    mounted: list[Path] = []
    try:
        _mount("--bind", str(writable), str(ro))
        mounted.append(ro)
        _mount("-o", "remount,bind,ro", str(ro))
        _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full))
        mounted.append(full)
        shutil.copy(writable / "report.json", full / "report.json")
        with contextlib.suppress(OSError), open(full / "filler", "wb", buffering=0) as fp:  # the rest of it
            while True:
                fp.write(b"\0" * 512)
        for d in (ro, full):
            before = sorted(os.listdir(d))
            p = cli("-m", "elastic_diag.cli", "report", str(d))
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
            assert f"cannot write {d}/report.html" in p.stderr and "--output" in p.stderr, p.stderr
            assert sorted(os.listdir(d)) == before, os.listdir(d)  # no page, no .tmp left behind
            p = cli("-m", "elastic_diag.cli", "report", str(d), "--output", "-")
            assert p.returncode == 0 and p.stdout.lower().startswith("<!doctype html"), p.stderr
            assert "SIGSEGV" in p.stdout
            p = cli("-m", "elastic_diag.cli", "report", str(d), "--output", str(tmp_path / f"{d.name}.html"))
            assert p.returncode == 0 and (tmp_path / f"{d.name}.html").is_file()
            p = cli("-m", "elastic_diag.cli", "verify", str(d), "--yes")  # it runs; the outcome is printed only
            assert p.returncode == 0 and "PASSED" in p.stdout and "Traceback" not in p.stderr, p.stderr
            assert "the outcome is not recorded: cannot write" in p.stderr, p.stderr
            assert (d / "report.json").read_text() == (writable / "report.json").read_text()
            assert sorted(os.listdir(d)) == before
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", "-l", str(m)], check=False)

"""Secrets stay out of everything written (issue 16): a run with HF_TOKEN=abc123 in its environment and
`--api-key abc123` on its command line, whose script prints both and raises an error quoting them,
leaves no abc123 anywhere under the diag dir; and the redaction rules on their own."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest
from helpers import ROOT, launch, torchrun_diag

from elastic_diag import redaction

SECRET = "abc123"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_no_secret_anywhere_under_the_diag_dir(tmp_path):
    diag = tmp_path / "diag"
    argv = torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-dir", str(diag),
                         "--diag-termination-log", str(tmp_path / "termination-log"),
                         str(ROOT / "tests" / "scenarios" / "upload_with_api_key.py"), "--api-key", SECRET)  # fmt: skip
    run = launch(argv, diag, env={"HF_TOKEN": SECRET})
    d = run.report["diagnosis"]
    assert (d["initiating_rank"], d["failure_class"], d["exception_type"]) == (1, "python_exception", "HTTPError"), d
    assert "token=***&key=***" in " ".join(d["evidence"]) + d["summary"], d
    grep = subprocess.run(["grep", "-r", "-l", SECRET, str(diag), str(tmp_path / "termination-log")],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert grep.stdout == "", f"the secret is in: {grep.stdout}"
    assert SECRET in run.stdout  # the console showed what the script printed: that is the user's own terminal
    assert stat.S_IMODE(os.stat(diag).st_mode) & ~0o750 == 0  # never wider than rwxr-x---
    # the environment snapshot of the failed attempt: on disk, in the report, folded in the page
    env = json.loads((diag / "attempt_0" / "environment.json").read_text())
    assert env["versions"]["torch"].startswith("2.") and env["took_ms"] < 2000 and "dev_shm" in env["disks"]
    assert run.report["attempts"][0]["environment"]["sources"] == env["sources"]
    assert "Environment at the first failure" in (diag / "report.html").read_text()


def test_secret_values_from_the_environment_and_the_command_line():
    env = {"HF_TOKEN": "hf_xyz123456", "WANDB_API_KEY": "0123abcd", "AWS_SECRET_ACCESS_KEY": "s3cr3t/Key",
           "PASSWORD": "x", "PATH": "/usr/bin", "KEYBOARD": ""}  # fmt: skip
    argv = ["train.py", "--hf-token", "tok-1", "--api_key=key-2", "--lr", "0.1", "--auth", "--steps", "5",
            "-password", "pw-3"]  # fmt: skip
    values = redaction.secret_values(env, argv)
    assert values == {"hf_xyz123456", "0123abcd", "s3cr3t/Key", "x", "tok-1", "key-2", "pw-3"}
    assert redaction.redact_argv(argv) == ["train.py", "--hf-token", "***", "--api_key=***", "--lr", "0.1",
                                           "--auth", "--steps", "5", "-password", "***"]  # fmt: skip
    assert redaction.redact_env(env)["HF_TOKEN"] == "***" and redaction.redact_env(env)["PATH"] == "/usr/bin"
    r = redaction.Redactor(values)
    assert r.text("pushing with x=1 and hf_xyz123456") == "pushing with x=1 and ***"  # "x": too short to search
    assert r.data({"argv": ["--hf-token", "tok-1"], "n": 3}) == {"argv": ["--hf-token", "***"], "n": 3}


def test_redact_file_across_chunk_boundaries(tmp_path):
    path = tmp_path / "stdout.log"
    secret = "hf_AbCdEf0123456789"
    text = ("x" * 1000 + secret + "\n") * 50
    path.write_text(text)
    assert redaction.redact_file(path, redaction.Redactor({secret}), chunk=1009)  # a value cut by every read
    out = path.read_text()
    assert secret not in out and out.count("***") == 50 and len(out) == len(text) - 50 * (len(secret) - 3)
    clean = tmp_path / "clean.log"
    clean.write_text("nothing here\n")
    before = clean.stat().st_mtime_ns
    assert not redaction.redact_file(clean, redaction.Redactor({secret})) and clean.stat().st_mtime_ns == before

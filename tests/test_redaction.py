"""Secrets stay out of everything written (issue 16): a run with HF_TOKEN=abc123 in its environment and
`--api-key abc123` on its command line, whose script prints both and raises an error quoting them,
leaves no abc123 anywhere under the diag dir; and the redaction rules on their own."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import stat
import subprocess
import sys
import time
from typing import Any

import pytest
from helpers import FIXTURES, ROOT, kill_leftovers, launch, torchrun_diag
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # masked where it was written (the console shows the rank's file) and in the summary's verify line
    assert SECRET not in run.stdout + run.stderr and "--api-key ***" in run.stderr, run.stderr[-3000:]
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


# A script that prints its secrets in the ways scripts do (its arguments, its environment, a connection
# string, a URL with a password, a provider key) through Python, writes one more past Python (from the fd,
# as a subprocess or C code would) on an error line, says it is ready, and waits to be killed.
PRINTS_SECRETS = """
import os, sys, time
print("config:", sys.argv[1:], "HF_TOKEN=" + os.environ["HF_TOKEN"], flush=True)
print("db: postgresql://trainer:Hunter2Pass@db.internal:5432/runs", flush=True)
sys.stderr.write("pushing with Authorization: Bearer " + os.environ["HF_TOKEN"] + "\\n")
sys.stderr.flush()
os.write(2, b"RuntimeError: upload failed for https://user:FdPassW0rd@hub.example.org token ghp_" + b"a1" * 18 + b"\\n")
print("ready", flush=True)
time.sleep(120)
"""
LEAKS = ("s3cretApiKey", "hf_Q9xLmZpRtVbNcYwKdHsJgFaE1234567890", "Hunter2Pass", "FdPassW0rd", "a1a1a1a1a1a1")


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_secrets_never_reach_the_streams_even_when_the_launcher_is_killed(tmp_path):
    """Issue 30 item 2: redaction where the text is written (each rank's sys.stdout / sys.stderr), so the
    stream files hold no secret after the launcher is SIGKILLed before its own exit-time pass; what got
    past Python (written to the fd) is masked again by `elastic-diag report` (defence in depth)."""
    script = tmp_path / "prints_secrets.py"
    script.write_text(PRINTS_SECRETS)
    diag = tmp_path / "diag"
    argv = torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-dir", str(diag), str(script),
                         "--api-key", LEAKS[0])  # fmt: skip
    env = {**os.environ, "HF_TOKEN": LEAKS[1], "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        outs = lambda: sorted(diag.glob("attempt_0/rank_*/stdout.log"))  # noqa: E731
        while not (len(outs()) == 2 and all("ready" in p.read_text() for p in outs())):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks never said ready"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: its exit-time masking never runs
        proc.wait(10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        kill_leftovers(diag)
    streams = {p.relative_to(diag): p.read_text() for p in diag.glob("attempt_0/rank_*/std*.log")}
    printed = "\n".join(streams.values())
    assert "ready" in printed and "config:" in printed and "Authorization: Bearer ***" in printed, streams
    for leak in LEAKS[:4]:
        assert leak not in printed.replace("FdPassW0rd", ""), (leak, streams)  # all but the fd write
    assert "FdPassW0rd" in printed  # written past Python: only the readers can mask it now
    report = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "report", str(diag)], capture_output=True,
                            text=True, timeout=60, check=False, cwd=ROOT)  # fmt: skip
    assert report.returncode == 0, report.stderr
    page = (diag / "report.html").read_text()
    written = page + report.stdout + report.stderr
    assert "upload failed" in written, "the error line written past Python is in the report"
    for leak in LEAKS:
        assert leak not in written, leak


SHAPE_CASES = {
    "postgresql://trainer:Hunter2Pass@db:5432/x": "postgresql://trainer:***@db:5432/x",
    "Authorization: Bearer abcdefghijklmnopqrstuvwxyz012345": "Authorization: Bearer ***",
    "{'Authorization': 'Basic dXNlcjpwYXNzd29yZA=='}": "{'Authorization': 'Basic ***'}",
    "host=db user=ml password=S3cretPw dbname=runs": "host=db user=ml password=*** dbname=runs",
    "export HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyzABCDEFGH": "export HF_TOKEN=***",
    "AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE": "AWS_ACCESS_KEY_ID=***",
    "AWS_SECRET_ACCESS_KEY='wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY'": "AWS_SECRET_ACCESS_KEY=***",
    "key=AKIAIOSFODNN7EXAMPLE;": "key=***;",
    "url?key=AIzaSyA-1234567890abcdefghijklmnopqrstu": "url?key=***",
    "ya29.a0AfH6SMBx3example-token_value_1234": "***",
    "AccountName=a;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq==;":
        "AccountName=a;AccountKey=***;",
    "https://a.blob.core.windows.net/c/f?sv=2020-08-04&sig=abcdEFGH1234ijklMNOP5678%3D": (
        "https://a.blob.core.windows.net/c/f?sv=2020-08-04&sig=***"),
    "token hf_abcdefghijklmnopqrstuvwxyzABCDEFGH used": "token *** used",
    "OPENAI sk-proj-abcdefghijklmnopqrstuvwxyz0123": "OPENAI ***",
    "sk-ant-api03-abcdefghijklmnopqrstuvwxyz": "***",
    "ghp_abcdefghijklmnopqrstuvwxyz0123456789 github_pat_11ABCDEFG0123456789_abcdefghij": "*** ***",
    "glpat-abcdefghij0123456789": "***",
    "xoxb-123456789012-abcdefghijkl": "***",
    "https://hooks.slack.com/services/T000/B000/XXXXXXXX": "https://hooks.slack.com/services/***",
    "WANDB_API_KEY=0123456789abcdef0123456789abcdef01234567": "WANDB_API_KEY=***",
    "wandb.login(key='0123456789abcdef0123456789abcdef01234567')": "wandb.login(key='***')",
    "Namespace(lr=0.1, hf_token='hf_x', api_key=\"k-1\")": "Namespace(lr=0.1, hf_token=***, api_key=***)",
    "python train.py --api-key 7f3a9bd2c1 --hub_token=abc --lr 3e-4": (
        "python train.py --api-key *** --hub_token=*** --lr 3e-4"),
    "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N": "jwt ***",
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\nnext": (
        "-----BEGIN OPENSSH PRIVATE KEY-----***-----END OPENSSH PRIVATE KEY-----\nnext"),
}  # fmt: skip


def test_secret_shapes_are_masked_and_training_lines_are_not():
    """Issue 30 item 4: secrets by their shape, whoever's they are; near-misses that training logs print."""
    for text, want in SHAPE_CASES.items():
        assert redaction.mask_shapes(text) == want, text
        assert redaction.shapes_found(text), text
    untouched = [
        "TOKENIZERS_PARALLELISM=false NCCL_SOCKET_IFNAME=eth0 MASTER_ADDR=10.0.0.1",
        "tokenizer eos_token='</s>' pad_token='<pad>' max_new_tokens=512 tokens/s 12345",
        "[rank0]:[E ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=600000)",
        "checkpoint sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 saved to ckpt-step-400",
        "init_method=tcp://10.0.0.1:29500 --max-tokens 4096 --tokenizer gpt2 --keys a,b",
        "git 0123456789abcdef0123456789abcdef01234567 KeyError: 'model.layers.0.weight' sk-learn",
        "https://github.com/pytorch/pytorch/issues/1234 user@example.org",
    ]
    for text in untouched:
        assert redaction.mask_shapes(text) == text and not redaction.shapes_found(text), text


def test_no_secret_shape_in_the_fixture_logs():
    """Issue 30 item 4: false positives on real training logs (289 fixtures: hashes, checkpoint names,
    SeqNums, URLs, tokenizer reprs) measured: none of them holds a line that a shape would mask."""
    found: dict[str, list[str]] = {}
    for path in sorted((FIXTURES / "logs").rglob("*")):
        if not path.is_file() or path.suffix == ".json":
            continue
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8", "replace")
        if redaction.mask_shapes(text) != text:
            found[str(path.relative_to(FIXTURES))] = [
                line for line in text.splitlines() if redaction.mask_shapes(line) != line][:3]  # fmt: skip
    assert not found, found


def test_a_big_text_is_masked_as_its_lines_are():
    """Past WHOLE_TEXT characters only the lines a gate is on are searched: the same result as a line at a time."""
    lines = [f"[rank{i % 8}]: step {i} loss {i / 7:.4f} tokens/s {i * 31} key={i}\n" for i in range(3000)]
    lines[1234] = "connecting postgresql://u:Hunter2Pass@db/x with HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyzABCDEFGH\n"
    lines[2999] = "--api-key s3cretApiKey"  # the last line, no line end
    text = "".join(lines)
    assert len(text) > redaction.WHOLE_TEXT
    out = redaction.mask_shapes(text)
    assert out == "".join(redaction.mask_shapes(line) for line in lines)
    assert "Hunter2Pass" not in out and "hf_abc" not in out and "s3cretApiKey" not in out and out.count("***") == 3


def test_redacting_stream_masks_what_is_written_and_is_the_stream_otherwise(tmp_path):
    path = tmp_path / "stderr.log"
    with open(path, "w") as f:
        stream = redaction.RedactingStream(f, redaction.Redactor({"myvalue99"}))
        print("using", "myvalue99", "and password=abc123", file=stream)
        stream.writelines(["Bearer abcdefghijklmnopqrstuvwx\n", "plain\n"])
        assert stream.fileno() == f.fileno() and stream.isatty() is False and stream.encoding == f.encoding
        assert stream.write("abc") == 3
    assert path.read_text() == "using *** and password=***\nBearer ***\nplain\nabc"


def test_deeply_nested_data_is_cut_not_recursed():
    value: Any = "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"
    for _ in range(10000):
        value = [value]
    out = redaction.Redactor(set()).data({"a": value})
    depth = 0
    cur = out["a"]
    while isinstance(cur, list):
        cur, depth = cur[0], depth + 1
    assert depth < redaction.MAX_DEPTH and "not shown" in cur


def test_hyperscan_prefilters_and_gate_words_mask_the_same():
    """The one-pass prefilters (Hyperscan) and the standard-library gate words give the same text, line by line
    and on big texts, on real logs with secrets of every shape planted in them."""
    assert redaction._byte_gates() is not None, "Hyperscan is a dependency on this platform"
    planted = [line.replace("\n", " ") for line in SHAPE_CASES]
    lines: list[str] = []
    for i, path in enumerate(sorted((FIXTURES / "logs").rglob("*.log"))):
        lines += path.read_text(errors="replace").splitlines(keepends=True)
        lines.append(planted[i % len(planted)] + "\n")
    for line in lines:
        assert redaction.mask_shapes(line) == redaction.mask_shapes_by_gates(line), line
    text = "".join(lines)
    whole = redaction.mask_shapes(text)
    assert whole == redaction.mask_shapes_by_gates(text) == "".join(map(redaction.mask_shapes, lines))
    assert whole.count("***") >= len(lines) // 50


_FRAGMENTS = [*SHAPE_CASES, "\n", " ", "-", "--", "=", "'", '"', ":", "@", "://", "token", "TOKEN", "key",
              "PRIVATE KEY", "-----BEGIN RSA PRIVATE KEY-----", "-----END RSA PRIVATE KEY-----", "\u0130", "\x00",
              "\udc80"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=12)), max_size=40), st.integers(0, 2))
def test_every_path_masks_any_text_the_same_and_leaves_no_secret_of_a_case(parts, repeat):
    """Property: the Hyperscan path and the gate-word path agree on any text (short, and long enough for the
    line-wise path), planted secrets, private key blocks cut anywhere and odd characters included."""
    text = "".join(parts) * (1 + repeat * 200)
    assert redaction.mask_shapes(text) == redaction.mask_shapes_by_gates(text)

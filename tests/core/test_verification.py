"""Verification commands you can paste (core/verification.py, launch/relaunch.py) and ``elastic-diag verify``
(gate/rerun.py): every template filled in, the relaunch built from real command lines, and the runner
bounded against a command that hangs, prints GBs, leaves children behind or is not there at all."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT, report_dir

from elastic_diag.config import DiagConfig
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verification import (
    PLACEHOLDER,
    JobFacts,
    evidence_values,
    judge,
    render,
    render_diagnosis,
    signature_line,
    unknown_placeholders,
)
from elastic_diag.report.checklist import signature_checklist
from elastic_diag.report.schema import validate

LIVE = JobFacts(cwd="/work/job dir", python="/venv/bin/python", relaunch="/venv/bin/torchrun-diag --nproc-per-node 2 "
                "--max-restarts 0 --diag-dir /d.verify train.py --lr 1", verify_dir="/d.verify", master_port=29511,
                logs="/d", checkpoint_dir="/ckpt", checkpoint="/ckpt/step_9.pt")  # fmt: skip


def test_every_template_uses_only_known_placeholders_and_fills_in_live():
    for sig in load_taxonomy():
        assert not unknown_placeholders(sig.verify), (sig.id, sig.verify)
        assert "<relaunch>" in sig.verify or "&&" in sig.verify, (
            f"{sig.id}: the verify must re-run or probe then re-run"
        )
        plan = render(sig.verify, LIVE, live=True)
        assert plan is not None and not PLACEHOLDER.search(plan.command), (sig.id, plan.command)
        assert plan.command.startswith("cd '/work/job dir' && "), plan.command
        assert not plan.variables, (sig.id, plan.variables)  # every value is known
        assert "exit 0 means the fix worked" in plan.expect
        offline = render(sig.verify, None, live=False)
        assert offline is not None and not PLACEHOLDER.search(offline.command), offline.command
        assert "$RELAUNCH" in offline.command and "$RELAUNCH" in offline.variables, offline


def test_a_step_whose_value_is_unknown_is_left_out_live_and_a_variable_offline():
    sig = load_taxonomy().get("transient-network-io")
    plan = render(sig.verify, LIVE, live=True)
    assert plan is not None and "curl" not in plan.command and plan.left_out and "address" in plan.left_out[0]
    url = render(
        sig.verify, LIVE, live=True, evidence=["requests.exceptions.HTTPError: 503 for url: https://hub.example/x.bin"]
    )
    assert url is not None and "curl -sSf -o /dev/null https://hub.example/x.bin && " in url.command
    offline = render(sig.verify, None, live=False)
    assert offline is not None and '"$URL"' in offline.command and "$URL" in offline.variables


def test_values_from_the_evidence_and_quoting():
    found = evidence_values([
        "RuntimeError: The server socket has failed to listen on any local network address. port: 29500, "
        "useIpv6: 0, code: -98, name: EADDRINUSE",
        "PermissionError: [Errno 13] Permission denied: '/ckpt/run 1/model.pt'",
    ])  # fmt: skip
    assert found == {"port": "29500", "path": "/ckpt/run 1/model.pt"}
    sig = load_taxonomy().get("permission-denied")
    plan = render(
        sig.verify, LIVE, live=True, evidence=["PermissionError: [Errno 13] Permission denied: '/ckpt/run 1/m.pt'"]
    )
    assert plan is not None and "'/ckpt/run 1/m.pt'" in plan.command
    port = render(load_taxonomy().get("port-in-use").verify, LIVE, live=True, evidence=["EADDRINUSE port: 29533"])
    assert port is not None and "close()' 29533 && " in port.command


def test_the_probes_run_as_printed(tmp_path):
    """The probe steps of the templates are real commands: each exits 0 where its condition holds and 1
    where it does not (the relaunch after them replaced by `true`)."""
    facts = JobFacts(cwd=str(tmp_path), python=sys.executable, relaunch="true", checkpoint_dir=str(tmp_path))
    tax = load_taxonomy()

    def run(sig_id: str, evidence: list[str] = ()) -> int:
        plan = render(tax.get(sig_id).verify, facts, live=True, evidence=evidence)
        assert plan is not None
        return subprocess.run(["bash", "-c", plan.command], capture_output=True, timeout=60).returncode

    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert run("port-in-use", [f"EADDRINUSE port: {taken}"]) == 1
    assert run("port-in-use", [f"EADDRINUSE port: {taken}"]) == 0
    assert run("disk-full", [f"OSError: [Errno 28] No space left on device: '{tmp_path}/x'"]) == 0
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere: the probe passes for root, as the job would
        assert run("permission-denied", [f"PermissionError: [Errno 13] Permission denied: '{tmp_path}/ro/x'"]) == 1
    assert run("permission-denied", [f"PermissionError: [Errno 13] Permission denied: '{tmp_path}/x'"]) == 0
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "good.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    for name, code in (("good.pt", 0), ("bad.pt", 1)):
        plan = render(tax.get("checkpoint-write-failed").verify, JobFacts(cwd=str(tmp_path), python=sys.executable,
                      relaunch="true", checkpoint=str(tmp_path / name)), live=True)  # fmt: skip
        assert plan is not None
        assert subprocess.run(["bash", "-c", plan.command], capture_output=True, timeout=60).returncode == code, name


def test_judge():
    kw = {"timeout_s": 10.0, "signature_id": "python-exception"}
    assert judge(exit_code=0, timed_out=False, seen_line=None, rerun_report={"status": "succeeded"}, **kw).passed
    failed = {"status": "failed", "diagnosis": {"signature_id": "python-exception", "initiating_rank": 1,
                                                "summary": "Rank 1 raised ValueError"}}  # fmt: skip
    same = judge(exit_code=1, timed_out=False, seen_line=None, rerun_report=failed, **kw)
    assert not same.passed and "still there" in same.summary and "rank 1" in same.summary
    other = judge(exit_code=1, timed_out=False, seen_line=None, rerun_report={"status": "failed", "diagnosis": {
        "signature_id": "segfault", "failure_class": "segfault", "summary": "Rank 0 SIGSEGV"}}, **kw)  # fmt: skip
    assert not other.passed and "gone, but" in other.summary
    again = judge(exit_code=1, timed_out=False, seen_line=None, initiating_rank=1, rerun_report={"status": "failed",
                  "diagnosis": {"signature_id": "collective-mismatch", "failure_class": "collective_mismatch",
                                "initiating_rank": 1, "summary": "Rank 1 ..."}}, **kw)  # fmt: skip
    assert not again.passed and "still there" in again.summary and "rank 1 again" in again.summary
    assert not judge(exit_code=0, timed_out=False, seen_line="ValueError: x", rerun_report=None, **kw).passed
    assert not judge(exit_code=None, timed_out=True, seen_line=None, rerun_report=None, **kw).passed
    assert not judge(exit_code=3, timed_out=False, seen_line=None, rerun_report=None, **kw).passed


def test_signature_line_is_bounded_per_line():
    big = "x" * 10_000_000 + "ValueError: late\n"  # the match lies past a line's first 4 KiB: not looked at
    started = time.monotonic()
    assert signature_line([r"ValueError: .*"], big) is None
    assert signature_line([r"ValueError: .*"], "a\nValueError: bad batch\n") == "ValueError: bad batch"
    assert time.monotonic() - started < 2


def test_render_diagnosis_keeps_a_rendered_one_and_the_schema_holds():
    d = {"failure_class": "segfault", "verify": load_taxonomy().get("segfault").verify, "evidence": []}
    once = render_diagnosis(d, LIVE, live=True)
    assert (
        once["verify_plan"]["verify_dir"] == "/d.verify"
        and "PYTHONFAULTHANDLER=1 /venv/bin/torchrun-diag" in once["verify"]
    )
    assert render_diagnosis(once, LIVE, live=True) == once
    again = render_diagnosis({**d, "verify": once["verify"]}, LIVE, live=True)  # another node's rendered verdict
    assert again["verify"] == once["verify"]


def test_the_signature_checklist_has_the_seed_order():
    for sig in load_taxonomy():
        titles = [t for t, _ in signature_checklist(sig)]
        assert (
            titles[0].startswith("First occurrence")
            and titles[3].startswith("Verify")
            and titles[4].startswith("Resume")
        )
        assert "Which rank, node and device" in titles[1] and "flight recorder" in titles[2]


# ---- the relaunch, from real command lines ---------------------------------------------------------


def test_relaunch_of_torchrun_diag_replaces_restarts_and_diag_dir(tmp_path, monkeypatch):
    from elastic_diag.launch.relaunch import job_facts

    monkeypatch.chdir(tmp_path)
    config = DiagConfig(diag_dir=tmp_path / "d")
    argv = ["--nnodes", "1", "--nproc-per-node", "2", "--max-restarts=3", "--diag-dir", str(tmp_path / "d"),
            "train.py", "--max-restarts", "7", "--api-key", "k"]  # fmt: skip
    facts = job_facts("torchrun-diag", config, argv)
    assert facts.relaunch is not None
    words = shlex.split(facts.relaunch)
    assert words[0].endswith("torchrun-diag") or words[1:3] == ["-m", "elastic_diag.run"]
    script = words.index("train.py")
    options = words[:script]
    assert options.count("--max-restarts") == 1 and options[options.index("--max-restarts") + 1] == "0"
    assert (
        options[options.index("--diag-dir") + 1] == str(tmp_path / "d") + ".verify"
        and "--max-restarts=3" not in options
    )
    assert words[script:] == ["train.py", "--max-restarts", "7", "--api-key", "k"]  # the script's own are its own
    assert facts.launch_command is not None and "--max-restarts=3" in facts.launch_command
    assert "--diag-dir" not in facts.launch_command.split("train.py")[0]  # a resume gets a new diag dir
    assert facts.cwd == str(tmp_path) and facts.verify_dir == str(tmp_path / "d") + ".verify"


def torch_run_file() -> str:
    import torch.distributed.run

    return str(torch.distributed.run.__file__)


def test_relaunch_under_the_switch_keeps_the_switch_and_moves_the_diag_dir(tmp_path, monkeypatch):
    from elastic_diag.launch.relaunch import job_facts

    monkeypatch.setenv("ELASTIC_DIAG", "1")
    monkeypatch.setenv("ELASTIC_DIAG_GRACE", "2")
    monkeypatch.setenv("ELASTIC_DIAG_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("ELASTIC_DIAG_REQUIRE_SLURM", "1")  # a test suite's own switch: not the job's
    config = DiagConfig(diag_dir=tmp_path / "d")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    facts = job_facts("torchrun", config, ["--standalone", "--nproc-per-node=2", "--rdzv-endpoint", "h:29601", "t.py"],
                      program_path=torchrun)  # fmt: skip
    assert facts.relaunch is not None
    assert facts.relaunch.startswith(f"ELASTIC_DIAG=1 ELASTIC_DIAG_GRACE=2 ELASTIC_DIAG_DIR={tmp_path}/d.verify ")
    assert "--max-restarts 0 t.py" in facts.relaunch and facts.master_port == 29601
    assert "ELASTIC_DIAG_DIR" not in (facts.launch_command or "")
    broken = job_facts("torchrun", config, ["--nproc-per-node"], program_path=torchrun)  # no relaunch, no raise
    assert broken.relaunch is None
    assert job_facts("api", config).relaunch is None
    # `accelerate launch` calls torch's elastic launch itself: its own command line comes back as it was
    accelerate = str(Path(sys.executable).parent / "accelerate")
    argv = ["launch", "--multi_gpu", "--num_processes", "3", "--num_machines", "1", "train.py", "--lr", "1"]
    acc = job_facts("torchrun", config, argv, program_path=accelerate)
    assert acc.relaunch == (f"ELASTIC_DIAG=1 ELASTIC_DIAG_GRACE=2 ELASTIC_DIAG_DIR={tmp_path}/d.verify {accelerate} "
                            "launch --multi_gpu --num_processes 3 --num_machines 1 train.py --lr 1")  # fmt: skip
    module = job_facts(
        "torchrun", config, ["--nproc-per-node", "2", "t.py"], program_path=str(Path(torch_run_file()))
    )  # python -m torch.distributed.run
    assert module.relaunch is not None and "--max-restarts 0 t.py" in module.relaunch


# ---- elastic-diag verify, bounded ------------------------------------------------------------------


def _diag_dir(tmp_path: Path, command: str, name: str = "run", signature_id: str | None = "python-exception",
              status: str = "failed") -> Path:  # fmt: skip
    return report_dir(tmp_path / name, command, cwd=tmp_path, signature_id=signature_id, status=status)


def verify(d: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``elastic-diag verify`` with no terminal: ``--yes`` (and here, ``--allow-any-command``: these commands
    are Python snippets of the tests', not on the allow-list) where a test means it to run."""
    p = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "verify", str(d), *args], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)  # fmt: skip
    report = json.loads((d / "report.json").read_text()) if (d / "report.json").exists() else {}
    if "verification" in report:
        validate(report)
    return p, report.get("verification", {})


RUN = ("--yes", "--allow-any-command")


def py(code: str, *args: str) -> str:
    """A command line running ``code`` with this interpreter (no shell reads it: verify runs argv)."""
    return shlex.join([sys.executable, "-c", code, *args])


def test_verify_passes_fails_and_sees_the_signature(tmp_path):
    d = _diag_dir(tmp_path, py("import os; print('all good'); print(os.getcwd())"))
    p, v = verify(d, *RUN)
    assert p.returncode == 0 and v["passed"] and v["exit_code"] == 0 and "PASSED" in p.stdout, (p.stdout, p.stderr)
    assert str(tmp_path) in v["output_tail"]  # it ran in the job's cwd
    assert "report.html" in os.listdir(d)
    d2 = _diag_dir(tmp_path, py("print('ValueError: bad batch at step 3')"), name="b")
    p, v = verify(d2, *RUN)
    assert p.returncode == 1 and not v["passed"] and v["signature_seen"] == "ValueError: bad batch at step 3", v


def test_verify_of_a_command_that_hangs_is_killed_with_its_children_at_the_deadline(tmp_path):
    marker = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '300']); "
            "open(sys.argv[1], 'w').write(str(child.pid)); time.sleep(300)")  # fmt: skip
    d = _diag_dir(tmp_path, py(hang, str(marker)))
    started = time.monotonic()
    p, v = verify(d, "--timeout", "2", *RUN)
    assert (
        p.returncode == 1 and v["timed_out"] and v["exit_code"] is None and "did not finish within 2 s" in v["summary"]
    )
    assert time.monotonic() - started < 30
    child = int(marker.read_text())
    time.sleep(0.2)
    try:  # the background child went with the group (a zombie waiting for an init that reaps late is gone too)
        state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state


def test_verify_of_a_command_that_prints_gbs_stays_bounded(tmp_path):
    chatty = (
        "import sys; out = sys.stdout.buffer; chunk = b'step 1234 loss 2.345 lr 3e-4 a chatty line\\n' * 25000\n"
        "for _ in range(1_200_000_000 // len(chunk) + 1): out.write(chunk)\n"
        "out.write(b'\\nValueError: at the end\\n')"
    )
    d = _diag_dir(tmp_path, py(chatty))
    # the peak of the verify process tree alone, measured by a parent of its own: this worker's own
    # RUSAGE_CHILDREN keeps the peak of every child it ever had (a torch run of an earlier test)
    measure = (
        "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)"
    )
    p = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "elastic_diag.cli", "verify", str(d),
                        "--timeout", "120", *RUN], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    v = json.loads((d / "report.json").read_text())["verification"]
    assert p.returncode == 1, p.stderr
    assert v["output_bytes"] > 1_200_000_000 and v["signature_seen"] == "ValueError: at the end", v["summary"]
    assert os.path.getsize(v["output_file"]) < 9 * 1024 * 1024
    assert "bytes of output left out here" in Path(v["output_file"]).read_text(errors="replace")
    peak_kib = int(p.stderr.strip().splitlines()[-1])
    assert peak_kib < 400 * 1024, f"the verify process peaked at {peak_kib} KiB"


def test_verify_bad_input(tmp_path):
    p, _ = verify(tmp_path / "nowhere")
    assert p.returncode == 2 and "no such folder" in p.stderr
    (tmp_path / "empty").mkdir()
    p, _ = verify(tmp_path / "empty")
    assert p.returncode == 2 and "no readable report.json" in p.stderr
    d = _diag_dir(tmp_path, "", name="e")
    p, _ = verify(d)
    assert p.returncode == 2 and "no verification command" in p.stderr
    p, _ = verify(d, "--timeout", "0")
    assert p.returncode == 2 and "--timeout" in p.stderr
    ok = _diag_dir(tmp_path, "", name="s")
    data = json.loads((ok / "report.json").read_text())
    data["status"], data["diagnosis"]["verify"] = "succeeded", None
    del data["diagnosis"]["verify_plan"]
    (ok / "report.json").write_text(json.dumps(data))
    p, v = verify(ok)
    assert p.returncode == 0 and "nothing to verify" in v["summary"]
    missing = _diag_dir(tmp_path, "no-such-tool-anywhere --x", name="m")
    p, v = verify(missing, *RUN)
    assert p.returncode == 1 and v["exit_code"] == 127 and "command not found" in v["output_tail"]

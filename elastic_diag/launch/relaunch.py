"""The job's launch command, again, as the verification commands re-run it (core/verification.py's
``<relaunch>``): the same launcher, options, script and arguments, with ``--max-restarts 0`` and a diag
dir of its own (``<diag-dir>.verify``), so its report.json says whether the signature is gone.

torchrun-diag: ``<bin>/torchrun-diag OPTIONS --max-restarts 0 --diag-dir D SCRIPT ARGS``. Plain
torchrun with the switch: ``ELASTIC_DIAG...=... ELASTIC_DIAG_DIR=D <bin>/torchrun OPTIONS --max-restarts 0
SCRIPT ARGS``. The Python API (``elastic_launch``) has no command line: no relaunch.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from elastic_diag import config as settings
from elastic_diag.config import ENV_DIAG_DIR, DiagConfig
from elastic_diag.core.verification import JobFacts
from elastic_diag.layout import ENV_BEACON, ENV_SWITCH

Launcher = Literal["torchrun-diag", "torchrun", "api"]
VERIFY_SUFFIX = ".verify"
# launcher options the relaunch sets itself (each takes one value)
# the switch's settings a relaunch under plain torchrun carries (not the diag dir: it gets its own; not
# the variables of tests or of the ranks' own plumbing)
SWITCH_SETTINGS = (ENV_SWITCH, settings.ENV_GRACE, settings.ENV_STACK_TIMEOUT, settings.ENV_HANG_TIMEOUT,
                   settings.ENV_STALL_TIMEOUT, settings.ENV_RESTART_POLICY, settings.ENV_VERIFY,
                   settings.ENV_CHECKPOINT_DIR, settings.ENV_VERIFY_TIMEOUT, settings.ENV_CONFIG,
                   settings.ENV_REQUEUE_EXIT_CODE, settings.ENV_TERMINATION_LOG, ENV_BEACON)  # fmt: skip
# a verification tells nobody (its outcome is the gate's): no notification flag goes into it
_REPLACED = {"torchrun-diag": ("--max-restarts", "--max_restarts", "--diag-dir", "--diag-notify", "--diag-notify-cmd",
                               "--diag-known-good"),
             "torchrun": ("--max-restarts", "--max_restarts")}  # fmt: skip


def _program(name: str, module: str) -> list[str]:
    """The launcher beside this interpreter (a venv's bin), else ``python -m module``."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    return [sys.executable, "-m", module]


def _split(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str], argparse.Namespace]:
    """(launcher options, script and its arguments, the parsed options). Raises ValueError."""
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:
        raise ValueError("the command line does not parse") from e
    rest = [args.training_script, *args.training_script_args]
    start = len(argv) - len(rest)
    if start < 0 or list(argv[start:]) != rest:
        raise ValueError("the script is not where the parser says")
    return list(argv[:start]), rest, args


def _without(options: list[str], names: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for opt in options:
        if skip:
            skip = False
            continue
        if opt in names:
            skip = True
            continue
        if any(opt.startswith(n + "=") for n in names):
            continue
        out.append(opt)
    return out


def _port(args: argparse.Namespace) -> int | None:
    endpoint = str(getattr(args, "rdzv_endpoint", "") or "")
    if endpoint.rpartition(":")[2].isdigit() and int(endpoint.rpartition(":")[2]) > 0:
        return int(endpoint.rpartition(":")[2])
    port = getattr(args, "master_port", None)
    return int(port) if isinstance(port, int) or (isinstance(port, str) and port.isdigit()) else None


def _nnodes(args: argparse.Namespace) -> int:
    try:
        from torch.distributed.run import parse_min_max_nnodes

        return int(parse_min_max_nnodes(str(args.nnodes))[1])
    except Exception:
        return 1


def _is_torchrun(program: str) -> bool:
    """torchrun's console script, or ``python -m torch.distributed.run``."""
    path = Path(program)
    return path.name in ("torchrun", "torchrun.exe") or path.parts[-3:] == ("torch", "distributed", "run.py")


def _own_program(program: str | None) -> list[str]:
    path = program if program is not None else sys.argv[0]
    if os.access(path, os.X_OK) and not path.endswith(".py"):
        return [os.path.abspath(path)] if os.sep in path else [path]
    return [sys.executable, path]


def job_facts(launcher: Launcher, config: DiagConfig, argv: Sequence[str] | None = None,
              program_path: str | None = None) -> JobFacts:  # fmt: skip
    """What the verification commands need to know of this job (``program_path``: the launcher's
    ``sys.argv[0]``, for tests); never raises (a command line it cannot
    read gives no relaunch, and the report writes ``$RELAUNCH`` with what to set it to)."""
    cwd = os.getcwd()
    verify_dir = str(config.diag_dir) + VERIFY_SUFFIX
    common = {"cwd": cwd, "python": sys.executable, "logs": str(config.diag_dir),
              "checkpoint_dir": str(config.checkpoint_dir) if config.checkpoint_dir else None}  # fmt: skip
    if launcher == "api":
        return JobFacts(**common)  # type: ignore[arg-type]
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if launcher == "torchrun-diag":
            from elastic_diag.launch.arguments import get_parser

            options, rest, args = _split(argv, get_parser())
            program = _program("torchrun-diag", "elastic_diag.run")
            command = [*program, *_without(options, _REPLACED[launcher]), "--max-restarts", "0",
                       "--diag-dir", verify_dir, *rest]  # fmt: skip
            original = [*program, *_without(options, ("--diag-dir",)), *rest]
            env: list[str] = []
            original_env: list[str] = []
        else:
            original_env = [f"{k}={shlex.quote(os.environ[k])}" for k in SWITCH_SETTINGS if k in os.environ]
            env = [*original_env, f"{ENV_DIAG_DIR}={shlex.quote(verify_dir)}"]
            if not _is_torchrun(sys.argv[0] if program_path is None else program_path):
                # another launcher that calls torch's elastic launch (`accelerate launch`, a wrapper
                # script): its own command line, as it was (its options are not torchrun's)
                command = original = [*_own_program(program_path), *argv]
                relaunch = " ".join([*env, shlex.join(command)])
                return JobFacts(cwd=cwd, python=sys.executable, relaunch=relaunch, verify_dir=verify_dir,
                                launch_command=" ".join([*original_env, shlex.join(original)]),
                                logs=str(config.diag_dir), checkpoint_dir=common["checkpoint_dir"])  # fmt: skip
            from torch.distributed.run import get_args_parser

            options, rest, args = _split(argv, get_args_parser())
            program = _program("torchrun", "torch.distributed.run")
            command = [*program, *_without(options, _REPLACED[launcher]), "--max-restarts", "0", *rest]
            original = [*program, *options, *rest]
    except ValueError:
        return JobFacts(**common)  # type: ignore[arg-type]
    relaunch = " ".join([*env, shlex.join(command)])
    launch_command = " ".join([*original_env, shlex.join(original)])
    python = None if getattr(args, "no_python", False) else sys.executable
    return JobFacts(cwd=cwd, python=python or sys.executable, relaunch=relaunch, launch_command=launch_command,
                    verify_dir=verify_dir,
                    master_port=_port(args), logs=str(config.diag_dir), checkpoint_dir=common["checkpoint_dir"],
                    nnodes=_nnodes(args))  # fmt: skip


# elastic-diag exec: the launcher that started the watched ranks, as the relaunch names it
_EXEC_PREFIX = {"slurm": ("srun", "-N", "SLURM_NNODES", "-n"), "openmpi": ("mpirun", None, None, "-np"),
                "pmi": ("mpiexec", None, None, "-n"), "pmix": ("mpiexec", None, None, "-n")}  # fmt: skip


def exec_job_facts(launcher: str | None, world_size: int | None, command: Sequence[str], diag_dir: Path,
                   env: dict[str, str] | None = None) -> JobFacts:  # fmt: skip
    """The verification commands' facts for a job watched by ``elastic-diag exec``: its relaunch is the same
    command under a new watch, with a diag dir of its own: ``srun -N<nodes> -n<tasks> elastic-diag exec
    --diag-dir D.verify -- COMMAND`` (Slurm), ``mpirun -np <N> ...`` (Open MPI), ``mpiexec -n <N> ...`` (PMI),
    or ``elastic-diag exec --diag-dir D.verify -- COMMAND`` for a command that spawns its ranks itself
    (``launcher`` None). A rank started by a wrapper of the user's (torchrun-style variables) has no relaunch
    elastic_diag can write: ``$RELAUNCH`` stays, with what to set it to."""
    environ = os.environ if env is None else env
    verify_dir = str(diag_dir) + VERIFY_SUFFIX
    cwd, logs = os.getcwd(), str(diag_dir)
    watch = [*_program("elastic-diag", "elastic_diag.cli"), "exec", "--diag-dir", verify_dir, "--", *command]
    original = [*_program("elastic-diag", "elastic_diag.cli"), "exec", "--", *command]
    if launcher is None:
        prefix: list[str] = []
    elif launcher in _EXEC_PREFIX and world_size:
        program, nodes_flag, nodes_var, tasks_flag = _EXEC_PREFIX[launcher]
        nodes = environ.get(nodes_var or "", "").strip()
        prefix = [program, *([nodes_flag, nodes] if nodes_flag and nodes.isdigit() else []), tasks_flag,
                  str(world_size)]  # fmt: skip
    else:
        return JobFacts(cwd=cwd, python=sys.executable, logs=logs)
    return JobFacts(cwd=cwd, python=sys.executable, logs=logs, relaunch=shlex.join([*prefix, *watch]),
                    launch_command=shlex.join([*prefix, *original]), verify_dir=verify_dir)  # fmt: skip

"""Settings of a diagnosed run: one frozen dataclass, validated on construction.

Precedence: command line > environment > default. Environment variable names are the constants
below.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_diag.errors import UsageError

ENV_DIAG_DIR = "ELASTIC_DIAG_DIR"
ENV_GRACE = "ELASTIC_DIAG_GRACE"
ENV_STACK_TIMEOUT = "ELASTIC_DIAG_STACK_TIMEOUT"
ENV_HANG_TIMEOUT = "ELASTIC_DIAG_HANG_TIMEOUT"
ENV_STALL_TIMEOUT = "ELASTIC_DIAG_STALL_TIMEOUT"
ENV_RESTART_POLICY = "ELASTIC_DIAG_RESTART_POLICY"
ENV_VERIFY = "ELASTIC_DIAG_VERIFY"  # controls separated by ";"
ENV_CHECKPOINT_DIR = "ELASTIC_DIAG_CHECKPOINT_DIR"
ENV_VERIFY_TIMEOUT = "ELASTIC_DIAG_VERIFY_TIMEOUT"
ENV_CONFIG = "ELASTIC_DIAG_CONFIG"
ENV_REQUEUE_EXIT_CODE = "ELASTIC_DIAG_REQUEUE_EXIT_CODE"
ENV_TERMINATION_LOG = "ELASTIC_DIAG_TERMINATION_LOG"
# Kubernetes reads a container's termination message from this file (terminationMessagePath's default)
KUBERNETES_TERMINATION_LOG = "/dev/termination-log"
DEFAULT_VERIFY_TIMEOUT_S = 120.0
DEFAULT_VERIFY_RETRIES = 2
# The settings a [tool.elastic_diag] table may hold (names as in DiagConfig.resolve).
TOML_KEYS = ("diag_dir", "grace", "stack_timeout", "tail_lines", "hang_timeout", "stall_timeout", "restart_policy",
             "verify", "checkpoint_dir", "verify_timeout", "verify_retries", "requeue_exit_code",
             "termination_log")  # fmt: skip

DEFAULT_RUNS_DIR = "elastic_diag_runs"
DIAG_DIR_MODE = 0o700  # a diag dir elastic_diag creates (layout.PRIVATE_DIR_MODE): the evidence is private
DEFAULT_GRACE_S = 5.0
DEFAULT_STACK_TIMEOUT_S = 2.0
PROGRESS_INTERVAL_S = 2.0  # the beacons' tick when no short threshold is set
DEFAULT_TAIL_LINES = 40


def default_diag_dir(now: float | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """A durable, unique folder under the working directory (never a temp dir).

    Inside a Slurm step (``srun``) it is named by the job and the step, ``slurm-<job>.<step>`` (and
    ``-r<N>`` after the N-th requeue), so every node of the step picks the same name: on a shared file
    system they share one folder and the leader writes the merged report. Elsewhere in a Slurm job
    (the batch script itself) the job id leads the usual time-stamped name."""
    env = os.environ if environ is None else environ
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    job = env.get("SLURM_JOB_ID", "").strip()
    if job and env.get("SLURM_STEP_ID", "").strip().isdigit():
        restart = env.get("SLURM_RESTART_COUNT", "").strip()
        again = f"-r{restart}" if restart.isdigit() and int(restart) > 0 else ""
        return Path.cwd() / DEFAULT_RUNS_DIR / f"slurm-{_safe(job)}.{env['SLURM_STEP_ID'].strip()}{again}"
    lead = f"slurm-{_safe(job)}-" if job else ""
    return Path.cwd() / DEFAULT_RUNS_DIR / f"{lead}{stamp}-{uuid.uuid4().hex[:6]}"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:64]


def host_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name as the scheduler knows it: Slurm's ``SLURMD_NODENAME`` (what ``squeue`` and
    ``sinfo`` print, also when several slurmd share one host), else the host name (the pod's name on
    Kubernetes)."""
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME", "").strip() or socket.gethostname()


def parse_requeue_exit_code(raw: object, source: str = "--diag-requeue-exit-code") -> int | None:
    """An exit status 1..255 (not 2, 3, 4, the launcher's own usage and gate codes), or None (off)."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "off", "none")):
        return None
    try:
        code = int(str(raw).strip())
    except ValueError as e:
        raise UsageError(f"{source} {raw!r}: expected an exit status between 1 and 255") from e
    if not 1 <= code <= 255:
        raise UsageError(f"{source} {raw!r}: an exit status must be between 1 and 255")
    if code in (2, 3, 4):
        raise UsageError(f"{source} {code}: 2, 3 and 4 are torchrun-diag's own exit statuses (usage error, restart "
                         "refused, verification failed); pick another, e.g. 75 (EX_TEMPFAIL)")  # fmt: skip
    return code


def parse_termination_log(raw: object) -> Path | None:
    """``auto`` (default): Kubernetes' /dev/termination-log when it exists; ``off``; or a path."""
    value = "auto" if raw is None else str(raw).strip()
    if value.lower() in ("", "auto"):
        default = Path(KUBERNETES_TERMINATION_LOG)
        return default if default.exists() else None
    if value.lower() in ("off", "none", "0"):
        return None
    return Path(value).absolute()


def progress_interval(hang_timeout_s: float | None, stall_timeout_s: float | None) -> float:
    """Every :data:`PROGRESS_INTERVAL_S`, or a fifth of the shortest threshold the user set (at least 0.1 s)."""
    fixed = [t for t in (hang_timeout_s, stall_timeout_s) if t]
    return min([PROGRESS_INTERVAL_S, *(max(0.1, t / 5) for t in fixed)])


def parse_hang_timeout(raw: str, source: str = "--diag-hang-timeout") -> float | None:  # and --diag-stall-timeout
    """``auto`` -> None (the automatic threshold), ``off`` -> 0.0, else seconds (> 0)."""
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("off", "0", "none", "false"):
        return 0.0
    try:
        seconds = float(value)
    except ValueError as e:
        raise UsageError(f"{source} {raw!r}: expected auto, off, or a number of seconds") from e
    if not 0 < seconds <= 7 * 86400:
        raise UsageError(f"{source} {raw!r}: must be more than 0 seconds and at most a week")
    return seconds


def _number(value: object, default: float, what: str) -> float:
    if value is None or value == "":
        return default
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise UsageError(f"{what}={value!r} is not a number") from e


def load_toml_settings(path: str | None) -> dict[str, object]:
    """The ``[tool.elastic_diag]`` table of ``path`` (or of ./pyproject.toml when path is None and it has one)."""
    import tomllib

    explicit = path is not None
    file = Path(path) if path is not None else Path.cwd() / "pyproject.toml"
    if not file.is_file():
        if explicit:
            raise UsageError(f"the settings file {str(file)!r} does not exist")
        return {}
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        if explicit:
            raise UsageError(f"the settings file {str(file)!r} is not valid TOML: {e}") from e
        return {}
    table = data.get("tool", {}).get("elastic_diag", {}) if isinstance(data.get("tool"), dict) else {}
    if not isinstance(table, dict):
        raise UsageError(f"{file}: [tool.elastic_diag] must be a table")
    unknown = sorted(set(table) - set(TOML_KEYS))
    if unknown:
        raise UsageError(f"{file}: unknown [tool.elastic_diag] setting(s) {unknown}; known: {', '.join(TOML_KEYS)}")
    return dict(table)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagConfig:
    """How the diagnosis runs.

    ``grace_s``: after the first failure, how long to wait for the other ranks to exit on their own
    before their stacks are taken and the group is torn down (ends early when all have exited).
    ``stack_timeout_s``: how long to wait for the stack dumps of ranks still alive.
    ``hang_timeout_s``: the health monitor's threshold for a hang verdict, which stops the group (None:
    automatic, 0: off). ``stall_timeout_s``: its threshold for a stall snapshot, which stops nothing (None:
    automatic, 0: off).
    """

    diag_dir: Path
    grace_s: float = DEFAULT_GRACE_S
    stack_timeout_s: float = DEFAULT_STACK_TIMEOUT_S
    tail_lines: int = DEFAULT_TAIL_LINES
    hang_timeout_s: float | None = None  # None: automatic threshold; 0: no hang verdict
    stall_timeout_s: float | None = None  # None: automatic threshold; 0: no stall snapshot
    restart_policy: str = "verified"
    verify: tuple[str, ...] = ()  # verification controls; () = the defaults (gate.default_controls)
    checkpoint_dir: Path | None = None
    verify_timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S
    verify_retries: int = DEFAULT_VERIFY_RETRIES
    # the exit status of a retryable failure that no restart can mend here (restarts used up, a node
    # lost): Slurm's RequeueExit= or a retry loop requeues the job on it; None: exit 1 as torchrun does
    requeue_exit_code: int | None = None
    termination_log: Path | None = None  # where the summary goes for `kubectl describe pod`; None: nowhere

    def __post_init__(self) -> None:
        # a str where a Path belongs (the Python API): accept it
        object.__setattr__(self, "diag_dir", Path(self.diag_dir).absolute())
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir).absolute())
        object.__setattr__(self, "verify", tuple(self.verify))
        if not 0 <= self.grace_s <= 600:
            raise UsageError(f"--diag-grace {self.grace_s}: must be between 0 and 600 seconds")
        if not 0 <= self.stack_timeout_s <= 60:
            raise UsageError(f"--diag-stack-timeout {self.stack_timeout_s}: must be between 0 and 60 seconds")
        if not 1 <= self.tail_lines <= 10_000:
            raise UsageError(f"--diag-tail-lines {self.tail_lines}: must be between 1 and 10000")
        if not 1 <= self.verify_timeout_s <= 86_400:
            raise UsageError(f"--diag-verify-timeout {self.verify_timeout_s}: must be between 1 and 86400 seconds")
        if not 0 <= self.verify_retries <= 20:
            raise UsageError(f"--diag-verify-retries {self.verify_retries}: must be between 0 and 20")
        if self.requeue_exit_code is not None:
            parse_requeue_exit_code(self.requeue_exit_code)

    @classmethod
    def resolve(
        cls,
        *,
        diag_dir: str | None = None,
        grace_s: float | None = None,
        stack_timeout_s: float | None = None,
        tail_lines: int | None = None,
        hang_timeout: str | None = None,
        stall_timeout: str | None = None,
        restart_policy: str | None = None,
        verify: Sequence[str] | None = None,
        checkpoint_dir: str | None = None,
        verify_timeout_s: float | None = None,
        verify_retries: int | None = None,
        config_file: str | None = None,
        requeue_exit_code: int | None = None,
        termination_log: str | None = None,
    ) -> DiagConfig:
        """CLI values (None when not given) over environment over a ``[tool.elastic_diag]`` table
        (``config_file``, else ``$ELASTIC_DIAG_CONFIG``, else ./pyproject.toml if it has one) over defaults."""
        toml = load_toml_settings(config_file or os.environ.get(ENV_CONFIG) or None)

        sources: dict[str, str] = {}  # setting -> where its value came from, for error messages

        def pick(cli: object, env: str | None, key: str) -> object:
            if cli is not None:
                sources[key] = f"--diag-{key.replace('_', '-')}"
                return cli
            if env is not None and os.environ.get(env, "") != "":
                sources[key] = env
                return os.environ[env]
            sources[key] = f"[tool.elastic_diag] {key}"
            return toml.get(key)

        def number(cli: object, env: str | None, key: str, default: float) -> float:
            return _number(pick(cli, env, key), default, sources.get(key, key))

        raw_dir = pick(diag_dir, ENV_DIAG_DIR, "diag_dir")
        raw_verify = pick(list(verify) if verify else None, ENV_VERIFY, "verify")
        if isinstance(raw_verify, str):
            raw_verify = [v.strip() for v in raw_verify.split(";") if v.strip()]
        raw_ckpt = pick(checkpoint_dir, ENV_CHECKPOINT_DIR, "checkpoint_dir")
        raw_hang = pick(hang_timeout, ENV_HANG_TIMEOUT, "hang_timeout")
        raw_stall = pick(stall_timeout, ENV_STALL_TIMEOUT, "stall_timeout")
        raw_requeue = pick(requeue_exit_code, ENV_REQUEUE_EXIT_CODE, "requeue_exit_code")
        raw_termination = pick(termination_log, ENV_TERMINATION_LOG, "termination_log")
        return cls(
            diag_dir=Path(str(raw_dir)).absolute() if raw_dir else default_diag_dir(),
            grace_s=number(grace_s, ENV_GRACE, "grace", DEFAULT_GRACE_S),
            stack_timeout_s=number(stack_timeout_s, ENV_STACK_TIMEOUT, "stack_timeout", DEFAULT_STACK_TIMEOUT_S),
            tail_lines=int(number(tail_lines, None, "tail_lines", DEFAULT_TAIL_LINES)),
            hang_timeout_s=parse_hang_timeout(str(raw_hang), sources["hang_timeout"]) if raw_hang is not None else None,
            stall_timeout_s=(
                parse_hang_timeout(str(raw_stall), sources["stall_timeout"]) if raw_stall is not None else None
            ),
            restart_policy=str(pick(restart_policy, ENV_RESTART_POLICY, "restart_policy") or "verified"),
            verify=tuple(str(v) for v in raw_verify) if isinstance(raw_verify, list | tuple) else (),
            checkpoint_dir=Path(str(raw_ckpt)).absolute() if raw_ckpt else None,
            verify_timeout_s=number(verify_timeout_s, ENV_VERIFY_TIMEOUT, "verify_timeout", DEFAULT_VERIFY_TIMEOUT_S),
            verify_retries=int(number(verify_retries, None, "verify_retries", DEFAULT_VERIFY_RETRIES)),
            requeue_exit_code=parse_requeue_exit_code(raw_requeue, sources["requeue_exit_code"]),
            termination_log=parse_termination_log(raw_termination),
        )

    @property
    def monitored(self) -> bool:
        """Whether the health monitor runs (and so the ranks' progress beacons): a hang verdict or a stall
        snapshot is on."""
        return self.hang_timeout_s != 0 or self.stall_timeout_s != 0

    @property
    def progress_interval_s(self) -> float:
        """How often each rank's beacon rewrites progress.json: every 2 s (each wake-up of a thread in every rank
        costs a loaded host; ``benchmarks/launcher.py overhead``), more often under a short threshold the user
        set, so that a rank making progress always shows it well within the threshold. A dump request does
        not wait for the next tick (the agent wakes the beacon through its socket)."""
        return progress_interval(self.hang_timeout_s, self.stall_timeout_s)

    def writable_problem(self) -> str | None:
        """Create the diag dir (0700, with the parents it lacks: the evidence holds paths, command lines, hosts,
        the job's output) and prove it writable; what is wrong with it, or None."""
        try:
            missing = [d for d in (self.diag_dir, *self.diag_dir.parents) if not d.is_dir()]
            for folder in reversed(missing):  # as layout.make_private_dir (config sits below layout)
                os.makedirs(folder, DIAG_DIR_MODE, exist_ok=True)
                os.chmod(folder, DIAG_DIR_MODE)  # the umask took its bits from makedirs' mode
            probe = self.diag_dir / f".write-probe-{os.getpid()}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
        except OSError as e:
            return f"the diag dir {str(self.diag_dir)!r} is not writable ({e.strerror or e})"
        return None

    def check_folder_path(self) -> None:
        """A diag dir path that can never be a folder (it, or a folder above it, is a file) is a mistyped path:
        a usage error, unlike a folder that cannot be written now (a read-only mount), where the job runs."""
        for path in (self.diag_dir, *self.diag_dir.parents):
            if path.exists() and not path.is_dir():
                raise UsageError(f"the diag dir {str(self.diag_dir)!r} is not writable: {str(path)!r} is a file, "
                                 f"not a folder; pass --diag-dir DIR or set {ENV_DIAG_DIR} to a folder")  # fmt: skip

    def check_writable(self) -> None:
        """Create the diag dir and prove it writable, or raise a UsageError naming it."""
        problem = self.writable_problem()
        if problem is not None:
            raise UsageError(f"{problem}; pass --diag-dir DIR or set {ENV_DIAG_DIR} to a folder you can write")

"""DiagLogsSpecs: where a rank's evidence goes, and how the bootstrap gets into the rank.

A torchelastic ``LogsSpecs`` (registered as the ``diag`` entry point of ``torchrun.logs_specs``). On
every attempt its ``reify`` makes ``<diag-dir>/attempt_<N>/rank_<global rank>/`` (what goes in it:
:mod:`elastic_diag.layout`), sends the rank's stdout and stderr there, and sets each rank's
environment so the worker bootstrap (``elastic_diag/worker/_boot``) loads with no change to the
script. The console still shows every rank's output, through torch's own tailer, unless the user's
``--redirects`` / ``--local-ranks-filter`` asked to hide it.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

from elastic_diag.config import ENV_DIAG_DIR, default_diag_dir
from elastic_diag.layout import (
    ENV_ATTEMPT,
    ENV_BOOT_PATH,
    ENV_LAUNCHER_PID,
    ENV_RANK_DIR,
    ENV_TORCHELASTIC_ERROR_FILE,
    ENV_TORCHELASTIC_RESTART_COUNT,
    ERROR_FILE,
    FILTERED_STDERR_FILE,
    FILTERED_STDOUT_FILE,
    STALE_FILES,
    STDERR_FILE,
    STDOUT_FILE,
    STREAM_FILES,
    AttemptLayout,
    RankLayout,
    attempt_dir_name,
    create_private_file,
    flight_recorder_env,
    make_private_dir,
    rank_dir_name,
)

BOOT_DIR = str(Path(__file__).resolve().parents[1] / "worker" / "_boot")


class DiagLogsSpecs(LogsSpecs):
    """LogsSpecs that always keeps every rank's stdout/stderr in the diag dir and shows them too."""

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
        *,
        diag_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        if diag_dir is None:
            diag_dir = os.environ.get(ENV_DIAG_DIR) or default_diag_dir()
        self.diag_dir = Path(diag_dir).absolute()
        self.attempts: dict[int, AttemptLayout] = {}
        self.current: AttemptLayout | None = None  # the layout of the attempt being started, if any
        self.errors: list[str] = []  # failures to lay out the evidence; drained by the agent
        self.extra_env: dict[str, str] = {}  # the restart gate's resume variables for the next attempt
        self.rank_env: dict[str, str] = {}  # the beacon's settings (launch/setup.py); the launcher's own win

    @classmethod
    def replacing(cls, old: object, diag_dir: str | os.PathLike[str]) -> DiagLogsSpecs:
        """Ours in place of the launch's own LogsSpecs, keeping its --log-dir, --redirects, --tee and
        --local-ranks-filter (for the console; every stream is kept on disk anyway)."""
        if isinstance(old, DiagLogsSpecs):
            return old
        return cls(
            log_dir=getattr(old, "_root_log_dir", None),
            redirects=getattr(old, "_redirects", None) or Std.NONE,
            tee=getattr(old, "_tee", None) or Std.NONE,
            local_ranks_filter=getattr(old, "_local_ranks_filter", None),
            diag_dir=diag_dir,
        )

    @property
    def root_log_dir(self) -> str:
        return str(self.diag_dir)

    def _on_console(self, local_rank: int, std: Std, redirs: dict[int, Std], tees: dict[int, Std]) -> bool:
        if self._local_ranks_filter and local_rank not in self._local_ranks_filter:
            return False
        return not (redirs[local_rank] & std) or bool(tees[local_rank] & std)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Lay out the attempt's evidence; if that fails, run on as plain torchrun would (console only)."""
        self.current = None
        try:
            return self._reify(envs)
        except OSError as e:
            attempt = envs[0].get(ENV_TORCHELASTIC_RESTART_COUNT, "?") if envs else "?"
            self.errors.append(f"laying out the evidence of attempt {attempt} in {self.diag_dir}: {e}")
            return self._console_only(envs)

    def _console_only(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest(filtered_stdout=os.devnull, filtered_stderr=os.devnull)
        for local_rank, env in envs.items():
            dest.stdouts[local_rank] = ""  # "" is torch's "the console"
            dest.stderrs[local_rank] = ""
            dest.error_files[local_rank] = os.devnull
            env[ENV_TORCHELASTIC_ERROR_FILE] = ""
        return dest

    def _reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        first = envs[0] if nprocs else {}
        attempt = int(first.get(ENV_TORCHELASTIC_RESTART_COUNT, "0"))
        attempt_dir = self.diag_dir / attempt_dir_name(attempt)
        make_private_dir(attempt_dir)
        for name in (FILTERED_STDOUT_FILE, FILTERED_STDERR_FILE):  # torch opens them "w": they keep our 0600
            create_private_file(attempt_dir / name)
        layout = AttemptLayout(attempt=attempt, dir=attempt_dir)

        redirs = to_map(self._redirects, nprocs)
        tees = to_map(self._tee, nprocs)
        dest = LogsDest(
            filtered_stdout=str(attempt_dir / FILTERED_STDOUT_FILE),
            filtered_stderr=str(attempt_dir / FILTERED_STDERR_FILE),
        )
        python_path = os.environ.get("PYTHONPATH", "")
        for local_rank in range(nprocs):
            env = envs[local_rank]
            rank = int(env.get("RANK", local_rank))
            rank_dir = attempt_dir / rank_dir_name(rank)
            make_private_dir(rank_dir)
            for stale in STALE_FILES:
                (rank_dir / stale).unlink(missing_ok=True)
            for name in STREAM_FILES:  # the ranks' streams, opened by torch's process handler
                create_private_file(rank_dir / name)
            layout.ranks[local_rank] = RankLayout(rank=rank, local_rank=local_rank, dir=rank_dir)

            dest.stdouts[local_rank] = str(rank_dir / STDOUT_FILE)
            dest.stderrs[local_rank] = str(rank_dir / STDERR_FILE)
            if self._on_console(local_rank, Std.OUT, redirs, tees):
                dest.tee_stdouts[local_rank] = dest.stdouts[local_rank]
            if self._on_console(local_rank, Std.ERR, redirs, tees):
                dest.tee_stderrs[local_rank] = dest.stderrs[local_rank]
            error_file = str(rank_dir / ERROR_FILE)
            dest.error_files[local_rank] = error_file

            env[ENV_TORCHELASTIC_ERROR_FILE] = error_file
            for key, value in {**flight_recorder_env(rank_dir), **self.rank_env}.items():
                env.setdefault(key, os.environ.get(key, value))
            env[ENV_RANK_DIR] = str(rank_dir)
            env[ENV_ATTEMPT] = str(attempt)
            env[ENV_LAUNCHER_PID] = str(os.getpid())  # the rank exits when we die (worker/bootstrap.py)
            env.update(self.extra_env)
            env[ENV_BOOT_PATH] = BOOT_DIR
            env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOT_DIR, env.get("PYTHONPATH", python_path)) if p)
        self.attempts[attempt] = layout
        self.current = layout
        return dest

    def __repr__(self) -> str:
        return f"DiagLogsSpecs(diag_dir={str(self.diag_dir)!r}, redirects={self._redirects}, tee={self._tee})"

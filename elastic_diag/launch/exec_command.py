"""``elastic-diag exec -- COMMAND``: which watch the command gets. A rank named by its launcher's variables gets a
:class:`~elastic_diag.launch.exec_watch.RankWatch` (srun, mpirun, a wrapper); a command with no rank in its
environment is the parent of its ranks (:mod:`elastic_diag.launch.spawn_watch`: ``mp.spawn``). Imports no torch."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_diag.config import DEFAULT_RUNS_DIR, ENV_DIAG_DIR
from elastic_diag.launch.exec_watch import (
    DEFAULT_GRACE_S,
    RankWatch,
    _exit_status,
    _say,
    exit_status_of,
    keep_verdict,
    run_unwatched,
)
from elastic_diag.launch.rank_env import job_name, rank_from_env
from elastic_diag.launch.spawn_watch import run_spawn_watch

if TYPE_CHECKING:
    from elastic_diag.ledger.tell import TellOptions


def shared_diag_dir(given: str | None, env: Mapping[str, str]) -> Path | None:
    """The folder every rank of the job writes into, or None when nothing names one."""
    if given or env.get(ENV_DIAG_DIR):
        return Path(given or env[ENV_DIAG_DIR]).absolute()
    name = job_name(env)
    return Path.cwd() / DEFAULT_RUNS_DIR / name.replace("/", "_") if name else None


def run_exec(command: Sequence[str], *, diag_dir: str | None = None, grace_s: float = DEFAULT_GRACE_S,
             env: Mapping[str, str] | None = None, hang_timeout_s: float | None = None,
             stall_timeout_s: float | None = None, requeue_exit_code: int | None = None,
             tell_options: TellOptions | None = None) -> int:  # fmt: skip
    """``elastic-diag exec``: the command's own exit status, whatever the diagnosis does. ``tell_options``: the
    ledger and the notifications of the verdict (None: neither)."""
    env = os.environ if env is None else env
    if not command:
        _say("error: no command: elastic-diag exec [--diag-dir DIR] -- COMMAND ...")
        return 2
    place = rank_from_env(env)
    if place is None:
        return run_spawn_watch(command, diag_dir=diag_dir, grace_s=grace_s, env=env, hang_timeout_s=hang_timeout_s,
                               stall_timeout_s=stall_timeout_s, requeue_exit_code=requeue_exit_code,
                               tell_options=tell_options)  # fmt: skip
    folder = shared_diag_dir(diag_dir, env)
    if folder is None:
        why = (
            f"rank {place.rank}: no diag dir: pass --diag-dir DIR or set {ENV_DIAG_DIR} to a folder every rank "
            "can write (nothing in the environment names the job)"
        )
        return run_unwatched(command, why)
    watch = RankWatch(command, place, folder, grace_s, env, hang_timeout_s=hang_timeout_s,
                      stall_timeout_s=stall_timeout_s, requeue_exit_code=requeue_exit_code)  # fmt: skip
    try:
        watch.prepare()
    except OSError as e:
        return run_unwatched(command, f"rank {place.rank}: the diag dir {str(folder)!r} is not writable "
                                      f"({e.strerror or e})")  # fmt: skip
    try:
        code = watch.run()
        if code == 127 and watch.proc is None:
            return code
        try:
            watch.wait_for_peers(code != 0)
            report = watch.judge()
        except Exception as e:  # noqa: BLE001 - the job's result comes first: say it, keep its exit status
            _say(f"rank {place.rank}: the verdict could not be written ({e!r}); `elastic-diag report {folder}` "
                 "judges the evidence again")  # fmt: skip
            return _exit_status(code)
        if report is not None:
            keep_verdict(report, folder, tell_options, show=report["status"] != "succeeded")
        return exit_status_of(code, report)
    finally:
        watch.restore_signals()

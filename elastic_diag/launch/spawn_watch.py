"""``elastic-diag exec -- python train.py`` with no rank in the environment: the command is the parent of its
ranks (``torch.multiprocessing.spawn``, ``multiprocessing``, a script that starts its own workers).

The watch starts the command with the bootstrap and ``ELASTIC_DIAG_SPAWN_DIR``; each process of its tree that
joins a process group becomes a rank and lays out ``rank_<R>/`` as under ``torchrun-diag``
(:mod:`elastic_diag.worker.spawned`). The command's own streams are kept in ``attempt_0/exec_parent/``;
a rank's go to its folder from the moment it joins, and the watch copies them to its console. When the
command ends, the watch writes each rank's ``launcher.json`` from what the reaping process recorded
(``exits/<pid>.json``: the exit code or signal, and whether the parent itself stopped it, as
``torch.multiprocessing``'s ``ProcessContext.join`` stops the others after the first failure), and judges the
attempt by the same rules as every other launcher (:func:`elastic_diag.launch.exec_watch.judge_attempt`).

When no process ever joins a group, the command's exit status is unchanged, a line says which variables were
looked for, and the folder is removed (kept, with the command's streams, when the command failed).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_diag.agent.health import HangAlarm
from elastic_diag.config import DEFAULT_TAIL_LINES, ENV_DIAG_DIR, default_diag_dir
from elastic_diag.launch.exec_health import ExecHealth
from elastic_diag.launch.exec_watch import (
    _CHUNK,
    Watch,
    _exit_status,
    _import_the_judge,
    _running,
    _say,
    exit_status_of,
    judge_attempt,
    keep_verdict,
    run_unwatched,
)
from elastic_diag.launch.rank_env import LOOKED_FOR
from elastic_diag.layout import (
    ENV_SPAWN_DIR,
    EXITS_DIR,
    JOINED_FILE,
    LAUNCHER_FILE,
    LAUNCHER_SCHEMA,
    PARENT_DIR,
    STDERR_FILE,
    STDOUT_FILE,
    RankLayout,
    create_private_file,
    make_private_dir,
    rank_dir_name,
    read_json,
    write_json_atomic,
)

if TYPE_CHECKING:
    from elastic_diag.ledger.tell import TellOptions

ECHO_INTERVAL_S = 0.2
STREAMS = ((STDOUT_FILE, "stdout"), (STDERR_FILE, "stderr"))


def joined_ranks(attempt_dir: Path) -> dict[int, dict[str, Any]]:
    """``rank -> joined.json`` for every rank folder a process claimed by joining a group."""
    found: dict[int, dict[str, Any]] = {}
    for path in attempt_dir.glob(f"rank_*/{JOINED_FILE}"):
        number = path.parent.name.removeprefix("rank_")
        record = read_json(path)
        if number.isdigit() and isinstance(record, dict):
            found[int(number)] = record
    return found


class RankEcho:
    """Copies what the ranks write into their folders to the watch's console, as it comes (a rank's streams
    leave the command's pipes when it joins a group)."""

    def __init__(self, attempt_dir: Path) -> None:
        self.attempt_dir = attempt_dir
        self.offsets: dict[Path, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="elastic-diag-echo", daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(ECHO_INTERVAL_S):
            self.copy_new()

    def copy_new(self) -> None:
        for folder in sorted(self.attempt_dir.glob("rank_*")):
            if not (folder / JOINED_FILE).exists():
                continue
            for name, console in STREAMS:
                path = folder / name
                start = self.offsets.get(path, 0)
                try:
                    with open(path, "rb") as f:
                        f.seek(start)
                        chunk = f.read(_CHUNK * 16)
                except OSError:
                    continue
                if chunk:
                    self.offsets[path] = start + len(chunk)
                    out = getattr(getattr(sys, console), "buffer", None)
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        out.write(chunk)  # type: ignore[union-attr]
                        out.flush()  # type: ignore[union-attr]

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        for _ in range(64):  # what is left, a bounded amount
            before = dict(self.offsets)
            self.copy_new()
            if self.offsets == before:
                break


class SpawnWatch(Watch):
    """The watch of a command whose children are the ranks."""

    def __init__(self, command: Sequence[str], diag_dir: Path, grace_s: float, env: Mapping[str, str],
                 **settings: Any) -> None:  # fmt: skip
        super().__init__(command, diag_dir, grace_s, env, **settings)
        self.parent_dir = self.attempt_dir / PARENT_DIR
        self.created = not diag_dir.exists()
        self.stopped_ranks: set[int] = set()  # stopped by this watch (a hang)
        self.health = ExecHealth(attempt_dir=self.attempt_dir, node=self.node, part="spawned",
                                 hang_timeout_s=self.hang_timeout_s, stall_timeout_s=self.stall_timeout_s,
                                 ranks=self._live, world=self.world_size, exited=self._exited,
                                 on_hang=self._hang)  # fmt: skip

    def _live(self) -> dict[int, tuple[int, RankLayout]]:
        live = {}
        for rank, joined in joined_ranks(self.attempt_dir).items():
            pid = joined.get("pid")
            if isinstance(pid, int) and _alive(pid):
                local = joined.get("local_rank")
                live[rank] = (pid, RankLayout(rank, local if isinstance(local, int) else rank,
                                              self.attempt_dir / rank_dir_name(rank)))  # fmt: skip
        return live

    def _exited(self) -> set[int]:
        return {r for r, j in joined_ranks(self.attempt_dir).items() if not _alive(j.get("pid"))}

    def _hang(self, alarm: HangAlarm) -> None:
        self.hang = alarm.to_json()
        live = self._live()
        _say(f"no rank has made progress for {alarm.stalled_s:.0f} s ({alarm.reason}): the stacks of rank(s) "
             f"{sorted(live)} are taken, they are stopped")  # fmt: skip
        self.stopped_ranks.update(live)
        self.stop_later([pid for pid, _ in live.values()])

    def prepare(self) -> None:
        make_private_dir(self.parent_dir)
        make_private_dir(self.attempt_dir / EXITS_DIR)
        for name in (STDOUT_FILE, STDERR_FILE):
            create_private_file(self.parent_dir / name)

    def child_env(self) -> dict[str, str]:
        env = self.boot_env()
        env[ENV_SPAWN_DIR] = str(self.attempt_dir)
        return env

    def run(self) -> int:
        tees = self.start(self.child_env(), self.parent_dir / STDOUT_FILE, self.parent_dir / STDERR_FILE)
        if tees is None or self.proc is None:
            return 127
        echo = RankEcho(self.attempt_dir)
        echo.thread.start()
        self.health.start()
        threading.Thread(target=_import_the_judge, name="elastic-diag-import", daemon=True).start()
        code = self.proc.wait()
        exit_time = time.time()
        self.wait_for_children()
        self.health.finish(failed=code != 0, began=exit_time if code != 0 else None)
        for t in tees:
            t.join(timeout=2)  # a child that never joined a group may still hold the pipes
        echo.finish()
        self.record_ends(code, exit_time)
        return code

    def wait_for_children(self) -> None:
        """Ranks still alive after the command ended (orphans): at most the grace period for them to end."""
        deadline = time.monotonic() + self.grace_s
        while not self.cut_short and time.monotonic() < deadline:
            alive = [r for r in joined_ranks(self.attempt_dir).values() if _alive(r.get("pid"))]
            if not alive:
                return
            time.sleep(0.1)

    def record_ends(self, code: int, exit_time: float) -> None:
        """Each rank's launcher.json, from what the process that reaped it recorded."""
        for rank, joined in joined_ranks(self.attempt_dir).items():
            pid = joined.get("pid")
            exit_code, when, stopped, offset = None, None, False, None
            record = read_json(self.attempt_dir / EXITS_DIR / f"{pid}.json") if isinstance(pid, int) else None
            if self.proc is not None and pid == self.proc.pid:
                exit_code, when, stopped = code, exit_time, self.stopped_by is not None and code != 0
            elif isinstance(record, dict):
                exit_code, when = record.get("exit_code"), record.get("time")
                stopped = record.get("signalled_by_parent") is not None and exit_code != 0
                offset = record.get("stack_offset")
            if rank in self.stopped_ranks and exit_code != 0:
                stopped = True
            if rank in self.health.stack_offsets:
                offset = self.health.stack_offsets[rank]
            alive = exit_code is None and _alive(pid)
            write_json_atomic(self.attempt_dir / f"rank_{rank}" / LAUNCHER_FILE, {
                "schema": LAUNCHER_SCHEMA, "attempt": 0, "run_id": self.diag_dir.name, "node": self.node,
                "decided_at": time.time(), "hang": self.hang, "tail_lines": DEFAULT_TAIL_LINES,
                "launcher": "elastic-diag exec (children of the command)",
                "rank": {"rank": rank, "local_rank": joined.get("local_rank"), "pid": pid, "exit_code": exit_code,
                         "exit_time": when, "alive_at_decision": alive, "stopped_by_agent": stopped,
                         "kernel": None, "stack_offset": offset, "node": joined.get("host") or self.node},
            }, indent=None)  # fmt: skip

    def notes(self, code: int) -> list[str]:
        notes = ["the ranks are children of the command, started through elastic-diag exec; its own output is in "
                 f"{self.parent_dir}"]  # fmt: skip
        joined = joined_ranks(self.attempt_dir)
        unknown = sorted(r for r, j in joined.items() if not (self.attempt_dir / EXITS_DIR / f"{j.get('pid')}.json")
                         .exists() and j.get("pid") != (self.proc.pid if self.proc else None))  # fmt: skip
        if unknown:
            notes.append(f"how rank(s) {unknown} ended is unknown: the process that reaped them recorded nothing "
                         "(a start method other than fork or spawn, or a parent that was killed)")  # fmt: skip
        by_spawn = sorted(r for r, j in joined.items() if str(j.get("how", "")).startswith("spawn index"))
        if by_spawn:
            notes.append(f"rank(s) {by_spawn} failed before joining a process group: numbered by their spawn index")
        if code != 0 and self.stopped_by is not None:
            notes.append(f"the command was stopped by signal {self.stopped_by} from outside")
        return notes

    def world_size(self) -> int | None:
        sizes = [j.get("world_size") for j in joined_ranks(self.attempt_dir).values()]
        known = [s for s in sizes if isinstance(s, int) and s > 0]
        return max(known) if known else None


def _alive(pid: object) -> bool:
    return isinstance(pid, int) and pid > 0 and _running(pid)


def run_spawn_watch(command: Sequence[str], *, diag_dir: str | None, grace_s: float, env: Mapping[str, str],
                    hang_timeout_s: float | None = None, stall_timeout_s: float | None = None,
                    requeue_exit_code: int | None = None, tell_options: TellOptions | None = None) -> int:  # fmt: skip
    """The command as the parent of its ranks; its own exit status whatever the diagnosis does."""
    given = diag_dir or env.get(ENV_DIAG_DIR)
    folder = Path(given).absolute() if given else default_diag_dir(environ=env)
    watch = SpawnWatch(
        command,
        folder,
        grace_s,
        env,
        hang_timeout_s=hang_timeout_s,
        stall_timeout_s=stall_timeout_s,
        requeue_exit_code=requeue_exit_code,
    )
    try:
        watch.prepare()
    except OSError as e:
        return run_unwatched(command, f"the diag dir {str(folder)!r} is not writable ({e.strerror or e})")
    try:
        code = watch.run()
        if code == 127 and watch.proc is None:
            return code
        if not joined_ranks(watch.attempt_dir):
            return _nothing_joined(watch, code)
        try:
            from elastic_diag.launch.relaunch import exec_job_facts

            report = judge_attempt(folder, None, watch.node, watch.notes(code), command_failed=code != 0,
                                   job=exec_job_facts(None, None, command, folder, dict(env)),
                                   requeue_exit_code=requeue_exit_code)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the job's result comes first: say it, keep its exit status
            _say(f"the verdict could not be written ({e!r}); `elastic-diag report {folder}` judges the evidence again")
            return _exit_status(code)
        if report is not None:
            keep_verdict(report, folder, tell_options, show=report["status"] != "succeeded" or code != 0)
        return exit_status_of(code, report)
    finally:
        watch.restore_signals()


def _nothing_joined(watch: SpawnWatch, code: int) -> int:
    looked = ", ".join(LOOKED_FOR)
    if code == 0:
        if watch.created:
            shutil.rmtree(watch.diag_dir, ignore_errors=True)
        _say(f"no rank: nothing in the environment names one (looked for {looked}) and no process of the command "
             "joined a process group; nothing to diagnose")  # fmt: skip
    else:
        _say(f"no rank: nothing in the environment names one (looked for {looked}) and no process of the command "
             f"joined a process group; its exit status {_exit_status(code)} is passed on, its output is kept in "
             f"{watch.parent_dir} (`elastic-diag analyze {watch.parent_dir}` reads it)")  # fmt: skip
    return _exit_status(code)

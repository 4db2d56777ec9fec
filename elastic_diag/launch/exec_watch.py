"""``elastic-diag exec -- COMMAND``: one rank's process under a small watch, for jobs torchrun does not launch.

``srun python train.py`` (Lightning and NeMo on Slurm), ``mpirun python train.py``: each task the launcher
starts is one rank. Prefixed with ``elastic-diag exec --``, the task runs under a watch that

* finds its rank and world size from the launcher's variables (:mod:`elastic_diag.launch.rank_env`);
* lays out ``<diag-dir>/attempt_0/rank_<R>/`` as ``torchrun-diag`` does (private: 0700 / 0600), and starts
  the command with the same worker bootstrap (exception records, stacks on a signal, the progress beacon,
  the flight recorder, secrets masked as the rank writes);
* keeps the rank's stdout and stderr in that folder and passes them on to its own (the launcher's console);
* passes SIGTERM / SIGINT / SIGHUP on to the rank unless it got the signal itself (srun and mpirun signal a
  whole step; the rank writes its own stacks on SIGTERM), and keeps waiting for it, so the exit and the
  evidence are on disk before the launcher's SIGKILL;
* runs torchrun-diag's health monitor over every rank's progress in the shared diag dir
  (:mod:`elastic_diag.launch.exec_health`: hangs stopped with their stacks, stall snapshots);
* writes the rank's ``launcher.json`` (its exit code or signal, its exit time, whether it was stopped from
  outside) first, then the verdict across ranks, from the same files and the same rules as ``torchrun-diag``.

Who writes ``report.json``: every watch, when its rank has ended, once every peer has ended or recorded its
own exception or the grace period has passed (``--diag-grace``). Each write judges all the evidence on disk
at that moment and replaces the file atomically, so the last watch to end leaves the verdict with the most
evidence; ``elastic-diag report DIR`` judges it again at any time. The summary is printed once per diag
dir, by the first watch to judge a failure (:func:`print_once`).

The diag dir is shared by the job's ranks: ``--diag-dir`` / ``ELASTIC_DIAG_DIR``, else one named by the
job (Slurm's job and step, Open MPI's job id, PMIx's namespace, ``MASTER_ADDR``/``MASTER_PORT``). The
watch imports no torch. :mod:`elastic_diag.launch.exec_command` picks the watch; :mod:`elastic_diag.launch.
spawn_watch` watches a command whose children are the ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from elastic_diag.agent.health import HangAlarm
from elastic_diag.config import DEFAULT_TAIL_LINES, host_name, progress_interval
from elastic_diag.core.verification import JobFacts
from elastic_diag.launch.exec_health import ExecHealth
from elastic_diag.launch.rank_env import RankPlace
from elastic_diag.layout import (
    ENV_BEACON,
    ENV_BOOT_PATH,
    ENV_LAUNCHER_PID,
    ENV_PROGRESS_INTERVAL,
    ENV_RANK_DIR,
    ENV_STACK_ON_TERM,
    ENV_TORCHELASTIC_ERROR_FILE,
    ERROR_FILE,
    EXCEPTION_FILE,
    LAUNCHER_FILE,
    LAUNCHER_SCHEMA,
    REPORT_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    RankLayout,
    attempt_dir_name,
    claim_rank_dir,
    create_private_file,
    flight_recorder_env,
    make_private_dir,
    rank_dir_name,
    write_json_atomic,
)

if TYPE_CHECKING:
    from elastic_diag.ledger.tell import TellOptions

BOOT_DIR = str(Path(__file__).resolve().parents[1] / "worker" / "_boot")
DEFAULT_GRACE_S = 5.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORWARD_DELAY_S = 0.3  # a signal the rank got itself (the launcher's, to the whole step) is not sent twice
_CHUNK = 1 << 16


def _say(text: str) -> None:
    print(f"elastic-diag exec: {text}", file=sys.stderr, flush=True)


def run_unwatched(command: Sequence[str], why: str) -> int:
    _say(f"{why}; the command runs without diagnosis")
    try:
        return _exit_status(subprocess.call(list(command)))
    except OSError as e:
        _say(f"cannot run {command[0]!r}: {e.strerror or e}")
        return 127


def _import_the_judge() -> None:
    """The verdict's modules imported while the rank runs (the watch is idle then): a third of a second less
    between a failure and its report. Never fails the watch."""
    with contextlib.suppress(Exception):
        import elastic_diag.core.classify
        import elastic_diag.layout
        import elastic_diag.report.document
        import elastic_diag.report.html
        import elastic_diag.report.summary  # noqa: F401


def _running(pid: int) -> bool:
    """Alive and not a zombie (``/proc``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _exit_status(code: int) -> int:
    return code if code >= 0 else 128 - code  # a signal: the shell's 128 + N


class Watch:
    """What every watch does: start the command, keep its streams and pass them on, forward the launcher's
    signals to it, record its end. :class:`RankWatch` watches one rank; :class:`~elastic_diag.launch.spawn_watch.
    SpawnWatch` a command whose children are the ranks."""

    def __init__(self, command: Sequence[str], diag_dir: Path, grace_s: float, env: Mapping[str, str], *,
                 hang_timeout_s: float | None = None, stall_timeout_s: float | None = None,
                 requeue_exit_code: int | None = None) -> None:  # fmt: skip
        self.command = list(command)
        self.requeue_exit_code = requeue_exit_code
        self.hang_timeout_s = hang_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.hang: dict[str, Any] | None = None  # the health monitor's alarm, when the watch stopped its ranks
        self.diag_dir = diag_dir
        self.attempt_dir = diag_dir / attempt_dir_name(0)
        self.grace_s = grace_s
        self.env = dict(env)
        self.node = host_name(env)
        self.stopped_by: int | None = None  # the signal the watch received and passed on
        self.cut_short = False  # a signal came after the command's end: stop waiting, judge now
        self.proc: subprocess.Popen[bytes] | None = None
        self.previous: dict[int, Any] = {}

    def boot_env(self) -> dict[str, str]:
        """The environment with the worker bootstrap first on PYTHONPATH."""
        env = dict(self.env)
        if self.hang_timeout_s != 0 or self.stall_timeout_s != 0:  # the user's own variables win
            env.setdefault(ENV_PROGRESS_INTERVAL, f"{progress_interval(self.hang_timeout_s, self.stall_timeout_s):g}")
        else:  # neither a hang verdict nor a stall snapshot: nothing reads the ranks' progress
            env.setdefault(ENV_BEACON, "0")
        env[ENV_STACK_ON_TERM] = "1"
        env[ENV_BOOT_PATH] = BOOT_DIR
        env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOT_DIR, self.env.get("PYTHONPATH", "")) if p)
        return env

    def start(self, env: Mapping[str, str], stdout_path: Path, stderr_path: Path) -> list[threading.Thread] | None:
        """The command started, its streams copied to the two files and the console; None when it cannot
        start (said on stderr). The signal handlers stay until :meth:`restore_signals`: a SIGTERM after the
        command's end (srun stopping the step while the watch waits for its peers) cuts the wait short, it does
        not kill the watch before the verdict is written."""
        self.previous = {s: signal.signal(s, self._forward) for s in FORWARDED}
        try:
            self.proc = subprocess.Popen(self.command, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            _say(f"cannot run {self.command[0]!r}: {e.strerror or e}")
            return None
        assert self.proc.stdout is not None and self.proc.stderr is not None
        return [self._tee(self.proc.stdout, stdout_path, sys.stdout),
                self._tee(self.proc.stderr, stderr_path, sys.stderr)]  # fmt: skip

    def restore_signals(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous = {}

    def _forward(self, signum: int, _frame: Any) -> None:
        """Passed on to the rank, unless the signal reached it too: srun and mpirun signal every process of a step
        together, and a second SIGTERM would cut short the stacks the rank writes on the first
        (``ENV_STACK_ON_TERM``). So the watch gives it :data:`FORWARD_DELAY_S` to end by itself first."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self.stopped_by = signum

            def forward() -> None:
                deadline = time.monotonic() + FORWARD_DELAY_S
                while time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.01)
                if proc.poll() is None:
                    with contextlib.suppress(OSError):
                        proc.send_signal(signum)

            threading.Thread(target=forward, name="elastic-diag-forward", daemon=True).start()
        else:
            self.cut_short = True  # the command has ended: judge now, before the launcher's SIGKILL

    def stop_later(self, pids: Sequence[int]) -> None:
        """SIGTERM to each process now, SIGKILL to those still alive after the grace period (a hang verdict)."""
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)

        def kill() -> None:
            deadline = time.monotonic() + max(self.grace_s, 1.0)
            while time.monotonic() < deadline and any(_running(p) for p in pids):
                time.sleep(0.1)
            for pid in pids:
                if _running(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill, name="elastic-diag-stop", daemon=True).start()

    def _tee(self, source: IO[bytes], path: Path, console: Any) -> threading.Thread:
        def copy() -> None:
            out = getattr(console, "buffer", None)
            with open(path, "ab") as sink:
                fd = source.fileno()
                while chunk := os.read(fd, _CHUNK):
                    sink.write(chunk)
                    sink.flush()
                    if out is not None:
                        try:
                            out.write(chunk)
                            out.flush()
                        except (OSError, ValueError):  # the console went away: the file still has it
                            out = None

        thread = threading.Thread(target=copy, name=f"elastic-diag-tee-{path.name}", daemon=True)
        thread.start()
        return thread


class RankWatch(Watch):
    """The watch of one rank: starts it, tees its streams, forwards signals, records its end."""

    def __init__(self, command: Sequence[str], place: RankPlace, diag_dir: Path, grace_s: float,
                 env: Mapping[str, str], **settings: Any) -> None:  # fmt: skip
        super().__init__(command, diag_dir, grace_s, env, **settings)
        self.place = place
        self.rank_dir = self.attempt_dir / rank_dir_name(place.rank)
        self.ended = False
        self.health = ExecHealth(attempt_dir=self.attempt_dir, node=self.node, part=rank_dir_name(place.rank),
                                 hang_timeout_s=self.hang_timeout_s, stall_timeout_s=self.stall_timeout_s,
                                 ranks=self._live, world=lambda: place.world_size,
                                 exited=lambda: self.reported_ranks() | ({place.rank} if self.ended else set()),
                                 on_hang=self._hang)  # fmt: skip

    def _live(self) -> dict[int, tuple[int, RankLayout]]:
        if self.proc is None or self.proc.poll() is not None:
            return {}
        local = self.place.local_rank if self.place.local_rank is not None else 0
        return {self.place.rank: (self.proc.pid, RankLayout(self.place.rank, local, self.rank_dir))}

    def _hang(self, alarm: HangAlarm) -> None:
        self.hang = alarm.to_json()
        _say(f"rank {self.place.rank}: no rank has made progress for {alarm.stalled_s:.0f} s ({alarm.reason}): "
             "its stacks are taken, it is stopped")  # fmt: skip
        if self.proc is not None and self.proc.poll() is None:
            self.stopped_by = signal.SIGTERM
            self.stop_later([self.proc.pid])

    def prepare(self) -> None:
        """The rank's folder, claimed for this watch (:func:`claim_rank_dir`). A second watch with the same rank
        (two launchers' variables that disagree, a task started twice) keeps its evidence beside it in
        ``rank_<R>.<host>.<pid>/``; the verdict is taken from the first and says so."""
        make_private_dir(self.attempt_dir)
        self.rank_dir, claimed = claim_rank_dir(self.attempt_dir, self.place.rank, self.node)
        if claimed is not None:
            _say(f"rank {self.place.rank} is already watched ({claimed}); this one's evidence goes to {self.rank_dir}")
        for name in (STDOUT_FILE, STDERR_FILE):
            create_private_file(self.rank_dir / name)

    def child_env(self) -> dict[str, str]:
        env = {**self.boot_env(), **flight_recorder_env(self.rank_dir)}
        env[ENV_RANK_DIR] = str(self.rank_dir)
        env[ENV_LAUNCHER_PID] = str(os.getpid())
        env.setdefault(ENV_TORCHELASTIC_ERROR_FILE, str(self.rank_dir / ERROR_FILE))
        return env

    def run(self) -> int:
        """Run the rank to its end; its raw exit code (negative: the signal that ended it), or 127 when it
        cannot start."""
        tees = self.start(self.child_env(), self.rank_dir / STDOUT_FILE, self.rank_dir / STDERR_FILE)
        if tees is None or self.proc is None:
            return 127
        self.health.start()
        threading.Thread(target=_import_the_judge, name="elastic-diag-import", daemon=True).start()
        code = self.proc.wait()
        exit_time = time.time()
        self.ended = True
        self.health.stop()
        self.record_end(code, exit_time)  # first: a launcher that stops the step SIGKILLs the watch soon after
        for t in tees:
            t.join(timeout=5)
        self.health.finish(failed=code != 0, began=exit_time if code != 0 else None)
        return code

    def record_end(self, code: int, exit_time: float) -> None:
        """This rank's launcher.json: what a launcher saw of it, the file ``read_attempt`` reads."""
        offset = self.health.stack_offsets.get(self.place.rank)
        record = {
            "schema": LAUNCHER_SCHEMA, "attempt": 0, "run_id": self.diag_dir.name, "node": self.node,
            "decided_at": exit_time, "hang": self.hang, "tail_lines": DEFAULT_TAIL_LINES,
            "launcher": f"elastic-diag exec ({self.place.launcher})",
            "rank": {"rank": self.place.rank, "local_rank": self.place.local_rank,
                     "pid": self.proc.pid if self.proc else None, "exit_code": code, "exit_time": exit_time,
                     "alive_at_decision": False, "stopped_by_agent": self.stopped_by is not None and code != 0,
                     "kernel": None, "stack_offset": offset, "node": self.node},
        }  # fmt: skip
        write_json_atomic(self.rank_dir / LAUNCHER_FILE, record, indent=None)

    def reported_ranks(self) -> set[int]:
        found = set()
        for path in self.attempt_dir.glob(f"rank_*/{LAUNCHER_FILE}"):
            number = path.parent.name.removeprefix("rank_")
            if number.isdigit():
                found.add(int(number))
        return found

    def wait_for_peers(self, failed: bool) -> None:
        """Until every rank of the world has ended or recorded its own exception (a rank's interpreter can take
        a second or more to tear down after it), at most the grace period, as torchrun-diag's grace ends early
        (a failed rank's peers are being stopped by the launcher now; a healthy rank does not wait for them)."""
        size = self.place.world_size
        if not failed or size is None:
            return
        deadline = time.monotonic() + self.grace_s
        while not self.cut_short and time.monotonic() < deadline:
            known = self.reported_ranks() | {r for r in range(size) if (self.attempt_dir / rank_dir_name(r) /
                                                                         EXCEPTION_FILE).exists()}  # fmt: skip
            if set(range(size)) <= known:
                return
            time.sleep(0.05)

    def judge(self) -> dict[str, Any] | None:
        """Every rank's evidence on disk judged by the core's rules (:func:`judge_attempt`); None while this
        healthy rank's peers still run."""
        from elastic_diag.launch.relaunch import exec_job_facts

        job = exec_job_facts(self.place.launcher, self.place.world_size, self.command, self.diag_dir, self.env)
        return judge_attempt(self.diag_dir, self.place.world_size, self.node,
                             [f"started by {self.place.launcher} through elastic-diag exec"],
                             job=job, requeue_exit_code=self.requeue_exit_code)  # fmt: skip


SUMMARY_CLAIM = "summary.printed"  # the diag dir: the watch that printed the verdict's summary (one per job)


def print_once(report: dict[str, Any], diag_dir: Path) -> bool:
    """The verdict's summary on this watch's console, unless another watch of the job printed it already (srun
    and mpirun merge every task's output into one console): the first watch to judge a failure prints it, so a
    watch the launcher kills before it judges (srun's and mpirun's teardown) leaves the summary to another."""
    try:
        fd = os.open(diag_dir / SUMMARY_CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return False
    except OSError:
        pass  # a diag dir that takes no more files: print anyway
    else:
        os.close(fd)
    from elastic_diag.report.summary import print_summary

    print_summary(report, str(diag_dir / REPORT_FILE))
    return True


def keep_verdict(report: dict[str, Any], diag_dir: Path, options: TellOptions | None, *, show: bool) -> None:
    """The verdict's summary printed once per job (``show``: a failure, :func:`print_once`), recorded in the ledger
    by every watch that judged it (the same attempt again replaces its row), and told by the watch that printed
    it; bounded, never changes the exit status."""
    printed = show and print_once(report, diag_dir)
    if options is None:
        return
    from elastic_diag.ledger.tell import after_verdict

    try:
        lines = after_verdict(report, str(diag_dir / REPORT_FILE), options, source="exec", diag_dir=diag_dir,
                              notify=printed)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the job's outcome comes first
        lines = [f"the verdict was not recorded or told: {e!r}"]
    for line in lines:
        _say(line)


def judge_attempt(diag_dir: Path, size: int | None, node: str, notes: list[str], *, command_failed: bool = False,
                  warnings: Sequence[dict[str, Any]] = (), job: JobFacts | None = None,
                  requeue_exit_code: int | None = None) -> dict[str, Any] | None:  # fmt: skip
    """Every rank's evidence under ``diag_dir/attempt_0`` judged by the core's rules, written to report.json and
    report.html; the report, or None when there is nothing to add yet (healthy so far, and ranks of a world of
    ``size`` still running). ``command_failed``: the watched command itself failed (a parent of the ranks): the
    attempt failed whatever the ranks' exits say. ``requeue_exit_code``: the report says whether the failure
    asks for a new allocation (core/requeue.py, as under ``torchrun-diag``; no restart gate runs here)."""
    from elastic_diag.core.classify import classify_attempt
    from elastic_diag.core.verdict import AttemptStatus
    from elastic_diag.layout import read_attempt
    from elastic_diag.report.document import AttemptRecord, build_report, write_report
    from elastic_diag.report.html import write_html

    attempt_dir = diag_dir / attempt_dir_name(0)
    read = read_attempt(attempt_dir)
    evidence = read.evidence
    failed = command_failed or any(ev.exit_code not in (0, None) for ev in evidence.ranks)
    if not failed and size is not None and {ev.rank for ev in evidence.ranks} < set(range(size)):
        return None
    diagnosis = classify_attempt(evidence)
    status: AttemptStatus = "failed" if failed else "succeeded"
    missing = sorted(set(range(size)) - {ev.rank for ev in evidence.ranks}) if size else []
    notes = list(notes)
    for d in sorted(attempt_dir.glob("rank_*.*")):
        rank = d.name.split(".")[0].removeprefix("rank_")
        notes.append(f"two processes claimed rank {rank}: the second one's evidence is in {d} (not judged)")
    if missing:
        notes.append(f"no evidence from rank(s) {missing} in {attempt_dir} (another host whose diag dir is "
                     "not shared, or a task that never started)")  # fmt: skip
    # the stalls the job got over, as warnings: from the records every watch wrote its part of, merged
    from elastic_diag.core.stall import stall_warning

    warnings = [*warnings, *(stall_warning(r, 0) for r in evidence.stalls if r.outcome in ("resumed", "ended"))]
    record = AttemptRecord(evidence=evidence, diagnosis=diagnosis, status=status, final=True)
    report = build_report(run_id=diag_dir.name, status=status, attempts=[record], diag_dir=str(diag_dir),
                          node=node, notes=[*notes, *read.problems], warnings=warnings, job=job)  # fmt: skip
    if requeue_exit_code is not None and status == "failed":
        from elastic_diag.core.findings import retryable_own_failure
        from elastic_diag.core.requeue import requeue_decision
        from elastic_diag.core.taxonomy import load_taxonomy

        culprit = next((ev for ev in evidence.ranks if ev.rank == diagnosis.initiating_rank), None)
        own = culprit is not None and retryable_own_failure(culprit, load_taxonomy()) is not None
        report["requeue"] = requeue_decision(status, diagnosis, own_retryable=own,
                                             exit_code=requeue_exit_code).to_json()  # fmt: skip
    write_report(diag_dir / REPORT_FILE, report)
    write_html(diag_dir, report)
    return report


def exit_status_of(code: int, report: dict[str, Any] | None) -> int:
    """The rank's (or command's) exit status, or the requeue exit code when the verdict asks for a new
    allocation: every watch of the job that judges it exits with that code, so srun's status is it."""
    requeue = report.get("requeue") if isinstance(report, dict) else None
    if code != 0 and isinstance(requeue, dict) and requeue.get("requeue") and isinstance(requeue.get("exit_code"), int):
        return int(requeue["exit_code"])
    return _exit_status(code)

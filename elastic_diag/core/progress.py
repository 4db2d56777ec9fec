"""What a rank's progress beacon recorded (``progress.json``, ``nonfinite.json``) and what the kernel said of
a rank killed by SIGKILL, as typed records with their JSON codecs: the one place that gives the keys of
those files a meaning. The files are read by :mod:`elastic_diag.layout`; the health monitor, the capture,
the reports and the rules use these records. Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_diag.core.values import as_count, as_seconds, as_text


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """One process group as the beacon last saw it: the last collective it enqueued and the last that
    completed (torch's ``_dump_*_trace`` pg_status; gloo counts a failed collective as completed)."""

    group: str
    last_enqueued: int
    last_completed: int

    @property
    def waiting(self) -> bool:
        """A collective was enqueued and has not completed: the rank waits in it."""
        return self.last_enqueued > self.last_completed


@dataclass(frozen=True, slots=True)
class Watch:
    """An open ``elastic_diag.watch(name, timeout)`` section: what the script said it waits for, since when
    (wall clock), and for how long at most (None: no timeout of its own)."""

    name: str
    since: float
    timeout: float | None = None


def _watch(data: Any) -> Watch | None:
    if not isinstance(data, list) or len(data) != 3 or as_seconds(data[1]) is None:
        return None
    return Watch(str(data[0])[:200], float(data[1]), as_seconds(data[2]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """A rank's progress beacon (``progress.json``, rewritten every tick): steps, backward passes and
    heartbeats counted, when it last progressed, its last step durations, its process groups' status,
    the scripts' own watch, and whether it is exiting."""

    time: float | None = None  # when the beacon wrote it
    pid: int | None = None
    steps: int | None = None  # optimizer steps
    progress_time: float | None = None  # when a step, backward or heartbeat was last seen
    step_durations: tuple[float, ...] = ()
    backward: int | None = None
    heartbeats: int | None = None
    watch: Watch | None = None  # the open elastic_diag.watch(...) section
    groups: tuple[GroupStatus, ...] = ()
    exiting: bool = False
    beacon_cpu_s: float | None = None

    @property
    def in_collective(self) -> bool:
        return any(g.waiting for g in self.groups)

    @property
    def started(self) -> bool:
        """It shows training activity (a process group, a step, a backward, a heartbeat, a watch): a script
        that shows none is not a distributed job the health monitor can judge."""
        return bool(self.groups or self.steps or self.backward or self.heartbeats or self.watch)

    def completed_a_collective(self) -> bool:
        """A collective completed on this rank (or it made a step): the job came up."""
        return any(g.last_completed >= 1 for g in self.groups) or bool(self.steps)

    def activity(self) -> tuple[object, ...]:
        """What changes when the rank makes any progress: counters, collectives enqueued and completed, its
        watch."""
        return (self.steps, self.backward, self.heartbeats,
                tuple((g.group, g.last_enqueued, g.last_completed) for g in self.groups), self.watch)  # fmt: skip

    def forward_activity(self) -> tuple[object, ...]:
        """What changes when the rank moves forward: as :meth:`activity`, without collectives completing (a
        rank that only waits sees them complete as its peers arrive)."""
        return (self.steps, self.backward, self.heartbeats, tuple((g.group, g.last_enqueued) for g in self.groups),
                self.watch)  # fmt: skip


def _groups(data: Any) -> tuple[GroupStatus, ...]:
    if not isinstance(data, dict):
        return ()
    out = []
    for name, status in data.items():
        if not isinstance(status, dict):
            continue
        try:
            enqueued = int(status.get("last_enqueued_collective", -1))
            completed = int(status.get("last_completed_collective", -1))
        except (TypeError, ValueError):
            continue
        out.append(GroupStatus(str(name), enqueued, completed))
    return tuple(sorted(out, key=lambda g: g.group))


def progress_from_json(data: Any) -> Progress | None:
    """progress.json as a record; None for anything that is not a JSON object."""
    if not isinstance(data, dict):
        return None
    durations = data.get("step_durations")
    return Progress(
        time=as_seconds(data.get("time")),
        pid=as_count(data.get("pid")),
        steps=as_count(data.get("steps")),
        progress_time=as_seconds(data.get("progress_time")),
        step_durations=tuple(float(d) for d in durations if as_seconds(d) is not None)
        if isinstance(durations, list)
        else (),
        backward=as_count(data.get("backward")),
        heartbeats=as_count(data.get("heartbeats")),
        watch=_watch(data.get("watch")),
        groups=_groups(data.get("pg_status")),
        exiting=data.get("exiting") is True,
        beacon_cpu_s=as_seconds(data.get("beacon_cpu_s")),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class NonFinite:
    """The first non-finite loss a rank backpropagated (``nonfinite.json``): its backward count, step, time
    and where in the user's code ``backward()`` was called."""

    backward: int
    step: int | None = None
    time: float | None = None
    where: str | None = None
    what: str = "loss"

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "backward": self.backward, "step": self.step, "time": self.time, "where": self.where}


def nonfinite_from_json(data: Any) -> NonFinite | None:
    if not isinstance(data, dict) or as_count(data.get("backward")) is None:
        return None
    return NonFinite(backward=data["backward"], step=as_count(data.get("step")), time=as_seconds(data.get("time")),
                     where=as_text(data.get("where"), 2000), what=as_text(data.get("what"), 100) or "loss")  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelEvidence:
    """What the kernel says of a rank killed by SIGKILL (agent/kernel.py): ``proven`` an OOM kill, the
    decisive ``line`` (the kernel log's, or the memory cgroup's count), the kernel log line naming the pid,
    the cgroup's state, and each source looked at with what it gave."""

    proven: bool
    line: str | None = None
    kernel_line: str | None = None
    cgroup: dict[str, Any] | None = None
    looked_at: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"proven": self.proven, "line": self.line, "kernel_line": self.kernel_line, "cgroup": self.cgroup,
                "looked_at": list(self.looked_at)}  # fmt: skip


def kernel_from_json(data: Any) -> KernelEvidence | None:
    if not isinstance(data, dict):
        return None
    looked = data.get("looked_at")
    cgroup = data.get("cgroup")
    return KernelEvidence(
        proven=data.get("proven") is True,
        line=as_text(data.get("line"), 2000),
        kernel_line=as_text(data.get("kernel_line"), 2000),
        cgroup=cgroup if isinstance(cgroup, dict) else None,
        looked_at=tuple(str(x)[:1000] for x in looked) if isinstance(looked, list) else (),
    )

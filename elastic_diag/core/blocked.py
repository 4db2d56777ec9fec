"""What a rank outside any collective waits on, as the kernel sees its main thread.

A rank whose peers wait in a collective while it is blocked outside torch (a file lock, a child process,
a pipe, a socket, a queue) shows only a Python frame in its stack: ``fcntl.flock``, ``Popen.wait``,
``queue.get``. The stall snapshot (``agent/blocked.py``) adds what the frame cannot say: the kernel
function the thread sleeps in (``wchan``), and what holds it: the process holding the lock (from
``/proc/locks``), the child it waits for and what that child waits on, the process holding the other end
of its pipe, the socket's peer. When the holder is another rank (or a process of another rank), the rank
that holds the others up is that one, not the first blocked rank (:func:`holding_rank`).

Pure: no torch, no I/O. The records come from ``stall.json`` and are validated like any untrusted input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# what a main thread waits for: the kinds of :attr:`Blocked.waits_for`
WAITS = ("lock", "child", "pipe", "fifo", "socket", "poll", "futex", "sleep", "disk", "running", "unknown")

# the kernel functions a thread sleeps in, by what it waits for (names vary across kernel versions)
_WCHAN_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lock", ("locks_lock_inode_wait", "flock_lock_inode_wait", "posix_lock_inode_wait", "fcntl_setlk",
              "locks_lock_file_wait", "__flock", "flock_lock", "posix_lock")),
    ("child", ("do_wait", "kernel_wait", "wait_consider_task", "do_wait_pid")),
    ("fifo", ("wait_for_partner", "fifo_open")),
    ("pipe", ("pipe_read", "pipe_write", "anon_pipe_read", "anon_pipe_write", "pipe_wait")),
    ("socket", ("wait_woken", "sk_wait_data", "inet_csk_accept", "sk_stream_wait", "unix_stream_read",
                "unix_wait_for_peer", "tcp_recvmsg", "skb_wait_for_more_packets", "__skb_wait_for_more_packets")),
    ("poll", ("do_select", "do_sys_poll", "poll_schedule_timeout", "ep_poll", "do_epoll_wait", "core_sys_select")),
    ("futex", ("futex",)),
    ("sleep", ("hrtimer_nanosleep", "do_nanosleep", "clock_nanosleep")),
)  # fmt: skip

TEXT_LIMIT = 300  # a command line, a path or a peer address, as kept


def wait_kind(state: str | None, wchan: str | None) -> str:
    """What a thread in ``state`` sleeping in the kernel function ``wchan`` waits for (one of :data:`WAITS`)."""
    if state == "D":
        return "disk"
    if state == "R":
        return "running"
    name = (wchan or "").strip()
    for kind, prefixes in _WCHAN_KINDS:
        if any(name.startswith(p) for p in prefixes):
            return kind
    return "unknown"


def process_waits(state: str | None, wchan: str | None) -> str:
    """``blocked writing to a pipe that nobody read (pipe_write)``: what another process (a child, a pipe's
    writer) was doing, for :attr:`Blocked.holder_waits`."""
    kind = wait_kind(state, wchan)
    at = f" ({wchan})" if wchan and kind not in ("disk", "running") else ""
    if kind == "pipe" and wchan and "write" in wchan:
        return f"blocked writing to a pipe that nobody read{at}"
    return {
        "lock": "waiting for a file lock",
        "child": "waiting for a child process of its own",
        "fifo": "opening a named pipe with no writer",
        "pipe": "blocked reading a pipe",
        "socket": "waiting on a socket",
        "poll": "waiting in poll/select",
        "futex": "waiting on a lock or queue (futex)",
        "sleep": "sleeping",
        "disk": f"in uninterruptible I/O (state D{f', {wchan}' if wchan else ''})",
        "running": "running on a CPU",
    }.get(kind, "blocked in the kernel") + at


@dataclass(frozen=True, slots=True, kw_only=True)
class Blocked:
    """One rank's main thread at the stall. ``holder_pid``: the process that holds it up (the lock's holder,
    the child it waits for, the other end of its pipe); ``holder_rank``: the rank that process is or was
    started by; ``holder_waits``: what that process waits on in turn (a child blocked writing a full pipe)."""

    state: str | None
    wchan: str | None
    waits_for: str
    what: str | None = None  # the lock's file, the child's command line, the pipe, the socket's peer
    holder_pid: int | None = None
    holder_rank: int | None = None
    holder_waits: str | None = None

    def describe(self, rank: int) -> str:
        """``waited for the lock on /data/cache.lock held by rank 2 (pid 4242)``: a phrase after a rank."""
        holder = self._holder(rank)
        what = self.what or ""
        if self.waits_for == "lock":
            return f"waited for the lock on {what or 'a file'}" + (f" held by {holder}" if holder else "")
        if self.waits_for == "child":
            text = f"waited for its child process {self.holder_pid or ''}".rstrip()
            text += f" ({what})" if what else ""
            return text + (f", which was itself {self.holder_waits}" if self.holder_waits else "")
        if self.waits_for == "fifo":
            return f"was opening a named pipe{f' {what}' if what else ''} that no process had opened for writing"
        if self.waits_for == "pipe":
            text = f"was blocked on a pipe{f' ({what})' if what else ''}"
            if holder:
                text += f" whose {'write' if 'write' not in (self.wchan or '') else 'read'} end {holder} held"
                text += f" ({self.holder_waits})" if self.holder_waits else ""
            return text
        if self.waits_for == "socket":
            return f"waited on a socket{f' ({what})' if what else ''} for data that never came"
        if self.waits_for == "disk":
            at = f", in {self.wchan}" if self.wchan else ""
            return f"was in uninterruptible I/O (state D{at}: a disk or network file system)"
        if self.waits_for == "futex":
            return "waited on a lock, condition or queue of its own process (a futex)" + (
                f"; its {what}" if what else ""
            )
        if self.waits_for == "poll":
            return f"waited in poll/select{f' on {what}' if what else ''}"
        if self.waits_for == "sleep":
            return "was sleeping (a timed wait or a polling loop)"
        if self.waits_for == "running":
            return "was running on a CPU (busy, not blocked)"
        return f"was blocked in the kernel{f' at {self.wchan}' if self.wchan else ''}"

    def _holder(self, rank: int) -> str | None:
        if self.holder_pid is None:
            return None
        if self.holder_rank is not None and self.holder_rank != rank:
            return f"rank {self.holder_rank} (pid {self.holder_pid})"
        if self.holder_rank == rank:
            return f"its child process {self.holder_pid}"
        return f"pid {self.holder_pid} (no rank of this node)"


def holding_rank(blocked: Mapping[int, Blocked | None]) -> int | None:
    """The rank the blocked ranks' waits lead to: each rank waiting on a process of another rank points at
    that rank; the chains are followed to their end. None when no rank waits on another, or when the chains
    end at more than one rank."""
    ends = set()
    for rank in blocked:
        seen = {rank}
        at = rank
        while (b := blocked.get(at)) is not None and b.holder_rank is not None and b.holder_rank not in seen:
            seen.add(b.holder_rank)
            at = b.holder_rank
        if at != rank:
            ends.add(at)
    return ends.pop() if len(ends) == 1 else None


# --- stall.json ---------------------------------------------------------------------------------------


def blocked_to_json(b: Blocked) -> dict[str, Any]:
    return {
        "state": b.state,
        "wchan": b.wchan,
        "waits_for": b.waits_for,
        "what": b.what,
        "holder_pid": b.holder_pid,
        "holder_rank": b.holder_rank,
        "holder_waits": b.holder_waits,
    }


def _text(value: Any) -> str | None:
    return value[:TEXT_LIMIT] if isinstance(value, str) and value else None


def _small_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def blocked_from_json(data: Any) -> Blocked | None:
    """A stall.json's ``blocked`` back as a record; None for anything that is not one."""
    if not isinstance(data, dict) or data.get("waits_for") not in WAITS:
        return None
    state = data.get("state")
    return Blocked(
        state=state if isinstance(state, str) and len(state) == 1 else None,
        wchan=_text(data.get("wchan")),
        waits_for=data["waits_for"],
        what=_text(data.get("what")),
        holder_pid=_small_int(data.get("holder_pid")),
        holder_rank=_small_int(data.get("holder_rank")),
        holder_waits=_text(data.get("holder_waits")),
    )

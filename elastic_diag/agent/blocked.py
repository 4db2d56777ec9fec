"""Read from /proc what a rank outside any collective is blocked on, for the stall snapshot.

For each rank the stall saw outside the collective (``agent/stall.py``): its main thread's state and
kernel wait function (``/proc/PID/stat``, ``/proc/PID/wchan``), and by what it waits for
(:func:`elastic_diag.core.blocked.wait_kind`):

* a file lock: the lock it waits for in ``/proc/locks`` (a ``->`` entry of its pid), or, for a library
  that polls (``filelock``: a sleep between non-blocking tries, its stack inside the library), the lock
  another rank's process holds; the file's path from the holder's open files;
* a child process: the newest live child, its command line and what it waits on in turn;
* a pipe or socket: the file descriptor its system call reads (``/proc/PID/syscall``), the process of
  the rank trees holding the pipe's other end, or the socket's peer (``/proc/PID/net/tcp``).

The holder's rank is the rank whose process tree it belongs to. Everything here is best effort and
bounded: a file that cannot be read (another user, a process that just exited, a kernel without
``wchan``) leaves that part out. Linux only; elsewhere nothing is returned.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from elastic_diag.core.blocked import TEXT_LIMIT, Blocked, process_waits, wait_kind

PROC = Path("/proc")
MAX_PROCESSES = 50_000  # /proc entries scanned for the process tree
MAX_FDS = 2048  # open files looked at per process
MAX_TREE = 256  # processes of the rank trees whose files are looked at
_LOCK_LIBRARY = re.compile(r"filelock|fasteners|portalocker|lockfile|[/\\]_?locks?\.py|\bflock\b|\blockf\b")


def _read(path: Path, limit: int = 65536) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


class _Processes:
    """The host's processes as the probe needs them: parents, states, command lines, open files."""

    def __init__(self, proc: Path) -> None:
        self.proc = proc
        self.parent: dict[int, int] = {}
        self.state: dict[int, str] = {}
        try:
            entries = os.scandir(proc)
        except OSError:
            return
        with entries:
            for n, entry in enumerate(entries):
                if n >= MAX_PROCESSES:
                    break
                if entry.name.isdigit():
                    self._stat(int(entry.name))

    def _stat(self, pid: int) -> None:
        text = _read(self.proc / str(pid) / "stat", 4096)
        if not text or ")" not in text:
            return
        fields = text.rsplit(")", 1)[1].split()
        if len(fields) >= 2 and fields[1].isdigit():
            self.state[pid], self.parent[pid] = fields[0], int(fields[1])

    def wchan(self, pid: int) -> str | None:
        text = (_read(self.proc / str(pid) / "wchan", 256) or "").strip()
        return text if text and text != "0" else None

    def cmdline(self, pid: int) -> str | None:
        text = _read(self.proc / str(pid) / "cmdline", 4096)
        return " ".join(text.replace("\0", " ").split())[:TEXT_LIMIT] if text else None

    def children(self, pid: int) -> list[int]:
        return sorted(c for c, p in self.parent.items() if p == pid and self.state.get(c) != "Z")

    def tree(self, roots: list[int]) -> list[int]:
        """The roots and their descendants, at most :data:`MAX_TREE`."""
        out: list[int] = []
        todo = list(roots)
        while todo and len(out) < MAX_TREE:
            pid = todo.pop(0)
            if pid in out:
                continue
            out.append(pid)
            todo.extend(self.children(pid))
        return out

    def rank_of(self, pid: int, rank_pids: Mapping[int, int]) -> int | None:
        """The rank whose process (or one of its descendants) ``pid`` is."""
        at, hops = pid, 0
        while at not in rank_pids and at in self.parent and hops < 64:
            at, hops = self.parent[at], hops + 1
        return rank_pids.get(at)

    def fds(self, pid: int) -> dict[int, str]:
        out: dict[int, str] = {}
        folder = self.proc / str(pid) / "fd"
        try:
            names = os.listdir(folder)
        except OSError:
            return out
        for name in names[:MAX_FDS]:
            with contextlib.suppress(OSError, ValueError):
                out[int(name)] = os.readlink(folder / name)
        return out

    def writes(self, pid: int, fd: int) -> bool:
        """The descriptor was opened for writing (``flags`` in fdinfo: O_WRONLY or O_RDWR)."""
        text = _read(self.proc / str(pid) / "fdinfo" / str(fd), 4096) or ""
        m = re.search(r"^flags:\s*([0-7]+)", text, re.M)
        return m is not None and int(m[1], 8) & 3 != 0

    def threads(self, pid: int) -> list[int]:
        try:
            return sorted(int(t) for t in os.listdir(self.proc / str(pid) / "task") if t.isdigit())[:MAX_TREE]
        except OSError:
            return []

    def thread_wait(self, pid: int, tid: int) -> tuple[str | None, str | None]:
        """(state, wchan) of one thread of ``pid``."""
        task = self.proc / str(pid) / "task" / str(tid)
        text = _read(task / "stat", 4096) or ""
        state = text.rsplit(")", 1)[1].split()[0] if ")" in text and text.rsplit(")", 1)[1].split() else None
        wchan = (_read(task / "wchan", 256) or "").strip()
        return state, wchan if wchan and wchan != "0" else None

    def syscall_fd(self, pid: int, tid: int | None = None) -> int | None:
        """The file descriptor of the system call the thread sleeps in (its first argument)."""
        folder = self.proc / str(pid) / ("task" if tid is not None else "") / (str(tid) if tid is not None else "")
        fields = (_read(folder / "syscall", 512) or "").split()
        if len(fields) < 2 or not fields[0].lstrip("-").isdigit():
            return None
        with contextlib.suppress(ValueError):
            fd = int(fields[1], 16)
            return fd if 0 <= fd < 1 << 20 else None
        return None


def _locks(proc: Path) -> list[tuple[bool, int, int]]:
    """``/proc/locks`` as (waiting, pid, inode)."""
    out = []
    for line in (_read(proc / "locks", 1 << 20) or "").splitlines():
        m = re.match(r"\s*\d+:\s+(->\s+)?\S+\s+\S+\s+\S+\s+(\d+)\s+[0-9a-f]+:[0-9a-f]+:(\d+)\s", line)
        if m:
            out.append((m[1] is not None, int(m[2]), int(m[3])))
    return out


def _inode(proc: Path, pid: int, fd: int) -> int | None:
    try:
        return os.stat(proc / str(pid) / "fd" / str(fd)).st_ino
    except OSError:
        return None


def _file_of(ps: _Processes, pid: int, inode: int) -> str | None:
    """The path under which ``pid`` has the file of ``inode`` open."""
    for fd, target in ps.fds(pid).items():
        if target.startswith("/") and _inode(ps.proc, pid, fd) == inode:
            return target[:TEXT_LIMIT]
    return None


def _hex_address(text: str) -> str:
    """``0100007F:1F90`` (or its 32-digit IPv6 form) as ``127.0.0.1:8080``."""
    host, _, port = text.partition(":")
    try:
        number = int(port, 16)
        raw = bytes.fromhex(host)
    except ValueError:
        return text
    if len(raw) == 4:
        return f"{'.'.join(str(b) for b in reversed(raw))}:{number}"
    words = [raw[i:i + 4][::-1].hex() for i in range(0, len(raw), 4)]  # fmt: skip
    return f"[{':'.join(w[j:j + 4] for w in words for j in (0, 4))}]:{number}"  # fmt: skip


def _socket_peer(proc: Path, pid: int, inode: int) -> str | None:
    for table, name in (("tcp", "TCP"), ("tcp6", "TCP"), ("udp", "UDP"), ("udp6", "UDP")):
        for line in (_read(proc / str(pid) / "net" / table, 1 << 20) or "").splitlines()[1:]:
            f = line.split()
            if len(f) > 9 and f[9] == str(inode):
                return f"{name} {_hex_address(f[1])} -> {_hex_address(f[2])}"
    for line in (_read(proc / str(pid) / "net" / "unix", 1 << 20) or "").splitlines()[1:]:
        f = line.split()
        if len(f) > 6 and f[6] == str(inode):
            return f"unix socket {f[7][:TEXT_LIMIT]}" if len(f) > 7 else "a unix socket"
    return None


def _lock_wait(ps: _Processes, pid: int, locks: list[tuple[bool, int, int]], in_lock_library: bool,
               mine: set[int]) -> tuple[int, int] | None:  # fmt: skip
    """(inode, holder pid) of the lock ``pid`` waits for: its own ``->`` entry in /proc/locks, or for a
    polling library the one lock held by a process outside its own tree."""
    for waiting, who, inode in locks:
        if waiting and who == pid:
            holder = next((p for w, p, i in locks if not w and i == inode and p != pid), None)
            if holder is not None:
                return inode, holder
    if not in_lock_library:
        return None
    held = {(inode, who) for waiting, who, inode in locks if not waiting and who not in mine and who in ps.parent}
    return held.pop() if len(held) == 1 else None


def _blocked_thread(ps: _Processes, pid: int) -> str | None:
    """``thread 4711 waiting on a socket (TCP a -> b)``: the first other thread of ``pid`` blocked on I/O
    (what a main thread waiting on a queue or a lock usually waits for in the end)."""
    for tid in ps.threads(pid):
        if tid == pid:
            continue
        state, wchan = ps.thread_wait(pid, tid)
        kind = wait_kind(state, wchan)
        if kind not in ("socket", "pipe", "fifo", "child", "lock", "disk"):
            continue
        if (wchan or "").startswith("inet_csk_accept"):
            continue  # a server thread waiting for clients waits for nobody in particular
        text = f"thread {tid} {process_waits(state, wchan)}"
        fd = ps.syscall_fd(pid, tid)
        target = ps.fds(pid).get(fd) if fd is not None else None
        m = re.fullmatch(r"socket:\[(\d+)\]", target or "")
        if m and (peer := _socket_peer(ps.proc, pid, int(m[1]))):
            text += f": {peer}"
        return text[:TEXT_LIMIT]
    return None


def probe_blocked(
    pids: Mapping[int, int], rank_pids: Mapping[int, int], stacks: Mapping[int, str] | None = None,
    proc: Path = PROC,
) -> dict[int, Blocked]:  # fmt: skip
    """What each rank of ``pids`` (rank -> pid) is blocked on. ``rank_pids``: pid -> rank of every rank of
    this node (to name a holder); ``stacks``: the ranks' stack dumps (a polling lock library's frames)."""
    if not pids or not (proc / "self").exists():
        return {}
    ps = _Processes(proc)
    locks = _locks(proc)
    tree = ps.tree(sorted(rank_pids))
    out = {}
    for rank, pid in pids.items():
        with contextlib.suppress(OSError, ValueError):
            blocked = _probe_one(ps, rank, pid, rank_pids, locks, tree, (stacks or {}).get(rank, ""))
            if blocked is not None:
                out[rank] = blocked
    return out


def _probe_one(ps: _Processes, rank: int, pid: int, rank_pids: Mapping[int, int],
               locks: list[tuple[bool, int, int]], tree: list[int], stack: str) -> Blocked | None:  # fmt: skip
    if pid not in ps.state:
        return None
    state, wchan = ps.state[pid], ps.wchan(pid)
    kind = wait_kind(state, wchan)
    base = Blocked(state=state, wchan=wchan, waits_for=kind)

    def holder_fields(holder: int) -> dict[str, object]:
        return {"holder_pid": holder, "holder_rank": ps.rank_of(holder, rank_pids),
                "holder_waits": process_waits(ps.state.get(holder), ps.wchan(holder))}  # fmt: skip

    if kind in ("lock", "sleep", "futex", "poll", "unknown", "running"):
        mine = set(ps.tree([pid]))
        # a library that polls a lock (filelock: a try, a 50 ms sleep) is caught sleeping or running its loop
        polling = kind in ("sleep", "running", "unknown") and bool(_LOCK_LIBRARY.search(stack))
        found = _lock_wait(ps, pid, locks, polling, mine)
        if found is not None:
            inode, holder = found
            path = _file_of(ps, holder, inode) or _file_of(ps, pid, inode)
            return Blocked(state=state, wchan=wchan, waits_for="lock", what=path, **holder_fields(holder))  # type: ignore[arg-type]
        if kind == "futex" and (thread := _blocked_thread(ps, pid)) is not None:
            return Blocked(state=state, wchan=wchan, waits_for="futex", what=thread)
        return base
    if kind == "child":
        children = ps.children(pid)
        if not children:
            return base
        child = children[-1]
        fields = holder_fields(child)
        return Blocked(state=state, wchan=wchan, waits_for="child", what=ps.cmdline(child), **fields)  # type: ignore[arg-type]
    if kind in ("pipe", "socket"):
        fd = ps.syscall_fd(pid)
        target = ps.fds(pid).get(fd) if fd is not None else None
        if target is None:
            return base
        if kind == "socket" or target.startswith("socket:"):
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            peer = _socket_peer(ps.proc, pid, int(m[1])) if m else None
            return Blocked(state=state, wchan=wchan, waits_for="socket", what=peer or target)
        reading = "write" not in (wchan or "")
        others = [(p, f) for p in tree if p != pid for f, t in ps.fds(p).items() if t == target]
        ends = [p for p, f in others if ps.writes(p, f) == reading]
        what = f"fd {fd}, {target}"
        if not ends:
            return Blocked(
                state=state,
                wchan=wchan,
                waits_for="pipe",
                what=what + (": no other process of the job holds its write end" if reading else ""),
            )
        return Blocked(state=state, wchan=wchan, waits_for="pipe", what=what, **holder_fields(ends[0]))  # type: ignore[arg-type]
    return base

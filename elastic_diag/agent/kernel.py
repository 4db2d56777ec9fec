"""The kernel's own evidence of an OOM kill: a SIGKILLed rank is ``host_oom`` only when the kernel
proves it, never by guess.

Two sources, each bounded in time and size, each reporting what it found or why it proved nothing:

* the rank's **memory cgroup**, remembered while the rank was alive (``/proc/<pid>/cgroup``: a zombie's
  shows the root, so the path is read on every poll of the live rank): cgroup v2 ``memory.events``
  ``oom_kill``, v1 ``memory.oom_control`` ``oom_kill`` with ``memory.failcnt``; the limit and the
  peak usage (v2 ``memory.max`` / ``memory.peak``, v1 ``memory.limit_in_bytes`` /
  ``memory.max_usage_in_bytes``). The count must have grown since the rank was first seen;
* the **kernel log**: ``/dev/kmsg`` when readable, else ``dmesg``; the line ``Out of memory: Killed
  process <pid>`` or ``Memory cgroup out of memory: Killed process <pid>`` with the rank's own pid.

The result is plain data (:func:`oom_evidence`), for the core to judge.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = Path("/dev/kmsg")
KMSG_MAX_BYTES = 8 * 1024 * 1024  # the kernel's ring buffer is 128 KiB - 32 MiB; read at most this much
KERNEL_LOG_BUDGET_S = 1.5
_KILLED = re.compile(rb"(?:Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?): "
                     rb"Killed process (\d+)")  # fmt: skip


def cgroup_paths(pid: int) -> dict[str, str]:
    """``{"memory": "/job/rank1", "": "/..."}`` from /proc/<pid>/cgroup (``""``: the v2 unified path);
    {} when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    value = (text or "").strip()
    return int(value) if value.isdigit() else None


def _field(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def memory_cgroup(paths: dict[str, str], root: Path | None = None) -> dict[str, Any] | None:
    """The rank's memory cgroup as it stands: version, path, oom_kill count, failcnt, limit, peak."""
    root = CGROUP_ROOT if root is None else root
    v1 = paths.get("memory")
    if v1 is not None:
        folder = root / "memory" / v1.lstrip("/")
        control = _read(folder / "memory.oom_control")
        if control is not None:
            limit = _number(_read(folder / "memory.limit_in_bytes"))
            return {"version": 1, "path": v1, "dir": str(folder), "oom_kill": _field(control, "oom_kill"),
                    "failcnt": _number(_read(folder / "memory.failcnt")),
                    "limit_bytes": limit if limit is not None and limit < 1 << 62 else None,
                    "peak_bytes": _number(_read(folder / "memory.max_usage_in_bytes"))}  # fmt: skip
    unified = paths.get("")
    if unified is not None:
        for folder in (root / unified.lstrip("/"), root / "unified" / unified.lstrip("/")):
            events = _read(folder / "memory.events")
            if events is not None:
                return {"version": 2, "path": unified, "dir": str(folder), "oom_kill": _field(events, "oom_kill"),
                        "limit_bytes": _number(_read(folder / "memory.max")),
                        "peak_bytes": _number(_read(folder / "memory.peak"))}  # fmt: skip
    return None


# the line before it names the victim's memory cgroup: "oom-kill:constraint=...,task_memcg=/job/x,task=python,pid=N"
_MEMCG = re.compile(rb"oom-kill:.*?task_memcg=([^,\s]+).*?[, ]pid=(\d+)")
_STAMP = re.compile(rb"^(?:\d+,\d+,(\d+),[^;]*;|\[\s*(\d+\.\d+)\])")  # kmsg's usec field, dmesg's [secs]


def _seconds_since_boot(line: bytes) -> float | None:
    m = _STAMP.match(line)
    if m is None:
        return None
    return int(m.group(1)) / 1e6 if m.group(1) else float(m.group(2))


def kernel_log_oom_lines(pids: set[int], budget_s: float = KERNEL_LOG_BUDGET_S,
                         since: float | None = None) -> tuple[dict[int, str], dict[int, str], str]:  # fmt: skip
    """The kernel's "Killed process <pid>" line for each of ``pids`` it names, and what was read (or
    why nothing could be): /dev/kmsg, else ``dmesg``; bounded by ``budget_s`` and KMSG_MAX_BYTES.
    ``since``: seconds since boot (``time.monotonic()`` when the ranks started); a stamped line from
    before it is another process that had the same pid. Also returns each pid's memory cgroup as the
    kernel named it (``task_memcg``): the cgroup of a rank that moved and died between two polls."""
    found: dict[int, str] = {}
    memcgs: dict[int, str] = {}
    deadline = time.monotonic() + budget_s

    def scan(chunk: bytes) -> None:  # one kmsg record, or lines of dmesg's output
        for line in chunk.splitlines():
            m = _KILLED.search(line)
            stamp = _seconds_since_boot(line) if since is not None else None
            if stamp is not None and since is not None and stamp < since:
                continue
            memcg = _MEMCG.search(line)
            if memcg and int(memcg.group(2)) in pids:
                memcgs[int(memcg.group(2))] = memcg.group(1).decode("utf-8", "replace")
            if m and int(m.group(1)) in pids:
                text = line.decode("utf-8", "replace").strip()
                # kmsg's "3,628,37286954100,-;Memory cgroup out of memory: ..." without its header
                found[int(m.group(1))] = text.split(";", 1)[1] if text[:1].isdigit() and ";" in text[:40] else text

    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        kmsg_problem = f"{KMSG}: {e.strerror or e}"
    else:
        read = 0
        try:
            while read < KMSG_MAX_BYTES and time.monotonic() < deadline:
                try:
                    record = os.read(fd, 16384)
                except BlockingIOError:
                    break  # the end of the ring buffer
                except OSError as e:
                    if e.errno == 32:  # EPIPE: records overwritten while reading; go on from the next
                        continue
                    raise
                if not record:
                    break
                read += len(record)
                scan(record)
            return found, memcgs, f"{KMSG} ({read} bytes read)"
        except OSError as e:
            kmsg_problem = f"{KMSG}: {e.strerror or e}"
        finally:
            os.close(fd)
    dmesg = shutil.which("dmesg")
    if dmesg is None:
        return found, memcgs, f"{kmsg_problem}; no dmesg on PATH"
    try:
        out = subprocess.run([dmesg], capture_output=True, timeout=max(0.2, deadline - time.monotonic()), check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return found, memcgs, f"{kmsg_problem}; dmesg: {type(e).__name__}"
    if out.returncode != 0:
        why = out.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
        return found, memcgs, f"{kmsg_problem}; dmesg exited {out.returncode}" + (f" ({why[0]})" if why else "")
    scan(out.stdout[-KMSG_MAX_BYTES:])
    return found, memcgs, f"{kmsg_problem}; dmesg ({len(out.stdout)} bytes)"


def oom_evidence(pid: int, cgroup_at_start: dict[str, Any] | None, paths: dict[str, str],
                 kernel_lines: dict[int, str], kernel_source: str,
                 kernel_memcg: str | None = None) -> dict[str, Any]:  # fmt: skip
    """What the kernel says of one SIGKILLed rank: ``proven``, the decisive ``line``, the ``cgroup``
    (limit and peak), and ``looked_at``: each source and what it gave."""
    looked: list[str] = []
    line = kernel_lines.get(pid)
    looked.append(f"kernel log: {kernel_source}: " + ("a line names this pid" if line else f"no OOM kill of pid {pid}"))
    if kernel_memcg and (paths.get("memory", paths.get("")) != kernel_memcg):
        # the kernel named the victim's cgroup and it is not the one last seen (the rank moved between polls)
        paths = {("memory" if "memory" in paths or not paths else ""): kernel_memcg}
        looked.append(f"memory cgroup: {kernel_memcg}, as the kernel's oom-kill line names it")
        cgroup_at_start = None
    cgroup = memory_cgroup(paths) if paths else None
    proof_by_cgroup = None
    if cgroup is None:
        looked.append("memory cgroup: " + ("none found for the rank" if paths else "the rank's cgroup was never read"))
    else:
        before = (cgroup_at_start or {}).get("oom_kill")
        now = cgroup.get("oom_kill")
        grew = before is not None and now is not None and now > before  # this rank's kill, not an old one
        looked.append(f"memory cgroup v{cgroup['version']} {cgroup['path']}: oom_kill {before} -> {now}"
                      + (f", failcnt {cgroup['failcnt']}" if cgroup.get("failcnt") is not None else ""))  # fmt: skip
        if grew:
            limit = _mib(cgroup.get("limit_bytes"))
            peak = _mib(cgroup.get("peak_bytes"))
            proof_by_cgroup = (f"memory cgroup {cgroup['path']}: oom_kill {before or 0} -> {now} "
                               f"(limit {limit}, peak {peak})")  # fmt: skip
    decisive = line or proof_by_cgroup
    return {"proven": decisive is not None, "line": decisive, "kernel_line": line, "cgroup": cgroup,
            "looked_at": looked}  # fmt: skip


def _mib(value: object) -> str:
    return f"{int(value) / 2**20:.0f} MiB" if isinstance(value, int) else "unknown"


def remember_cgroups(pids: dict[int, int], known: dict[int, dict[str, str]],
                     baseline: dict[int, dict[str, Any] | None]) -> None:  # fmt: skip
    """Refresh each live rank's cgroup paths (a rank may move itself); the first memory-cgroup state
    seen under a path is its baseline oom_kill count."""
    for key, pid in pids.items():
        paths = cgroup_paths(pid)
        if not paths or known.get(key) == paths:
            continue
        if not _running(pid):  # read after the exit: a zombie's cgroup is the root, not its own
            continue
        known[key] = paths
        with contextlib.suppress(Exception):
            baseline[key] = memory_cgroup(paths)


def _running(pid: int) -> bool:
    """Not a zombie (checked after the cgroup was read: then that read was of the live process)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")

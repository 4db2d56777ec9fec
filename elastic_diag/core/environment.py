"""What in an attempt's environment snapshot (agent/environment.py, ``environment.json``) deserves a
warning: /dev/shm nearly full, a full disk, uncorrected ECC errors, a low ``nofile`` or ``memlock``,
an InfiniBand port that is not active. Pure: the snapshot in, sentences out."""

from __future__ import annotations

from typing import Any

SHM_NEARLY_FULL_PERCENT = 95.0
LOW_NOFILE = 4096


def environment_findings(snapshot: dict[str, Any]) -> list[str]:
    """What in the snapshot deserves attention, in words (pure)."""
    out: list[str] = []
    shm = (snapshot.get("disks") or {}).get("dev_shm") or {}
    if isinstance(shm.get("used_percent"), int | float) and shm["used_percent"] >= SHM_NEARLY_FULL_PERCENT:
        out.append(f"/dev/shm is {shm['used_percent']:.0f}% full ({shm['free_bytes'] / 2**20:.0f} MiB free): "
                   "dataloader workers and NCCL's shared-memory transport fail when it fills")  # fmt: skip
    for name in ("workdir", "checkpoint_dir"):
        disk = (snapshot.get("disks") or {}).get(name) or {}
        if isinstance(disk.get("used_percent"), int | float) and disk["used_percent"] >= 98.0:
            out.append(f"the {name.replace('_', ' ')} {disk['path']} is {disk['used_percent']:.0f}% full")
    for gpu in snapshot.get("gpus") or []:
        if gpu.get("ecc_uncorrected"):
            out.append(f"GPU {gpu.get('index')} ({gpu.get('name')}) has {gpu['ecc_uncorrected']} uncorrected ECC "
                       "error(s) since the driver loaded: drain the node and run the vendor's diagnostics")  # fmt: skip
    nofile = ((snapshot.get("ulimits") or {}).get("nofile") or {}).get("soft")
    if isinstance(nofile, int) and nofile < LOW_NOFILE:
        out.append(f"ulimit -n (nofile) is {nofile}: many ranks, dataloader workers and NCCL sockets need more "
                   "(raise it to 65536 or more)")  # fmt: skip
    memlock = ((snapshot.get("ulimits") or {}).get("memlock") or {}).get("soft")
    if isinstance(memlock, int) and memlock < 64 * 2**20 and (snapshot.get("infiniband") or snapshot.get("gpus")):
        out.append(f"ulimit -l (memlock) is {memlock // 1024} KiB: InfiniBand / GPUDirect RDMA needs it unlimited")
    for port in snapshot.get("infiniband") or []:
        if port.get("state") and "Active" not in port["state"]:
            out.append(f"InfiniBand {port['ca']} port {port['port']} is {port['state']}")
    return out

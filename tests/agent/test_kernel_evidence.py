"""An OOM kill is proven by the kernel, never guessed (issue 16): a rank moves itself into a memory
cgroup the test made with a low limit and allocates until the kernel's OOM killer SIGKILLs it. The
report says host_oom with the kernel's own line and the cgroup's limit. A plain kill -9 stays
`killed` and says what was looked at (tests/launch/test_launcher_matrix.py, the sigkill case)."""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path

import pytest
from helpers import ROOT, launch, torchrun_diag

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

LIMIT = 96 * 2**20


def _memory_cgroup() -> tuple[Path, str]:
    """A fresh memory cgroup with LIMIT (v1 where mounted, else v2): its folder and its limit file."""
    name = f"elastic_diag_test_{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        folder, limit_file = v1 / name, "memory.limit_in_bytes"
    elif Path("/sys/fs/cgroup/cgroup.controllers").exists() and "memory" in Path(
            "/sys/fs/cgroup/cgroup.subtree_control").read_text():  # fmt: skip
        folder, limit_file = Path("/sys/fs/cgroup") / name, "memory.max"
    else:
        pytest.skip("no writable memory cgroup here (neither v1's memory controller nor v2 with memory delegated)")
    try:
        folder.mkdir()
        (folder / limit_file).write_text(str(LIMIT))
        with contextlib.suppress(OSError):
            (folder / "memory.swappiness").write_text("0")  # v1: reclaim by killing, not by swapping
    except OSError as e:
        with contextlib.suppress(OSError):
            folder.rmdir()
        pytest.skip(f"cannot make a memory cgroup with a limit here ({e.strerror}): needs root")
    return folder, limit_file


def _remove(folder: Path) -> None:
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:
        try:
            folder.rmdir()
        except OSError:  # still has a task (a worker not yet reaped): kill what is left, retry
            for pid in (folder / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    import os
                    import signal

                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.1)


def test_an_oom_kill_in_a_memory_cgroup_is_proven_by_the_kernel(tmp_path):
    folder, _ = _memory_cgroup()
    try:
        argv = torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-dir", str(tmp_path),
                             str(ROOT / "tests" / "scenarios" / "oom_in_cgroup.py"))  # fmt: skip
        run = launch(argv, tmp_path, env={"SCENARIO_MEMORY_CGROUP": str(folder)})
    finally:
        _remove(folder)
    assert not folder.exists()
    d = run.report["diagnosis"]
    assert (d["initiating_rank"], d["failure_class"], d["signature_id"]) == (1, "host_oom", "host-oom-kill"), d
    culprit = run.rank(1)
    assert culprit["exit_code"] == -9 and culprit["kernel"]["proven"] is True, culprit.get("kernel")
    line = culprit["kernel"]["kernel_line"]
    assert line and f"Killed process {culprit['pid']} " in line  # the kernel's own words, this rank's pid
    assert line in d["evidence"][0] or d["evidence"][0] in line, d["evidence"]
    cgroup = culprit["kernel"]["cgroup"]
    assert cgroup["path"].endswith(folder.name) and cgroup["limit_bytes"] == LIMIT, cgroup
    assert "killed by the kernel's OOM killer (proven:" in d["summary"]
    assert run.rank(0)["role"] in ("collateral", "stopped")

"""The environment snapshot of a failed attempt (issue 16): every source timed and bounded, a tool that
hangs killed at its share of the 2 s budget, a 10 MB variable cut, secrets masked; and the warnings the
core draws from it. nvidia-smi and ibstat are played by small scripts on PATH that print what the real
ones print (their --query-gpu CSV and ibstat's port blocks)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from elastic_diag.agent.environment import MAX_VALUE_CHARS, take_snapshot
from elastic_diag.core.environment import environment_findings

NVIDIA_SMI = """#!/bin/sh
echo "0, NVIDIA H100 80GB HBM3, 71234, 81559, 0, 41"
echo "1, NVIDIA H100 80GB HBM3, 70998, 81559, 2, 44"
"""
IBSTAT = """#!/bin/sh
cat <<'OUT'
CA 'mlx5_0'
	CA type: MT4123
	Number of ports: 1
	Port 1:
		State: Active
		Physical state: LinkUp
		Rate: 200
CA 'mlx5_1'
	CA type: MT4123
	Number of ports: 1
	Port 1:
		State: Down
		Physical state: Disabled
		Rate: 10
OUT
"""


def _tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(body)
    path.chmod(0o755)


def test_the_snapshot_with_gpus_and_infiniband(tmp_path, monkeypatch):
    _tool(tmp_path, "nvidia-smi", NVIDIA_SMI)
    _tool(tmp_path, "ibstat", IBSTAT)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NCCL_IB_HCA", "x" * (10 * 2**20))  # a 10 MB variable
    monkeypatch.setenv("TORCH_HUB_TOKEN", "hf_secret_value_1234")
    snap = take_snapshot(tmp_path, tmp_path)
    assert all("error" not in s and "skipped" not in s for s in snap["sources"].values()), snap["sources"]
    assert [g["ecc_uncorrected"] for g in snap["gpus"]] == [0, 2] and snap["gpus"][0]["memory_total_mib"] == 81559
    assert [(p["ca"], p["state"]) for p in snap["infiniband"]] == [("mlx5_0", "Active"), ("mlx5_1", "Down")]
    assert snap["variables"]["NCCL_DEBUG"] == "WARN" and len(snap["variables"]["NCCL_IB_HCA"]) == MAX_VALUE_CHARS
    assert snap["variables"]["TORCH_HUB_TOKEN"] == "***"
    assert snap["disks"]["checkpoint_dir"]["path"] == str(tmp_path) and "dev_shm" in snap["disks"]
    assert snap["ulimits"]["nofile"]["soft"] is None or snap["ulimits"]["nofile"]["soft"] > 0
    findings = environment_findings(snap)
    assert any("GPU 1 (NVIDIA H100 80GB HBM3) has 2 uncorrected ECC" in f for f in findings), findings
    assert any("InfiniBand mlx5_1 port 1 is Down" in f for f in findings), findings


def test_a_tool_that_hangs_is_bounded_and_reported(tmp_path, monkeypatch):
    _tool(tmp_path, "nvidia-smi", "#!/bin/sh\nsleep 30\n")  # a GPU in a bad state: nvidia-smi never returns
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    snap = take_snapshot(tmp_path, None)
    assert time.monotonic() - started < 2.5
    assert "TimeoutExpired" in snap["sources"]["gpus"]["error"] and "gpus" not in snap
    assert snap["sources"]["infiniband"] == {"skipped": "ibstat is not on PATH"}
    assert "memory" in snap and "checkpoint_dir" not in snap["disks"]

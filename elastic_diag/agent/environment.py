"""The environment of a failed attempt, taken once at its first failure: ``attempt_N/environment.json``.

What a person asks first on a failure: which torch, CUDA, NCCL and Python; how much host memory and
swap is left; how full the working dir, the checkpoint dir and /dev/shm are; the ulimits that break
NCCL and dataloaders (``nofile``, ``memlock``); the ``NCCL_*`` / ``TORCH_*`` / ``CUDA_*`` / ``PET_*``
settings; and, where the tools exist, the GPUs (``nvidia-smi``: name, memory, ECC errors,
temperature) and the InfiniBand ports (``ibstat``).

Every source is timed and bounded: the whole snapshot gets :data:`BUDGET_S`, a command that hangs
is killed at its share, and a source that fails is recorded with its error. Values of secret-named
variables are masked (:mod:`elastic_diag.redaction`). :func:`elastic_diag.core.environment.environment_findings`
turns the snapshot into warnings.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_diag import redaction

BUDGET_S = 2.0
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "PET_", "TORCHELASTIC_", "OMP_", "GLOO_")
MAX_VARS = 400
MAX_VALUE_CHARS = 2048
NVIDIA_SMI_QUERY = "index,name,memory.used,memory.total,ecc.errors.uncorrected.volatile.total,temperature.gpu"


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree", "Shmem"):
            out[name] = int(rest.split()[0]) * 1024
    return out


def _disks(paths: dict[str, Path | None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, path in paths.items():
        if path is None:
            continue
        try:
            usage = shutil.disk_usage(path)
            used = round(100 * (usage.total - usage.free) / usage.total, 1) if usage.total else None
            out[name] = {"path": str(path), "total_bytes": usage.total, "free_bytes": usage.free, "used_percent": used}
        except OSError as e:
            out[name] = {"path": str(path), "error": e.strerror or str(e)}
    return out


def _ulimits() -> dict[str, Any]:
    def limit(which: int) -> dict[str, int | None]:
        soft, hard = resource.getrlimit(which)
        inf = resource.RLIM_INFINITY
        return {"soft": None if soft == inf else soft, "hard": None if hard == inf else hard}

    return {"nofile": limit(resource.RLIMIT_NOFILE), "memlock": limit(resource.RLIMIT_MEMLOCK)}


def _variables() -> dict[str, str]:
    names = sorted(k for k in os.environ if k.startswith(ENV_PREFIXES))[:MAX_VARS]
    return redaction.redact_env({k: os.environ[k][:MAX_VALUE_CHARS] for k in names})


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    torch: Any = sys.modules.get("torch")  # the agent has it loaded; importing it here would cost seconds
    if torch is None:
        out["torch"] = None
        return out
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cuda_available"] = bool(torch.cuda.is_available())
    try:
        nccl = torch.cuda.nccl.version() if out["cuda_available"] else None
        out["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else nccl
    except Exception as e:  # a CPU build: no NCCL
        out["nccl"] = None
        out["nccl_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def _build_flags() -> dict[str, str]:
    """``torch.__config__.show()``'s "Build settings" line, in short: the flags that matter here."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return {}
    text = torch.__config__.show()
    keep = ("BUILD_TYPE", "CUDA_VERSION", "CUDNN_VERSION", "USE_CUDA", "USE_NCCL", "USE_GLOO", "USE_MPI",
            "USE_ROCM", "TORCH_VERSION", "CXX_COMPILER", "USE_CUDNN")  # fmt: skip
    flags: dict[str, str] = {}
    for part in text.replace("\n", ",").split(","):
        key, eq, value = part.strip().partition("=")
        if eq and key in keep:
            flags[key] = value.strip()[:200]
    return flags


def _command(argv: list[str], timeout: float) -> str:
    # a minimal environment: the job's may be too big to exec with (one 10 MB variable: E2BIG)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=max(0.1, timeout))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):  # the tool and whatever it started: nothing is left running
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(err or out).strip()[:300]}")
    return out[: 64 * 1024]


def _gpus(timeout: float) -> list[dict[str, Any]]:
    exe = shutil.which("nvidia-smi")
    assert exe is not None
    text = _command([exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"], timeout)
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 6:
            continue

        def num(s: str) -> int | None:
            return int(s) if s.isdigit() else None

        gpus.append({"index": num(cells[0]), "name": cells[1], "memory_used_mib": num(cells[2]),
                     "memory_total_mib": num(cells[3]), "ecc_uncorrected": num(cells[4]),
                     "temperature_c": num(cells[5])})  # fmt: skip
    return gpus


def _ib_ports(timeout: float) -> list[dict[str, str]]:
    exe = shutil.which("ibstat")
    assert exe is not None
    ports: list[dict[str, str]] = []
    ca = port = None
    for line in _command([exe], timeout).splitlines():
        s = line.strip()
        if s.startswith("CA '"):
            ca = s[4:].rstrip("'")
        elif s.startswith("Port ") and s.endswith(":"):
            port = s[5:-1]
        elif s.startswith(("State:", "Physical state:", "Rate:")) and ca and port:
            key, _, value = s.partition(":")
            entry = next((p for p in ports if p["ca"] == ca and p["port"] == port), None)
            if entry is None:
                entry = {"ca": ca, "port": port}
                ports.append(entry)
            entry[key.lower().replace(" ", "_")] = value.strip()
    return ports


def take_snapshot(workdir: Path, checkpoint_dir: Path | None, budget_s: float = BUDGET_S,
                  clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:  # fmt: skip
    """Every source in turn, each with what it cost; the rest skipped once the budget is spent."""
    started = clock()
    deadline = started + budget_s
    sources: dict[str, Any] = {}
    snapshot: dict[str, Any] = {"taken_at": time.time(), "budget_s": budget_s, "sources": sources}

    def source(name: str, fn: Callable[[], Any], needs: str | None = None) -> None:
        if needs is not None and shutil.which(needs) is None:
            sources[name] = {"skipped": f"{needs} is not on PATH"}
            return
        if clock() >= deadline:
            sources[name] = {"skipped": f"the snapshot's {budget_s:g} s budget was spent"}
            return
        t0 = clock()
        try:
            snapshot[name] = fn()
            sources[name] = {"ms": round((clock() - t0) * 1000, 1)}
        except Exception as e:
            sources[name] = {"ms": round((clock() - t0) * 1000, 1), "error": f"{type(e).__name__}: {e}"[:300]}

    def share() -> float:  # a command's timeout: what is left, at most 1 s
        return min(1.0, max(0.1, deadline - clock()))

    # the cheap ones first: a slow command cannot crowd them out of the budget
    source("memory", _meminfo)
    source("disks", lambda: _disks({"workdir": workdir, "checkpoint_dir": checkpoint_dir, "dev_shm": Path("/dev/shm")}))
    source("ulimits", _ulimits)
    source("variables", _variables)
    source("versions", _versions)
    source("build", _build_flags)
    source("gpus", lambda: _gpus(share()), needs="nvidia-smi")
    source("infiniband", lambda: _ib_ports(share()), needs="ibstat")
    snapshot["took_ms"] = round((clock() - started) * 1000, 1)
    return snapshot

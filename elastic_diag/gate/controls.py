"""The verification controls of the restart gate: each runs in a subprocess with a deadline and retries
(tenacity), its output kept in ``<diag-dir>/attempt_N/gate/``. Built-ins: ``collective`` (a 2-rank gloo
all_reduce), ``checkpoint`` (the newest checkpoint loads), ``disk`` (free space where the checkpoints go),
``signature`` (the failure's signature is absent from the controls' output); anything else is the user's
command.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenacity import RetryError, Retrying, retry_if_result, stop_after_attempt, stop_after_delay, wait_exponential

from elastic_diag.layout import latest_checkpoint
from elastic_diag.report.terminal import Progress

BUILTIN_CONTROLS = ("collective", "checkpoint", "disk", "signature")


OUTPUT_LIMIT = 64 * 1024


MIN_FREE_BYTES = 1 << 30


@dataclass(slots=True)
class ControlResult:
    name: str
    passed: bool
    summary: str
    output: str = ""
    seconds: float = 0.0
    tries: int = 1

    def to_json(self, output_file: str | None = None) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "summary": self.summary, "seconds": round(self.seconds, 3),
                "tries": self.tries, "output_file": output_file, "output_tail": self.output[-2000:]}  # fmt: skip


@dataclass(slots=True)
class ControlContext:
    nproc: int
    out_dir: Path
    checkpoint_dir: Path | None = None
    timeout_s: float = 120.0
    retries: int = 2
    signature_patterns: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def checkpoint_identity(folder: Path | None) -> str | None:
    path = latest_checkpoint(folder)
    if path is None:
        return None
    try:
        return f"{path}@{path.stat().st_mtime_ns}"
    except OSError:
        return None


def _run(argv: list[str] | str, ctx: ControlContext, *, shell: bool = False) -> tuple[int | None, str]:
    """Run a command with the control's deadline; (exit code or None on timeout, output)."""
    try:
        proc = subprocess.run(argv, shell=shell, capture_output=True, text=True, errors="replace",
                              timeout=ctx.timeout_s, env={**os.environ, **ctx.env}, check=False,
                              start_new_session=True)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out[-OUTPUT_LIMIT:] + f"\n[elastic_diag: killed after the {ctx.timeout_s:.0f} s deadline]"
    except OSError as e:
        return 127, f"cannot run {argv!r}: {e.strerror or e}"
    return proc.returncode, ((proc.stdout or "") + (proc.stderr or ""))[-OUTPUT_LIMIT:]


_COLLECTIVE_SCRIPT = """
import datetime, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ["ELASTIC_DIAG_CONTROL_TIMEOUT"])))
t = torch.ones(1024)
dist.all_reduce(t)
dist.barrier()
assert t[0].item() == dist.get_world_size(), t[0].item()
print(f"rank {dist.get_rank()}: all_reduce and barrier ok", flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def control_collective(ctx: ControlContext) -> ControlResult:
    """A short all-ranks all_reduce + barrier (gloo), as many ranks as the job has on this node."""
    port = _free_port()
    procs = []
    deadline = time.monotonic() + ctx.timeout_s
    for rank in range(ctx.nproc):
        env = {**os.environ, **ctx.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(ctx.nproc), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
               "ELASTIC_DIAG_CONTROL_TIMEOUT": str(max(5.0, ctx.timeout_s - 5))}  # fmt: skip
        procs.append(
            subprocess.Popen([sys.executable, "-c", _COLLECTIVE_SCRIPT], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        )  # fmt: skip
    outputs, codes = [], []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            codes.append(None)
        outputs.append(f"--- control rank {rank} (exit {codes[-1]}) ---\n{out[-OUTPUT_LIMIT // ctx.nproc :]}")
    ok = all(c == 0 for c in codes)
    summary = (f"all_reduce + barrier over {ctx.nproc} rank(s): ok" if ok
               else f"all_reduce + barrier over {ctx.nproc} rank(s) failed (exit codes {codes})")  # fmt: skip
    return ControlResult("collective", ok, summary, "\n".join(outputs))


_CHECKPOINT_SCRIPT = """
import os, sys, torch
path = sys.argv[1]
if os.path.isdir(path):
    if os.path.exists(os.path.join(path, ".metadata")):
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader(path).read_metadata()
        print(f"DCP checkpoint: {len(md.state_dict_metadata)} entries")
    else:
        files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
        if not files:
            sys.exit("the checkpoint folder is empty")
        for f in files:
            if f.endswith((".pt", ".pth", ".bin")):
                torch.load(f, map_location="cpu", weights_only=True)
        print(f"checkpoint folder: {len(files)} file(s) readable")
elif path.endswith((".pt", ".pth", ".bin", ".ckpt")):
    obj = torch.load(path, map_location="cpu", weights_only=True)
    print(f"torch.save checkpoint: {type(obj).__name__} loaded")
else:
    with open(path, "rb") as fp:
        n = len(fp.read(1 << 20))
    print(f"checkpoint file readable ({n} bytes read)")
"""


def control_checkpoint(ctx: ControlContext) -> ControlResult:
    latest = latest_checkpoint(ctx.checkpoint_dir)
    if ctx.checkpoint_dir is None:
        return ControlResult("checkpoint", False, "no --diag-checkpoint-dir given: nothing to check")
    if latest is None:
        return ControlResult("checkpoint", False, f"no checkpoint under {ctx.checkpoint_dir}")
    if latest.is_file() and latest.stat().st_size == 0:
        return ControlResult("checkpoint", False, f"the latest checkpoint {latest} is empty (a partial write?)")
    code, out = _run([sys.executable, "-c", _CHECKPOINT_SCRIPT, str(latest)], ctx)
    ok = code == 0
    return ControlResult("checkpoint", ok, f"latest checkpoint {latest}: {'loadable' if ok else 'NOT loadable'}", out)


def control_disk(ctx: ControlContext) -> ControlResult:
    folder = ctx.checkpoint_dir or ctx.out_dir
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".elastic_diag_probe_{os.getpid()}"
        with open(probe, "wb") as fp:
            fp.write(b"\0" * 4096)
            fp.flush()
            os.fsync(fp.fileno())
        probe.unlink()
        free = shutil.disk_usage(folder).free
    except OSError as e:
        return ControlResult("disk", False, f"{folder} is not writable: {e.strerror or e}")
    latest = latest_checkpoint(ctx.checkpoint_dir)
    need = MIN_FREE_BYTES
    if latest is not None and latest.is_file():
        need = max(need, int(latest.stat().st_size * 1.1))
    ok = free >= need
    return ControlResult("disk", ok, f"{folder}: writable, {free / 2**30:.1f} GiB free (need {need / 2**30:.1f} GiB)")


def control_command(command: str, ctx: ControlContext) -> ControlResult:
    """The user's command (``--diag-verify``), bounded as ``elastic-diag verify`` runs one (gate/rerun.py):
    its process group killed at the deadline, its output bounded in memory."""
    from elastic_diag.gate.rerun import run_command

    run = run_command(command, timeout_s=ctx.timeout_s, log_path=None, env=ctx.env)  # the gate writes the output
    out = (run.head if run.output_bytes <= len(run.head.encode()) else run.head[:OUTPUT_LIMIT // 2] + "\n...\n"
           + run.tail[-OUTPUT_LIMIT // 2 :])  # fmt: skip
    if run.timed_out:
        return ControlResult(command, False, f"did not finish within {ctx.timeout_s:.0f} s", out)
    if run.exit_code == 127 and ("not found" in out or "cannot run" in out):
        return ControlResult(command, False, f"command not found (exit 127): {out.strip()[-300:]}", out)
    return ControlResult(command, run.exit_code == 0, f"exit status {run.exit_code}", out)


def run_control(spec: str, ctx: ControlContext) -> ControlResult:
    """One control with retries and exponential backoff, all within its deadline (tenacity)."""
    fn = CONTROLS.get(spec)
    started = time.monotonic()
    tries = 0

    def once() -> ControlResult:
        nonlocal tries
        tries += 1
        try:
            return fn(ctx) if fn is not None else control_command(spec, ctx)
        except Exception as e:  # a control that crashes fails; it never takes the agent down
            return ControlResult(spec, False, f"the control raised {type(e).__name__}: {e}")

    retrying = Retrying(
        stop=stop_after_attempt(max(1, ctx.retries + 1)) | stop_after_delay(ctx.timeout_s),
        wait=wait_exponential(multiplier=0.5, max=10),
        retry=retry_if_result(lambda r: not r.passed),
        reraise=True,
    )
    try:
        result: ControlResult = retrying(once)
    except RetryError as e:
        result = e.last_attempt.result()
    result.seconds = time.monotonic() - started
    result.tries = tries
    return result


def default_controls(checkpoint_dir: Path | None) -> list[str]:
    return ["collective", *(["checkpoint", "disk"] if checkpoint_dir is not None else [])]


def verify(specs: Sequence[str], ctx: ControlContext) -> list[ControlResult]:
    """Run the controls in order; stop at the first that fails. ``signature`` checks the other
    controls' output for the failure's signature lines (it must be absent). A terminal sees a progress
    line while each control runs."""
    results: list[ControlResult] = []
    for spec in specs:
        if spec == "signature":
            continue
        with Progress(f"elastic_diag: verification control {spec!r} before a restart"):
            result = run_control(spec, ctx)
        results.append(result)
        if not result.passed:
            return results
    if "signature" in specs:
        results.append(check_signature_absent(results, ctx))
    return results


def check_signature_absent(results: Sequence[ControlResult], ctx: ControlContext) -> ControlResult:
    """The same judgement as ``elastic-diag verify`` (core/verification.signature_line): no line of the
    commands' output matches the failure's signature."""
    from elastic_diag.core.verification import signature_line

    if not ctx.signature_patterns:
        return ControlResult("signature", True, "the failure has no signature lines to look for")
    ran = [r for r in results if r.name not in CONTROLS]
    if not ran:
        return ControlResult("signature", False, "needs a --diag-verify command that re-runs the failing input")
    for r in ran:
        line = signature_line(ctx.signature_patterns, r.output)
        if line is not None:
            return ControlResult("signature", False, f"the failure's signature is still in {r.name!r}'s output: "
                                                     f"{line[:200]}")  # fmt: skip
    return ControlResult("signature", True, "the failure's signature is absent from the re-run")


CONTROLS: dict[str, Callable[[ControlContext], ControlResult]] = {
    "collective": control_collective,
    "checkpoint": control_checkpoint,
    "disk": control_disk,
}

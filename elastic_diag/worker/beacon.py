"""Worker side of the health monitor: a progress beacon and a dump responder in every rank.

Started by the worker bootstrap (no change to the training script). A daemon thread wakes every
``ELASTIC_DIAG_PROGRESS_INTERVAL`` seconds (the launcher sets it: 2 s, less under a short threshold the
user set; see ``DiagConfig.progress_interval_s``), or at once when the agent sends a byte to its wake-up
socket (:func:`elastic_diag.layout.wake_address`, after a dump request), and:

* writes ``progress.json`` in the rank's evidence folder: optimizer steps (a global optimizer
  step hook) and the durations of the last ones, ``loss.backward()`` calls, explicit
  :func:`elastic_diag.heartbeat` calls, the open :func:`elastic_diag.watch` section, and the
  process groups' sequence numbers from the flight recorder (``last_enqueued`` /
  ``last_completed``: 5 us to read). The agent's health monitor reads these files;
* answers a dump request from the agent (a ``dump.request`` file): all threads' stacks
  (faulthandler, into ``stacks.txt``) and the flight recorder's entries (``fr_trace.json``), then
  ``dump.done``. A Python thread runs while the main thread is blocked in a C++ collective, on a
  lock or in a Python loop (the GIL is released or switched every 5 ms); a rank that never lets it
  run is dumped by the agent's faulthandler signal instead.

The flight recorder is also written when the rank dies of an uncaught exception and when it exits
(torch's JSON as it comes: about 80 ms of CPU for 2,000 entries, 1 MB). The first ``loss.backward()`` on a
non-finite scalar is recorded in ``nonfinite.json`` (checked one step late, so a GPU loss costs no
extra synchronisation). ``ELASTIC_DIAG_NO_TORCH_HOOKS=1`` turns the optimizer and backward hooks off.

Standard library only at import; torch is looked at only once the script has imported it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastic_diag.layout import (
    CALLS_FILE,
    DUMP_DONE_FILE,
    DUMP_REQUEST_FILE,
    ENV_BEACON,
    ENV_NO_TORCH_HOOKS,
    ENV_PROGRESS_INTERVAL,
    FR_FILE,
    FR_MAX_BYTES,
    NONFINITE_FILE,
    PROGRESS_FILE,
    wake_address,
    write_atomic,
)
from elastic_diag.worker import calls

ENV_INTERVAL = ENV_PROGRESS_INTERVAL
DEFAULT_INTERVAL_S = 2.0  # without the launcher's setting (the bootstrap installed by hand)
NO_WAKE_INTERVAL_S = 0.5  # the tick when no wake-up socket can be bound: a dump request is read within it
STEP_HISTORY = 32


class Beacon:
    """The rank's progress counters and the thread that publishes them."""

    def __init__(self, rank_dir: str, interval: float, stacks_file: Any) -> None:
        self.rank_dir = rank_dir
        self.interval = interval
        self.stacks_file = stacks_file
        self.lock = threading.Lock()
        self.steps = 0
        self.step_durations: deque[float] = deque(maxlen=STEP_HISTORY)
        self.last_step: float | None = None
        self.progress_time: float | None = None  # wall clock of the last step, backward or heartbeat
        self.backward = 0
        self.heartbeats = 0
        self.watch: list[Any] | None = None  # [name, started, timeout]
        self.pending_loss: tuple[int, float, Any, str] | None = None
        self.nonfinite_written = False
        self.hooks_installed = False
        self.distributed_seen = False
        self.final_dump: str | None = None
        self.calls_installed = False  # the root and peer of each collective call (worker/calls.py)
        self.step_hook: Any = None  # the optimizer hook's handle
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="elastic-diag-beacon", daemon=True)
        self.thread_cpu_s = 0.0  # the beacon thread's own CPU time so far
        self.wake_socket: Any = None  # the socket the thread waits on (None: it only sleeps)
        self.wake_fd: int | None = None

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> None:
        self.wake_socket = _open_wake(wake_address(self.rank_dir))
        self.wake_fd = self.wake_socket.fileno() if self.wake_socket is not None else None
        if self.wake_fd is None:  # no socket (not Linux, or the name taken): a request waits for a tick, so tick often
            self.interval = min(self.interval, NO_WAKE_INTERVAL_S)
        self.thread.start()

    def _wait(self) -> bool:
        """Sleep one interval, or less if the agent wakes the thread (a dump request); True: stop."""
        fd = self.wake_fd
        if fd is None:
            return self.stop.wait(self.interval)
        try:
            ready, _, _ = select.select([fd], [], [], self.interval)
        except (OSError, ValueError):  # the descriptor is no longer valid: plain sleeps from now on
            self.wake_fd = None
            return self.stop.is_set()
        if ready:
            with contextlib.suppress(OSError):  # drained: one wake-up however many requests were sent
                for _ in range(64):
                    self.wake_socket.recv(16)
        return self.stop.is_set()

    def close_wake(self) -> None:
        """The wake-up socket closed (the kernel closes it too, for a rank that was killed)."""
        sock, self.wake_socket, self.wake_fd = self.wake_socket, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _run(self) -> None:
        failures = 0
        while not self._wait():
            try:
                self.tick()
                failures = 0
            except Exception as e:  # never break the rank; a passing error (an import under way) is retried
                failures += 1
                if failures == 20:
                    print(f"elastic_diag: progress beacon stopped after 20 failed ticks: {e!r}", file=sys.stderr)
                    return

    def tick(self) -> None:
        if threading.current_thread() is self.thread:
            self.thread_cpu_s = time.thread_time()
        if not self.hooks_installed and "torch" in sys.modules:
            self._install_torch_hooks()
        if not self.calls_installed and "torch.distributed" in sys.modules:
            # the bootstrap's import hook installs them first; this is for a beacon started by hand
            self.calls_installed = os.environ.get(ENV_NO_TORCH_HOOKS, "") not in ("", "0") or calls.install()
        request = os.path.join(self.rank_dir, DUMP_REQUEST_FILE)
        if os.path.exists(request):
            self._answer_dump(request)
        self._write(PROGRESS_FILE, self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            data: dict[str, Any] = {
                "time": time.time(),
                "pid": os.getpid(),
                "steps": self.steps,
                "progress_time": self.progress_time,
                "step_durations": list(self.step_durations),
                "backward": self.backward,
                "heartbeats": self.heartbeats,
                "watch": self.watch,
                "beacon_cpu_s": round(self.thread_cpu_s, 4),
            }
        data["pg_status"] = pg_status()
        if data["pg_status"]:
            self.distributed_seen = True
        return data

    # -- dumps -------------------------------------------------------------------------------------
    def _answer_dump(self, request: str) -> None:
        try:
            with open(request) as fp:
                request_id = fp.read().strip()
            os.unlink(request)
        except OSError:
            return
        try:
            self.stacks_file.write(f"\n--- elastic_diag dump {request_id} at {time.time():.6f} ---\n")
            self.stacks_file.flush()
            faulthandler.dump_traceback(file=self.stacks_file, all_threads=True)
            self.stacks_file.flush()
        except (OSError, ValueError):
            pass
        # the reason says who asked: hang-request, stall-request, failure-request, stop-request
        self.dump_flight_recorder(f"{request_id.split('-', 1)[0]}-request")
        self._write(DUMP_DONE_FILE, {"id": request_id, "time": time.time()})

    def dump_flight_recorder(self, reason: str) -> None:
        """The flight recorder's entries into ``fr_trace.json`` (the last dump wins), torch's JSON as it comes:
        parsed and written again, 2,000 entries (1 MB) cost 300 ms of the rank's CPU, as it is 80 ms (measured
        with python benchmarks/stall.py snapshot-cost)."""
        if calls.installed():
            recorded = calls.snapshot()
            if recorded["calls"] or recorded["new_groups"]:
                self._write(CALLS_FILE, {"reason": reason, "time": time.time(), **recorded})
        raw = fr_trace_json()
        if raw is None or len(raw) > FR_MAX_BYTES:
            return
        if b'"collective_seq_id"' not in raw and b'"last_enqueued_collective"' not in raw:
            return  # no collective recorded: nothing to say
        head = json.dumps({"reason": reason, "time": time.time(), "pid": os.getpid()})
        self._write_bytes(FR_FILE, head[:-1].encode() + b', "trace": ' + raw + b"}")

    def at_exit(self, reason: str) -> None:
        """On an uncaught exception (from the excepthook) and at interpreter exit (atexit); the
        exception's dump is kept."""
        self.check_pending_loss()
        if reason == "exit" and self.thread.ident is not None:  # the beacon ran
            # the health monitor stops watching a rank that is on its way out (interpreter teardown with
            # torch can take seconds, and its last snapshot may be from inside the final collective)
            self._write(PROGRESS_FILE, {**self.snapshot(), "exiting": True})
        if self.final_dump is None and (self.distributed_seen or pg_status() or calls.recorded()):
            self.final_dump = reason
            self.dump_flight_recorder(reason)

    # -- hooks -------------------------------------------------------------------------------------
    def _install_torch_hooks(self) -> None:
        self.hooks_installed = True
        if os.environ.get(ENV_NO_TORCH_HOOKS, "") not in ("", "0"):
            return
        torch = sys.modules["torch"]
        optim = sys.modules.get("torch.optim.optimizer")
        register = getattr(optim, "register_optimizer_step_post_hook", None)
        if register is None or getattr(torch, "Tensor", None) is None or not hasattr(torch, "autograd"):
            self.hooks_installed = False  # torch is still being imported (by the main thread): next tick
            return
        self.step_hook = register(self._on_step)
        original = torch.Tensor.backward
        beacon = self

        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            beacon.on_backward(tensor)
            return original(tensor, *args, **kwargs)

        backward.__doc__ = original.__doc__
        backward.__wrapped__ = original  # type: ignore[attr-defined]
        torch.Tensor.backward = backward

    def _on_step(self, *_: Any) -> None:
        now = time.monotonic()
        with self.lock:
            if self.last_step is not None:
                self.step_durations.append(now - self.last_step)
            self.last_step = now
            self.steps += 1
            self.progress_time = time.time()

    def on_backward(self, tensor: Any) -> None:
        with self.lock:
            self.backward += 1
            self.progress_time = time.time()
            count = self.backward
        try:
            if tensor.numel() != 1 or not tensor.is_floating_point():
                return
            self.check_pending_loss()  # the previous step's flag: long computed by now
            if self.nonfinite_written:
                return
            frame = sys._getframe(2)
            if tensor.device.type == "cpu":  # a CPU scalar: read it now (a few us)
                if not math.isfinite(tensor.item()):
                    self.pending_loss = (count, time.time(), False, _where(frame))
                    self.check_pending_loss()
                return
            # on a device: keep the flag and read it one step later, when it is long computed
            self.pending_loss = (count, time.time(), tensor.detach().isfinite(), _where(frame))
        except Exception:
            return

    def check_pending_loss(self) -> None:
        pending, self.pending_loss = self.pending_loss, None
        if pending is None or self.nonfinite_written:
            return
        count, when, flag, where = pending
        try:
            finite = bool(flag)
        except Exception:
            return
        if not finite:
            self.nonfinite_written = True
            self._write(NONFINITE_FILE, {"what": "loss", "backward": count, "step": self.steps, "time": when,
                                         "where": where})  # fmt: skip

    # -- files -------------------------------------------------------------------------------------
    def _write(self, name: str, data: dict[str, Any]) -> None:
        try:
            text = json.dumps(data)
        except (TypeError, ValueError):
            return
        self._write_bytes(name, text.encode())

    def _write_bytes(self, name: str, data: bytes) -> None:
        # numbers and the flight recorder's entries: no secret to mask, and the tick stays cheap
        with contextlib.suppress(OSError):
            write_atomic(Path(self.rank_dir) / name, data, redact=False)


def _open_wake(address: bytes) -> Any:
    """The beacon's wake-up socket, bound and not blocking; None where it cannot be (no abstract namespace
    outside Linux, or the name already taken: the thread then only sleeps). ``_socket``, not ``socket``: a
    tenth of the import time, in every rank before its script starts."""
    try:
        import _socket

        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
    except (ImportError, AttributeError, OSError):
        return None
    try:
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        return None
    return sock


def _where(frame: Any) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _distributed() -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not getattr(dist, "is_available", lambda: False)():
        return None
    return dist


def pg_status() -> dict[str, Any]:
    """Per process group: last enqueued / started / completed collective sequence numbers."""
    if _distributed() is None:
        return {}
    try:
        c10d = sys.modules["torch"]._C._distributed_c10d
        raw = c10d._dump_fr_trace_json(includeCollectives=False)
        status = json.loads(raw).get("pg_status") or {}
        return status if isinstance(status, dict) else {}
    except Exception:
        return {}


def fr_trace_json() -> bytes | None:
    if _distributed() is None:
        return None
    try:
        raw = sys.modules["torch"]._C._distributed_c10d._dump_fr_trace_json()
    except Exception:
        return None
    return raw.encode() if isinstance(raw, str) else bytes(raw)


# -- the public API (elastic_diag.heartbeat / elastic_diag.watch) -------------------------------------
_beacon: Beacon | None = None


def start(rank_dir: str, stacks_file: Any) -> Beacon:
    """The rank's beacon; its thread and hooks only when ``ELASTIC_DIAG_BEACON`` is not ``0`` (the
    launcher sets 0 when both the hang and the stall monitor are off; the flight recorder is still written at
    exit)."""
    global _beacon
    try:
        interval = float(os.environ.get(ENV_INTERVAL, "") or DEFAULT_INTERVAL_S)
    except ValueError:
        interval = DEFAULT_INTERVAL_S
    _beacon = Beacon(rank_dir, max(0.05, interval), stacks_file)
    if os.environ.get(ENV_BEACON, "1") != "0":
        _beacon.start()
    return _beacon


def current() -> Beacon | None:
    return _beacon


def heartbeat() -> None:
    """Tell the health monitor this rank is making progress (a no-op outside elastic_diag)."""
    b = _beacon
    if b is not None:
        with b.lock:
            b.heartbeats += 1
            b.progress_time = time.time()


@contextlib.contextmanager
def watch(name: str, timeout: float | None = None) -> Iterator[None]:
    """A section that must finish within ``timeout`` seconds; the health monitor calls a rank that
    stays longer a hang (with no timeout: the section only counts as progress when it ends)."""
    b = _beacon
    if b is None:
        yield
        return
    with b.lock:
        previous, b.watch = b.watch, [name, time.time(), timeout]
    try:
        yield
    finally:
        with b.lock:
            b.watch = previous
            b.heartbeats += 1
            b.progress_time = time.time()

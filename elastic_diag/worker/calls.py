"""What torch's flight recorder does not keep: the root and the peer of each collective call, and the
process groups each rank created.

torch's flight recorder records each collective's op, sizes and dtypes, but not the root of a broadcast,
reduce, gather or scatter, nor the peer of a send or recv: a rank that broadcasts from another ``src`` than
its peers, or receives from a peer that never sends to it, leaves entries identical to its peers'. And a
rank that skips a ``new_group`` call (which every rank must make, member or not) shifts the names of every
later group. So the beacon wraps the process group's rooted and point-to-point methods (every path in
``torch.distributed`` reaches them: ``dist.broadcast``, ``broadcast_object_list``, ``isend``, ...) and
``new_group``, and keeps per rank:

* the last :data:`MAX_CALLS` calls: op, process group (name and size), root or peer (group ranks), the
  caller's line outside torch, the time;
* how many sends to and receives from each peer, per group (a count is never cut);
* every ``new_group`` call: the ranks passed, where.

The beacon writes them to ``calls.json`` whenever it writes the flight recorder (:mod:`elastic_diag.core.calls`
compares them across ranks). A wrapper costs a few microseconds (one frame walk); it never changes the call.
``ELASTIC_DIAG_NO_TORCH_HOOKS=1`` turns it off with the other hooks.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from typing import Any

from elastic_diag.worker import imports

MAX_CALLS = 256
MAX_GROUPS = 1024
_OPS = ("broadcast", "reduce", "gather", "scatter", "send", "recv", "recv_anysource")

_lock = threading.Lock()
_calls: deque[dict[str, Any]] = deque(maxlen=MAX_CALLS)
_counts: dict[str, int] = {}  # "send|group|peer" -> calls
_groups: list[dict[str, Any]] = []
_installed = False


def _caller() -> str | None:
    """The innermost frame outside torch: where the user's code made the call."""
    frame: Any = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if "/torch/" not in name and "\\torch\\" not in name and name != __file__:
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _group_of(pg: Any) -> tuple[str, int | None]:
    try:
        name = str(pg.group_name)
    except Exception:
        name = "?"
    try:
        size = int(pg.size())
    except Exception:
        size = None
    return name, size


def _root(op: str, args: tuple[Any, ...]) -> int | None:
    """The root (group rank) of a rooted collective, or the peer of a send or recv, from the method's
    arguments: ``(tensors, opts)`` with ``opts.rootRank``, ``(tensors, peer, tag)``."""
    try:
        if op in ("send", "recv"):
            return int(args[1])
        if op == "recv_anysource":
            return None
        opts = args[-1]
        return int(opts.rootRank)
    except Exception:
        return None


def _record(op: str, pg: Any, args: tuple[Any, ...]) -> None:
    group, size = _group_of(pg)
    root = _root(op, args)
    entry = {"op": op, "group": group, "size": size, "root": root, "where": _caller(), "time": time.time()}
    with _lock:
        _calls.append(entry)
        if op in ("send", "recv"):
            key = f"{op}|{group}|{root}"
            if key in _counts or len(_counts) < MAX_GROUPS:
                _counts[key] = _counts.get(key, 0) + 1


def _wrap_method(cls: Any, op: str) -> None:
    original = getattr(cls, op, None)
    if original is None or getattr(original, "__elastic_diag__", False):
        return

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):  # the call itself must never see the record fail
            _record(op, self, args)
        return original(self, *args, **kwargs)

    method.__elastic_diag__ = True  # type: ignore[attr-defined]
    method.__wrapped__ = original  # type: ignore[attr-defined]
    method.__doc__ = getattr(original, "__doc__", None)
    setattr(cls, op, method)


def _wrap_new_group(module: Any) -> None:
    original = getattr(module, "new_group", None)
    if original is None or getattr(original, "__elastic_diag__", False):
        return

    def new_group(*args: Any, **kwargs: Any) -> Any:
        try:
            ranks = kwargs.get("ranks", args[0] if args else None)
            listed = sorted(int(r) for r in ranks) if ranks is not None else None
            with _lock:
                if len(_groups) < MAX_GROUPS:
                    _groups.append({"ranks": listed, "where": _caller(), "time": time.time()})
        except Exception:
            pass
        return original(*args, **kwargs)

    new_group.__elastic_diag__ = True  # type: ignore[attr-defined]
    new_group.__wrapped__ = original  # type: ignore[attr-defined]
    new_group.__doc__ = original.__doc__
    module.new_group = new_group


def install() -> bool:
    """Wrap the process group's methods and ``new_group`` (once torch.distributed is imported); True once
    done or not possible (no distributed build)."""
    global _installed
    if _installed:
        return True
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dist = sys.modules.get("torch.distributed")
    module = sys.modules.get("torch.distributed.distributed_c10d")
    if dist is None or module is None:
        return False  # torch is still being imported
    pg = getattr(c10d, "ProcessGroup", None)
    if pg is None:
        _installed = True
        return True
    for op in _OPS:
        _wrap_method(pg, op)
    _wrap_new_group(module)
    if getattr(dist, "new_group", None) is not getattr(module, "new_group", None):
        setattr(dist, "new_group", module.new_group)  # noqa: B010 - the package re-exports the module's function
    _installed = True
    return True


TARGET = "torch.distributed.distributed_c10d"


def _install_after_import(_module: Any) -> None:
    install()


def install_on_import() -> None:
    """Install now if torch.distributed is loaded, else the moment its c10d module has been executed (a
    script can call ``init_process_group`` and its first broadcast before the beacon's next tick)."""
    imports.when_imported(TARGET, _install_after_import)


def installed() -> bool:
    return _installed


def recorded() -> bool:
    """Any call or new_group recorded (a rank that only sent and received has no collective in its flight
    recorder, but its calls are worth writing)."""
    return bool(_calls or _groups)


def snapshot() -> dict[str, Any]:
    """``calls.json``: the last calls, the send/recv counts, the groups created."""
    with _lock:
        return {"calls": list(_calls), "p2p_counts": dict(_counts), "new_groups": list(_groups),
                "max_calls": MAX_CALLS}  # fmt: skip

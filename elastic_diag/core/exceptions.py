"""An exception as a rank recorded it (the bootstrap's excepthook, torchelastic's error file) or printed it
(a traceback in its output), with its cause chain, and the one JSON codec of that record. Pure: no torch,
no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from elastic_diag.core.stacks import is_user_file
from elastic_diag.core.values import as_seconds

_CHAIN_SEPARATOR = re.compile(
    r"\n\s*(?:During handling of the above exception, another exception occurred|"
    r"The above exception was the direct cause of the following exception):\s*\n"
)
_TRACEBACK_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@dataclass(frozen=True, slots=True)
class ExceptionRecord:
    """An exception as the worker bootstrap recorded it (or as a rank printed it).

    ``mro``: the qualified names of its class's bases, itself first (so a numpy ``_ArrayMemoryError``
    is known to be a ``MemoryError``). ``chain``: the exceptions it was raised while handling or from
    (``__context__`` / ``__cause__``), oldest first, as ``(type, message)``: a cleanup that fails in a
    collective while handling the rank's own ValueError raises a peer-closed error whose chain holds
    the cause. ``thread``: the name of the thread that raised it when not the main thread.
    ``problems``: what could not be recorded (a ``__str__`` that raised, a message cut to size)."""

    type: str
    message: str
    traceback: str
    time: float | None = None
    mro: tuple[str, ...] = ()
    chain: tuple[tuple[str, str], ...] = ()
    thread: str | None = None
    problems: tuple[str, ...] = ()

    @property
    def last_line(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type

    def section(self, index: int) -> str:
        """The part of the traceback text that belongs to the ``index``-th exception of the chain,
        oldest first (Python prints each one's frames, then "During handling of the above exception,
        another exception occurred:"); the whole text when it has no such parts."""
        parts = _CHAIN_SEPARATOR.split(self.traceback)
        if len(parts) < 2 or not -len(parts) <= index < len(parts):
            return self.traceback
        return parts[index]

    def type_names(self) -> tuple[str, ...]:
        """Its type, then the bases it was recorded with (short and qualified names both match)."""
        return (self.type, *self.mro) if self.type not in self.mro else self.mro

    def location(self) -> str | None:
        """``file:line in func`` of the innermost frame of the traceback, if there is one."""
        frames = _TRACEBACK_FRAME.findall(self.traceback)
        if not frames:
            return None
        file, line, func = frames[-1]
        return f"{file}:{line} in {func}"

    def user_location(self) -> str | None:
        """The innermost traceback frame in the user's code (outside torch and the standard library)."""
        for file, line, func in reversed(_TRACEBACK_FRAME.findall(self.traceback)):
            if is_user_file(file):
                return f"{file}:{line} in {func}"
        return None


def exception_to_json(
    exc: ExceptionRecord, *, message_chars: int = 20_000, traceback_chars: int = 100_000, time: float | None = None
) -> dict[str, Any]:
    """An ExceptionRecord as JSON (the bootstrap's exception.json shape), bounded; ``time`` replaces its own
    (a record moved onto another clock)."""
    return {"type": exc.type, "message": exc.message[:message_chars], "traceback": exc.traceback[-traceback_chars:],
            "time": exc.time if time is None else time, "mro": list(exc.mro), "chain": [list(c) for c in exc.chain],
            "thread": exc.thread, "problems": list(exc.problems)}  # fmt: skip


def exception_from_json(data: Any) -> ExceptionRecord | None:
    """exception.json, thread_exception.json, and the exceptions inside first_error.json and the nodes'
    records, back as an ExceptionRecord; None for anything that is not one (garbled, foreign)."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str) or not data["type"]:
        return None
    mro, chain, thread, problems = data.get("mro"), data.get("chain"), data.get("thread"), data.get("problems")
    return ExceptionRecord(
        type=data["type"],
        message=str(data.get("message", "")),
        traceback=str(data.get("traceback", ""))[:100_000],
        time=as_seconds(data.get("time")),
        mro=tuple(str(m) for m in mro) if isinstance(mro, list) else (),
        chain=tuple((str(c[0]), str(c[1])) for c in chain if isinstance(c, list) and len(c) == 2)
        if isinstance(chain, list)
        else (),
        thread=str(thread) if thread else None,
        problems=tuple(p for p in problems if isinstance(p, str)) if isinstance(problems, list) else (),
    )


def exception_from_error_file(data: dict[str, Any] | None) -> ExceptionRecord | None:
    """The exception in torchelastic's error file (``{"message": {"message": "T: msg", "extraInfo": {...}}}``)."""
    msg = data.get("message") if isinstance(data, dict) else None
    if not isinstance(msg, dict) or not isinstance(msg.get("message"), str):
        return None
    etype, _, text = msg["message"].partition(": ")
    extra = msg.get("extraInfo") or {}
    ts = extra.get("timestamp") if isinstance(extra, dict) else None
    callstack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
    return ExceptionRecord(
        type=etype or "Exception",
        message=text,
        traceback=str(callstack)[:100_000],
        time=float(ts) if isinstance(ts, str) and ts.isdigit() else None,
    )


def exception_from_file_data(data: dict[str, Any] | None) -> ExceptionRecord | None:
    """Either file's exception, told apart by its shape: ours (exception.json) or torchelastic's (error.json)."""
    if data is not None and "type" in data:
        return exception_from_json(data)
    return exception_from_error_file(data)

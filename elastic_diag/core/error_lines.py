"""The first error a rank printed of its own, found in its output as the lines arrive.

Many scripts catch an exception, log it (``logging.exception``, ``traceback.print_exc()``, a
framework's logger), spend seconds cleaning up (a checkpoint, a flush), then re-raise: the
excepthook fires after the peers have already failed waiting for this rank. The printed traceback is
when the failure began. The launcher reads each rank's stdout and stderr as they grow
(:mod:`elastic_diag.agent.tailer`) and feeds every line here with its arrival time; :class:`ErrorScanner`
keeps the first error that is the rank's own:

* a traceback (``Traceback (most recent call last):`` ... ``SomeError: message``, chained ones and
  a thread's ``Exception in thread NAME:`` included) whose exception is not a symptom of a peer's
  failure (a peer-closed, a timeout, gloo's abort of the receiver of mismatched data), or whose
  chain starts with one that is not (a cleanup's collective that failed while handling the rank's
  own ValueError);
* a line outside a traceback that marks a failure of the rank itself (a fatal signal's banner,
  ``terminate called``, a CUDA or NCCL error line): a signature whose role is not ``collateral``.

The time of the line is its arrival, or the timestamp it carries (a logging ``asctime``, a glog
header) when that is earlier and plausible: output that sat in a buffer arrives late, never early.
Pure: lines and times in, an :class:`~elastic_diag.core.evidence.ErrorLine` out; no torch, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from elastic_diag.core.evidence import ErrorLine
from elastic_diag.core.exceptions import ExceptionRecord, exception_from_json, exception_to_json
from elastic_diag.core.log_lines import parse_line
from elastic_diag.core.taxonomy import Signature, Taxonomy
from elastic_diag.core.values import as_seconds

TRACEBACK = "Traceback (most recent call last):"
HOOK_FAILED = "Error in sys.excepthook:"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_THREAD = re.compile(r"^Exception in thread (?P<name>.+?)(?: \(\w+\))?:$")
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?:: (?P<msg>.*))?$")
_FRAME_LINE = re.compile(r"^\s")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MAX_TRACEBACK_LINES = 2000
MAX_MESSAGE_LINES = 1500  # DCP quotes every failed rank's traceback in its message
MAX_LINE = 4000
CONFIRM_LINES = 3  # lines after a native error line that must not be a symptom
MAX_MESSAGE_CHARS = 20_000
# A timestamp a line carries is used when it is at most this much before the line's arrival (a
# buffered stream) and not after it (a clock or zone that is not the launcher's).
LOGGED_WINDOW_S = 3600.0
_LOGGED_AHEAD_S = 1.0
# Where the first lines of the scripted failures we know say so (taxonomy signatures): the generic
# "SomethingError: message" only counts inside a traceback.
_GENERIC = "python-exception"


@dataclass(slots=True)
class _Block:
    """A traceback being read: its lines, and the exceptions of its chain seen so far."""

    start: float
    logged: float | None
    thread: str | None
    lines: list[str] = field(default_factory=list)
    exceptions: list[tuple[str, str]] = field(default_factory=list)  # (type, message), oldest first
    in_message: bool = False  # the lines after an exception line: its message's continuation
    message_lines: int = 0
    frames: int = 0
    ignored: bool = False  # the traceback of a failing excepthook (the real one follows it)
    chained: bool = False  # "During handling of the above exception..." was the last separator
    exception_at: float | None = None  # when its (last) exception line arrived


class ErrorScanner:
    """Feed one stream's lines in order; :meth:`first` is the first error of the rank's own."""

    def __init__(self, taxonomy: Taxonomy, stream: str = "stderr", *, local_time: bool = True) -> None:
        self._tax = taxonomy
        self._stream = stream
        # the live line clock reads what its own ranks wrote: a logged time with no zone is this machine's
        self.local_time = local_time
        self._found: ErrorLine | None = None
        self._block: _Block | None = None
        self._thread: str | None = None  # "Exception in thread X:" seen on the line before
        self._last_logged: float | None = None  # the timestamp of the previous line (logging.exception)
        # a native error line ("terminate called ...") waits for the lines after it: gloo's what(): line
        # saying the rank only received mismatched data makes it a symptom, not the rank's own failure
        self._pending: ErrorLine | None = None
        self._pending_lines = 0
        self._after_symptom = False
        self._hook_failed = False
        self.lines = 0

    @property
    def found(self) -> ErrorLine | None:
        return self._found

    def settled(self, now: float, after_s: float = 1.0) -> ErrorLine | None:
        """The first own error once nothing is likely to change it: found, or a traceback whose
        exception line arrived ``after_s`` ago (a long message may still be arriving; its first line,
        which the verdict reads, is known)."""
        if self._found is not None:
            return self._found
        block = self._block
        if (
            block is not None
            and block.exceptions
            and block.exception_at is not None
            and now - block.exception_at >= after_s
        ):
            judged = self._judge(block)
            # a native error line printed before the traceback came first (as in feed)
            return (self._pending or judged) if judged is not None else None
        return None

    def first(self) -> ErrorLine | None:
        """The first own error, a traceback still being written counted as complete (the stream may
        have ended with it: the rank died), and a native error line with nothing after it."""
        if self._found is None and self._block is not None:
            judged = self._judge(self._block)
            return (self._pending or judged) if judged is not None else self._pending
        return self._found or self._pending

    def feed(self, raw: str, arrival: float) -> None:
        self.lines += 1
        if self._found is not None:
            return
        if "\x1b" in raw:
            raw = _ANSI.sub("", raw)  # colour codes (FORCE_COLOR, a coloured logger)
        if "\x00" in raw:  # a crashed writer's hole of NULs: what follows it is the line (before it is cut)
            raw = next((seg for seg in reversed(raw.split("\x00")) if seg.strip()), "")
        parsed = parse_line(raw[:MAX_LINE], local_time=self.local_time)
        text = parsed.text.rstrip()
        if parsed.rank is not None and text.startswith(" "):
            text = text[1:]  # torch writes "[rank1]: Traceback ...": one space after the prefix
        if (at := text.find(TRACEBACK)) > 0 and not text[:at].isspace():
            text = text[at:]  # a progress bar's last frame, with no newline, before the traceback
        logged = _plausible(parsed.time, arrival)
        block = self._block
        if block is not None:
            if self._continue(block, text, arrival):
                return
            self._block = None
            judged = self._judge(block)
            if judged is not None:
                self._found = self._pending or judged
                return
            if block.exceptions and not block.ignored:  # a symptom's traceback: a native line before it was none
                self._pending = None
                self._after_symptom = True
        if text == HOOK_FAILED:  # the user's excepthook failed: its traceback comes next, then the real one
            self._hook_failed = True
            return
        if text.startswith(TRACEBACK):
            if self._hook_failed:
                self._hook_failed = False
                self._block = _Block(start=arrival, logged=None, thread=None, lines=[text], ignored=True)
                return
            prev = self._last_logged
            start = min(arrival, logged if logged is not None else (prev if prev is not None else arrival))
            self._block = _Block(start=start, logged=logged or prev, thread=self._thread, lines=[text])
            self._thread = None
            return
        m = _THREAD.match(text)
        self._thread = m["name"] if m else None
        self._last_logged = logged
        if not text or m is not None:
            return
        if self._pending is not None:  # a native error line is confirmed when no symptom follows it
            if self._symptom(text):
                self._pending = None
                self._after_symptom = True
                return
            self._pending_lines += 1
            if self._pending_lines >= CONFIRM_LINES:
                self._found, self._pending = self._pending, None
                return
        if self._after_symptom or self._pending is not None:
            return
        if self._symptom(text):
            self._after_symptom = True  # what it prints next (an abort, a teardown) follows from the symptom
            return
        self._pending = self._judge_line(text, arrival, logged)
        self._pending_lines = 0

    def _continue(self, block: _Block, text: str, arrival: float) -> bool:
        """Whether ``text`` still belongs to the traceback being read."""
        if len(block.lines) >= MAX_TRACEBACK_LINES:
            return False
        if any(text.startswith(c) for c in _CHAINED):
            block.in_message = False
            block.chained = True
            block.lines.append(text)
            return True
        if text.startswith(TRACEBACK):
            if block.chained:  # the next exception of the chain
                block.chained = False
                block.in_message = False
                block.lines.append(text)
                return True
            if not block.in_message:
                return False  # another traceback, printed after this one
            # a traceback inside the message (torch.distributed.checkpoint quotes each failed rank's own
            # "Traceback (most recent call last): (RANK 2)"): the message's, not the rank's
        if not text:
            if block.exceptions:
                block.in_message = False
            block.lines.append(text)
            return True
        if _FRAME_LINE.match(text) and not block.in_message:
            block.frames += 1
            block.lines.append(text)
            return True
        if block.in_message:
            # a message of several lines (torch's often are), until a blank line or another log line; kept
            # in the traceback's text only: what follows may be the rank's next log lines, not the message
            if _THREAD.match(text) or parse_line(text).time is not None or block.message_lines >= MAX_MESSAGE_LINES:
                return False
            block.message_lines += 1
            block.lines.append(text)
            return True
        if block.frames or block.exceptions:
            m = _EXC_LINE.match(text)
            if m is not None:
                block.exceptions.append((m["type"], (m["msg"] or "")[:MAX_MESSAGE_CHARS]))
                block.exception_at = arrival
                block.in_message = True
                block.message_lines = 0
                block.lines.append(text)
                return True
        return False

    def _judge(self, block: _Block) -> ErrorLine | None:
        """The traceback as the rank's own error, or None when its exception is a peer's symptom."""
        if not block.exceptions or block.ignored:
            return None
        own = None
        for etype, msg in reversed(block.exceptions):
            if not self._collateral(f"{etype}: {msg}" if msg else etype):
                own = (etype, msg)
                break
        if own is None:
            return None
        last_type, last_msg = block.exceptions[-1]
        record = ExceptionRecord(
            type=last_type,
            message=last_msg,
            traceback="\n".join(block.lines)[-100_000:],
            time=block.start,
            chain=tuple(block.exceptions[:-1]),
            thread=block.thread,
        )
        if own != (last_type, last_msg):  # the own exception is earlier in the chain: name it
            record = ExceptionRecord(type=own[0], message=own[1], traceback=record.section(block.exceptions.index(own)),
                                     time=block.start, thread=block.thread)  # fmt: skip
        text = record.last_line.splitlines()[0] if record.last_line else record.type
        return ErrorLine(time=block.start, text=text[:MAX_LINE], arrival=block.start, logged=block.logged,
                         exception=record, stream=self._stream)  # fmt: skip

    def _collateral(self, line: str) -> bool:
        best = _best([s for s, _m in self._tax.match_line(line)])
        return best is not None and best.role_hint == "collateral"

    def _symptom(self, line: str) -> bool:
        return self._collateral(line)

    def _judge_line(self, text: str, arrival: float, logged: float | None) -> ErrorLine | None:
        hits = [s for s, _m in self._tax.match_line(text) if s.id != _GENERIC]
        best = _best(hits)
        if best is None or best.role_hint == "collateral":
            return None
        t = min(arrival, logged) if logged is not None else arrival
        return ErrorLine(time=t, text=text[:MAX_LINE], arrival=arrival, logged=logged, stream=self._stream)


def _best(hits: list[Signature]) -> Signature | None:
    best: Signature | None = None
    for sig in hits:
        if best is None or sig.priority > best.priority:
            best = sig
    return best


def _plausible(logged: float | None, arrival: float) -> float | None:
    if logged is None:
        return None
    if arrival - LOGGED_WINDOW_S <= logged <= arrival + _LOGGED_AHEAD_S:
        return min(logged, arrival)
    return None


def error_line_to_json(line: ErrorLine) -> dict[str, Any]:
    """``first_error.json``: written by the launcher's line clock, read by the capture and the analyzer."""
    exc = line.exception
    return {
        "time": line.time,
        "text": line.text,
        "arrival": line.arrival,
        "logged": line.logged,
        "stream": line.stream,
        "exception": exception_to_json(exc, message_chars=MAX_MESSAGE_CHARS) if exc else None,
    }


def error_line_from_json(data: Any) -> ErrorLine | None:
    """The record back; None for anything that is not one (a garbled or foreign file)."""
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        return None
    t = as_seconds(data.get("time"))
    if t is None:
        return None
    record = exception_from_json(data.get("exception"))
    return ErrorLine(time=t, text=data["text"][:MAX_LINE], arrival=as_seconds(data.get("arrival")),
                     logged=as_seconds(data.get("logged")), exception=record,
                     stream=str(data.get("stream") or "stderr"))  # fmt: skip


def scan_lines(
    lines: list[str] | tuple[str, ...], taxonomy: Taxonomy, times: list[float] | None = None
) -> ErrorLine | None:
    """The first own error of a finished stream (tests, and output read after the fact)."""
    scanner = ErrorScanner(taxonomy)
    for i, line in enumerate(lines):
        scanner.feed(line, times[i] if times else float(i))
    return scanner.first()

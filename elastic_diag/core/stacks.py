"""Stacks: faulthandler's dump of every thread of a rank, parsed, and whether its main thread was inside a
collective or in the user's own code. Pure: no torch, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Innermost frames in these parts of torch mean "inside a collective or waiting on one" (DDP's and
# FSDP's collectives run inside autograd's backward, so a rank blocked there shows autograd frames).
_COLLECTIVE_PATHS = (
    "/torch/distributed/",
    "/torch/nn/parallel/",
    "/torch/autograd/",
    "/torch/_tensor.py",
)
_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)(?: \[[^\]]*\])? \(most recent call first\):")
_STDLIB = re.compile(r"/lib/python\d+\.\d+/(?!site-packages/|dist-packages/)")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')


def is_user_file(path: str) -> bool:
    """A frame of the user's code: outside torch, the standard library, site-packages and our own hooks."""
    p = path.replace("\\", "/")
    return (
        "/torch/" not in p
        and "/threading.py" not in p
        and "/site-packages/" not in p
        and not _STDLIB.search(p)
        and not p.endswith("elastic_diag/worker/beacon.py")  # the backward hook's own frame
        and not p.startswith("<")
    )


@dataclass(frozen=True, slots=True)
class StackFrame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


@dataclass(frozen=True, slots=True)
class StackDump:
    """One faulthandler dump of all threads; ``threads[-1]`` is the oldest thread (the main one)."""

    text: str
    threads: tuple[tuple[StackFrame, ...], ...]

    @property
    def main_thread(self) -> tuple[StackFrame, ...]:
        return self.threads[-1] if self.threads else ()

    def in_collective(self) -> bool | None:
        """Whether the main thread's innermost frame is inside torch.distributed / autograd."""
        frames = self.main_thread
        if not frames:
            return None
        return any(p in frames[0].file.replace("\\", "/") for p in _COLLECTIVE_PATHS)

    def user_frame(self) -> StackFrame | None:
        """The innermost main-thread frame outside torch and the standard library's threading."""
        for f in self.main_thread:
            if is_user_file(f.file):
                return f
        return self.main_thread[0] if self.main_thread else None


def parse_stack_dump(text: str) -> StackDump | None:
    """Parse faulthandler's ``dump_traceback(all_threads=True)`` text; None when it has no thread."""
    threads: list[list[StackFrame]] = []
    for raw in text.splitlines():
        if _THREAD_HEADER.match(raw):
            threads.append([])
            continue
        m = _FRAME.match(raw)
        if m and threads:
            threads[-1].append(StackFrame(m["file"], int(m["line"]), m["func"].strip()))
    if not threads:
        return None
    return StackDump(text=text, threads=tuple(tuple(t) for t in threads))

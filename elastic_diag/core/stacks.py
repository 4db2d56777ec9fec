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
_STREAM_WRAPPER = "elastic_diag/redaction.py"  # the rank's sys.stdout / sys.stderr: its print, not our thread
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
        and not p.endswith(_STREAM_WRAPPER)  # a print of the rank's, through the masking stream
        and not p.startswith("<")
    )


@dataclass(frozen=True, slots=True)
class StackFrame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


_OWN_CODE = "/elastic_diag/"
OWN_THREAD_MARK = " [elastic_diag's own thread: answering the dump]"


def _is_own_thread(frames: tuple[StackFrame, ...]) -> bool:
    """A thread of elastic_diag's (the beacon, the dump answerer): its innermost frame is ours, not counting
    the masking stream a print of the rank's passes through."""
    for f in frames:
        path = f.file.replace("\\", "/")
        if not path.endswith(_STREAM_WRAPPER):
            return _OWN_CODE in path
    return False


@dataclass(frozen=True, slots=True)
class StackDump:
    """One faulthandler dump of all threads; ``threads[-1]`` is the oldest thread (the main one).
    ``blocks``: each thread's text (its header and frames), in the dump's order; ``head``: what came before
    the first thread (elastic_diag's dump marker)."""

    text: str
    threads: tuple[tuple[StackFrame, ...], ...]
    blocks: tuple[str, ...] = ()
    head: str = ""

    def for_people(self) -> str:
        """The dump as a person should read it: the thread that matters first (the main thread, where the
        training loop is stuck or waits in a collective), the other threads of the job next, and
        elastic_diag's own threads (the one that wrote the dump is faulthandler's "Current thread") last and
        marked as the tool's."""
        if len(self.blocks) != len(self.threads) or len(self.blocks) < 2:
            return self.text
        order = [len(self.threads) - 1, *range(len(self.threads) - 1)]
        own = [i for i in order if _is_own_thread(self.threads[i])]
        first = [i for i in order if i not in own]
        if not first:
            return self.text
        parts = [self.blocks[i] for i in first]
        for i in own:
            header, _, rest = self.blocks[i].partition("\n")
            parts.append(header.rstrip() + OWN_THREAD_MARK + ("\n" + rest if rest else ""))
        return (self.head + "\n".join(p.rstrip("\n") + "\n" for p in parts)).rstrip("\n") + "\n"

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
    blocks: list[list[str]] = []
    head: list[str] = []
    for raw in text.splitlines():
        if _THREAD_HEADER.match(raw):
            threads.append([])
            blocks.append([raw])
            continue
        (blocks[-1] if blocks else head).append(raw)
        m = _FRAME.match(raw)
        if m and threads:
            threads[-1].append(StackFrame(m["file"], int(m["line"]), m["func"].strip()))
    if not threads:
        return None
    return StackDump(text=text, threads=tuple(tuple(t) for t in threads),
                     blocks=tuple("\n".join(b) for b in blocks), head="".join(h + "\n" for h in head))  # fmt: skip

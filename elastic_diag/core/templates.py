"""Log lines reduced to templates: what two runs of the same job print alike, whatever their numbers.

A line's **template** is the line with its run-to-run variation made slots: every digit (times, steps, loss
values, pids, ports, ranks in paths and prefixes), hexadecimal addresses, hashes and UUIDs (the letters a-f count
as digits), temporary paths, the bar and counters of a progress bar (a line rewritten with CR is its last
frame), runs of spaces; a rank prefix (``[default3]:``, ``[rank3]:``, ``3: ``, ``[1,3]<stderr>:``) and the
host/pid/tid head of an NCCL line are taken off. Two runs of one script print the same templates; a line whose
template the good run never printed is **novel**.

The work is split for speed (a log of 200 MB is a few million lines; Python cannot touch each one):

1. :func:`pre_templates`: a chunk of bytes has every digit and a-f letter made ``0`` and every non-ASCII byte
   ``\\x80`` (``bytes.translate``: C speed), then is split into lines. Most chatter of one run becomes a few
   thousand distinct "pre-templates" (a number's length still varies), so a ``set`` of them is small;
2. :func:`template`: each distinct pre-template is finished with regular expressions (number runs made one
   ``0``, prefixes off, the progress bar's frame), once per :func:`shape_key` (its runs of ``0`` made one). Its
   cost is per distinct shape, not per line.

Both are pure (no I/O, no torch): the reading is :mod:`elastic_diag.offline.divergence`'s.
"""

from __future__ import annotations

import re

# digits and the letters of hexadecimal -> "0", every non-ASCII byte -> 0x80. The hex letters go too: an address,
# a hash, a request id would otherwise make every line of its kind a distinct shape (and cost a regular expression
# each). A word is then kept by its other letters ("Channel" -> "0h0nn0l"): two messages that differ only in a-f
# letters share a template, a small price.
_TABLE = bytearray(range(256))
for _d in b"123456789abcdefABCDEF":
    _TABLE[_d] = ord("0")
for _b in range(0x80, 0x100):
    _TABLE[_b] = 0x80
TRANSLATE = bytes(_TABLE)


def _tr(literal: bytes) -> bytes:
    return re.escape(literal.translate(TRANSLATE))


_ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# rank prefixes (torchrun --tee / --role, torch's [rankN]:, srun --label, mpirun --tag-output), repeated
_PREFIX = re.compile(
    rb"^(?:\[(?:"
    + _tr(b"default")
    + rb"|"
    + _tr(b"rank")
    + rb"|[\w.-]{1,32}?)0+\]:|0+: |\[0+,0+\]<"
    + _tr(b"std")
    + rb"(?:"
    + _tr(b"out")
    + rb"|"
    + _tr(b"err")
    + rb")>: ?)+"
)
# a tqdm frame ("Epoch 0:  40%|####      | 6/15 [00:00<00:00, 14.70it/s, loss=0.4]"): its bar, counters, times and
# postfix change with timing, so a frame is its description and "<progress>"; output glued after it, with no
# newline between, is a line of its own
_BAR = re.compile(rb"^(?P<desc>.{0,200}?)0+%\|[^|\n]{0,200}\| ?0+/0+ \[[^\]\n]{0,200}\]")
# an NCCL line's head: "host:pid:tid [dev] " (the host differs from run to run)
_NCCL_HEAD = re.compile(rb"^[\w.-]+:0+:0+ \[0+\] ")
_SLOTS = re.compile(
    rb"(?P<tmp>/tmp/[^\s/:'\",]+)"
    rb"|(?P<num>0(?:0|[.:,_/+\-xX]0)*)"
    rb"|(?P<bar>\x80[\x80 #=>.\-]*)"
    rb"|(?P<space>[ \t]{2,})"
)
_SLOT_TEXT = {"tmp": b"/tmp/#", "num": b"0", "bar": b"\x80", "space": b" "}


def _slot(m: re.Match[bytes]) -> bytes:
    return _SLOT_TEXT[m.lastgroup or "num"]


def pre_templates(chunk: bytes) -> list[bytes]:
    """The chunk's lines (split at LF, as an editor counts them) with digits and a-f letters made ``0`` and
    non-ASCII bytes ``\\x80``: one byte for one byte, so a pre-template has its raw line's length and place."""
    return chunk.translate(TRANSLATE).split(b"\n")


def shape_key(pre: bytes) -> bytes:
    """A pre-template with its runs of ``0`` made one (a number's length no longer matters): pre-templates with
    the same key have the same template, so :func:`template` runs once per key."""
    while b"00" in pre:
        pre = pre.replace(b"00", b"0")
    return pre


def template(pre: bytes) -> bytes:
    """A pre-template finished: colour codes and prefixes off, every slot one token, ends trimmed."""
    if b"\r" in pre:  # a progress bar's frames rewritten with CR: the last one is what the terminal showed
        pre = next((seg for seg in reversed(pre.split(b"\r")) if seg.strip()), b"")
    if b"\x1b" in pre:
        pre = _ANSI.sub(b"", pre)
    pre = _PREFIX.sub(b"", pre, count=1)
    if b"%|" in pre and (bar := _BAR.match(pre)) is not None:
        rest = pre[bar.end() :]
        if not rest.strip():
            return _SLOTS.sub(_slot, bar["desc"]).strip() + b" <progress>"
        pre = _PREFIX.sub(b"", rest, count=1)
    pre = _NCCL_HEAD.sub(b"<nccl> ", pre, count=1)
    return _SLOTS.sub(_slot, pre).strip()


def shown_template(t: bytes) -> str:
    """A template as text (its slots readable)."""
    return t.decode("utf-8", "replace").replace("\x80", "~").replace("\ufffd", "~")


__all__ = ["TRANSLATE", "pre_templates", "shape_key", "shown_template", "template"]

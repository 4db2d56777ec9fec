"""Secrets stay out of everything elastic_diag writes or prints.

Two kinds of rule, applied together by :class:`Redactor`:

* **Known values.** The values of environment variables whose names say they are secret (TOKEN, KEY,
  SECRET, PASSWORD, CREDENTIAL, AUTH) and the values that follow such flags on a command line
  (``--hf-token X``, ``--api-key=X``) are replaced by ``***`` wherever they appear. Values shorter
  than 4 characters are masked as values of those variables and flags but not searched for in free
  text.
* **Shapes** (:data:`SHAPES`): what a secret looks like in any text, whoever's it is: a password in a
  URL (``scheme://user:PASSWORD@host``), ``Authorization:`` / ``Bearer`` headers, ``password=`` in a
  connection string, ``NAME_TOKEN=value`` assignments, ``--api-key VALUE`` flags, private key blocks,
  and provider keys by their documented prefixes (AWS ``AKIA``..., GCP ``AIza``..., Azure
  ``AccountKey=`` / SAS ``sig=``, Hugging Face ``hf_``..., OpenAI/Anthropic ``sk-``..., GitHub
  ``ghp_``..., Slack ``xox``... and webhooks, GitLab ``glpat-``..., JWTs). The patterns follow what
  gitleaks and detect-secrets match, narrowed so that the fixture logs (hashes, checkpoint names,
  SeqNums, ``eos_token='</s>'``) are left alone (tests/test_redaction.py measures it).

Where it applies (docs/security.md): where text is written (each rank's ``sys.stdout`` /
``sys.stderr`` through :class:`RedactingStream`, installed by the worker bootstrap; every file of
ours through :func:`elastic_diag.layout.write_atomic`; the ranks' stream files again when they
exit) and again wherever evidence becomes a report, a page or a terminal summary.

The worker bootstrap writes through it before the user's script runs: the standard library only at import;
Hyperscan (a dependency on Linux x86_64 / aarch64) is loaded on the first text to mask, and without it the
gate words do the same work more slowly.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

MASK = "***"
MIN_SEARCHED = 4  # a value this short ("1", "yes") is not searched for in free text
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
# a command-line flag naming a secret: --hf-token, --api_key, --wandb-api-key, -password, --auth
SECRET_FLAG = re.compile(r"^--?[A-Za-z0-9_-]*(?:token|key|secret|password|passwd|credential|auth)[A-Za-z0-9_-]*$",
                         re.IGNORECASE)  # fmt: skip


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def secret_values(environ: Mapping[str, str], argv: Sequence[str]) -> set[str]:
    """Every secret value in an environment and a command line."""
    values = {v for k, v in environ.items() if is_secret_name(k) and v}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not SECRET_FLAG.match(flag):
            continue
        if eq and value:
            values.add(value)
        elif not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            values.add(argv[i + 1])
    return values


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line with the value of every secret flag masked."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next and not arg.startswith("-"):
            out.append(MASK)
            mask_next = False
            continue
        mask_next = False
        flag, eq, _ = arg.partition("=")
        if SECRET_FLAG.match(flag):
            if eq:
                out.append(f"{flag}={MASK}")
                continue
            mask_next = True
        out.append(arg)
    return out


def redact_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) and v else v) for k, v in environ.items()}


# A value: quoted, or up to a space / quote / separator.
_VALUE = r"""(?:'[^'\n]*'|"[^"\n]*"|[^\s'",;&]+)"""
_SECRET_WORDS = (
    r"(?:TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|API_?KEY|ACCESS_?KEY|SECRET_?KEY|PRIVATE_?KEY|"
    r"CREDENTIALS?|AUTH)"
)


class Shape:
    """One kind of secret in free text: ``pattern`` finds it, its group ``secret`` is what is masked
    (the whole match when it has none). A line is searched only when it holds one of ``gate`` (in
    the lower-cased text, or as is with ``cased``) and, when given, one of ``also``: most lines hold
    neither, and a regex search costs microseconds a line (patterns start with a literal where they
    can, so that ``re`` scans for it fast)."""

    __slots__ = ("name", "pattern", "gate", "cased", "also", "prefilter", "spans_lines")

    def __init__(self, name: str, pattern: str, gate: tuple[str, ...], *, cased: bool = False,
                 also: tuple[str, ...] = (), flags: int = 0, prefilter: str | None = None) -> None:  # fmt: skip
        self.name = name
        self.pattern = re.compile(pattern, flags)
        self.gate = gate
        self.cased = cased
        self.also = also
        # what a big text is scanned for in one Hyperscan pass (no look-behind there): the gates, or
        # a regex closer to the shape where a gate word is common in logs ("tokens/s", "key")
        self.prefilter = prefilter or "|".join(re.escape(g) for g in gate)
        self.spans_lines = bool(flags & re.DOTALL)

    def may_hold(self, text: str, lowered: str) -> bool:
        where = text if self.cased else lowered
        return any(g in where for g in self.gate) and (not self.also or any(a in text for a in self.also))

    def mask(self, text: str) -> str:
        if "secret" not in self.pattern.groupindex:
            return self.pattern.sub(MASK, text)

        def one(m: re.Match[str]) -> str:
            start, end = m.span("secret")
            if start < 0 or start == end:
                return m.group(0)
            return m.group(0)[: start - m.start()] + MASK + m.group(0)[end - m.start() :]

        return self.pattern.sub(one, text)


_NOT_WORD_BEFORE = r"(?<![A-Za-z0-9_])"
_QUOTES = ("'", '"')

SHAPES: tuple[Shape, ...] = (
    Shape("private key block",
          r"-----BEGIN ((?:[A-Z0-9]+ ){0,3})PRIVATE KEY((?: BLOCK)?)-----(?P<secret>.*?)"
          r"(?:-----END \1PRIVATE KEY\2-----|\Z)",
          ("PRIVATE KEY",), cased=True, flags=re.DOTALL),
    Shape("password in a URL", r"://[^\s:/@'\"<>]+:(?P<secret>[^\s@/'\"<>]+)@", ("://",), cased=True, also=("@",),
          prefilter=r"://[^\s:/@]+:[^\s@/]+@"),
    Shape("Authorization header",
          r"(?i)authorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token|digest|negotiate)\s+)?"
          r"(?!(?:bearer|basic|token|digest|negotiate)\b)(?P<secret>[^\s\"',;]{4,})", ("authorization",)),
    Shape("Bearer token", r"Bearer\s+(?P<secret>[A-Za-z0-9._~+/-]{16,}=*)", ("Bearer",), cased=True),
    Shape("password= in a connection string",
          r"(?i)" + _NOT_WORD_BEFORE + r"(?:password|passwd|pwd)[\"']?\s*[=:]\s*(?P<secret>" + _VALUE + ")",
          ("passw", "pwd")),
    Shape("secret variable assignment",
          r"(?<![A-Za-z0-9])" + _SECRET_WORDS + r"S?\s*=\s*(?P<secret>" + _VALUE + ")",
          ("TOKEN", "SECRET", "PASS", "KEY", "CREDENTIAL", "AUTH"), cased=True, also=("=",)),
    Shape("secret keyword argument",
          _NOT_WORD_BEFORE
          + r"(?:(?:hf|hub|auth|access|api|bearer|refresh|id|github|gh|wandb|session|slack|openai)_token|"
          r"token|api_?key|access_key|secret(?:_key)?|client_secret|private_key|wandb_key|passphrase)"
          r"[\"']?\s*[:=]\s*(?P<secret>'[^'\n]+'|\"[^\"\n]+\")",
          ("token", "api_key", "apikey", "access_key", "secret", "private_key", "wandb_key", "passphrase"),
          also=_QUOTES,
          prefilter=r"(?:token|api_?key|access_key|secret|secret_key|private_key|wandb_key|passphrase)[\"']?\s*[:=]\s*[\"']"),
    Shape("secret command-line flag",
          r"(?i)-(?<![\w-]-)-?[A-Za-z0-9_-]*?(?:token|api[-_]?key|access[-_]?key|secret(?:[-_]?key)?|password|passwd|"
          r"passphrase|credentials?|wandb[-_]?key|private[-_]?key)(?:=|\s+)(?P<secret>(?!-)" + _VALUE + ")",
          ("token", "key", "secret", "passw", "passphrase", "credential"), also=("-",),
          prefilter=r"-[A-Za-z0-9_-]*(?:token|key|secret|passw(?:or)?d|passphrase|credentials?)(?:=|\s)"),
    Shape("AWS access key id", r"(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])",
          ("AKIA", "ASIA", "ABIA", "ACCA", "A3T"), cased=True),
    Shape("Google API key", r"AIza[0-9A-Za-z_-]{35}", ("AIza",), cased=True),
    Shape("Google OAuth token", r"ya29\.[0-9A-Za-z_-]{20,}", ("ya29.",), cased=True),
    Shape("Azure account key", r"(?:AccountKey|SharedAccessKey)=(?P<secret>[A-Za-z0-9+/=]{20,})", ("Key=",),
          cased=True),
    Shape("Azure SAS signature", r"sig=(?<=[?&]sig=)(?P<secret>[A-Za-z0-9%+/=]{16,})", ("sig=",), cased=True),
    Shape("Hugging Face token", r"(?:hf|api_org)_[A-Za-z0-9]{30,}", ("hf_", "api_org_"), cased=True),
    Shape("OpenAI / Anthropic key", r"sk-(?:proj-|svcacct-|admin-|ant-)?[A-Za-z0-9_-]{20,}", ("sk-",), cased=True),
    Shape("GitHub token", r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,}",
          ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"), cased=True),
    Shape("GitLab token", r"glpat-[A-Za-z0-9_-]{20,}", ("glpat-",), cased=True),
    Shape("Slack token", r"xox[abposr]-[A-Za-z0-9-]{10,}", ("xox",), cased=True),
    Shape("Slack / Teams webhook",
          r"https://(?:hooks\.slack\.com/services|[A-Za-z0-9.-]+\.webhook\.office\.com/webhookb2)/"
          r"(?P<secret>[^\s'\"<>]+)",
          ("hooks.slack.com", "webhook.office.com")),
    Shape("W&B API key", r"(?i)wandb[\w.()-]{0,20}?(?:key|token)\W{1,5}(?P<secret>[0-9a-f]{40})(?![0-9a-f])",
          ("wandb",)),
    Shape("JSON web token", r"eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}", ("eyJ",), cased=True),
)  # fmt: skip
SHORTEST = 8  # no shape matches fewer characters ("TOKEN=ab"): shorter writes (" ", "\n") are not searched


def _gates(cased: bool) -> tuple[tuple[str, int], ...]:
    return tuple((g, i) for i, s in enumerate(SHAPES) if s.cased == cased for g in s.gate)


# every gate literal once, with its shape: one flat loop of `in` tests is the cheap part of a line's
# cost (a generator per shape cost 30 us a line on this project's 2-core machine; this costs 3)
_CASED_GATES = _gates(True)
_LOWER_GATES = _gates(False)


def _candidates(text: str, lowered: str) -> list[int]:
    found = [i for g, i in _CASED_GATES if g in text]
    found += [i for g, i in _LOWER_GATES if g in lowered]
    return sorted(set(found)) if found else found


WHOLE_TEXT = 4096  # a text longer than this (a stream file's chunk) is searched only on the lines a gate is on


def mask_shapes(text: str) -> str:
    """``text`` with every secret of a known shape masked: the shapes' prefilters found in one Hyperscan pass
    where Hyperscan is installed (a few microseconds a line), else by the gate words (:func:`mask_shapes_by_gates`);
    both give the same text (tests/test_redaction.py)."""
    if len(text) < SHORTEST:
        return text
    gates = _byte_gates()
    if gates is None:
        return mask_shapes_by_gates(text)
    data = text.encode("utf-8", "surrogateescape")
    hits = gates.hits(data)
    if hits is None:  # another thread is scanning: the gate words
        return mask_shapes_by_gates(text)
    if not hits:
        return text
    if len(text) > WHOLE_TEXT:
        return _mask_gated_byte_lines(data, hits).decode("utf-8", "surrogateescape")
    for i in sorted({i for i, _ in hits}):
        text = _mask_one(SHAPES[i], text)
    return text


def mask_shapes_by_gates(text: str) -> str:
    """:func:`mask_shapes` with the standard library only: a shape is tried where one of its gate words is."""
    if len(text) < SHORTEST:
        return text
    lowered = text.lower()
    candidates = _candidates(text, lowered)
    if len(text) > WHOLE_TEXT and candidates:
        return _mask_gated_lines(text, lowered, candidates)
    for i in candidates:
        text = _mask_one(SHAPES[i], text)
    return text


def _mask_one(shape: Shape, text: str) -> str:
    return shape.mask(text) if not shape.also or any(a in text for a in shape.also) else text


def _mask_gated_lines(text: str, lowered: str, candidates: list[int]) -> str:
    """A big text: each candidate shape is tried on the lines that hold one of its gates, not on all of
    it (the patterns that cannot start with a literal scan at a few MB/s; the gates are found at GB/s).
    A shape that spans lines (a private key block) is tried on the whole text."""
    if len(lowered) != len(text):  # a character whose lower case is longer: positions differ, search it all
        lowered = ""
    lines: dict[int, set[int]] = {}  # line start -> the shapes to try on it
    whole: list[int] = []  # shapes tried on all of the text, after the lines (their masks move positions)
    for i in candidates:
        shape = SHAPES[i]
        if shape.spans_lines or not lowered and not shape.cased:
            whole.append(i)
            continue
        where = text if shape.cased else lowered
        for gate in shape.gate:
            pos = where.find(gate)
            while pos >= 0:
                start = text.rfind("\n", 0, pos) + 1
                lines.setdefault(start, set()).add(i)
                end = text.find("\n", pos)
                if end < 0:
                    break
                pos = where.find(gate, end)
    out: list[str] = []
    done = 0
    for start in sorted(lines):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        line = text[start:end]
        for i in sorted(lines[start]):
            line = _mask_one(SHAPES[i], line)
        out += (text[done:start], line)
        done = end
    out.append(text[done:])
    text = "".join(out)
    for i in whole:
        text = _mask_one(SHAPES[i], text)
    return text


def shapes_found(text: str) -> list[str]:
    """The names of the shapes found in ``text`` (for tests and for measuring false positives)."""
    lowered = text.lower()
    return [s.name for s in SHAPES if s.may_hold(text, lowered) and s.pattern.search(text)]


MAX_DEPTH = 64  # nesting of JSON-like data masked; deeper values are replaced, never recursed into


class Redactor:
    """Replaces known secret values and secrets of a known shape in text and in JSON-like data."""

    def __init__(self, values: set[str]) -> None:
        self.values = sorted((v for v in values if len(v) >= MIN_SEARCHED), key=len, reverse=True)

    def text(self, text: str) -> str:
        for value in self.values:
            if value in text:
                text = text.replace(value, MASK)
        return mask_shapes(text)

    def data(self, value: Any, depth: int = 0) -> Any:
        """Strings inside dicts, lists and tuples masked; dict keys too. Nesting deeper than
        :data:`MAX_DEPTH` (hostile input) is replaced by a note rather than recursed into."""
        if isinstance(value, str):
            return self.text(value)
        if depth >= MAX_DEPTH and isinstance(value, dict | list | tuple):
            return f"(nested deeper than {MAX_DEPTH} levels: not shown)"
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self.data(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.data(v, depth + 1) for v in value]
        return value


class RedactingStream:
    """A text stream (a rank's ``sys.stdout`` / ``sys.stderr``) that masks what is written through it,
    so that a secret never reaches the file the launcher keeps, even when the launcher is killed
    before it can mask the file afterwards. Everything but ``write`` / ``writelines`` is the wrapped
    stream's own (``fileno``, ``isatty``, ``encoding``, ``buffer``, ``flush``). Bytes written to
    ``.buffer`` or to the file descriptor from C are not seen here: the stream files are masked
    again when the rank exits."""

    def __init__(self, stream: Any, redactor: Redactor) -> None:
        self._stream = stream
        self._redactor = redactor

    @property
    def wrapped(self) -> Any:
        return self._stream

    def write(self, text: str) -> int:
        if isinstance(text, str) and text:
            self._stream.write(self._redactor.text(text))
        else:
            self._stream.write(text)  # the stream's own TypeError for bytes and the like
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __iter__(self) -> Any:
        return iter(self._stream)


def redact_file(path: str | os.PathLike[str], redactor: Redactor, chunk: int = 1 << 20) -> bool:
    """Rewrite a file with its secrets masked (a rank's stdout.log after it exited: what a subprocess or
    C code wrote past :class:`RedactingStream`), read in chunks cut at line ends. A file with nothing
    to mask is left untouched. True when it changed."""
    tmp = f"{os.fspath(path)}.redact{os.getpid()}"
    changed = False
    try:
        with open(path, "rb") as src:
            head = src.read(chunk)
            if len(head) < chunk and _masked(head, redactor) == head:
                return False  # the common case: a small file with nothing to mask, left untouched
            # 0600 whatever the umask: the file it replaces is one of the diag dir's (layout.PRIVATE_FILE_MODE)
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as dst:
                os.fchmod(dst.fileno(), 0o600)
                carry = b""
                while head or carry:
                    data = carry + head
                    head = src.read(chunk)
                    cut = data.rfind(b"\n") + 1 if head else len(data)
                    if cut == 0 and len(data) >= 16 * chunk:
                        cut = len(data)  # no line end in 16 chunks: masked as it is rather than held
                    piece, carry = data[:cut], data[cut:]
                    masked = _masked(piece, redactor)
                    changed = changed or masked != piece
                    dst.write(masked)
        if changed:
            os.replace(tmp, path)
        return changed
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _masked(data: bytes, redactor: Redactor) -> bytes:
    """A chunk of a stream file with its secrets masked: the known values as bytes, then the shapes on the
    lines that hold a gate (found by Hyperscan in one pass when it is installed, as it is on Linux x86_64 and
    aarch64; else by the text path)."""
    out = data
    for value in redactor.values:
        needle = value.encode("utf-8", "surrogateescape")
        if needle in out:
            out = out.replace(needle, MASK.encode())
    gates = _byte_gates()
    hits = gates.hits(out) if gates is not None else None
    if hits is None:
        text = out.decode("utf-8", "surrogateescape")
        masked = mask_shapes_by_gates(text)
        return out if masked == text else masked.encode("utf-8", "surrogateescape")
    return _mask_gated_byte_lines(out, hits)


class _ByteGates:
    """Every shape's prefilter in one Hyperscan database (case-insensitive where the shape's gate is)."""

    def __init__(self, hyperscan: Any) -> None:
        self.lock = threading.Lock()
        self.db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        self.db.compile(expressions=[s.prefilter.encode() for s in SHAPES], ids=list(range(len(SHAPES))),
                        elements=len(SHAPES),
                        flags=[0 if s.cased else hyperscan.HS_FLAG_CASELESS for s in SHAPES])  # fmt: skip

    def hits(self, data: bytes) -> list[tuple[int, int]] | None:
        """(shape index, the offset where its prefilter's match ends) for each match; None when another thread
        is scanning (one scratch space; never waited for: a rank's threads print, and a process forked while
        the lock was held must not hang on it)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            found: list[tuple[int, int]] = []
            self.db.scan(data, match_event_handler=_gate_hit, context=found)
            return found
        finally:
            self.lock.release()


def _gate_hit(shape: int, _start: int, end: int, _flags: int, found: list[tuple[int, int]]) -> None:
    found.append((shape, end))


_BYTE_GATES: list[_ByteGates | None] = []


def _byte_gates() -> _ByteGates | None:
    """The Hyperscan gates, built on first use (the worker never needs them: it masks a write at a time)."""
    if not _BYTE_GATES:
        try:
            import hyperscan  # type: ignore[import-not-found,import-untyped,unused-ignore]

            _BYTE_GATES.append(_ByteGates(hyperscan))
        except Exception:  # noqa: BLE001 - ImportError, hyperscan.error, a CPU it cannot run on: the text path
            _BYTE_GATES.append(None)
    return _BYTE_GATES[0]


def _mask_gated_byte_lines(data: bytes, hits: list[tuple[int, int]]) -> bytes:
    if not hits:
        return data
    lines: dict[int, set[int]] = {}
    whole: set[int] = set()
    for i, end in hits:
        if SHAPES[i].spans_lines:
            whole.add(i)  # a private key block spans lines: tried on the whole chunk
        else:
            lines.setdefault(data.rfind(b"\n", 0, end) + 1, set()).add(i)
    out: list[bytes] = []
    done = 0
    for start in sorted(lines):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        line = data[start:end].decode("utf-8", "surrogateescape")
        masked = line
        for i in sorted(lines[start]):
            masked = _mask_one(SHAPES[i], masked)
        out += (data[done:start], masked.encode("utf-8", "surrogateescape") if masked != line else data[start:end])
        done = end
    out.append(data[done:])
    result = b"".join(out)
    if whole:
        text = result.decode("utf-8", "surrogateescape")
        for i in sorted(whole):
            text = _mask_one(SHAPES[i], text)
        result = text.encode("utf-8", "surrogateescape")
    return result


def redact_files(paths: Sequence[str | os.PathLike[str]], redactor: Redactor | None = None) -> list[str]:
    """Mask the secrets in each existing file (the ranks' streams once they have exited); the ones rewritten."""
    redactor = redactor or current()
    return [os.fspath(p) for p in paths if os.path.exists(p) and redact_file(p, redactor)]


_CURRENT: Redactor | None = None


def current() -> Redactor:
    """The redactor of this process: its environment and its command line, read once."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Redactor(secret_values(os.environ, sys.argv))
    return _CURRENT

"""Secrets stay out of everything elastic_diag writes.

The values of environment variables whose names say they are secret (TOKEN, KEY, SECRET, PASSWORD,
CREDENTIAL, AUTH) and the values that follow such flags on a command line (``--hf-token X``,
``--api-key=X``) are replaced by ``***`` wherever they would appear in a file or store record of
ours: worker.json, exception.json, first_error.json, root_cause.json, report.json, report.html, the
node records in the rendezvous store, the termination message. The ranks' own stdout/stderr files
are what the ranks printed and are kept as they are. Values shorter than 4 characters are masked as
values of those variables and flags but not searched for in free text.

Standard library only: the worker bootstrap writes through it before the user's script runs.
"""

from __future__ import annotations

import os
import re
import sys
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


class Redactor:
    """Replaces known secret values in text and in JSON-like data."""

    def __init__(self, values: set[str]) -> None:
        self.values = sorted((v for v in values if len(v) >= MIN_SEARCHED), key=len, reverse=True)

    def text(self, text: str) -> str:
        for value in self.values:
            if value in text:
                text = text.replace(value, MASK)
        return text

    def data(self, value: Any) -> Any:
        """Strings inside dicts, lists and tuples masked; dict keys too."""
        if not self.values:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self.data(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.data(v) for v in value]
        return value


def redact_file(path: str | os.PathLike[str], redactor: Redactor, chunk: int = 1 << 20) -> bool:
    """Rewrite a file with the secrets masked (a rank's stdout.log after it exited: a script that
    prints its arguments); read in chunks that overlap by the longest value. True when it changed."""
    if not redactor.values:
        return False
    keep = max(len(v.encode()) for v in redactor.values) - 1
    needles = [v.encode() for v in redactor.values]
    changed = False
    tmp = f"{os.fspath(path)}.redact{os.getpid()}"
    try:
        with open(path, "rb") as src:
            head = src.read(chunk)
            if not any(n in head for n in needles) and len(head) < chunk:
                return False  # the common case: a small file with nothing to mask, left untouched
            # 0600 whatever the umask: the file it replaces is one of the diag dir's (layout.PRIVATE_FILE_MODE)
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as dst:
                os.fchmod(dst.fileno(), 0o600)
                carry = b""
                while head:
                    data = carry + head
                    for n in needles:
                        if n in data:
                            data = data.replace(n, MASK.encode())
                            changed = True
                    head = src.read(chunk)
                    cut = len(data) - keep if head and keep > 0 else len(data)
                    dst.write(data[:cut])
                    carry = data[cut:]
                dst.write(carry)
        if changed:
            os.replace(tmp, path)
        return changed
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def redact_files(paths: Sequence[str | os.PathLike[str]], redactor: Redactor | None = None) -> list[str]:
    """Mask the secrets in each existing file (the ranks' streams once they have exited); the ones rewritten."""
    redactor = redactor or current()
    if not redactor.values:
        return []
    return [os.fspath(p) for p in paths if os.path.exists(p) and redact_file(p, redactor)]


_CURRENT: Redactor | None = None


def current() -> Redactor:
    """The redactor of this process: its environment and its command line, read once."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Redactor(secret_values(os.environ, sys.argv))
    return _CURRENT

"""The container's termination message: the verdict in one paragraph, for ``kubectl describe pod``.

Kubernetes reads at most 4,096 bytes from the file at the container's ``terminationMessagePath``
(``/dev/termination-log`` unless the pod spec says otherwise) when the container ends, and shows them
as the container's ``Last State: Terminated ... Message:``. The paragraph names the culprit rank, its
node (the pod), the failure class, the signature and where the full report is; every agent writes
its own node's view, and the leader's is the merged verdict of every node.

:func:`termination_message` is pure; :func:`write_termination_message` and
:func:`termination_log_problem` are the file's edges and never raise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from elastic_diag import redaction

MAX_BYTES = 4096  # what the kubelet keeps of the file


def termination_message(report: dict[str, Any], report_path: str, *, limit: int = MAX_BYTES) -> str:
    """One paragraph, at most ``limit`` bytes of UTF-8; the report's place is never cut off."""
    d = report.get("diagnosis") or {}
    status = report.get("status", "failed")
    where = f" Report: {report_path}"
    if status == "succeeded":
        head = f"elastic_diag: job succeeded on {report.get('node')}."
        return _fit(head, "", where, limit)
    if status == "stopped":
        head = "elastic_diag: job STOPPED from outside (no rank failed):"
    elif d.get("initiating_rank") is not None:
        head = (f"elastic_diag: job FAILED: initiating rank {d['initiating_rank']} on {d.get('initiating_node')}: "
                f"{d.get('failure_class')}")  # fmt: skip
    else:
        head = f"elastic_diag: job FAILED: no rank could be named: {d.get('failure_class')}"
    if status != "stopped":
        extra = [x for x in (d.get("exception_type"), d.get("signature_id") and f"signature {d['signature_id']}") if x]
        head += (f" ({', '.join(extra)})" if extra else "") + "."
    body = " ".join(str(d.get("summary") or "").split())
    if d.get("suspected_rank") is not None:
        body += f" Suspected, not proven: rank {d['suspected_rank']}."
    if d.get("fix"):
        body += " Fix: " + " ".join(str(d["fix"]).split())
    return _fit(head, " " + body if body else "", where, limit)


def _fit(head: str, body: str, tail: str, limit: int) -> str:
    """head + body + tail within ``limit`` bytes: the body is cut first (with an ellipsis), then the head."""

    def size(text: str) -> int:
        return len(text.encode("utf-8"))

    room = limit - size(head) - size(tail)
    if size(body) > room:
        cut = body.encode("utf-8")[: max(0, room - len(b" ..."))].decode("utf-8", "ignore")
        body = cut + " ..." if room >= 4 else ""
    text = head + body + tail
    if size(text) > limit:  # a head longer than the limit (it is not): keep the report's place
        text = head.encode("utf-8")[: max(0, limit - size(tail))].decode("utf-8", "ignore") + tail
    return text


def termination_log_problem(path: Path) -> str | None:
    """Why ``path`` cannot take the message (None when it can). Appends nothing: an existing file
    is opened for appending and closed, a missing one is looked at through its folder."""
    try:
        if path.is_dir():
            return f"{path} is a folder"
        if path.exists():
            with open(path, "a", encoding="utf-8"):
                return None
        parent = path.parent
        if not parent.is_dir():
            return f"its folder {parent} does not exist"
        if not os.access(parent, os.W_OK):
            return f"its folder {parent} is not writable"
        return None
    except OSError as e:
        return f"{e.strerror or e}"


def write_termination_message(path: Path, text: str) -> str | None:
    """Write the message (replacing the file's content, as Kubernetes expects); the error, if any."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(redaction.current().text(text))
        return None
    except OSError as e:
        return f"writing the termination message to {path}: {e.strerror or e}"

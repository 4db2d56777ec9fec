"""The error file torch's "Root Cause (first observed failure)" is pointed at: torch names the rank whose
failure it saw first, often one that only waited; after the verdict, the launcher's failure list is
reordered so that the initiating rank comes first, with its own error file (``root_cause.json``, torchelastic's
error-file shape) holding the verdict, its traceback or its stack. torch then prints it, and copies it to the
launcher's own error file, as it would the rank's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_diag.core.evidence import AttemptEvidence
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.layout import ROOT_CAUSE_FILE, write_json_atomic

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


def corrected_failures(
    failures: dict[int, ProcessFailure], evidence: AttemptEvidence, diagnosis: Diagnosis, *, rank_dirs: dict[int, Path],
    diag_dir: Path,
) -> dict[int, ProcessFailure]:  # fmt: skip
    """torch's failure list (by global rank) with the initiating rank first and its error file written;
    unchanged when that rank is not in it. ``rank_dirs``: each local rank's evidence folder."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    root = diagnosis.initiating_rank
    if root not in failures:
        return failures
    old = failures[root]
    ev = evidence.rank(root)
    earliest = min(f.timestamp for f in failures.values())
    detail = [f"elastic_diag: rank {root} is the initiating rank ({diagnosis.failure_class}).", diagnosis.summary]
    if ev is not None and ev.exception is not None and ev.exception.traceback:
        detail.append(ev.exception.traceback.rstrip())
    elif ev is not None and ev.stack is not None:
        detail.append("Its stack when the launcher took the verdict:")
        detail.append(ev.stack.for_people().rstrip()[:8000])
    elif ev is not None:
        detail.append("Last lines of its stderr:")
        detail.extend(f"  {line}" for line in ev.stderr_tail[-15:])
    detail.append(f"Evidence: {diag_dir}")
    root_file = rank_dirs[old.local_rank] / ROOT_CAUSE_FILE
    data: dict[str, Any] = {
        "message": {
            "message": diagnosis.summary,
            "extraInfo": {"py_callstack": "\n".join(detail), "timestamp": str(earliest)},
            "errorCode": old.exitcode,
        }
    }
    write_json_atomic(root_file, data, indent=None)
    fixed = ProcessFailure(local_rank=old.local_rank, pid=old.pid, exitcode=old.exitcode, error_file=str(root_file))
    ordered = {root: fixed}
    ordered.update((r, f) for r, f in failures.items() if r != root)
    return ordered

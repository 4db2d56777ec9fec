"""The command line of ``torchrun-diag``: torch's own torchrun parser (so every torchrun flag and its ``PET_*``
environment fallback works) with elastic_diag's ``--diag-*`` group and ``--no-diag``. The launcher parses it,
and the relaunch of a verification command splits a recorded command line with it.
"""

from __future__ import annotations

import argparse


def get_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    from elastic_diag import __version__

    parser = get_args_parser()
    parser.prog = "torchrun-diag"
    parser.description = "torchrun with elastic_diag: names the rank that failed first, keeps its evidence."
    group = parser.add_argument_group("elastic_diag", "Diagnosis options (all torchrun options above work as usual)")
    group.add_argument(
        "--diag-dir",
        default=None,
        help="Folder for the run's evidence and report.json (env ELASTIC_DIAG_DIR; default: a new folder "
        "under ./elastic_diag_runs/).",
    )
    group.add_argument(
        "--diag-grace",
        type=float,
        default=None,
        help="Seconds to let other ranks exit on their own after the first failure, before their stacks "
        "are taken and the group is torn down (env ELASTIC_DIAG_GRACE; default 5).",
    )
    group.add_argument(
        "--diag-stack-timeout",
        type=float,
        default=None,
        help="Seconds to wait for the stack dumps of ranks still alive (default 2).",
    )
    group.add_argument(
        "--diag-hang-timeout",
        default=None,
        metavar="auto|off|SECONDS",
        help="Call a hang when no rank has made progress (steps, backward, collectives, heartbeats) for this "
        "long: take every rank's stacks and flight recorder, then stop the group. 'auto' (default): 10x the "
        "median step time, at least 60 s, 600 s before 3 steps (env ELASTIC_DIAG_HANG_TIMEOUT).",
    )
    group.add_argument(
        "--diag-stall-timeout",
        default=None,
        metavar="auto|off|SECONDS",
        help="When no rank has made progress for this long while one waits in a collective, take every rank's "
        "stacks and flight recorder WITHOUT stopping anything (a stall record; a warning if progress resumes, "
        "the evidence of the verdict if the job then fails). 'auto' (default): 3x the median step time, at least "
        "5 s, 30 s before 3 steps; at most one snapshot a minute (env ELASTIC_DIAG_STALL_TIMEOUT).",
    )
    group.add_argument(
        "--diag-restart-policy",
        default=None,
        metavar="never|always|verified|MODULE:CALLABLE",
        help="Whether a failed attempt may restart (with --max-restarts): 'verified' (default) restarts only "
        "a failure that is not deterministic, after the verification controls pass, and never into the same "
        "failure unless the checkpoint advanced; 'always' is torchrun's behaviour; or your own policy "
        "(env ELASTIC_DIAG_RESTART_POLICY).",
    )
    group.add_argument(
        "--diag-verify",
        action="append",
        default=None,
        metavar="CONTROL",
        help="A verification control to pass before a restart (repeatable): collective, checkpoint, disk, "
        "signature, or a shell command that must exit 0 (default: collective, plus checkpoint and disk with "
        "--diag-checkpoint-dir).",
    )
    group.add_argument(
        "--diag-checkpoint-dir",
        default=None,
        help="Where the job writes its checkpoints: checked by the checkpoint and disk controls; its newest "
        "entry is passed to the next attempt as ELASTIC_DIAG_RESUME_FROM.",
    )
    group.add_argument(
        "--diag-verify-timeout", type=float, default=None, help="Deadline of each control in seconds (default 120)."
    )
    group.add_argument(
        "--diag-verify-retries", type=int, default=None, help="Retries of a failing control, with backoff (default 2)."
    )
    group.add_argument(
        "--diag-config",
        default=None,
        metavar="TOML",
        help="A TOML file with a [tool.elastic_diag] table of these settings (default: ./pyproject.toml when it "
        "has one; env ELASTIC_DIAG_CONFIG). The command line and the environment win.",
    )
    group.add_argument(
        "--diag-tail-lines", type=int, default=None, help="Lines of each rank's stderr kept in the report (default 40)."
    )
    group.add_argument(
        "--diag-requeue-exit-code",
        default=None,
        metavar="N",
        help="Exit with N (1-255, e.g. 75) when the failure is retryable but no restart can mend it here (restarts "
        "used up, the gate refused, a node lost), so Slurm's RequeueExit= or a retry loop requeues the job; a "
        "deterministic failure exits 1 as torchrun does (env ELASTIC_DIAG_REQUEUE_EXIT_CODE).",
    )
    group.add_argument(
        "--diag-ledger",
        default=None,
        metavar="PATH|URL|off",
        help="Append every attempt's verdict to this ledger: a SQLite file (the default: "
        "$XDG_STATE_HOME/elastic_diag/ledger.sqlite) or postgresql://... for a team; `elastic-diag fleet` reads it "
        "(env ELASTIC_DIAG_LEDGER).",
    )
    group.add_argument(
        "--diag-notify",
        default=None,
        metavar="URL",
        help="POST a failed run's verdict as JSON to URL (a Slack- or Teams-compatible `text` and the structured "
        "verdict; bounded in time, never changes the exit status; env ELASTIC_DIAG_NOTIFY).",
    )
    group.add_argument(
        "--diag-notify-cmd",
        default=None,
        metavar="CMD",
        help="Run CMD REPORT_PATH (no shell) after a failed run's verdict (env ELASTIC_DIAG_NOTIFY_CMD).",
    )
    group.add_argument(
        "--diag-known-good",
        default=None,
        metavar="PATH",
        help="After a failed run's verdict, compare its logs with this good run of the same job (a diag dir, a log "
        "dir or file): each rank's first line that the good run never printed, in the report (env "
        "ELASTIC_DIAG_KNOWN_GOOD; with the ledger on and none given, the last successful run of the same job).",
    )
    group.add_argument(
        "--diag-drain",
        action="store_true",
        default=None,
        help="Under Slurm, when a failure blamed on the node asks for a requeue and the ledger recommends excluding "
        "that node, drain it first (scontrol update NodeName=... State=DRAIN; needs Slurm operator rights) so the "
        "requeued job starts without it; said when refused (env ELASTIC_DIAG_DRAIN=1).",
    )
    group.add_argument(
        "--diag-termination-log",
        default=None,
        metavar="PATH|auto|off",
        help="Write the verdict's one-paragraph summary (at most 4096 bytes) here when the run ends, for "
        "`kubectl describe pod` ('auto', the default: /dev/termination-log when it exists; env "
        "ELASTIC_DIAG_TERMINATION_LOG).",
    )
    group.add_argument("--no-diag", action="store_true", help="Run exactly as plain torchrun, with no diagnosis.")
    group.add_argument("--version", action="version", version=f"torchrun-diag {__version__}")
    return parser

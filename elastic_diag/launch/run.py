"""``torchrun-diag``: torchrun with diagnosis. Same as ``elastic-diag run`` and ``python -m elastic_diag.run``.

Every torchrun flag comes from torch's own parser (``torch.distributed.run.get_args_parser``), so
``PET_*`` environment fallbacks keep working; elastic_diag adds the ``--diag-*`` group and
``--no-diag`` (behave exactly as plain torchrun, for A/B comparisons).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import logging
import os
import shutil
import sys
import traceback
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from elastic_diag.errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
)
from elastic_diag.launch.arguments import get_parser
from elastic_diag.layout import ENV_SWITCH

if TYPE_CHECKING:
    from elastic_diag.ledger.tell import TellOptions
    from elastic_diag.report.session import DiagSession, RunEnd

logger = logging.getLogger("elastic_diag")


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        return  # resolved by the worker's interpreter; a missing module fails there with its own message
    if args.no_python:
        if os.path.isfile(script) or shutil.which(script):
            return
        raise UsageError(f"the program {script!r} is not a file and not on PATH")
    if not os.path.isfile(script):
        raise UsageError(f"the training script {script!r} does not exist (working directory: {os.getcwd()})")


def _prepare_rdzv(args: argparse.Namespace) -> None:
    """What ``torch.distributed.run.run`` does to the args before ``config_from_args`` (torch 2.13.0)."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def run_plain_torchrun(args: argparse.Namespace) -> int:
    """torch's own ``torchrun`` on the same arguments: ``--no-diag``, and a diag dir that cannot be written."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run

    record(run)(args)
    return EXIT_OK


def _print_summary(report: dict[str, object], path: str, unwritten: dict[str, str]) -> None:
    from elastic_diag.report.summary import print_summary  # loaded after the run, not before the ranks start

    print_summary(report, path, unwritten=unwritten)


def run_diagnosed(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    # torch is in (the parser is torchrun's): what it built lives as long as the launcher, so the collector
    # need not walk it again and again (a full collection over torch's objects takes 0.1 to 0.2 s here;
    # the imports below cost 0.2 s less CPU with it); frozen again once the session is open
    gc.freeze()
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler
    from torch.distributed.run import config_from_args

    from elastic_diag.agent.agent import defer_stop_signals
    from elastic_diag.config import ENV_DIAG_DIR, DiagConfig
    from elastic_diag.gate.policy import load_policy
    from elastic_diag.launch.launcher import launch_agent
    from elastic_diag.launch.relaunch import job_facts
    from elastic_diag.launch.setup import open_session

    _check_script(args)
    config = DiagConfig.resolve(
        diag_dir=args.diag_dir,
        grace_s=args.diag_grace,
        stack_timeout_s=args.diag_stack_timeout,
        tail_lines=args.diag_tail_lines,
        hang_timeout=args.diag_hang_timeout,
        stall_timeout=args.diag_stall_timeout,
        restart_policy=args.diag_restart_policy,
        verify=args.diag_verify,
        checkpoint_dir=args.diag_checkpoint_dir,
        verify_timeout_s=args.diag_verify_timeout,
        verify_retries=args.diag_verify_retries,
        config_file=args.diag_config,
        requeue_exit_code=args.diag_requeue_exit_code,
        termination_log=args.diag_termination_log,
    )
    load_policy(config.restart_policy)  # a usage error before anything starts (open_session loads it again)
    from elastic_diag.launch.known_good import ENV_KNOWN_GOOD
    from elastic_diag.ledger.tell import TellOptions

    known_good = args.diag_known_good or os.environ.get(ENV_KNOWN_GOOD, "").strip() or None
    tell_options = TellOptions.resolve(ledger=args.diag_ledger, notify=args.diag_notify,
                                       notify_cmd=args.diag_notify_cmd,
                                       drain=args.diag_drain)  # fmt: skip
    config.check_folder_path()
    problem = config.writable_problem()
    if problem is not None:  # the job comes first: it runs as plain torchrun would, and exits as it would
        print(f"torchrun-diag: warning: {problem}; the job runs WITHOUT diagnosis, as plain torchrun "
              f"(pass --diag-dir DIR or set {ENV_DIAG_DIR} to a folder you can write)", file=sys.stderr)  # fmt: skip
        return run_plain_torchrun(args)
    _prepare_rdzv(args)
    try:
        launch_config, cmd, cmd_args = config_from_args(args)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise UsageError(str(e)) from e
    session, launch_config.logs_specs = open_session(config, run_id=launch_config.run_id or "",
                                                     logs_specs=launch_config.logs_specs,
                                                     job=job_facts("torchrun-diag", config, argv))  # fmt: skip
    gc.freeze()
    if args.logs_specs:
        session.note(f"--logs-specs {args.logs_specs} was replaced by elastic_diag's own (it keeps every stream)")
    error_handler = ErrorHandler()
    error_handler.initialize()
    try:
        launch_agent(launch_config, cmd, list(cmd_args), session=session)
    except ChildFailedError as e:
        end = session.end("failed")
        _, root = e.get_first_failure()
        if root.error_file != "<N/A>" and os.path.isfile(root.error_file):
            try:
                error_handler.dump_error_file(root.error_file, root.exitcode)
            except Exception as copy_error:
                session.internal_error("copying the root cause into the launcher's error file", copy_error)
        print(str(e), file=sys.stderr)
        return _announce(end, session, tell_options, known_good)
    except SignalException as e:  # scancel, a time limit, preemption, an eviction, Ctrl-C
        end = session.end("stopped", signum=int(e.sigval))
        defer_stop_signals(exiting=True)  # a late repeat of the signal must not turn exit 143 into a kill
        return _announce(end, session, tell_options, known_good)
    except BaseException as e:
        end = session.end("failed", launch_error="".join(traceback.format_exception(e)))
        if end.exit_code != EXIT_FAILED:  # a rendezvous timeout that asks for a requeue
            traceback.print_exception(e)
            return _announce(end, session, tell_options, known_good)
        _announce(end, session, tell_options, known_good)
        raise
    return _announce(session.end("succeeded"), session, tell_options, known_good)


def _announce(end: RunEnd, session: DiagSession, tell_options: TellOptions, known_good: str | None = None) -> int:
    """The summary, then the requeue decision's line, on stderr; then the verdict recorded in the ledger and told
    (bounded, never changes the exit status); then, for a failure, the comparison with a known-good run; the exit
    status."""
    _print_summary(end.report, str(session.report_path), session.unwritten)
    if end.requeue_line:
        print(end.requeue_line, file=sys.stderr)
    from elastic_diag.ledger.tell import after_verdict

    try:
        lines = after_verdict(end.report, str(session.report_path), tell_options, source="torchrun-diag",
                              diag_dir=session.report_path.parent)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the job's outcome comes first
        lines = [f"the verdict was not recorded or told: {e!r}"]
    for line in lines:
        print(f"torchrun-diag: {line}", file=sys.stderr)
    if str(end.report.get("status")) != "succeeded":
        from elastic_diag.launch.known_good import compare_after_verdict

        try:
            compared = compare_after_verdict(end.report, session.report_path.parent, known_good, tell_options.ledger)
        except Exception as e:  # noqa: BLE001 - the job's outcome comes first
            compared = [f"the comparison with a known-good run failed: {e!r}"]
        for line in compared:
            print(f"torchrun-diag: {line}", file=sys.stderr)
    return end.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = get_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.logs_specs is None and os.environ.get("PET_LOGS_SPECS"):  # the one torchrun flag torch reads no PET_ for
        args.logs_specs = os.environ["PET_LOGS_SPECS"]
    # ELASTIC_DIAG=1 turns diagnosis on under plain torchrun; torchrun-diag builds its own agent (and
    # --no-diag means none), so the switch's wrapped rendezvous must not select another one
    os.environ.pop(ENV_SWITCH, None)
    if args.no_diag:
        return run_plain_torchrun(args)
    try:
        return run_diagnosed(args, argv)
    except UsageError as e:
        print(f"torchrun-diag: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def exit_now(code: int) -> NoReturn:
    """Leave with ``code`` as soon as the launcher's work is done (the report written, the summary
    printed): the atexit handlers run (logging's flush, a caller's own) and the console streams are
    flushed, but not Python's finalization, which in a process that imported torch tears its modules
    down one by one for 0.9 to 1.1 s of CPU (measured here: python benchmarks/launcher.py phases)."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _entry() -> None:
    exit_now(main())


if __name__ == "__main__":
    _entry()

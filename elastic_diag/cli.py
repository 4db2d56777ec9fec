"""``elastic-diag``: the command-line front door.

Subcommands: ``run`` (the same as ``torchrun-diag``), ``analyze PATH...`` (offline, no torch),
``report DIR`` (render report.html), ``verify DIR`` (show the report's verification command and where it
comes from, ask, run it if it is on the allow-list, record the outcome: gate/report_command.py),
``signatures`` (list the taxonomy), ``explain ID`` (one signature as a page), ``exec -- COMMAND`` (one rank
started by srun / mpirun under a watch, or a command that spawns its ranks: launch/exec_command.py).
``main(argv) -> parse -> subcommand``; only ``main`` touches the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_diag.errors import EXIT_FAILED, EXIT_NOT_RUN, EXIT_OK, EXIT_USAGE, CommandRefused, ElasticDiagError


def explain_text(sid: str) -> str:
    from elastic_diag.core.taxonomy import load_taxonomy

    sig = load_taxonomy().get(sid)

    def wrap(text: str) -> str:
        return textwrap.fill(" ".join(text.split()), width=96)

    from elastic_diag.report.checklist import signature_checklist

    out = [f"{sig.id}: {sig.title}", f"class: {sig.failure_class}    role: {sig.role_hint}    "
           f"retryable: {'yes' if sig.retryable else 'no'}", ""]  # fmt: skip
    out.append("Checklist (in this order):")
    for i, (title, lines) in enumerate(signature_checklist(sig), start=1):
        label = f"  {i}. {title}" if title != "Where" else "  where"
        out.append(label + ":")
        out.extend(f"       {line}" for line in lines if line)
    out.append("")
    if sig.patterns or sig.exception_types or sig.signals:
        out.append("Recognised by:")
        out.extend(f"  line matching  {p.pattern}" for p in sig.patterns)
        out.extend(f"  exception      {t}" for t in sig.exception_types if t != "*")
        out.extend(f"  signal         {s}" for s in sig.signals)
        out.append("")
    out += ["What it means:", textwrap.indent(wrap(sig.meaning), "  "), "", "How to confirm:"]
    for item in sig.confirm:
        out.append(textwrap.fill(item, width=94, initial_indent="  - ", subsequent_indent="    "))
    out += ["", "Fix:", textwrap.indent(wrap(sig.fix), "  ")]
    if sig.siblings:
        out += ["", "Look-alikes: " + ", ".join(sig.siblings)]
    return "\n".join(out)


def _cmd_signatures(args: argparse.Namespace) -> int:
    from elastic_diag.core.taxonomy import load_taxonomy

    if args.write_docs:
        from elastic_diag.report.signature_docs import write_docs

        names = write_docs(Path(args.write_docs))
        print(f"wrote {len(names)} pages to {args.write_docs}")
        return EXIT_OK

    for sig in sorted(load_taxonomy(), key=lambda s: (s.failure_class, s.id)):
        print(f"{sig.id:32} {sig.failure_class:20} {sig.role_hint:11} {sig.title}")
    return EXIT_OK


def _cmd_explain(args: argparse.Namespace) -> int:
    try:
        print(explain_text(args.signature_id))
    except KeyError:
        print(f"elastic-diag: error: no signature {args.signature_id!r}; see `elastic-diag signatures`",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    return EXIT_OK


def _cmd_analyze(args: argparse.Namespace) -> int:
    import json

    from elastic_diag import redaction
    from elastic_diag.offline.analyze import analyze_paths, format_analysis
    from elastic_diag.report.terminal import Paint, Progress, wants_colour

    missing = [p for p in args.paths if not os.path.exists(p)]
    if len(missing) == len(args.paths):
        print(f"elastic-diag: error: no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return EXIT_USAGE
    with Progress("elastic-diag analyze", sys.stderr) as progress:
        analysis = analyze_paths(args.paths, progress=progress.update)
        if args.known_good:
            from elastic_diag.offline.divergence import with_known_good

            analysis = with_known_good(analysis, args.paths, args.known_good, insist=args.known_good_anyway,
                                       progress=progress.update)  # fmt: skip
    if args.json:
        print(json.dumps(redaction.current().data(analysis.to_json()), indent=2))  # JSON escapes control characters
    else:
        print(format_analysis(analysis, Paint(wants_colour(sys.stdout))))
    if not analysis.files:
        print(f"elastic-diag: error: nothing readable in {', '.join(args.paths)}", file=sys.stderr)
        return EXIT_USAGE
    if args.record:
        _record_analysis(analysis, args)
    return EXIT_FAILED if analysis.failure_seen else EXIT_OK


def _record_analysis(analysis: Any, args: argparse.Namespace) -> None:
    """``analyze --record``: the verdict in the ledger, as one attempt of a run named by the files analysed (the
    same files again replace it)."""
    import hashlib

    from elastic_diag.ledger.tell import TellOptions, record_verdict

    data = analysis.to_json()
    paths = sorted(os.path.abspath(p) for p in args.paths)
    run_id = "analyze:" + hashlib.sha256("\0".join(paths).encode()).hexdigest()[:16]
    report = {"run_id": run_id, "status": "failed" if analysis.failure_seen else "succeeded",
              "diagnosis": data.get("diagnosis"), "ranks": data.get("ranks")}  # fmt: skip
    options = TellOptions.resolve(ledger=args.diag_ledger)
    for line in record_verdict(report, paths[0], options, source="analyze"):
        print(f"elastic-diag: {line}", file=sys.stderr)


def _diag_dir(arg: str) -> Path | None:
    """A diag dir given as the folder or its report.json; None (and the error said) when there is none."""
    diag_dir = Path(arg)
    if diag_dir.is_file() and diag_dir.name.endswith(".json"):
        diag_dir = diag_dir.parent
    if not diag_dir.is_dir():
        print(f"elastic-diag: error: no such folder: {arg}", file=sys.stderr)
        return None
    return diag_dir


def _cmd_report(args: argparse.Namespace) -> int:
    from elastic_diag.layout import HTML_FILE, write_atomic
    from elastic_diag.report.html import render_html
    from elastic_diag.report.reading import load_report_dir
    from elastic_diag.report.terminal import shown

    diag_dir = _diag_dir(args.diag_dir)
    if diag_dir is None:
        return EXIT_USAGE
    report, problems = load_report_dir(diag_dir)
    page = render_html(report, problems, source=str(diag_dir / "report.json"))
    for p in problems:
        print(f"elastic-diag: {shown(p)}", file=sys.stderr)
    if args.output == "-":
        from elastic_diag import redaction

        sys.stdout.write(redaction.current().text(page))  # as write_atomic masks what goes to a file
        return EXIT_OK
    path = Path(args.output) if args.output else diag_dir / HTML_FILE
    try:
        write_atomic(path, page)
    except OSError as e:  # a read-only or full diag dir: nothing there is lost, the page goes elsewhere
        print(f"elastic-diag: error: cannot write {shown(str(path))} ({e.strerror or e}); pass --output FILE to "
              "write the page elsewhere, or --output - for stdout", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    print(shown(str(path)))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from elastic_diag.gate.rerun import pending_verification, verify_diag_dir
    from elastic_diag.redaction import MASK
    from elastic_diag.report.terminal import Progress, printable, shown

    diag_dir = _diag_dir(args.diag_dir)
    if diag_dir is None:
        return EXIT_USAGE
    if not 1 <= args.timeout <= 86_400:
        print(f"elastic-diag: error: --timeout {args.timeout:g}: must be between 1 and 86400 seconds", file=sys.stderr)
        return EXIT_USAGE
    pending = pending_verification(diag_dir)
    if pending.command:  # a report is data: show what it would run and where it comes from, then ask
        print(f"elastic-diag verify: {printable(pending.describe())}", file=sys.stderr)
        if MASK in pending.command:
            print(f"elastic-diag: not run: the command holds a secret masked as {MASK} when the report was written; "
                  "run it yourself with the real value", file=sys.stderr)  # fmt: skip
            return EXIT_NOT_RUN
        if pending.parsed.unreadable is not None or (pending.parsed.refusals and not args.allow_any_command):
            print("elastic-diag: refused: not run (see above); read it and run it yourself, or pass "
                  "--allow-any-command to run it here (still without a shell)", file=sys.stderr)  # fmt: skip
            return EXIT_NOT_RUN
        if not args.yes and not _yes_on_terminal():
            return EXIT_NOT_RUN
    with Progress(f"elastic-diag verify: running the verification of {diag_dir} (at most {args.timeout:g} s)",
                  sys.stderr):  # fmt: skip
        record = verify_diag_dir(diag_dir, timeout_s=args.timeout, allow_any_command=args.allow_any_command,
                                 pending=pending)  # fmt: skip
    if record.get("command"):
        from elastic_diag.gate.rerun import shown_command

        print(f"ran: {printable(shown_command(record['command']))}")
    print(("PASSED: " if record["passed"] else "FAILED: ") + shown(str(record["summary"])))
    if record.get("output_file"):
        print(f"output: {shown(str(record['output_file']))} ({record.get('output_bytes', 0)} bytes)")
    if record.get("not_recorded"):
        print(f"elastic-diag: the outcome is not recorded: {shown(str(record['not_recorded']))}", file=sys.stderr)
    else:
        print(f"recorded in {diag_dir / 'report.json'} (verification)")
    return EXIT_OK if record["passed"] else EXIT_FAILED


def _cmd_exec(args: argparse.Namespace) -> int:
    from elastic_diag.launch.exec_command import run_exec

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not 0 <= args.diag_grace <= 3600:
        print(f"elastic-diag: error: --diag-grace {args.diag_grace:g}: must be between 0 and 3600 seconds",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    from elastic_diag.config import (
        ENV_HANG_TIMEOUT,
        ENV_REQUEUE_EXIT_CODE,
        ENV_STALL_TIMEOUT,
        parse_hang_timeout,
        parse_requeue_exit_code,
    )

    requeue = (parse_requeue_exit_code(args.diag_requeue_exit_code) if args.diag_requeue_exit_code is not None
               else parse_requeue_exit_code(os.environ.get(ENV_REQUEUE_EXIT_CODE), ENV_REQUEUE_EXIT_CODE))  # fmt: skip
    from elastic_diag.ledger.tell import TellOptions

    tell_options = TellOptions.resolve(ledger=args.diag_ledger, notify=args.diag_notify,
                                       notify_cmd=args.diag_notify_cmd,
                                       drain=args.diag_drain)  # fmt: skip

    return run_exec(command, diag_dir=args.diag_dir, grace_s=args.diag_grace,
                    hang_timeout_s=parse_hang_timeout(args.diag_hang_timeout or os.environ.get(ENV_HANG_TIMEOUT, ""),
                                                      "--diag-hang-timeout"),
                    stall_timeout_s=parse_hang_timeout(args.diag_stall_timeout
                                                       or os.environ.get(ENV_STALL_TIMEOUT, ""),
                                                       "--diag-stall-timeout"),
                    requeue_exit_code=requeue, tell_options=tell_options)  # fmt: skip


def _ledger_flags(parser: argparse.ArgumentParser, notify: bool = True) -> None:
    parser.add_argument(
        "--diag-ledger",
        metavar="PATH|URL|off",
        help="the ledger of verdicts: a SQLite file (default "
        "$XDG_STATE_HOME/elastic_diag/ledger.sqlite) or postgresql://... (env ELASTIC_DIAG_LEDGER)",
    )
    if notify:
        parser.add_argument("--diag-notify", metavar="URL",
                            help="POST a failed verdict as JSON to URL (Slack / Teams `text` and the verdict's fields; "
                            "env ELASTIC_DIAG_NOTIFY)")  # fmt: skip
        parser.add_argument(
            "--diag-notify-cmd",
            metavar="CMD",
            help="run CMD REPORT_PATH after a failed verdict (no shell; env ELASTIC_DIAG_NOTIFY_CMD)",
        )
        parser.add_argument(
            "--diag-drain",
            action="store_true",
            default=None,
            help="under Slurm, drain a node the ledger recommends excluding before a requeue asked for by a failure "
            "blamed on it (needs Slurm operator rights; env ELASTIC_DIAG_DRAIN=1)",
        )


def _cmd_fleet(args: argparse.Namespace) -> int:
    from elastic_diag.ledger.fleet import ExclusionRule, fleet_view, view_json
    from elastic_diag.ledger.fleet_page import fleet_html, fleet_text
    from elastic_diag.ledger.store import Ledger, LedgerError, ledger_url

    url = ledger_url(args.diag_ledger)
    if url is None:
        print("elastic-diag: error: the ledger is off (--diag-ledger off or ELASTIC_DIAG_LEDGER=off)", file=sys.stderr)
        return EXIT_USAGE
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        print(f"elastic-diag: error: no ledger at {url.removeprefix('sqlite:///')} (no verdict recorded yet; "
              "--diag-ledger PATH|URL names another)", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    rule = ExclusionRule(window_days=args.window_days, min_node_failures=args.min_node_failures,
                         widespread_hosts=args.widespread_hosts, hold_days=args.hold_days)  # fmt: skip
    ledger = Ledger(url)
    try:
        view = fleet_view(ledger, rule)
    except LedgerError as e:
        print(f"elastic-diag: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        ledger.close()
    for note in ledger.notes:
        print(f"elastic-diag: {note}", file=sys.stderr)
    from elastic_diag.layout import write_atomic

    if args.html:
        write_atomic(Path(args.html), fleet_html(view), redact=False)
    if args.prometheus:
        from elastic_diag.ledger.fleet import prometheus_text

        write_atomic(Path(args.prometheus), prometheus_text(view), redact=False)
    print(view_json(view) if args.json else fleet_text(view))
    if args.apply:
        return _drain(view)
    return EXIT_OK


def _drain(view: dict[str, Any]) -> int:
    """``--apply``: each recommended host drained with scontrol (its reason says why); exit 1 if one was not."""
    import shutil
    import subprocess

    from elastic_diag.ledger.fleet import drain_reason, scontrol_drain

    if not view["exclude"]:
        return EXIT_OK
    if shutil.which("scontrol") is None:
        print("elastic-diag: error: --apply: scontrol is not on PATH (this is not a Slurm host)", file=sys.stderr)
        return EXIT_FAILED
    why = {h["host"]: h["why"] for h in view["hosts"]}
    failed = 0
    for host in view["exclude"]:
        argv = scontrol_drain(host, drain_reason(why.get(host, "")))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0:
            print(f"elastic-diag: drained {host}", file=sys.stderr)
        else:
            failed += 1
            print(f"elastic-diag: could not drain {host}: {done.stderr.strip()[:200]}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _yes_on_terminal() -> bool:
    """Ask on the terminal whether to run it; with no terminal to ask, say how to say yes. True: run."""
    if not sys.stdin.isatty():
        print("elastic-diag: not run: stdin is not a terminal, so nobody can be asked; read the command above "
              "and pass --yes to run it", file=sys.stderr)  # fmt: skip
        return False
    print("Run it? [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    if answer.strip().lower() in ("y", "yes"):
        return True
    print("elastic-diag: not run (the answer was not yes)", file=sys.stderr)
    return False


def get_parser() -> argparse.ArgumentParser:
    from elastic_diag import __version__

    parser = argparse.ArgumentParser(prog="elastic-diag", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"elastic-diag {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="torchrun with diagnosis (same as torchrun-diag)", add_help=False)
    signatures = sub.add_parser("signatures", help="list the failure signatures")
    signatures.add_argument("--write-docs", metavar="DIR", help="write the reference pages (docs/signatures)")
    signatures.set_defaults(func=_cmd_signatures)
    analyze = sub.add_parser("analyze", help="diagnose a failed job from its log files, locally")
    analyze.add_argument("paths", nargs="+", help="log files, torchrun log dirs, elastic_diag diag dirs")
    analyze.add_argument("--json", action="store_true", help="print one JSON object (elastic_diag.analysis/1)")
    analyze.add_argument("--record", action="store_true",
                         help="append the verdict to the ledger (--diag-ledger, env ELASTIC_DIAG_LEDGER)")  # fmt: skip
    analyze.add_argument("--known-good", nargs="+", metavar="GOOD",
                         help="logs of a run of the same job that succeeded (files, dirs, diag dirs, .gz): the first "
                         "line of each rank that differs from it, before its first error")  # fmt: skip
    analyze.add_argument("--known-good-anyway", action="store_true",
                         help="compare with the --known-good run even when it is itself a failure")  # fmt: skip
    _ledger_flags(analyze, notify=False)
    analyze.set_defaults(func=_cmd_analyze)
    report = sub.add_parser("report", help="(re)render report.html of a diag dir, from its report.json")
    report.add_argument("diag_dir", help="the run's diag dir (or its report.json)")
    report.add_argument(
        "--output", "-o", metavar="FILE", help="write the page to FILE instead of DIR/report.html ('-': stdout)"
    )
    report.set_defaults(func=_cmd_report)
    verify = sub.add_parser("verify", help="run a report's verification command; exit 0 when the failure is gone")
    verify.add_argument("diag_dir", help="the run's diag dir (or its report.json)")
    verify.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="kill the command after S seconds (default 1800): a timeout fails the verification",
    )
    verify.add_argument(
        "--yes", "-y", action="store_true", help="run the command without asking (needed where stdin is not a terminal)"
    )
    verify.add_argument(
        "--allow-any-command",
        action="store_true",
        help="run a command that is not on the allow-list of diagnostic programs (still no shell)",
    )
    verify.set_defaults(func=_cmd_verify)
    run_one = sub.add_parser(
        "exec",
        help="run one rank (started by srun, mpirun, a wrapper) under a watch: its evidence and the verdict",
        usage="elastic-diag exec [--diag-dir DIR] [--diag-grace S] [--diag-hang-timeout T] [--diag-stall-timeout T] "
        "-- COMMAND ...",
    )
    run_one.add_argument("--diag-dir", metavar="DIR",
                         help="the folder every rank writes into (default: $ELASTIC_DIAG_DIR, else one named by "
                         "the job: Slurm's job and step, Open MPI's job id)")  # fmt: skip
    run_one.add_argument("--diag-grace", type=float, default=5.0, metavar="S",
                         help="after its rank failed, seconds the watch waits for the other ranks' evidence "
                         "before judging (default 5)")  # fmt: skip
    run_one.add_argument("--diag-hang-timeout", metavar="auto|off|SECONDS",
                         help="as torchrun-diag's: call a hang when no rank has made progress for this long, take "
                         "the stacks, stop the ranks (default auto; env ELASTIC_DIAG_HANG_TIMEOUT)")  # fmt: skip
    run_one.add_argument("--diag-stall-timeout", metavar="auto|off|SECONDS",
                         help="as torchrun-diag's: a stall snapshot (stacks and flight recorders, nothing stopped) "
                         "(default auto; env ELASTIC_DIAG_STALL_TIMEOUT)")  # fmt: skip
    run_one.add_argument("--diag-requeue-exit-code", metavar="N",
                         help="as torchrun-diag's: exit N when the verdict asks for a new allocation (a retryable "
                         "failure), for Slurm's RequeueExit= (env ELASTIC_DIAG_REQUEUE_EXIT_CODE)")  # fmt: skip
    _ledger_flags(run_one)
    run_one.add_argument("command", nargs=argparse.REMAINDER, help="the rank's command, after --")
    run_one.set_defaults(func=_cmd_exec)
    fleet = sub.add_parser("fleet", help="the hosts ranked by the failures blamed on them; which to keep out")
    _ledger_flags(fleet, notify=False)
    fleet.add_argument("--window-days", type=float, default=14.0, metavar="D", help="the window (default 14 days)")
    fleet.add_argument("--min-node-failures", type=int, default=2, metavar="N",
                       help="recommend excluding a host with N node failures in the window (default 2)")  # fmt: skip
    fleet.add_argument("--widespread-hosts", type=int, default=3, metavar="N",
                       help="list a failure seen on N hosts or more as widespread (default 3)")  # fmt: skip
    fleet.add_argument("--hold-days", type=float, default=30.0, metavar="D",
                       help="keep a host out D days after its last counted node failure once the rule kept it out "
                       "(default 30; 0: only the window counts)")  # fmt: skip
    fleet.add_argument("--json", action="store_true", help="print one JSON object (elastic_diag.fleet/1)")
    fleet.add_argument("--html", metavar="FILE", help="write the fleet page (self-contained HTML)")
    fleet.add_argument("--prometheus", metavar="FILE", help="write a Prometheus textfile (node_exporter)")
    fleet.add_argument("--apply", action="store_true",
                       help="drain the recommended hosts with scontrol (Slurm; the reason says why)")  # fmt: skip
    fleet.set_defaults(func=_cmd_fleet)
    explain = sub.add_parser("explain", help="explain one failure signature")
    explain.add_argument("signature_id")
    explain.set_defaults(func=_cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from elastic_diag.launch.run import main as run_main

        return run_main(argv[1:])
    args = get_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CommandRefused as e:
        print(f"elastic-diag: refused: {e}", file=sys.stderr)
        return EXIT_NOT_RUN
    except ElasticDiagError as e:
        print(f"elastic-diag: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader went away (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _entry() -> None:
    code = main()
    if sys.argv[1:2] == ["run"]:  # the launcher: leave without Python's finalization (launch/run.py)
        from elastic_diag.launch.run import exit_now

        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    _entry()

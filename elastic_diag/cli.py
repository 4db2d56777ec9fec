"""``elastic-diag``: the command-line front door.

Subcommands: ``run`` (the same as ``torchrun-diag``), ``analyze PATH...`` (offline, no torch),
``report DIR`` (render report.html), ``verify DIR`` (run the report's verification command and record
the outcome), ``signatures`` (list the taxonomy), ``explain ID`` (one
signature as a page).
``main(argv) -> parse -> subcommand``; only ``main`` touches the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from elastic_diag.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ElasticDiagError


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
    if args.json:
        print(json.dumps(redaction.current().data(analysis.to_json()), indent=2))  # JSON escapes control characters
    else:
        print(format_analysis(analysis, Paint(wants_colour(sys.stdout))))
    if not analysis.files:
        print(f"elastic-diag: error: nothing readable in {', '.join(args.paths)}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_FAILED if analysis.failure_seen else EXIT_OK


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
    from elastic_diag.report.html import write_html
    from elastic_diag.report.terminal import shown

    diag_dir = _diag_dir(args.diag_dir)
    if diag_dir is None:
        return EXIT_USAGE
    path, problems = write_html(diag_dir)
    for p in problems:
        print(f"elastic-diag: {shown(p)}", file=sys.stderr)
    print(shown(str(path)))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from elastic_diag.gate.rerun import verify_diag_dir
    from elastic_diag.report.terminal import Progress

    diag_dir = _diag_dir(args.diag_dir)
    if diag_dir is None:
        return EXIT_USAGE
    if not 1 <= args.timeout <= 86_400:
        print(f"elastic-diag: error: --timeout {args.timeout:g}: must be between 1 and 86400 seconds", file=sys.stderr)
        return EXIT_USAGE
    with Progress(f"elastic-diag verify: running the verification of {diag_dir} (at most {args.timeout:g} s)",
                  sys.stderr):  # fmt: skip
        record = verify_diag_dir(diag_dir, timeout_s=args.timeout)
    if record.get("command"):
        print(f"ran: {record['command']}")
    print(("PASSED: " if record["passed"] else "FAILED: ") + str(record["summary"]))
    if record.get("output_file"):
        print(f"output: {record['output_file']} ({record.get('output_bytes', 0)} bytes)")
    print(f"recorded in {diag_dir / 'report.json'} (verification)")
    return EXIT_OK if record["passed"] else EXIT_FAILED


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
    analyze.set_defaults(func=_cmd_analyze)
    report = sub.add_parser("report", help="(re)render report.html of a diag dir, from its report.json")
    report.add_argument("diag_dir", help="the run's diag dir (or its report.json)")
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
    verify.set_defaults(func=_cmd_verify)
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

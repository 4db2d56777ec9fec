"""After a verdict: record it in the ledger and tell people (a webhook, a command, the Slurm job's Comment).

Everything here is bounded in time and never raises: a ledger that cannot be written, a webhook that answers
500 or never answers, a command that fails are each one line on stderr and a record in ``notify.json`` of the
diag dir; the job's outcome and exit status are the launcher's, whatever happens here.

Options come from the flags (``--diag-ledger``, ``--diag-notify``, ``--diag-notify-cmd``) or the environment
(``ELASTIC_DIAG_LEDGER``, ``ELASTIC_DIAG_NOTIFY``, ``ELASTIC_DIAG_NOTIFY_CMD``), read by every command.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_diag import redaction
from elastic_diag.ledger.store import ENV_LEDGER, ENV_RETRY_S, Ledger, LedgerError, ledger_url, safe_url
from elastic_diag.ledger.verdicts import job_id_from_env, verdicts_of_report
from elastic_diag.redaction import mask_shapes

ENV_NOTIFY = "ELASTIC_DIAG_NOTIFY"
ENV_NOTIFY_CMD = "ELASTIC_DIAG_NOTIFY_CMD"
ENV_NOTIFY_TIMEOUT_S = "ELASTIC_DIAG_NOTIFY_TIMEOUT_S"
ENV_SLURM_COMMENT = "ELASTIC_DIAG_SLURM_COMMENT"  # 0: leave the Slurm job's Comment alone
ENV_DRAIN = "ELASTIC_DIAG_DRAIN"  # 1: drain a recommended host before the requeue (--diag-drain)
NOTIFY_FILE = "notify.json"
NOTIFY_SCHEMA = "elastic_diag.notify/1"
DEFAULT_NOTIFY_TIMEOUT_S = 10.0
COMMENT_MAX = 250


@dataclass(frozen=True, slots=True)
class TellOptions:
    ledger: str | None  # the SQLAlchemy URL, None: off
    notify_url: str | None = None
    notify_cmd: str | None = None
    slurm_job: str | None = None  # the job whose Comment carries the verdict
    timeout_s: float = DEFAULT_NOTIFY_TIMEOUT_S
    retry_s: float | None = None
    drain: bool = False  # drain the failing host before a Slurm requeue when the ledger recommends excluding it

    @classmethod
    def resolve(cls, *, ledger: str | None = None, notify: str | None = None, notify_cmd: str | None = None,
                drain: bool | None = None, env: Mapping[str, str] | None = None) -> TellOptions:  # fmt: skip
        """From the flags, else the environment; a bad ledger value is a UsageError (before anything starts)."""
        e = os.environ if env is None else env
        timeout = _float(e.get(ENV_NOTIFY_TIMEOUT_S), DEFAULT_NOTIFY_TIMEOUT_S)
        comment = e.get(ENV_SLURM_COMMENT, "1").strip() not in ("0", "off", "no")
        retry = _float(e.get(ENV_RETRY_S), None)
        return cls(
            ledger=ledger_url(ledger, e),
            notify_url=(notify or e.get(ENV_NOTIFY, "")).strip() or None,
            notify_cmd=(notify_cmd or e.get(ENV_NOTIFY_CMD, "")).strip() or None,
            slurm_job=e.get("SLURM_JOB_ID", "").strip() or None if comment else None,
            timeout_s=timeout,
            retry_s=retry,
            drain=bool(drain) or e.get(ENV_DRAIN, "").strip().lower() in ("1", "yes", "on", "true"),
        )


def _float(raw: str | None, default: float | None) -> Any:
    try:
        return float(raw) if raw not in (None, "") else default
    except ValueError:
        return default


def record_verdict(report: Mapping[str, Any], report_path: str | None, options: TellOptions, *, source: str,
                   env: Mapping[str, str] | None = None, now: float | None = None,
                   ledger: Ledger | None = None) -> list[str]:  # fmt: skip
    """The report's verdicts appended to the ledger; the lines to say (a failure to record, a file set aside)."""
    if options.ledger is None:
        return []
    e = os.environ if env is None else env
    report = redaction.current().data(report)  # the report in memory is not yet masked (report.json is)
    own = ledger is None
    ledger = ledger or _open(options)
    try:
        rows = verdicts_of_report(report, source=source, job_id=job_id_from_env(e), report_path=report_path,
                                  recorded_at=time.time() if now is None else now)  # fmt: skip
        ledger.record(rows)
        return list(ledger.notes)
    except LedgerError as err:
        return [*ledger.notes, f"the verdict was not recorded in the ledger: {err}"]
    except Exception as err:  # noqa: BLE001 - the job's outcome comes first
        return [*ledger.notes, f"the verdict was not recorded in the ledger {ledger.shown}: {mask_shapes(repr(err))}"]
    finally:
        if own:
            ledger.close()


def _open(options: TellOptions) -> Ledger:
    assert options.ledger is not None
    return Ledger(options.ledger) if options.retry_s is None else Ledger(options.ledger, retry_s=options.retry_s)


def keep_out(report: Mapping[str, Any], options: TellOptions, env: Mapping[str, str],
             ledger: Ledger | None = None) -> list[str]:  # fmt: skip
    """A failure blamed on the node, on a host the ledger (this verdict included) recommends excluding: the lines
    to say. Under Slurm, when the job asks for a requeue and ``options.drain`` is set, the host is drained first
    (``scontrol update NodeName=H State=DRAIN``), so the requeued job starts without it; Slurm refuses to change a
    running job's own excluded nodes ("Job is no longer pending execution"), so a drain is the one way from
    inside the job. Otherwise, and when the drain is refused (it needs Slurm operator rights), how to keep it
    out."""
    if options.ledger is None or str(report.get("status")) == "succeeded":
        return []
    rows = verdicts_of_report(report, source="keep-out", recorded_at=time.time())
    last = rows[-1] if rows else None
    if last is None or last.blame != "node" or not last.initiating_host:
        return []
    from elastic_diag.ledger.fleet import ExclusionRule, drain_reason, host_verdict, scontrol_drain

    own = ledger is None
    ledger = ledger or _open(options)
    try:
        exclude, n = host_verdict(ledger, last.initiating_host)
    except LedgerError as err:
        return [f"the ledger could not say whether {last.initiating_host} should be excluded: {err}"]
    finally:
        if own:
            ledger.close()
    if not exclude:
        return []
    host = last.initiating_host
    rule = ExclusionRule()
    why = f"{n} node failure(s) in {rule.window_days:g} days (rule: {rule.min_node_failures})"  # as the fleet says
    said = f"{host} is recommended for exclusion: {why} (elastic-diag fleet)"
    requeue = report.get("requeue") if isinstance(report.get("requeue"), Mapping) else None
    requeued = bool(env.get("SLURM_JOB_ID", "").strip() and requeue is not None and requeue.get("requeue"))
    if not requeued:
        return [f"{said}; resubmit with --exclude={host}, or drain it (elastic-diag fleet --apply)"]
    if options.drain:
        done = run_drain(scontrol_drain(host, drain_reason(why)), options.timeout_s)
        if done is None:
            return [f"{said}: drained it, so the requeued job starts without it (once mended: scontrol update "
                    f"NodeName={host} State=RESUME)"]  # fmt: skip
        return [f"{said}; it could not be drained ({done}): the requeued job may land on it again; resubmit "
                f"with --exclude={host}"]  # fmt: skip
    return [f"{said}; the requeued job may land on it again (Slurm does not change a running job's excluded "
            f"nodes): pass --diag-drain (Slurm operator rights) to drain it before the requeue, drain it with "
            f"elastic-diag fleet --apply, or resubmit with --exclude={host}"]  # fmt: skip


def run_drain(argv: list[str], timeout_s: float) -> str | None:
    """``scontrol update NodeName=... State=DRAIN``, bounded; None when done, else why not."""
    if not shutil.which(argv[0]):
        return f"{argv[0]} is not on PATH"
    try:
        done = subprocess.run(argv, timeout=timeout_s, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    except (subprocess.TimeoutExpired, OSError) as err:
        return mask_shapes(str(err))[:200]
    if done.returncode == 0:
        return None
    return mask_shapes(done.stderr.decode(errors="replace").strip()[:200]) or f"exit {done.returncode}"


def one_line(report: Mapping[str, Any]) -> str:
    """The verdict in one line (the Slack text, the Slurm Comment)."""
    d = report.get("diagnosis") if isinstance(report.get("diagnosis"), Mapping) else {}
    assert isinstance(d, Mapping)
    status = str(report.get("status") or "failed")
    if status == "succeeded":
        return "elastic_diag: job succeeded"
    cls = d.get("failure_class") or "unknown"
    rank = d.get("initiating_rank")
    where = f"initiating rank {rank} on {d.get('initiating_node') or '?'}" if rank is not None else "no rank named"
    summary = " ".join(str(d.get("summary") or "").split())
    first = summary.split(". ")[0][:160]
    return mask_shapes(f"elastic_diag: job {status.upper()}: {where}: {cls}" + (f" - {first}" if first else ""))


def notification(report: Mapping[str, Any], report_path: str | None, *, env: Mapping[str, str]) -> dict[str, Any]:
    """The webhook's JSON: ``text`` for Slack / Teams, and the structured verdict beside it."""
    d = report.get("diagnosis") if isinstance(report.get("diagnosis"), Mapping) else {}
    assert isinstance(d, Mapping)
    rows = verdicts_of_report(report, source="notify", recorded_at=time.time())
    last = rows[-1] if rows else None
    fields = {
        "schema": NOTIFY_SCHEMA, "run_id": report.get("run_id"), "job_id": job_id_from_env(env) or report.get("run_id"),
        "status": report.get("status"), "failure_class": d.get("failure_class"),
        "initiating_rank": d.get("initiating_rank"), "initiating_host": d.get("initiating_node"),
        "blame": last.blame if last else None, "signature": d.get("signature_id"),
        "fingerprint": last.fingerprint if last else None, "summary": d.get("summary"), "fix": d.get("fix"),
        "verify": d.get("verify"), "report": report_path, "hosts": list(last.hosts) if last else [],
    }  # fmt: skip
    text = one_line(report) + (f"\nreport: {report_path}" if report_path else "")
    return {"text": text, "elastic_diag": fields}


def tell(report: Mapping[str, Any], report_path: str | None, options: TellOptions, *, diag_dir: Path | None,
         env: Mapping[str, str] | None = None) -> list[str]:  # fmt: skip
    """Post the verdict, run the command, set the Slurm Comment (each bounded); the lines to say. Only a verdict
    that is not a success is told."""
    if str(report.get("status")) == "succeeded":
        return []
    e = os.environ if env is None else env
    report = redaction.current().data(report)  # what is posted may be pasted in public: this process's secrets out
    outcomes: list[dict[str, Any]] = []
    if options.notify_url:
        outcomes.append(post_json(options.notify_url, notification(report, report_path, env=e), options.timeout_s))
    if options.notify_cmd:
        outcomes.append(run_notify_cmd(options.notify_cmd, report_path, options.timeout_s, e))
    if options.slurm_job and shutil.which("scontrol"):
        outcomes.append(slurm_comment(options.slurm_job, one_line(report), options.timeout_s))
    if not outcomes:
        return []
    if diag_dir is not None:
        try:
            from elastic_diag.layout import write_json_atomic

            write_json_atomic(diag_dir / NOTIFY_FILE, {"schema": "elastic_diag.notified/1", "outcomes": outcomes})
        except Exception:  # noqa: BLE001 - the lines below still say it
            pass
    return [o["line"] for o in outcomes if not o["ok"]]


def post_json(url: str, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST ``payload``; done within ``timeout_s`` whatever the server does (slow, 500, never answers)."""
    shown = _shown_url(url)
    data = json.dumps(payload).encode()
    result: dict[str, Any] = {"kind": "webhook", "target": shown, "ok": False, "line": ""}

    def send() -> None:
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the user's own URL
                result["status"] = resp.status
                result["ok"] = 200 <= resp.status < 300
        except urllib.error.HTTPError as err:
            result["status"] = err.code
            result["error"] = f"HTTP {err.code}"
        except Exception as err:  # noqa: BLE001
            result["error"] = mask_shapes(str(getattr(err, "reason", err)))[:200]

    started = time.monotonic()
    worker = threading.Thread(target=send, daemon=True, name="elastic-diag-notify")
    worker.start()
    worker.join(timeout_s)
    result["seconds"] = round(time.monotonic() - started, 3)
    if worker.is_alive():
        result["error"] = f"no answer within {timeout_s:g} s"
    if not result["ok"]:
        result["line"] = f"the verdict was not posted to {shown}: {result.get('error', 'failed')}"
    return result


def _shown_url(url: str) -> str:
    """The scheme and host only: a webhook's path is its secret (Slack's /services/T../B../...)."""
    head, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0].rpartition("@")[2]
    return f"{head}{sep}{host}/..." if sep else "(a URL)"


def run_notify_cmd(cmd: str, report_path: str | None, timeout_s: float, env: Mapping[str, str]) -> dict[str, Any]:
    """``CMD REPORT_PATH`` (no shell), with ``ELASTIC_DIAG_REPORT`` set; killed after ``timeout_s``."""
    try:
        argv = [*shlex.split(cmd), *([report_path] if report_path else [])]
    except ValueError as err:
        return {"kind": "command", "ok": False, "line": f"--diag-notify-cmd could not be read: {err}"}
    shown = shlex.join(argv[:1]) + (" ..." if len(argv) > 1 else "")
    result: dict[str, Any] = {"kind": "command", "target": shown, "ok": False, "line": ""}
    try:
        done = subprocess.run(argv, env={**env, "ELASTIC_DIAG_REPORT": report_path or ""}, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              check=False, start_new_session=True)  # fmt: skip
        result["exit_code"] = done.returncode
        result["ok"] = done.returncode == 0
        if not result["ok"]:
            tail = mask_shapes(done.stderr.decode(errors="replace").strip().splitlines()[-1:][0][:200]
                               if done.stderr.strip() else "")  # fmt: skip
            result["line"] = f"--diag-notify-cmd {shown} exited {done.returncode}" + (f": {tail}" if tail else "")
    except subprocess.TimeoutExpired:
        result["line"] = f"--diag-notify-cmd {shown} was killed after {timeout_s:g} s"
    except OSError as err:
        result["line"] = f"--diag-notify-cmd {shown} could not start: {err.strerror or err}"
    return result


def slurm_comment(job: str, line: str, timeout_s: float) -> dict[str, Any]:
    """The Slurm job's Comment set to the one-line verdict (``scontrol update JobId=... Comment=...``)."""
    argv = ["scontrol", "update", f"JobId={job}", f"Comment={line[:COMMENT_MAX]}"]
    result: dict[str, Any] = {"kind": "slurm_comment", "target": f"JobId={job}", "ok": False, "line": ""}
    try:
        done = subprocess.run(argv, timeout=timeout_s, stdin=subprocess.DEVNULL, capture_output=True, check=False)
        result["ok"] = done.returncode == 0
        if not result["ok"]:
            why = done.stderr.decode(errors="replace").strip()[:200]
            result["line"] = f"the Slurm job {job}'s Comment was not set: {why or f'exit {done.returncode}'}"
    except (subprocess.TimeoutExpired, OSError) as err:
        result["line"] = f"the Slurm job {job}'s Comment was not set: {err}"
    return result


def after_verdict(report: Mapping[str, Any], report_path: str | None, options: TellOptions, *, source: str,
                  diag_dir: Path | None, notify: bool = True) -> list[str]:  # fmt: skip
    """Record, then tell: the lines to say on stderr (each prefixed by the caller)."""
    ledger = _open(options) if options.ledger is not None else None  # one engine for the record and the rule
    try:
        lines = record_verdict(report, report_path, options, source=source, ledger=ledger)
        if notify:
            lines += tell(report, report_path, options, diag_dir=diag_dir)
            lines += keep_out(report, options, os.environ, ledger=ledger)
    finally:
        if ledger is not None:
            ledger.close()
    return lines


__all__ = ["ENV_DRAIN", "ENV_LEDGER", "TellOptions", "after_verdict", "record_verdict", "safe_url", "tell"]

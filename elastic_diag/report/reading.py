"""report.json read back for the page: a complete one, or whatever a killed or truncated run left (every
complete field is kept, and what was cut is said), or none at all (then the newest attempt's evidence is
judged again, as the live agent judges it). Never raises on a bad file: the problems are returned to be shown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic_diag.layout import REPORT_FILE, attempt_dirs, is_attempt_dir, launcher_deaths, read_attempt
from elastic_diag.report.document import MAX_REPORT_BYTES, SCHEMA


def salvage_object(text: str) -> tuple[dict[str, Any], str | None]:
    """The complete top-level entries of a JSON object that may be cut short, and where it broke.

    A report cut mid-way (a full disk, a copy interrupted) still has its schema, status and
    diagnosis, which come first; a list cut mid-way (``ranks``) keeps its complete elements.
    """
    decoder = json.JSONDecoder()
    out: dict[str, Any] = {}
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return out, "not a JSON object"
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == "}":
            return out, None
        try:
            key, i = decoder.raw_decode(text, i)
            i = _skip_ws(text, i)
            if i >= len(text) or text[i] != ":" or not isinstance(key, str):
                return out, f"cut short after the key {key!r}"
            i = _skip_ws(text, i + 1)
            try:
                value, i = decoder.raw_decode(text, i)
            except RecursionError:
                return out, f"{key!r} is nested deeper than this reader follows"
            except ValueError:
                if i < len(text) and text[i] == "[":
                    out[key] = _salvage_list(text, i + 1)
                    return out, f"cut short inside {key!r} (kept its first {len(out[key])} entries)"
                return out, f"cut short inside {key!r}"
            out[key] = value
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's stack
            return out, f"cut short ({e.__class__.__name__} at character {i})"
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        if i < len(text) and text[i] == "}":
            return out, None
        return out, f"cut short at character {i}"


def _salvage_list(text: str, i: int) -> list[Any]:
    decoder = json.JSONDecoder()
    items: list[Any] = []
    while True:
        i = _skip_ws(text, i)
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return items
        items.append(value)
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] != ",":
            return items
        i += 1


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def load_report_dir(diag_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """The report of a diag dir and the list of what is missing from it; never raises for bad content.

    With no usable verdict in report.json, the newest attempt's evidence folder is judged again and that
    verdict stands in (said in the list). A launcher that died without its final record is said first."""
    problems: list[str] = launcher_deaths(diag_dir)
    path = diag_dir / REPORT_FILE
    report: dict[str, Any] = {}
    if not path.is_file():
        problems.append(
            f"no {REPORT_FILE} in {diag_dir} (the run may still be going, or was killed before it wrote one)"
        )
    else:
        try:
            with open(path, "rb") as fp:
                raw = fp.read(MAX_REPORT_BYTES + 1)
        except OSError as e:
            raw = b""
            problems.append(f"{REPORT_FILE} could not be read: {e}")
        if len(raw) > MAX_REPORT_BYTES:
            problems.append(f"{REPORT_FILE} is larger than {MAX_REPORT_BYTES >> 20} MB; only its beginning was read")
            raw = raw[:MAX_REPORT_BYTES]
        text = raw.decode("utf-8", errors="replace")
        try:
            loaded = json.loads(text)
            if isinstance(loaded, dict):
                report = loaded
            else:
                problems.append(f"{REPORT_FILE} holds a JSON {type(loaded).__name__}, not an object")
        except RecursionError:  # nested deeper than the parser goes: nothing of it is shown
            problems.append(f"{REPORT_FILE} is nested too deep to read (not a report of elastic_diag)")
        except ValueError:
            report, where = salvage_object(text)
            if text.strip():
                problems.append(
                    f"{REPORT_FILE} is incomplete ({where}); showing the {len(report)} complete "
                    f"entries: {', '.join(report) or 'none'}"
                )
            else:
                problems.append(f"{REPORT_FILE} is empty")
    if report and report.get("schema") not in (None, SCHEMA):
        problems.append(f"{REPORT_FILE} has schema {report.get('schema')!r}; this version renders {SCHEMA!r}")
    if not isinstance(report.get("diagnosis"), dict) or not isinstance(report.get("ranks"), list):
        report = _fill_from_evidence(diag_dir, report, problems)
    for key in ("status", "diagnosis", "ranks", "attempts"):
        if key not in report:
            problems.append(f"{REPORT_FILE} has no {key!r}")
    return report, problems


def _fill_from_evidence(diag_dir: Path, report: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The verdict and the ranks judged again from the newest attempt's evidence folder, as the live agent
    judges it (:func:`~elastic_diag.layout.read_attempt`, then the core's rules), where report.json has none."""
    from elastic_diag.core.classify import classify_attempt
    from elastic_diag.core.verification import render_diagnosis
    from elastic_diag.report.document import rank_entry

    attempts = [d for d in attempt_dirs(diag_dir) if is_attempt_dir(d)]
    if not attempts:
        problems.append(f"no rank evidence found in {diag_dir} either")
        return report
    try:
        read = read_attempt(attempts[-1])
        diagnosis = classify_attempt(read.evidence)
    except Exception as e:  # the page is still written with what there is
        problems.append(f"the evidence in {attempts[-1]} could not be judged: {e!r}")
        return report
    problems.extend(f"{attempts[-1].name}: {p}" for p in read.problems)
    filled = dict(report)
    used = []
    if not isinstance(filled.get("diagnosis"), dict):
        filled["diagnosis"] = render_diagnosis(diagnosis.to_json(), None, live=False)
        used.append("the verdict")
    if not isinstance(filled.get("ranks"), list) or not filled["ranks"]:
        filled["ranks"] = [rank_entry(ev, diagnosis.roles.get(ev.rank, "unknown")) for ev in read.evidence.ranks]
        used.append("the ranks")
    filled.setdefault("status", "failed" if diagnosis.failure_class not in ("healthy", None) else "unknown")
    filled.setdefault("diag_dir", str(diag_dir))
    if used:
        problems.append(f"{' and '.join(used)} judged again from the evidence in {attempts[-1]}")
    return filled

"""The shipped JSON Schemas (elastic_diag/report/schemas/) against real documents: every report.json of the
fixtures, ``elastic-diag analyze --json`` of every fixture case, node records as the agents publish them,
reports built with a gate, a cluster and a hang; and near misses each schema must refuse. No torch."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import FIXTURES

from elastic_diag.core import merge as nodes
from elastic_diag.core.evidence import AttemptEvidence, ErrorLine, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.progress import NonFinite, Progress
from elastic_diag.core.schema_ids import ANALYSIS_SCHEMA, FLEET_SCHEMA, NODE_RECORD_SCHEMA, REPORT_SCHEMA
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.taxonomy import FAILURE_CLASSES
from elastic_diag.core.verdict import ROLES, Diagnosis
from elastic_diag.offline.analyze import analyze_paths
from elastic_diag.report.document import AttemptRecord, build_report
from elastic_diag.report.schema import SCHEMA_FILES, load_schema, validate

REPORTS = sorted(FIXTURES.rglob("report.json"))
CASES = sorted(p for group in ("logs", "runs", "fr", "reports") for p in (FIXTURES / group).iterdir() if p.is_dir())


def _rel(p: Path) -> str:
    return str(p.relative_to(FIXTURES))


# --- the schemas themselves -------------------------------------------------------------------------


def _objects(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            yield node
        for v in node.values():
            yield from _objects(v)
    elif isinstance(node, list):
        for v in node:
            yield from _objects(v)


@pytest.mark.parametrize("schema_id", sorted(SCHEMA_FILES))
def test_each_schema_is_valid_and_pins_its_id(schema_id):
    schema = load_schema(schema_id)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == schema_id
    assert schema["properties"]["schema"] == {"const": schema_id}
    assert "schema" in schema["required"]
    # additive: every object with known fields admits the fields a newer version adds
    described = [o for o in _objects(schema) if "properties" in o]
    assert described and all(o.get("additionalProperties") is True for o in described)


@pytest.mark.parametrize(
    ("schema_id", "path", "bad"),
    [
        (REPORT_SCHEMA, ("diagnosis", "failure_class"), "exploded"),  # not a class of the vocabulary
        (REPORT_SCHEMA, ("status",), "maybe"),
        (ANALYSIS_SCHEMA, ("diagnosis", "initiating_rank"), "two"),  # a rank is an integer or null
        (NODE_RECORD_SCHEMA, ("ranks",), "not a list"),
    ],
)  # fmt: skip
def test_each_shipped_schema_rejects_a_document_that_breaks_it(schema_id, path, bad):
    """The schemas are loaded from the installed package (its data files) and really constrain: a document
    the code writes validates, the same document with one field broken does not."""
    documents = {REPORT_SCHEMA: REPORTS[0], ANALYSIS_SCHEMA: None, NODE_RECORD_SCHEMA: None}
    if schema_id == REPORT_SCHEMA:
        doc = json.loads(documents[schema_id].read_text())
    elif schema_id == ANALYSIS_SCHEMA:
        doc = json.loads(json.dumps(analyze_paths([CASES[0]]).to_json()))
    else:
        doc = nodes.record_of(_oom_node(), node="host-0", group_rank=0, offset=0.0)
    validate(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)
    # the fleet's schema (elastic_diag.fleet/1) is checked against a real ledger in tests/ledger/test_fleet.py
    assert sorted(SCHEMA_FILES) == sorted((REPORT_SCHEMA, ANALYSIS_SCHEMA, NODE_RECORD_SCHEMA, FLEET_SCHEMA))


def test_enums_follow_the_code():
    """The failure classes and roles in the schemas are the ones the classifier produces."""
    for schema_id in (REPORT_SCHEMA, ANALYSIS_SCHEMA):
        schema = load_schema(schema_id)
        assert schema["$defs"]["diagnosis"]["properties"]["failure_class"]["enum"] == list(FAILURE_CLASSES)
        assert schema["$defs"]["rank"]["properties"]["role"]["enum"] == list(ROLES)


# --- real documents --------------------------------------------------------------------------------


def test_there_are_documents_to_validate():
    assert len(REPORTS) >= 7 and len(CASES) >= 40


@pytest.mark.parametrize("path", REPORTS, ids=_rel)
def test_fixture_reports_conform(path):
    doc = json.loads(path.read_text())
    assert doc["schema"] == REPORT_SCHEMA
    validate(doc)


@pytest.mark.parametrize("case", CASES, ids=_rel)
def test_analysis_of_every_fixture_case_conforms(case):
    doc = analyze_paths([case]).to_json()
    assert doc["schema"] == ANALYSIS_SCHEMA
    validate(json.loads(json.dumps(doc)))  # as a reader of `analyze --json` gets it


# --- node records, as record_of builds them ----------------------------------------------------------

WATCHDOG = ("[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=90210, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600071 milliseconds before timing out.")  # fmt: skip
STACK = "\n".join([
    "Thread 0x00007f0000000001 (most recent call first):",
    '  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
    '  File "/job/train.py", line 211 in train_step',
    '  File "/job/train.py", line 300 in main',
])  # fmt: skip
OOM = ExceptionRecord(type="torch.OutOfMemoryError", message="CUDA out of memory. Tried to allocate 20.00 GiB",
                      traceback='File "/job/train.py", line 198, in forward\n', time=1000.0,
                      mro=("torch.OutOfMemoryError", "RuntimeError", "Exception"),
                      chain=(("ValueError", "bad batch"),), problems=("message cut to 2000 characters",))  # fmt: skip


def _oom_node() -> AttemptEvidence:
    """The culprit's node (benchmarks/merge.py): one rank out of memory, its peer in the watchdog."""
    return AttemptEvidence(attempt=0, decided_at=1602.0, ranks=(
        RankEvidence(rank=0, local_rank=0, node="host-0", pid=4242, exit_code=1, exit_time=1000.2, start_time=10.0,
                     exception=OOM, stderr_tail=(f"{OOM.type}: {OOM.message}",),
                     progress=Progress(progress_time=999.0, steps=12),
                     error_line=ErrorLine(time=999.9, text="Traceback (most recent call last):", arrival=999.9,
                                          logged=None, exception=OOM)),
        RankEvidence(rank=1, local_rank=1, node="host-0", exit_code=-6, exit_time=1601.0,
                     stderr_tail=(WATCHDOG.format(r=1), "Fatal Python error: Aborted"), stack=parse_stack_dump(STACK)),
    ))  # fmt: skip


def _hung_node() -> AttemptEvidence:
    """Alive at the verdict (no exit code), a dead thread, a NaN loss, the health monitor's alarm."""
    dead = ExceptionRecord(type="RuntimeError", message="loader died", traceback="", time=50.0, thread="loader")
    hang = {"threshold_s": 5.0, "stalled_s": 5.019, "reason": "--diag-hang-timeout", "rank": None,
            "detected_at": 60.0}  # fmt: skip
    return AttemptEvidence(attempt=2, decided_at=61.0, hang=hang, came_up=True, ranks=(
        RankEvidence(rank=2, local_rank=0, node="host-1", pid=7, alive_at_decision=True, stopped_by_agent=True,
                     stack=parse_stack_dump(STACK), thread_exception=dead, nonfinite=NonFinite(backward=4, time=40.0)),
        RankEvidence(rank=3, local_rank=1, node="host-1"),  # nothing known
    ))  # fmt: skip


def _healthy_node() -> AttemptEvidence:
    return AttemptEvidence(attempt=0, ranks=tuple(RankEvidence(rank=r, local_rank=r, node="h", exit_code=0,
                                                               exit_time=5.0) for r in range(4)))  # fmt: skip


@pytest.mark.parametrize(
    "evidence, group_rank, offset",
    [(_oom_node(), 0, 0.0), (_hung_node(), 1, 0.0), (_hung_node(), 1, -2.5), (_healthy_node(), 3, 0.0),
     (AttemptEvidence(attempt=0, ranks=()), 0, 0.0)],
    ids=["oom", "hang", "hang-offset", "healthy", "empty"],
)  # fmt: skip
def test_node_records_conform(evidence, group_rank, offset):
    rec = nodes.record_of(evidence, node=f"host-{group_rank}", group_rank=group_rank, offset=offset)
    assert rec["schema"] == NODE_RECORD_SCHEMA
    validate(rec)
    validate(nodes.parse_record(json.dumps(rec)))  # as the other agents read it from the store


# --- reports with the parts the fixtures lack: gate, cluster, hang, warnings, a launch failure -----------


def test_a_report_with_gate_cluster_hang_and_warnings_conforms():
    ev = _hung_node()
    diag = Diagnosis(failure_class="hang", initiating_rank=2, initiating_node="host-1", summary="stuck",
                     evidence=("rank 2 alive",), roles={2: "initiating", 3: "unknown"}, rule="hang")  # fmt: skip
    gate = {"attempt": 2, "policy": "verified", "failure": "hang (hang) on rank 2", "reason": "verification failed",
            "controls": [{"name": "gpu", "passed": False, "summary": "no", "seconds": 1.5, "tries": 2,
                          "output_file": None, "output_tail": ""}],
            "decision": "refused", "verification_failed": True}  # fmt: skip
    cluster = {"clock_offset_s": -2.5, "local_diagnosis": diag.to_json(), "decided_by": "group rank 0",
               "nodes": ["host-0", "host-1"], "missing_group_ranks": [], "store_bytes_sent": 10,
               "store_bytes_read": 20}  # fmt: skip
    warning = {"class": "straggler", "rank": 3, "node": "host-1", "lag_s": 0.2, "step_s": None, "summary": "slow"}
    record = AttemptRecord(evidence=ev, diagnosis=diag, status="failed", final=True, gate=gate, cluster=cluster)
    doc = build_report(run_id="r", status="failed", attempts=[record], diag_dir="/d", node="host-1",
                       warnings=[warning], internal_errors=["x: ValueError: y"], notes=["a note"])  # fmt: skip
    assert {"hang", "gate", "nodes"} <= set(doc["attempts"][0])
    validate(json.loads(json.dumps(doc, default=str)))


@pytest.mark.parametrize("status", ["succeeded", "failed"])
def test_reports_with_no_attempt_conform(status):
    launch = Diagnosis(failure_class="rendezvous_timeout", summary="timed out", evidence=("RendezvousTimeoutError",))
    validate(build_report(run_id="", status=status, attempts=[], diag_dir="/d", node="n", launch_diagnosis=launch))


# --- near misses: the schemas are not vacuous -------------------------------------------------------------


@pytest.fixture
def report() -> dict[str, Any]:
    return json.loads((FIXTURES / "runs" / "diag_hang" / "report.json").read_text())


@pytest.fixture
def analysis() -> dict[str, Any]:
    return analyze_paths([FIXTURES / "logs" / "01_console_valueerror_rank3"]).to_json()


def _refused(doc: dict[str, Any]) -> jsonschema.ValidationError:
    with pytest.raises(jsonschema.ValidationError) as info:
        validate(doc)
    return info.value


def test_an_unknown_failure_class_is_refused(report):
    report["diagnosis"]["failure_class"] = "exploded"
    assert "exploded" in _refused(report).message
    bad = copy.deepcopy(report)
    del bad["diagnosis"]
    bad["attempts"][0]["diagnosis"]["failure_class"] = "exploded"
    _refused(bad)


def test_a_rank_given_as_a_string_is_refused(report):
    report["ranks"][0]["rank"] = "0"
    assert list(_refused(report).absolute_path) == ["ranks", 0, "rank"]


def test_a_report_without_diagnosis_is_refused(report):
    del report["diagnosis"]
    assert "'diagnosis' is a required property" in _refused(report).message


def test_an_analysis_without_ranks_is_refused(analysis):
    validate(analysis)
    del analysis["ranks"]
    assert "'ranks' is a required property" in _refused(analysis).message


def test_other_near_misses_are_refused(report, analysis):
    wrong_role = copy.deepcopy(report)
    wrong_role["ranks"][1]["role"] = "victim"
    _refused(wrong_role)
    wrong_status = copy.deepcopy(report)
    wrong_status["status"] = "crashed"
    _refused(wrong_status)
    as_analysis = copy.deepcopy(report)  # a report is not an analysis, nor the other way round
    as_analysis["schema"] = ANALYSIS_SCHEMA
    _refused(as_analysis)
    analysis["schema"] = REPORT_SCHEMA
    _refused(analysis)
    rec = nodes.record_of(_oom_node(), node="h", group_rank=0, offset=0.0)
    rec["ranks"][0]["exception"]["chain"] = [["ValueError"]]
    _refused(rec)
    rec = nodes.record_of(_oom_node(), node="h", group_rank="0", offset=0.0)
    _refused(rec)


def test_unknown_or_missing_schema_id_is_a_key_error(report):
    report["schema"] = "elastic_diag.report/2"
    with pytest.raises(KeyError):
        validate(report)
    del report["schema"]
    with pytest.raises(KeyError):
        validate(report)


def test_fields_a_newer_version_adds_are_accepted(report):
    report["new_top_level"] = {"anything": 1}
    report["diagnosis"]["new_field"] = [1, 2]
    report["ranks"][0]["new_field"] = None
    report["attempts"][0]["new_field"] = "x"
    validate(report)

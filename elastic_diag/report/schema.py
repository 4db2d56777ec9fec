"""The JSON Schemas (draft 2020-12) of the documents other tools read, shipped in ``schemas/``.

- ``elastic_diag.report/1``: report.json (docs/report.md);
- ``elastic_diag.analysis/1``: ``elastic-diag analyze --json``;
- ``elastic_diag.node_record/1``: what each node's agent publishes in the rendezvous store;
- ``elastic_diag.fleet/1``: ``elastic-diag fleet --json`` (docs/fleet.md).

The contract is additive: a field that is always written is required, every field known is typed, and
any object may carry fields a newer version adds, so an old reader never breaks on a new document.

For the tests and for tools that want to check a document: the package itself never validates and
does not depend on ``jsonschema`` (it is imported only inside :func:`validate`). No torch.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from elastic_diag.core.schema_ids import ANALYSIS_SCHEMA, FLEET_SCHEMA, NODE_RECORD_SCHEMA, REPORT_SCHEMA

SCHEMA_FILES: dict[str, str] = {
    REPORT_SCHEMA: "report.schema.json",
    ANALYSIS_SCHEMA: "analysis.schema.json",
    NODE_RECORD_SCHEMA: "node_record.schema.json",
    FLEET_SCHEMA: "fleet.schema.json",
}


def load_schema(schema_id: str) -> dict[str, Any]:
    """The schema of ``schema_id`` (``elastic_diag.report/1``, ...); KeyError for an id not shipped."""
    name = SCHEMA_FILES[schema_id]
    text = (resources.files("elastic_diag.report") / "schemas" / name).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def validate(document: dict[str, Any]) -> None:
    """Check ``document`` against the schema its ``schema`` field names.

    Raises ``jsonschema.ValidationError`` when it does not conform, KeyError when its schema id is not
    one of :data:`SCHEMA_FILES` (or it has none). Needs ``jsonschema`` (``pip install jsonschema``)."""
    import jsonschema  # type: ignore[import-untyped, unused-ignore]  # a test dependency, no stubs needed

    schema = load_schema(document["schema"])
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is not None:
        raise error

"""The ids of the documents the product writes and other tools read (their JSON Schemas:
elastic_diag/report/schemas/). Each document carries its id in ``schema``; the ids change only by adding."""

REPORT_SCHEMA = "elastic_diag.report/1"  # report.json
ANALYSIS_SCHEMA = "elastic_diag.analysis/1"  # elastic-diag analyze --json
NODE_RECORD_SCHEMA = "elastic_diag.node_record/1"  # one node's failure record, through the rendezvous store
NODE_VERDICT_SCHEMA = "elastic_diag.node_verdict/1"  # the leader's verdict, through the store
FLEET_SCHEMA = "elastic_diag.fleet/1"  # `elastic-diag fleet --json` (elastic_diag/ledger/fleet.py)

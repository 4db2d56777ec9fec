"""The pure core: evidence in, a verdict out. No torch, no processes, no clock, no files.

Read in this order: :mod:`~elastic_diag.core.evidence` (what is known about each rank),
:mod:`~elastic_diag.core.taxonomy` (the failure signatures, data), :mod:`~elastic_diag.core.findings`
(one rank's evidence matched against them), :mod:`~elastic_diag.core.flight_recorder` (the ranks'
collective schedules compared), :mod:`~elastic_diag.core.attribution` (the ordered rules) and
:mod:`~elastic_diag.core.classify` (the entry point: evidence -> :class:`~elastic_diag.core.verdict.Diagnosis`).
:mod:`~elastic_diag.core.log_lines` and :mod:`~elastic_diag.core.error_lines` read log text (the live
agent's line clock and the offline analyzer share them); :mod:`~elastic_diag.core.merge` joins several
nodes' records into one attempt.
"""

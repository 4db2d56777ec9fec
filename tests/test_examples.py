"""The examples, run for real: every ``--inject`` of examples/train_ddp.py and examples/train_fsdp2.py
gives the failure class the scripts' tables promise, and names the culprit (rank 1, or rank 0 alone).

The cheapest shape that still tells the story: one rank for a failure of the rank's own (an
exception, a signal: what its peers do then is the fault matrix's business), 2 ranks, or 3 where a
majority must disagree with one rank (schedules, stragglers) or a store host and a client must both
wait; the failure at step 1; a short grace. Injections that the other
test files already run with 4 ranks are listed in ``RUN_ELSEWHERE`` with the test that runs them,
and a test checks that list against the scripts, so no injection goes unrun.
"""

from __future__ import annotations

import pytest
from helpers import ROOT, injection_tables, launch, load_example, torchrun_diag

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

EXAMPLES = ROOT / "examples"
CULPRIT = 1


DDP = load_example("train_ddp")
FSDP2 = load_example("train_fsdp2")
FAULTS = load_example("faults")
TABLES = injection_tables()

# (script, inject) -> the test that runs it (3 ranks, culprit rank 2, more assertions)
MATRIX = "launch/test_launcher_matrix.py::test_fault_matrix_names_the_culprit"
HANGS = "agent/test_health.py::test_hang_outside_collectives_is_detected_before_the_collective_timeout"
SCHEDULES = "agent/test_health.py::test_a_rank_that_leaves_the_collective_schedule_is_named"
RUN_ELSEWHERE = {
    ("train_ddp.py", "none"): "launch/test_launcher_matrix.py::test_healthy_run_raises_no_alarm",
    ("train_ddp.py", "exception"): MATRIX,
    ("train_ddp.py", "exception-after-cleanup"): MATRIX,
    ("train_ddp.py", "segfault"): MATRIX,
    ("train_ddp.py", "sigkill"): MATRIX,
    ("train_ddp.py", "exit"): MATRIX,
    ("train_ddp.py", "memoryerror"): MATRIX,
    ("train_ddp.py", "hang"): MATRIX,
    ("train_ddp.py", "transient"): "gate/test_gate.py::test_transient_failure_is_verified_then_restarted",
    ("train_ddp.py", "deadlock"): HANGS,
    ("train_ddp.py", "infinite-loop"): HANGS,
    ("train_ddp.py", "regex-hang"):
        "agent/test_health.py::test_a_rank_holding_the_gil_is_dumped_by_signal_and_the_missing_evidence_is_reported",
    ("train_ddp.py", "skip-collective"): SCHEDULES,
    ("train_ddp.py", "extra-collective"): SCHEDULES,
    ("train_ddp.py", "unused-layer"): SCHEDULES,
    ("train_ddp.py", "shape-mismatch"): "agent/test_health.py::test_shape_mismatch_names_the_rank_and_both_sides",
    ("train_ddp.py", "straggler"): "agent/test_health.py::test_a_straggler_is_a_warning_not_a_hang",
    ("train_ddp.py", "slow-first-step"):
        "agent/test_health.py::test_a_slow_first_step_raises_nothing_with_the_automatic_threshold",
    ("train_fsdp2.py", "nan"): "agent/test_health.py::test_fsdp2_nan_names_the_rank_whose_loss_went_non_finite_first",
}  # fmt: skip

# FSDP2's point failures (an exception, a signal, ...) are the same faults.inject_now call as DDP's,
# made at the same place in the step, and late-join and recv-deadlock the same faults functions
# called before init_process_group and before the step's first collective; the DDP runs below and
# elsewhere exercise each one. FSDP2 runs one point failure (exception) to show the dispatch, and
# every injection whose effect FSDP2 changes (its own collectives: hang, schedules, NaN, straggler).
SAME_CODE_AS_DDP = {
    "transient", "segfault", "abort", "sigkill", "exit", "memoryerror", "cuda-oom", "cuda-error",
    "network-error", "disk-full", "port-conflict", "deadlock", "infinite-loop", "regex-hang", "late-join",
    "recv-deadlock",
}  # fmt: skip

HERE = [
    # script, inject, ranks, extra torchrun-diag flags, extra script arguments
    ("train_ddp.py", "abort", 1, (), ()),
    ("train_ddp.py", "cuda-oom", 1, (), ()),
    ("train_ddp.py", "cuda-error", 1, (), ()),
    ("train_ddp.py", "network-error", 1, (), ()),
    ("train_ddp.py", "disk-full", 1, (), ()),
    ("train_ddp.py", "port-conflict", 1, (), ()),
    ("train_ddp.py", "late-join", 3, (), ("--pg-timeout", "3")),  # 3: the store host and a client wait
    ("train_ddp.py", "recv-deadlock", 2, (), ("--pg-timeout", "3")),
    ("train_ddp.py", "nan", 2, (), ()),
    ("train_fsdp2.py", "none", 1, (), ()),
    ("train_fsdp2.py", "exception", 1, (), ()),
    ("train_fsdp2.py", "hang", 2, ("--diag-hang-timeout", "2"), ()),
    ("train_fsdp2.py", "skip-collective", 3, ("--diag-hang-timeout", "2"), ()),
    ("train_fsdp2.py", "extra-collective", 3, ("--diag-hang-timeout", "2"), ()),
    ("train_fsdp2.py", "shape-mismatch", 3, (), ()),
    ("train_fsdp2.py", "straggler", 3, (), ("--steps", "10")),
]
# a line of the culprit's own failure that report.json must keep (its stderr tail or its exception)
CULPRIT_LINE = {
    "abort": "injecting abort",
    "cuda-oom": "CUDA out of memory",
    "cuda-error": "illegal memory access",
    "network-error": "NET/IB : Got completion from peer",
    "disk-full": "unexpected pos",
    "port-conflict": "EADDRINUSE",
    "exception": "injected failure: bad batch",
}


# injection -> the test that runs its report's verification as printed (elastic-diag verify), once per
# injection name: here for every case of HERE, else in the test that runs the injection
VERIFIED_BY = {
    **{inject: "test_examples.py::test_example_injection_gives_its_class" for _, inject, *_ in HERE},
    **{inject: MATRIX for inject in ("segfault", "sigkill", "exit", "memoryerror")},
    "exception-after-cleanup": (
        "launch/test_rendezvous.py::test_the_switch_under_torchrun_standalone_gives_the_same_verdict"
    ),
    "transient": RUN_ELSEWHERE[("train_ddp.py", "transient")],
    "deadlock": HANGS, "infinite-loop": HANGS, "unused-layer": SCHEDULES,
    "regex-hang": RUN_ELSEWHERE[("train_ddp.py", "regex-hang")],
    "slow-first-step": RUN_ELSEWHERE[("train_ddp.py", "slow-first-step")],
}  # fmt: skip


def test_every_injection_has_its_verification_run_by_a_test():
    names = {inject for table in TABLES.values() for inject in table}
    assert names == set(VERIFIED_BY), names ^ set(VERIFIED_BY)
    for inject, where in VERIFIED_BY.items():
        test_file, test_name = where.split("::")
        source = (ROOT / "tests" / test_file).read_text()
        body = source[source.index(f"def {test_name}(") :]
        body = body[: body.find("\ndef ", 1)]
        assert "assert_verify_reproduces()" in body or "run.verify()" in body, (inject, where)


def test_every_injection_of_both_examples_is_run_by_a_test():
    here = {(case[0], case[1]) for case in HERE}
    assert set(FAULTS.INJECTIONS) <= set(DDP.INJECTIONS) and set(FAULTS.INJECTIONS) == set(FSDP2.INJECTIONS)
    produced = {cls for table in TABLES.values() for cls in table.values()}
    known = {"python_exception", "segfault", "abort", "killed", "host_oom", "cuda_oom", "cuda_error", "silent_exit",
             "hang", "collective_desync", "collective_mismatch", "collective_timeout", "network_error", "io_error",
             "rendezvous_timeout", "port_conflict", "nan_inf", "straggler", "healthy"}  # fmt: skip
    assert produced == known  # every failure class (docs/report.md) but `unknown`
    for script, table in TABLES.items():
        for inject in table:
            key = (script, inject)
            if key in here:
                continue
            if key in RUN_ELSEWHERE:
                test_file, test_name = RUN_ELSEWHERE[key].split("::")
                source = (ROOT / "tests" / test_file).read_text()
                assert f"def {test_name}(" in source and f'"{inject}"' in source, key
                continue
            assert script == "train_fsdp2.py" and inject in SAME_CODE_AS_DDP, f"{key} is run by no test"
            assert ("train_ddp.py", inject) in here or ("train_ddp.py", inject) in RUN_ELSEWHERE


@pytest.mark.parametrize("script, inject, ranks, flags, job_flags", HERE, ids=[f"{c[0][:-3]}-{c[1]}" for c in HERE])
def test_example_injection_gives_its_class(tmp_path, script, inject, ranks, flags, job_flags):
    expected = TABLES[script][inject]
    culprit = CULPRIT if ranks > 1 else 0
    job = [str(EXAMPLES / script), "--inject", inject, "--culprit-rank", str(culprit), "--at-step", "1", "--steps", "4",
           "--pg-timeout", "6", *job_flags]  # fmt: skip
    argv = torchrun_diag("--standalone", "--nproc-per-node", str(ranks), "--diag-grace", "2", *flags,
                         "--diag-dir", str(tmp_path), *job)  # fmt: skip
    run = launch(argv, tmp_path)
    report = run.report
    d = report["diagnosis"]
    assert (tmp_path / "report.html").is_file()
    if expected in ("healthy", "straggler"):
        assert run.returncode == 0 and report["status"] == "succeeded", run.stderr[-3000:]
        warned = [(w["class"], w["rank"]) for w in report["warnings"]]
        assert warned == ([("straggler", culprit)] if expected == "straggler" else []), report["warnings"]
        code, v, out = run.verify()
        assert code == 0 and v["passed"] and "nothing to verify" in v["summary"], out
        return
    assert run.returncode == 1, run.stderr[-3000:]
    assert d["failure_class"] == expected, d
    if expected == "collective_timeout":  # every rank waits inside a collective: nobody to blame
        assert d["initiating_rank"] is None and d["collateral_ranks"] == list(range(ranks)), d
    else:
        assert d["initiating_rank"] == culprit, d
        assert d["fix"] and d["verify"] and d["summary"]
    if inject in CULPRIT_LINE:
        entry = run.rank(culprit)
        kept = "\n".join([*entry["last_lines"], str(entry["exception"]), *d["evidence"]])
        assert CULPRIT_LINE[inject] in kept, kept
    # the verification, run as printed on the unchanged job, fails the same way (the page says so)
    run.assert_verify_reproduces()

"""elastic_diag/ledger/verdicts.py: a report.json as the ledger's rows (blame, proof, fingerprint, hosts); untrusted."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_diag.ledger.verdicts import blame_of, fingerprint, job_id_from_env, template, verdicts_of_report


def _report(rank: int = 2, host: str = "gpu-07", line: str = "rank 2: #4 all_gather sizes [[17,32]] Float",
            sig: str = "collective-mismatch", cls: str = "collective_mismatch", rule: str = "schedule_parted",
            where: str = "/home/u/train.py:17 in main") -> dict:  # fmt: skip
    d = {"failure_class": cls, "initiating_rank": rank, "initiating_node": host, "exception_type": None,
         "signature_id": sig, "summary": f"Rank {rank} on {host} issued the same collective. More.", "rule": rule,
         "evidence": [line], "collective": {"source": {str(rank): where}}}  # fmt: skip
    ranks = [{"rank": r, "node": host if r == rank else "gpu-01"} for r in range(4)]
    return {"schema": "elastic_diag.report/1", "run_id": "run-a", "status": "failed", "diagnosis": d,
            "attempts": [{"attempt": 0, "status": "failed", "diagnosis": d, "ranks": ranks}],
            "launch": {"launch_command": "torchrun-diag --nproc-per-node 4 train.py"}}  # fmt: skip


def test_one_row_per_attempt_with_the_rank_to_host_map():
    (v,) = verdicts_of_report(_report(), source="torchrun-diag", recorded_at=100.0, job_id="slurm:7")
    assert (v.initiating_rank, v.initiating_host, v.failure_class, v.blame, v.proof) == (
        2,
        "gpu-07",
        "collective_mismatch",
        "job",
        "schedule",
    )
    assert v.hosts == ("gpu-01", "gpu-07") and dict(v.rank_hosts) == {
        0: "gpu-01",
        1: "gpu-01",
        2: "gpu-07",
        3: "gpu-01",
    }
    assert v.job_id == "slurm:7" and v.command.startswith("torchrun-diag") and v.summary.startswith("Rank 2")


def test_the_same_failure_in_two_jobs_has_one_fingerprint_another_failure_another():
    a = _report(line="rank 2: #4 all_gather sizes [[17,32]] Float", where="/tmp/pytest-1/x/train.py:17 in main")
    b = _report(rank=5, host="gpu-99", line="rank 5: #9 all_gather sizes [[33,32]] Float",
                where="/tmp/pytest-2/y/train.py:17 in main")  # fmt: skip
    c = _report(line="rank 2: #4 broadcast sizes [[17,32]] Float")
    fa, fb, fc = (fingerprint(r["diagnosis"]) for r in (a, b, c))
    assert fa == fb != fc and len(fa) == 16
    assert template("pid=4242 at 0x7f00ab12 took 12.5 s [10.0.0.3]:29500") == "# at # took # s #"


@pytest.mark.parametrize(
    "sig, lines, blame",
    [
        ("gpu-xid-ecc", ["NVRM: Xid (PCI:0000:3b:00): 79, pid=2211, name=python, GPU has fallen off the bus."], "node"),
        ("gpu-xid-ecc", ["NVRM: Xid (PCI:0000:3b:00): 13, pid=2211, Graphics Exception: ESR 0x404600"], "job"),
        ("gpu-xid-ecc", ["NVRM: Xid (PCI:0000:3b:00): 31, pid=1, MMU Fault", "NVRM: Xid (PCI:0000:3b:00): 48"], "node"),
        ("nccl-network-error", ["NCCL WARN NET/IB : Got completion from peer 10.0.0.2 with error 12"], "node"),
        ("python-exception", ["KeyError: 'ferret'"], "job"),
        ("rendezvous-timeout", ["RendezvousTimeoutError"], "infra"),
        ("segfault", ["Segmentation fault"], "unknown"),
        ("no-such-signature", ["?"], "job"),  # the class decides: python_exception
    ],
)
def test_blame_is_the_signatures_and_an_application_xid_is_the_jobs(sig, lines, blame):
    assert blame_of({"signature_id": sig, "failure_class": "python_exception", "evidence": lines}) == blame


def test_healthy_and_unnamed_verdicts():
    r = _report()
    r["status"] = r["attempts"][0]["status"] = "succeeded"
    (v,) = verdicts_of_report(r, source="exec", recorded_at=1.0)
    assert (v.failure_class, v.blame, v.fingerprint, v.proof) == ("healthy", "none", None, "none")
    r = _report(rule="no_rank_named")
    r["attempts"][0]["diagnosis"]["initiating_rank"] = None
    r["attempts"][0]["diagnosis"]["initiating_node"] = None
    (v,) = verdicts_of_report(r, source="exec", recorded_at=1.0)
    assert v.proof == "none" and v.initiating_host is None and v.fingerprint


def test_a_report_without_attempts_is_one_row_of_its_diagnosis():
    r = _report()
    del r["attempts"]
    r["ranks"] = [{"rank": 2, "node": "gpu-07"}]
    (v,) = verdicts_of_report(r, source="analyze", recorded_at=1.0)
    assert v.initiating_host == "gpu-07" and v.attempt == 0


def test_job_ids():
    assert job_id_from_env({"SLURM_JOB_ID": "123"}) == "slurm:123"
    assert (
        job_id_from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "bert-large-worker-3"}) == "k8s:bert-large"
    )
    assert job_id_from_env({"ELASTIC_DIAG_JOB_ID": "nightly", "SLURM_JOB_ID": "1"}) == "nightly"
    assert job_id_from_env({}) == ""


_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
_json = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(["run_id", "status", "diagnosis", "attempts", "ranks", "launch"]), _json))
def test_any_json_is_read_without_an_exception(data):
    """report.json is untrusted: a field of any type gives a row, never an exception."""
    for v in verdicts_of_report(data, source="analyze", recorded_at=0.0):
        assert v.to_row()["run_id"]


def test_a_hostile_report_is_cut_to_size():
    r = _report()
    r["attempts"][0]["diagnosis"] = copy.deepcopy(r["diagnosis"]) | {
        "summary": "x" * 100_000,
        "initiating_node": "h" * 999,
    }
    (v,) = verdicts_of_report(r, source="analyze", recorded_at=0.0)
    assert len(v.summary) <= 400 and len(v.initiating_host or "") <= 255


def test_a_gpus_pci_address_and_an_infiniband_gid_are_the_hosts_not_the_failures():
    a = template("NVRM: Xid (PCI:0000:3b:00): 79, pid=2211, name=python, GPU has fallen off the bus.")
    b = template("NVRM: Xid (PCI:0000:ab:00.0): 79, pid=11, name=python, GPU has fallen off the bus.")
    assert a == b
    gid = "NET/IB : Got completion from peer 10.1.2.3<40567> with status=12 localGid fd01::abcd:ff{} remoteGids fe80::1"
    assert template(gid.format(21)) == template(gid.format("3a")) and "abcd" not in template(gid.format(21))

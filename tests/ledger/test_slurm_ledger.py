"""The ledger under a real Slurm (a one-node cluster on this host, tests/slurm_cluster.py): a failed `srun elastic-diag
exec` job carries its one-line verdict in the job's Comment and is recorded with the Slurm job id and node; once the
node has two node failures, `elastic-diag fleet --apply` drains it (its reason says why), and it is resumed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from slurm_cluster import running_cluster

from elastic_diag.ledger.store import Ledger
from elastic_diag.ledger.verdicts import verdicts_of_report

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python, GPU has fallen off the bus."


def _rows(ledger: Ledger) -> list[dict]:
    import sqlalchemy as sa

    return ledger.read("rows", lambda c: [dict(r._mapping) for r in c.execute(sa.select(ledger.table()))])


def test_the_job_comment_the_record_and_a_drain_applied_then_resumed(tmp_path):
    with running_cluster(nodes=1) as slurm:
        work = tmp_path / "work"
        work.mkdir()
        script = work / "job.py"
        script.write_text("import sys\nraise RuntimeError('the label map has no ferret')\n")
        ledger_path = tmp_path / "ledger.sqlite"
        batch = tmp_path / "job.sh"
        batch.write_text(f"#!/bin/bash\nsrun {sys.executable} -m elastic_diag exec --diag-dir {work}/diag "
                         f"-- {sys.executable} {script}\n")  # fmt: skip
        batch.chmod(0o755)
        job = slurm.sbatch(batch, "-N1", "-o", str(tmp_path / "job.out"), cwd=work,
                           env={"ELASTIC_DIAG_LEDGER": str(ledger_path)})  # fmt: skip
        info = slurm.wait_state(job, {"COMPLETED", "FAILED"}, 90)
        assert info["JobState"] == "FAILED", (tmp_path / "job.out").read_text()
        comment = slurm.client("scontrol", "show", "job", job).stdout
        assert "Comment=elastic_diag: job FAILED: initiating rank 0 on node0: python_exception" in comment, comment
        ledger = Ledger(f"sqlite:///{ledger_path}")
        (row,) = _rows(ledger)
        assert (row["job_id"], row["initiating_host"], row["blame"], row["source"]) == (
            f"slurm:{job}",
            "node0",
            "job",
            "exec",
        )
        # the user's bug does not count against node0; two GPU faults in two other jobs do
        for i, other in enumerate(("9001", "9002")):
            report = {"run_id": f"g{i}", "status": "failed", "attempts": [{"attempt": 0, "status": "failed",
                      "ranks": [{"rank": 0, "node": "node0"}],
                      "diagnosis": {"failure_class": "cuda_error", "initiating_rank": 0, "initiating_node": "node0",
                                    "signature_id": "gpu-xid-ecc", "evidence": [XID79.format(pid=i)]}}]}  # fmt: skip
            ledger.record(verdicts_of_report(report, source="exec", job_id=f"slurm:{other}", recorded_at=time.time()))
        ledger.close()
        env = {**slurm.env, "ELASTIC_DIAG_LEDGER": str(ledger_path)}
        shown = subprocess.run([sys.executable, "-m", "elastic_diag", "fleet", "--json"], env=env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        view = json.loads(shown.stdout)
        assert view["exclude"] == ["node0"] and view["hosts"][0]["failures"] == {"node": 2, "job": 1, "infra": 0,
                                                                                  "unknown": 0}  # fmt: skip
        applied = subprocess.run([sys.executable, "-m", "elastic_diag", "fleet", "--apply"], env=env,
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        assert applied.returncode == 0 and "drained node0" in applied.stderr, applied.stderr
        node = slurm.client("scontrol", "show", "node", "node0").stdout
        assert "DRAIN" in node and "Reason=elastic_diag: 2 node failure(s)" in node, node
        slurm.client("scontrol", "update", "NodeName=node0", "State=RESUME")
        deadline = time.monotonic() + 30
        while "DRAIN" in (node := slurm.client("scontrol", "show", "node", "node0").stdout):
            assert time.monotonic() < deadline, node
            time.sleep(0.3)

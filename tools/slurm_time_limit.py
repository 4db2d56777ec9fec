"""A Slurm time limit, for real: not in the suite, because Slurm's smallest limit is a minute.

    python tools/slurm_time_limit.py [WORK_DIR]      # about two minutes; root, slurm-wlm and munge

It starts the private one-node Slurm of tests/slurm_cluster.py and submits `sbatch --time=1` with
`srun torchrun-diag` running tests/scenarios/sigterm_save_blocks.py (rank 1 blocks in its SIGTERM
handler's checkpoint save). It uses Slurm's KillWait=30 and torch's default --shutdown-timeout (30 s).
Then it prints the job's state, the launcher's exit status and the report's verdict. Expected:
TIMEOUT, "launcher exit 143", status stopped, rank 1 held in save_checkpoint.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from slurm_cluster import SlurmCluster  # noqa: E402


def main() -> int:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="slurm-time-limit-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "slurm", ignore_errors=True)
    (work / "slurm").mkdir()
    cluster = SlurmCluster(work / "slurm", nodes=1)
    launcher = Path(sys.executable).parent / "torchrun-diag"
    script = work / "job.sh"
    script.write_text(f"""#!/bin/bash
export OMP_NUM_THREADS=1 SCENARIO_CKPT_DIR={work}
srun bash -c 'trap "echo the step shell got SIGTERM" TERM
{launcher} --standalone --nproc-per-node 2 --diag-dir {work}/diag --diag-grace 3 \\
    {ROOT}/tests/scenarios/sigterm_save_blocks.py
echo "launcher exit $?"'
""")
    script.chmod(0o755)
    try:
        cluster.start()
        job = cluster.sbatch(script, "-N1", "--time=1", "-o", str(work / "out.txt"), cwd=work)
        info = cluster.wait_state(job, {"TIMEOUT", "CANCELLED", "COMPLETED", "FAILED"}, 240)
        print(f"job {job}: {info.get('JobState')} ({info.get('Reason')}), exit {info.get('ExitCode')}")
    finally:
        cluster.stop()
    out = (work / "out.txt").read_text(errors="replace")
    print(next((line for line in out.splitlines() if line.startswith("launcher exit")), "launcher exit: (none)"))
    report = json.loads((work / "diag" / "report.json").read_text())
    print(f"report: {report['status']}: {report['diagnosis']['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

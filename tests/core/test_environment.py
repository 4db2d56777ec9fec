"""The warnings an environment snapshot gives (core/environment.py). Pure."""

from __future__ import annotations

from elastic_diag.core.environment import environment_findings


def test_the_findings_of_a_full_shm_and_low_ulimits():
    snap = {"disks": {"dev_shm": {"path": "/dev/shm", "used_percent": 99.2, "free_bytes": 64 * 2**20}},
            "ulimits": {"nofile": {"soft": 1024}, "memlock": {"soft": 65536}}, "gpus": [{"index": 0}]}  # fmt: skip
    findings = environment_findings(snap)
    assert findings[0].startswith("/dev/shm is 99% full (64 MiB free)")
    assert any("ulimit -n (nofile) is 1024" in f for f in findings)
    assert any("ulimit -l (memlock) is 64 KiB" in f for f in findings)
    assert environment_findings({}) == []

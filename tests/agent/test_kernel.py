"""agent/kernel.py on files laid out as the kernel lays them out (a cgroup tree in a temp dir, a kernel
log file): what proves an OOM kill, what does not, and what a missing or unreadable source says."""

from __future__ import annotations

from pathlib import Path

from elastic_diag.agent import kernel


def _v1(root: Path, path: str, oom_kill: int, limit: int = 96 << 20, peak: int = 96 << 20) -> None:
    folder = root / "memory" / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")
    (folder / "memory.failcnt").write_text("412\n")
    (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (folder / "memory.max_usage_in_bytes").write_text(f"{peak}\n")


def test_memory_cgroup_v1_and_v2(tmp_path):
    _v1(tmp_path, "/slurm/uid_0/job_42/step_0/task_1", 1)
    state = kernel.memory_cgroup({"memory": "/slurm/uid_0/job_42/step_0/task_1"}, root=tmp_path)
    assert state is not None and (state["version"], state["oom_kill"], state["limit_bytes"]) == (1, 1, 96 << 20)
    v2 = tmp_path / "kubepods.slice" / "pod1"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 17\noom 1\noom_kill 1\noom_group_kill 0\n")
    (v2 / "memory.max").write_text("max\n")  # no limit: "max"
    (v2 / "memory.peak").write_text("123456789\n")
    state = kernel.memory_cgroup({"": "/kubepods.slice/pod1"}, root=tmp_path)
    assert state is not None and (state["version"], state["oom_kill"], state["limit_bytes"]) == (2, 1, None)
    assert kernel.memory_cgroup({"memory": "/gone"}, root=tmp_path) is None  # vanished with the pid


def test_oom_evidence_needs_the_count_to_grow_or_the_pid_in_the_kernel_log(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel, "CGROUP_ROOT", tmp_path)
    paths = {"memory": "/job/task_1"}
    _v1(tmp_path, "/job/task_1", 0)
    before = kernel.memory_cgroup(paths, root=tmp_path)
    _v1(tmp_path, "/job/task_1", 1)
    grew = kernel.oom_evidence(4242, before, paths, {}, "/dev/kmsg (0 bytes read)")
    assert grew["proven"] and "oom_kill 0 -> 1 (limit 96 MiB, peak 96 MiB)" in grew["line"]
    old = kernel.oom_evidence(4242, kernel.memory_cgroup(paths, root=tmp_path), paths, {}, "dmesg (10 bytes)")
    assert not old["proven"]  # an oom_kill from before this rank was seen proves nothing about it
    assert any("oom_kill 1 -> 1" in x for x in old["looked_at"]) and any("no OOM kill of pid 4242" in x
                                                                         for x in old["looked_at"])  # fmt: skip
    never = kernel.oom_evidence(4242, None, {}, {}, "/dev/kmsg: Operation not permitted; no dmesg on PATH")
    assert not never["proven"] and "the rank's cgroup was never read" in never["looked_at"][1]
    _v1(tmp_path, "/job_7/task_1", 1, limit=64 << 20)  # the rank moved here and died before a poll saw it
    moved = kernel.oom_evidence(4242, before, paths, {4242: "Memory cgroup out of memory: Killed process 4242"},
                                "kmsg", kernel_memcg="/job_7/task_1")  # fmt: skip
    assert moved["proven"] and moved["cgroup"]["path"] == "/job_7/task_1" and moved["cgroup"]["limit_bytes"] == 64 << 20
    by_log = kernel.oom_evidence(4242, None, {}, {4242: "Out of memory: Killed process 4242 (python3)"}, "kmsg")
    assert by_log["proven"] and by_log["line"].startswith("Out of memory: Killed process 4242")


def test_the_kernel_log_names_the_pid_or_says_why_not(tmp_path, monkeypatch):
    log = tmp_path / "kmsg"
    log.write_bytes(b"6,625,372869,-;[  pid  ]   uid  tgid total_vm      rss name\n"
                    b"6,627,372869,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
                    b"oom_memcg=/job_7/task_1,task_memcg=/job_7/task_1,task=python3,pid=30286,uid=0\n"
                    b"3,628,372870,-;Memory cgroup out of memory: Killed process 30286 (python3) total-vm:82136kB\n"
                    b"3,700,372990,-;Out of memory: Killed process 777 (java) total-vm:1kB\n")  # fmt: skip
    monkeypatch.setattr(kernel, "KMSG", log)
    found, memcgs, source = kernel.kernel_log_oom_lines({30286, 12})
    assert found == {30286: "Memory cgroup out of memory: Killed process 30286 (python3) total-vm:82136kB"}
    assert memcgs == {30286: "/job_7/task_1"}
    assert source.startswith(str(log))
    found, _, _ = kernel.kernel_log_oom_lines({30286}, since=0.5)  # stamped 0.372870 s: before the ranks started
    assert found == {}
    monkeypatch.setattr(kernel, "KMSG", tmp_path / "no-kmsg")
    monkeypatch.setenv("PATH", str(tmp_path))  # and no dmesg either
    found, _, source = kernel.kernel_log_oom_lines({30286})
    assert found == {} and "No such file or directory" in source and "no dmesg on PATH" in source


def test_cgroups_are_remembered_while_the_rank_lives(tmp_path):
    import os

    known: dict = {}
    baseline: dict = {}
    kernel.remember_cgroups({0: os.getpid()}, known, baseline)
    assert known[0] == kernel.cgroup_paths(os.getpid()) and 0 in baseline
    kernel.remember_cgroups({1: 2**22 + 12345}, known, baseline)  # no such pid: nothing, no error
    assert 1 not in known

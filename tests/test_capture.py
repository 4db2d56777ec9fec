"""Evidence files: bounded reads, the per-attempt layout, and the worker environment."""

from __future__ import annotations

import os
import resource

from torch.distributed.elastic.multiprocessing.api import Std

from elastic_diag.agent.logs_specs import BOOT_DIR, DiagLogsSpecs
from elastic_diag.layout import read_exception, read_tail


def test_tail_of_a_flooded_file_is_bounded(tmp_path):
    big = tmp_path / "stderr.log"
    with open(big, "wb") as fp:
        chunk = (b"x" * 1023 + b"\n") * 1024  # 1 MiB
        for _ in range(200):  # 200 MiB
            fp.write(chunk)
        fp.write(b"RuntimeError: the last line\n")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lines = read_tail(big, max_lines=5)
    assert lines[-1] == "RuntimeError: the last line" and len(lines) == 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 20_000  # KiB


def test_tail_survives_binary_and_missing_files(tmp_path):
    f = tmp_path / "bin.log"
    f.write_bytes(b"\xff\xfe\x00garbage\nok line\n")
    assert read_tail(f, 10)[-1] == "ok line"
    assert read_tail(tmp_path / "missing.log", 10) == ()
    (tmp_path / "exception.json").write_text("{not json")
    assert read_exception(tmp_path) is None


def test_reify_lays_out_attempts_and_injects_bootstrap(tmp_path):
    specs = DiagLogsSpecs(redirects=Std.NONE, tee=Std.NONE, local_ranks_filter={0}, diag_dir=tmp_path)
    envs = {i: {"RANK": str(4 + i), "TORCHELASTIC_RESTART_COUNT": "1"} for i in range(2)}
    dest = specs.reify(envs)
    assert dest.stderrs[1] == str(tmp_path / "attempt_1" / "rank_5" / "stderr.log")
    assert dest.tee_stderrs == {0: dest.stderrs[0]}  # rank 1 filtered from the console, still kept on disk
    assert envs[1]["TORCHELASTIC_ERROR_FILE"].endswith(os.path.join("rank_5", "error.json"))
    assert envs[0]["PYTHONPATH"].split(os.pathsep)[0] == BOOT_DIR
    assert specs.current.attempt == 1 and specs.current.ranks[1].rank == 5


def test_user_redirect_hides_console_but_keeps_file(tmp_path):
    specs = DiagLogsSpecs(redirects=Std.ERR, tee=Std.NONE, diag_dir=tmp_path)
    dest = specs.reify({0: {"RANK": "0"}})
    assert dest.tee_stderrs == {} and dest.tee_stdouts == {0: dest.stdouts[0]}
    assert dest.stderrs[0].endswith("stderr.log")

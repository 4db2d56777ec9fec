"""DiagLogsSpecs: the per-attempt layout of the evidence folder, and the worker environment."""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.api import Std

from elastic_diag.agent.logs_specs import BOOT_DIR, DiagLogsSpecs


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

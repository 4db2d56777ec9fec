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


def test_the_beacon_settings_follow_the_thresholds_and_the_users_own_win(tmp_path, monkeypatch):
    """open_session gives the ranks the beacon's tick (2 s; a fifth of a short threshold the user set) or
    turns the beacon off when nothing watches the ranks; a variable the user exported wins."""
    from elastic_diag.config import DiagConfig
    from elastic_diag.launch.setup import open_session
    from elastic_diag.layout import ENV_BEACON, ENV_PROGRESS_INTERVAL

    monkeypatch.delenv(ENV_PROGRESS_INTERVAL, raising=False)
    monkeypatch.delenv(ENV_BEACON, raising=False)

    def rank_env(**settings: str) -> dict[str, str]:
        config = DiagConfig.resolve(diag_dir=str(tmp_path / "d"), **settings)
        _, specs = open_session(config, run_id="r", logs_specs=None)
        envs: dict[int, dict[str, str]] = {0: {"RANK": "0"}}
        specs.reify(envs)
        return envs[0]

    assert rank_env()[ENV_PROGRESS_INTERVAL] == "2" and ENV_BEACON not in rank_env()
    assert rank_env(hang_timeout="1.5")[ENV_PROGRESS_INTERVAL] == "0.3"
    assert rank_env(stall_timeout="4", hang_timeout="120")[ENV_PROGRESS_INTERVAL] == "0.8"
    assert rank_env(stall_timeout="0.2")[ENV_PROGRESS_INTERVAL] == "0.1"
    off = rank_env(hang_timeout="off", stall_timeout="off")
    assert off[ENV_BEACON] == "0" and ENV_PROGRESS_INTERVAL not in off
    monkeypatch.setenv(ENV_PROGRESS_INTERVAL, "0.25")
    assert rank_env()[ENV_PROGRESS_INTERVAL] == "0.25"

"""What the worker's ``sitecustomize`` calls in every Python process elastic_diag starts: the rank's hooks when
its launcher named its folder (:mod:`elastic_diag.worker.bootstrap`), or, under ``elastic-diag exec`` of a
command whose children are the ranks, the hooks that make a process joining a group a rank
(:mod:`elastic_diag.worker.spawned`). Standard library only; never breaks the process."""

from __future__ import annotations

import os
import sys

from elastic_diag.layout import ENV_RANK_DIR, ENV_SPAWN_DIR


def install_from_env(cpu_at_start: float | None = None) -> None:
    if os.environ.get(ENV_RANK_DIR):
        from elastic_diag.worker import bootstrap

        bootstrap.install_from_env(cpu_at_start)
    elif os.environ.get(ENV_SPAWN_DIR):
        try:
            from elastic_diag.worker import spawned

            spawned.install(os.environ[ENV_SPAWN_DIR])
        except Exception as e:
            print(f"elastic_diag: the spawned ranks' hooks failed, their evidence will be partial: {e!r}",
                  file=sys.stderr)  # fmt: skip

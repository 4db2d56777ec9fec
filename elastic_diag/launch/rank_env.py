"""Which rank a process is, from what its launcher put in its environment (``elastic-diag exec``).

Launchers other than torchrun say it in their own variables; the first family that names a rank wins, in
this order (a torchrun-style ``RANK`` set by the user's own wrapper is the most specific):

=========================  =====================  ===========================  =====================
launcher                   rank                   world size                   local rank
=========================  =====================  ===========================  =====================
torchrun, a user wrapper   ``RANK``               ``WORLD_SIZE``               ``LOCAL_RANK``
Slurm ``srun``             ``SLURM_PROCID``       ``SLURM_NTASKS``             ``SLURM_LOCALID``
Open MPI ``mpirun``        ``OMPI_COMM_WORLD_RANK`` ``OMPI_COMM_WORLD_SIZE``   ``OMPI_COMM_WORLD_LOCAL_RANK``
MPICH / Intel MPI (PMI)    ``PMI_RANK``           ``PMI_SIZE``                 ``MPI_LOCALRANKID``
PMIx                       ``PMIX_RANK``          (none)                       (none)
=========================  =====================  ===========================  =====================

``SLURM_PROCID`` is set in a batch script too (0): it counts only inside a step (``SLURM_STEP_ID``).
Pure: takes a mapping, returns a value; junk (``RANK=abc``, a negative or huge number) is not a rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_RANK = 2**31 - 1  # torch's ranks are C ints

# (launcher, rank variable, world size variable, local rank variable)
FAMILIES: tuple[tuple[str, str, str | None, str | None], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("pmix", "PMIX_RANK", None, None),
)
LOOKED_FOR = tuple(f[1] for f in FAMILIES)


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where this process stands in the job: its rank, how many there are, its rank on this host, and the
    launcher whose variables said so."""

    rank: int
    world_size: int | None
    local_rank: int | None
    launcher: str


def _number(raw: str | None) -> int | None:
    if raw is None:
        return None
    raw = raw.strip()
    if not raw.isdigit() or len(raw) > 10:
        return None
    value = int(raw)
    return value if value <= MAX_RANK else None


def rank_from_env(env: Mapping[str, str]) -> RankPlace | None:
    """This process's rank from its launcher's variables, or None when none names one."""
    for launcher, rank_var, size_var, local_var in FAMILIES:
        if launcher == "slurm" and not env.get("SLURM_STEP_ID", "").strip():
            continue  # a batch script's SLURM_PROCID=0 is not a rank of a step
        rank = _number(env.get(rank_var))
        if rank is None:
            continue
        size = _number(env.get(size_var)) if size_var else None
        if size is not None and (size == 0 or rank >= size):
            size = None  # a world that cannot hold the rank says nothing
        local = _number(env.get(local_var)) if local_var else None
        return RankPlace(rank=rank, world_size=size, local_rank=local, launcher=launcher)
    return None


def job_name(env: Mapping[str, str]) -> str | None:
    """A name every rank of one job computes alike, for a shared diag dir when none is given: Slurm's job and
    step (``-r<N>`` after the N-th requeue), Open MPI's job id, PMIx's namespace, or torchrun-style
    ``MASTER_ADDR``:``MASTER_PORT``; None when the environment holds none of them."""
    job, step = env.get("SLURM_JOB_ID", "").strip(), env.get("SLURM_STEP_ID", "").strip()
    if job and step:
        restart = env.get("SLURM_RESTART_COUNT", "").strip()  # a requeued job's next run: a folder of its own
        return f"slurm-{job}.{step}" + (f"-r{restart}" if restart.isdigit() and int(restart) > 0 else "")
    for var, prefix in (("OMPI_MCA_ess_base_jobid", "ompi"), ("PMIX_NAMESPACE", "pmix")):
        if env.get(var, "").strip():
            return f"{prefix}-{env[var].strip()}"
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if addr and port.isdigit():
        return f"exec-{addr}-{port}"
    return None

"""TORCH_DISTRIBUTED_DEBUG=DETAIL's fingerprint reports compared (core/fingerprints.py): the rank behind
the others named, ranks that name each other leave no rank, a rank's own failure stands. Pure."""

from __future__ import annotations

from elastic_diag.core.attribution import judge
from elastic_diag.core.evidence import AttemptEvidence, LogLine, RankEvidence
from elastic_diag.core.log_lines import evidence_line, signatures_of
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verdict import Diagnosis

TAX = load_taxonomy()


def timed_out(rank: int, seq: int, op: str = "ALLREDUCE", numel: int = 4096) -> str:
    return (f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, "
            f"NumelIn={numel}, NumelOut={numel}, Timeout(ms)=600000) ran for 600031 milliseconds before timing "
            "out.")  # fmt: skip


def lines(*texts: str, order: int = 10, clock: str | None = None) -> tuple[LogLine, ...]:
    return tuple(evidence_line(t, order=order + i, clock=clock, signature=sig.id)
                 for i, t in enumerate(texts) for sig in signatures_of(t, TAX))  # fmt: skip


def rank(r: int, *texts: str, **kw: object) -> RankEvidence:
    return RankEvidence(rank=r, local_rank=r, node="", lines=lines(*texts, order=10 * r + 1), **kw)  # type: ignore[arg-type]


def verdict(*ranks: RankEvidence, **kw: object) -> Diagnosis:
    return judge(AttemptEvidence(attempt=0, ranks=ranks, source="logs", **kw))  # type: ignore[arg-type]


DETAIL = ("RuntimeError: Detected mismatch between collectives on ranks. Rank {me} is running collective: "
          "CollectiveFingerPrint(SequenceNumber={seq}, OpType=ALLREDUCE, TensorShape=[8], TensorDtypes=Float), but "
          "Rank {other} is running collective: CollectiveFingerPrint(SequenceNumber={other_seq}, OpType=BROADCAST, "
          "TensorShape=[8], TensorDtypes=Float).")  # fmt: skip


def test_detail_fingerprints_name_the_rank_behind_the_others():
    d = verdict(rank(0, DETAIL.format(me=0, seq=12, other=3, other_seq=11)),
                rank(1, DETAIL.format(me=1, seq=12, other=3, other_seq=11)),
                rank(2, DETAIL.format(me=2, seq=12, other=3, other_seq=11)))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (3, "collective_desync", "detail_fingerprints")


def test_detail_fingerprints_that_name_each_other_name_no_rank():
    d = verdict(rank(0, DETAIL.format(me=0, seq=5, other=1, other_seq=5)),
                rank(1, DETAIL.format(me=1, seq=5, other=0, other_seq=5)))  # fmt: skip
    assert (d.initiating_rank, d.failure_class) == (None, "collective_desync")


def test_detail_fingerprints_do_not_replace_a_rank_s_own_oom():
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    d = verdict(rank(0, DETAIL.format(me=0, seq=12, other=3, other_seq=11)), rank(2, oom))
    assert (d.initiating_rank, d.failure_class) == (2, "cuda_oom")

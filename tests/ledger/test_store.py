"""elastic_diag/ledger/store.py against a SQLite file and a PostgreSQL server this module starts (Debian's postgresql,
a temp data dir, a non-root user; tests/pg_server.py): the same tests on both. Verdicts recorded and replaced, the
counts the fleet reads kept, 64 writers at once (processes, as 8 nodes x 8 ranks), a server that goes away and comes
back, a newer ledger refused, a corrupt file set aside, a password never shown."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pg_server import PgServer, postgres_server

from elastic_diag.ledger.store import Ledger, LedgerError, ledger_url, safe_url
from elastic_diag.ledger.verdicts import Verdict

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgServer]:
    with postgres_server(tmp_path_factory.mktemp("pg")) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite'}"
        return
    server: PgServer = request.getfixturevalue("pg")
    yield _fresh(server)


def _fresh(server: PgServer) -> str:
    """The server's ledger database emptied (the tests of this module share the server)."""
    server.psql("DROP TABLE IF EXISTS verdicts, host_days, ledger_meta")
    return server.url


def _verdict(run: str, attempt: int = 0, *, host: str = "gpu-01", blame: str = "node", at: float | None = None,
             fp: str = "f" * 16, status: str = "failed", job: str = "slurm:1") -> Verdict:  # fmt: skip
    return Verdict(recorded_at=time.time() if at is None else at, run_id=run, attempt=attempt, source="exec",
                   status=status, job_id=job, failure_class="cuda_error", blame=blame, signature="gpu-xid-ecc",
                   proof="own", initiating_rank=3, initiating_host=host, fingerprint=fp, hosts=(host,),
                   rank_hosts=((3, host),), summary="Rank 3 on gpu-01: Xid 79")  # fmt: skip


def _counts(ledger: Ledger) -> tuple[int, int]:
    import sqlalchemy as sa

    def q(conn: sa.Connection) -> tuple[int, int]:
        rows = conn.execute(sa.select(sa.func.count()).select_from(ledger.table())).scalar_one()
        counted = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(ledger.days().c.count), 0))).scalar_one()
        return int(rows), int(counted)

    try:
        return ledger.read("count", q)
    finally:
        ledger.close()


def test_a_verdict_recorded_again_replaces_its_row_and_moves_its_count(url):
    ledger = Ledger(url)
    assert ledger.record([_verdict("r1"), _verdict("r1", 1)]) == 2
    ledger.record([_verdict("r1", 1, host="gpu-02", blame="job")])  # a later watch's merged verdict
    assert _counts(ledger) == (2, 2)
    import sqlalchemy as sa

    rows = ledger.read("read", lambda c: c.execute(sa.select(ledger.table().c.initiating_host)
                                                    .order_by(ledger.table().c.attempt)).scalars().all())  # fmt: skip
    assert rows == ["gpu-01", "gpu-02"]
    ledger.close()


def _write_one(url: str, i: int, barrier: multiprocessing.synchronize.Barrier) -> None:  # type: ignore[name-defined]
    ledger = Ledger(url, retry_s=60.0)
    barrier.wait()
    ledger.record([_verdict(f"job-{i // 8}", i % 8, host=f"node{i // 8}")])
    ledger.close()


def test_64_writers_at_once_lose_no_verdict(url):
    """8 nodes x 8 ranks end at the same moment, each process records its verdict (forked after the imports)."""
    first = Ledger(url)
    first.ensure_schema()
    first.close()  # no pooled connection crosses the fork
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(64)
    procs = [ctx.Process(target=_write_one, args=(url, i, barrier)) for i in range(64)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 64
    assert _counts(Ledger(url)) == (64, 64)


def test_a_newer_ledger_is_refused_and_left_as_it_was(url, tmp_path):
    ledger = Ledger(url)
    ledger.record([_verdict("r1")])
    import sqlalchemy as sa

    with ledger.engine.begin() as conn:
        conn.execute(sa.text("UPDATE ledger_meta SET value = '99' WHERE key = 'schema_version'"))
    ledger.close()
    before = Path(url.removeprefix("sqlite:///")).read_bytes() if url.startswith("sqlite") else None
    again = Ledger(url)
    with pytest.raises(LedgerError, match="schema 99, written by a newer elastic_diag .* it was not changed"):
        again.record([_verdict("r2")])
    again.close()
    if before is not None:
        assert Path(url.removeprefix("sqlite:///")).read_bytes() == before


def test_a_corrupt_sqlite_file_is_set_aside_not_deleted(tmp_path):
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"this is not a database, it is a log file someone pointed us at\n" * 50)
    ledger = Ledger(f"sqlite:///{path}")
    assert ledger.record([_verdict("r1")]) == 1
    (aside,) = tmp_path.glob("ledger.sqlite.corrupt-*")
    assert aside.read_bytes().startswith(b"this is not a database")
    assert "is not a SQLite database" in ledger.notes[0] and aside.name in ledger.notes[0]
    assert _counts(ledger) == (1, 1)


def test_a_server_that_goes_away_and_comes_back_within_the_bound(pg):
    ledger = Ledger(_fresh(pg), retry_s=20.0)
    ledger.ensure_schema()
    pg.stop()
    back = threading.Timer(1.5, pg.start)
    back.start()
    try:
        started = time.monotonic()
        assert ledger.record([_verdict("while-down")]) == 1
        assert 1.0 < time.monotonic() - started < 20
    finally:
        back.join()
    ledger.close()


def test_a_server_that_stays_away_is_reported_in_bounded_time_without_the_password(pg):
    ledger = Ledger(_fresh(pg), retry_s=2.0)
    ledger.ensure_schema()
    pg.stop()
    try:
        started = time.monotonic()
        with pytest.raises(LedgerError) as err:
            ledger.record([_verdict("while-down")])
        assert time.monotonic() - started < 15
    finally:
        pg.start()
    assert pg.password not in str(err.value) and "ledger:***@127.0.0.1" in str(err.value)
    wrong = Ledger(pg.url.replace(pg.password, "not-the-password-x1"), retry_s=0.5)
    with pytest.raises(LedgerError) as err:
        wrong.record([_verdict("r")])
    wrong.close()
    ledger.close()
    assert "not-the-password-x1" not in str(err.value) and "password authentication failed" in str(err.value)


def test_urls_and_their_display(tmp_path):
    assert ledger_url(str(tmp_path / "l.sqlite"), {}) == f"sqlite:///{tmp_path / 'l.sqlite'}"
    assert ledger_url(None, {"ELASTIC_DIAG_LEDGER": "postgresql://u:pw@db/l"}) == "postgresql+psycopg://u:pw@db/l"
    assert ledger_url(None, {"XDG_STATE_HOME": str(tmp_path)}) == f"sqlite:///{tmp_path}/elastic_diag/ledger.sqlite"
    assert ledger_url("off", {}) is None and ledger_url(None, {"ELASTIC_DIAG_LEDGER": "off"}) is None
    assert safe_url("postgresql+psycopg://u:s3cret@db:5432/l") == "postgresql+psycopg://u:***@db:5432/l"
    from elastic_diag.errors import UsageError

    with pytest.raises(UsageError, match=r"mysql://u:\*\*\*@db"):
        ledger_url("mysql://u:s3cret@db/x", {})


def test_a_missing_table_is_not_waited_for(tmp_path):
    """Only what mends by waiting is retried (unreachable, locked): a ledger whose table was dropped fails at once."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", retry_s=10.0)
    ledger.record([_verdict("r1")])
    import sqlalchemy as sa

    with ledger.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE host_days"))
    started = time.monotonic()
    with pytest.raises(LedgerError, match="no such table: host_days"):
        ledger.record([_verdict("r2")])
    assert time.monotonic() - started < 3
    ledger.close()


def test_a_ledger_it_may_not_write_is_said_at_once():
    """A ledger SQLite cannot open (a read-only file system; /proc here, read-only even for root) must not hold every
    job's end for the retry bound: one line, at once."""
    from elastic_diag.ledger.tell import TellOptions, record_verdict

    started = time.monotonic()
    report = {"run_id": "r", "status": "failed", "diagnosis": {"failure_class": "abort"}}
    options = TellOptions(ledger="sqlite:////proc/elastic-diag-ledger.sqlite", retry_s=10.0)
    (line,) = record_verdict(report, None, options, source="exec")
    assert time.monotonic() - started < 3, line
    assert "the verdict was not recorded in the ledger" in line and "unable to open database file" in line

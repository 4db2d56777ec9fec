"""The test helper pg_server.py: a private PostgreSQL server that starts, stops, restarts and leaves nothing behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pg_server
import psycopg
import pytest
from pg_server import postgres_server

pytestmark = [pytest.mark.timeout(120)]


def _pgrep(pattern: str) -> str:
    return subprocess.run(["pgrep", "-a", "-f", pattern], capture_output=True, text=True, timeout=30).stdout


def test_server_round_trip(tmp_path: Path) -> None:
    with postgres_server(tmp_path) as pg:
        dsn = pg.url.replace("postgresql+psycopg://", "postgresql://")
        assert pg.url.startswith("postgresql+psycopg://ledger:") and f"@127.0.0.1:{pg.port}/ledger" in pg.url
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
            conn.execute("INSERT INTO t VALUES (1, 'one')")
        assert pg.psql("SELECT id, name FROM t") == "1|one"
        assert pg.psql("SHOW max_connections") == "200"
        assert pg.psql("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'ledger'") == "ledger"
        with pytest.raises(psycopg.OperationalError):  # password auth over TCP
            psycopg.connect(dsn.replace(pg.password, "wrong"), connect_timeout=10).close()

        pg.stop()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn, connect_timeout=5).close()
        pg.start()
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT name FROM t WHERE id = 1").fetchone() == ("one",)
        data_dir = pg.data_dir
        assert _pgrep(str(data_dir))

    assert _pgrep(str(data_dir)) == ""
    assert not data_dir.exists()
    assert (tmp_path / "postgres.log").is_file()


def test_missing_postgres_skips_or_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pg_server, "PG_ROOT", tmp_path / "nowhere")
    monkeypatch.delenv(pg_server.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install postgresql"), postgres_server(tmp_path):
        pass
    monkeypatch.setenv(pg_server.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="apt-get install postgresql"), postgres_server(tmp_path):
        pass

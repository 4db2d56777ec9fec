"""A real, private PostgreSQL server for one test module: initdb into a fresh temp dir, listen on 127.0.0.1 on a
port from the kernel, a role and database ``ledger`` with a random password, and everything (processes, files)
gone when the context exits.

    with postgres_server(tmp_path_factory.mktemp("pg")) as pg:
        engine = sqlalchemy.create_engine(pg.url)

initdb refuses to run as root, so as root the server runs as a dedicated system user (created on first use).
The data lives in a fresh ``/tmp/elastic-diag-pg-*`` dir rather than under ``base``: pytest's tmp dirs are 0700
and root's, out of that user's reach, and a unix socket path must stay under ~100 characters. The server log is
copied to ``base / "postgres.log"`` at teardown, so a failed test's log stays with its tmp dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

import pytest

PG_ROOT = Path("/usr/lib/postgresql")
PG_USER = "elastic-diag-pg"  # who runs the server when the tests run as root
USERADD_LOCK = "/tmp/.elastic-diag-pg-useradd.lock"  # serializes creating PG_USER (see _server_user)
REQUIRE_ENV = "ELASTIC_DIAG_REQUIRE_POSTGRES"
TIMEOUT = 60.0  # every subprocess; pg_ctl's own -t too
DB = ROLE = "ledger"
SUPERUSER = "postgres"
BIND_FAILED = re.compile(r"could not bind|could not create any TCP/IP sockets|Address already in use")

SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "off",
    "max_connections": "200",  # a test opens 64 concurrent writers
    "shared_buffers": "'32MB'",
    "logging_collector": "off",
    "log_min_messages": "warning",
}
HBA = f"""\
# written by tests/pg_server.py
local   all  {SUPERUSER}  trust
local   all  all       trust
host    all  all       127.0.0.1/32  scram-sha-256
"""


class PostgresError(RuntimeError):
    """A pg_ctl / initdb / psql call failed; the message has its output and the server log's tail."""


@dataclass(frozen=True)
class PgServer:
    """A running server. ``url`` is for SQLAlchemy; ``stop()`` / ``start()`` take it down and bring it back
    (same port, same data); ``psql(sql)`` runs SQL as the superuser over the unix socket."""

    url: str  # postgresql+psycopg://ledger:<password>@127.0.0.1:<port>/ledger
    password: str = field(repr=False)
    port: int
    data_dir: Path
    socket_dir: Path
    log_file: Path
    bin_dir: Path = field(repr=False)
    uid: int | None = field(default=None, repr=False)  # None: run as ourselves
    gid: int | None = field(default=None, repr=False)

    def start(self) -> None:
        """``pg_ctl start -w``: back when it returns."""
        _pg_ctl(self.bin_dir, self.data_dir, self.log_file, self.uid, self.gid, "start")

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast -w``: every connection is cut and the port is closed when it returns."""
        _pg_ctl(self.bin_dir, self.data_dir, self.log_file, self.uid, self.gid, "stop", "-m", mode)

    def psql(self, sql: str, database: str = DB) -> str:
        """Run ``sql`` as the superuser (unaligned, tuples only: one row a line, columns split by ``|``)."""
        cmd = [str(self.bin_dir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", str(self.socket_dir),
               "-p", str(self.port), "-U", SUPERUSER, "-d", database, "-c", sql]  # fmt: skip
        return _run(cmd, self.uid, self.gid, self.data_dir.parent, self.log_file).strip()


def _fail(why: str) -> NoReturn:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why}; {REQUIRE_ENV}=1 requires it: apt-get install postgresql", pytrace=False)
    pytest.skip(f"{why} (apt-get install postgresql; {REQUIRE_ENV}=1 makes this a failure)")


def find_bin_dir() -> Path | None:
    """The newest /usr/lib/postgresql/<version>/bin with initdb, pg_ctl, postgres and psql."""

    def version(p: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", p.parent.name)) or (0,)

    tools = ("initdb", "pg_ctl", "postgres", "psql")
    found = [d for d in PG_ROOT.glob("*/bin") if all((d / t).is_file() for t in tools)]
    return max(found, key=version, default=None)


def _env() -> dict[str, str]:
    """Ours without any PG* setting (a PGPASSWORD or PGHOST from the caller must not steer initdb/psql) and in
    English, so the log can be matched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    return env


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


def _run(cmd: list[str], uid: int | None, gid: int | None, cwd: Path, log: Path | None = None) -> str:
    """Run ``cmd`` as uid:gid (no supplementary groups) under TIMEOUT; PostgresError with its output if it fails."""
    drop: dict[str, Any] = {"user": uid, "group": gid, "extra_groups": []} if uid is not None else {}
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, errors="replace",
                              timeout=TIMEOUT, stdin=subprocess.DEVNULL, **drop)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise PostgresError(f"{' '.join(cmd)}: no answer in {TIMEOUT:.0f} s\n" + (_tail(log) if log else "")) from e
    if proc.returncode != 0:
        msg = f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}{proc.stderr}"
        if log is not None:
            msg += f"\n--- server log ({log}) ---\n{_tail(log)}"
        raise PostgresError(msg)
    return str(proc.stdout)


def _pg_ctl(bin_dir: Path, data: Path, log: Path, uid: int | None, gid: int | None, *args: str) -> None:
    cmd = [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", str(int(TIMEOUT)), *args]
    _run(cmd, uid, gid, data.parent, log)


def _lookup_user() -> tuple[int, int] | None:
    try:
        pw = pwd.getpwnam(PG_USER)
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def _server_user() -> tuple[int, int] | None:
    """(uid, gid) to drop to: the dedicated system user, created if missing, when we are root; None otherwise.

    Concurrent useradd calls are not safe here: run side by side, each one "succeeds" and the last to write
    /etc/passwd wins, so a worker may chown to a uid that a moment later belongs to nobody. Every worker
    therefore creates the user under one flock (USERADD_LOCK, left in place: removing a lock file races), and
    still takes "already exists" (exit 9) from someone else's useradd as success."""
    if os.geteuid() != 0:
        return None
    if (ids := _lookup_user()) is not None:
        return ids
    if shutil.which("useradd") is None:
        raise PostgresError(f"initdb cannot run as root and there is no useradd to create {PG_USER}")
    fd = os.open(USERADD_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the holder's useradd runs under TIMEOUT, so this wait is bounded
        if (ids := _lookup_user()) is not None:
            return ids
        proc = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                               "--user-group", PG_USER],
                              capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        if (ids := _lookup_user()) is None:
            raise PostgresError(f"useradd {PG_USER} exited {proc.returncode}: {proc.stderr.strip()}")
        return ids
    finally:
        os.close(fd)  # releases the flock


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_conf(data: Path, base_conf: str, socket_dir: Path, port: int) -> None:
    settings = {**SETTINGS, "port": str(port), "unix_socket_directories": f"'{socket_dir}'"}
    lines = "".join(f"{k} = {v}\n" for k, v in settings.items())
    (data / "postgresql.conf").write_text(f"{base_conf}\n# tests/pg_server.py\n{lines}")


def _sessions_of(pid: int) -> list[int]:
    """Every live process in the session led by ``pid`` (pg_ctl setsid()s the postmaster; its children stay in
    it)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "(comm)": state ppid pgrp session; a zombie (Z) holds nothing: it waits for init to reap it
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == pid:
            found.append(int(stat.parent.name))
    return found


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def _kill_leftovers(data: Path, pids: set[int]) -> None:
    """SIGKILL whatever is left of the server(s) of ``data``: the sessions of every postmaster seen, and any
    process whose command line names the data dir."""
    pid = _postmaster_pid(data)
    if pid is not None:
        pids.add(pid)
    for _ in range(50):
        victims = {p for leader in pids for p in _sessions_of(leader)}
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if str(data).encode() in cmdline.read_bytes():
                    victims.add(int(cmdline.parent.name))
        victims.discard(os.getpid())
        if not victims:
            return
        for v in victims:
            with contextlib.suppress(OSError):
                os.kill(v, signal.SIGKILL)
        time.sleep(0.1)


@contextlib.contextmanager
def postgres_server(base: Path) -> Iterator[PgServer]:
    """Start a private server, yield it, then stop it (``-m immediate``), kill anything left of it and remove its
    files. Skips the test when PostgreSQL is not installed, fails it instead under ELASTIC_DIAG_REQUIRE_POSTGRES=1."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        _fail(f"PostgreSQL is not installed (no {PG_ROOT}/<version>/bin/initdb)")
    ids = _server_user()
    uid, gid = ids if ids is not None else (None, None)
    root = Path(tempfile.mkdtemp(prefix="elastic-diag-pg-", dir="/tmp" if ids is not None else None))
    data, sock, log = root / "data", root / "sock", root / "postgres.log"
    postmasters: set[int] = set()
    try:
        sock.mkdir(mode=0o700)
        log.touch()
        if ids is not None:
            for p in (root, sock, log):
                os.chown(p, *ids)
        _run([str(bin_dir / "initdb"), "-D", str(data), "--no-sync", "-A", "trust", "-U", SUPERUSER,
              "-E", "UTF8", "--locale=C"], uid, gid, root)  # fmt: skip
        base_conf = (data / "postgresql.conf").read_text()
        (data / "pg_hba.conf").write_text(HBA)
        for attempt in range(5):  # the port is free when the kernel hands it out, not necessarily a moment later
            port = _free_port()
            _write_conf(data, base_conf, sock, port)
            log.write_text("")
            try:
                _pg_ctl(bin_dir, data, log, uid, gid, "start")
                break
            except PostgresError:
                if attempt == 4 or not BIND_FAILED.search(_tail(log, 200)):
                    raise
        pid = _postmaster_pid(data)
        if pid is not None:
            postmasters.add(pid)
        password = secrets.token_urlsafe(18)
        url = f"postgresql+psycopg://{ROLE}:{quote(password, safe='')}@127.0.0.1:{port}/{DB}"
        server = PgServer(url, password, port, data, sock, log, bin_dir, uid, gid)
        server.psql(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{password}'", database="postgres")
        server.psql(f"CREATE DATABASE {DB} OWNER {ROLE}", database="postgres")
        yield server
    finally:
        pid = _postmaster_pid(data)
        if pid is not None:
            postmasters.add(pid)
        if pid is not None or postmasters:
            with contextlib.suppress(PostgresError, OSError):
                _pg_ctl(bin_dir, data, log, uid, gid, "stop", "-m", "immediate")
        _kill_leftovers(data, postmasters)
        with contextlib.suppress(OSError):
            base.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, base / "postgres.log")
        shutil.rmtree(root, ignore_errors=True)

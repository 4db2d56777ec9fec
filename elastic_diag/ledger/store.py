"""The ledger's storage: one SQLite file by default, or a PostgreSQL database for a team, with one schema,
versioned migrations and bounded retries, through SQLAlchemy Core.

Where: ``--diag-ledger PATH|URL``, else ``ELASTIC_DIAG_LEDGER``, else ``$XDG_STATE_HOME/elastic_diag/ledger.sqlite``
(``~/.local/state/...``); ``off`` turns it off. A write that fails (the server down, the file locked) is retried
for a bounded time (tenacity) and then reported in one line: it never changes the job's outcome. A ledger
written by a newer elastic_diag is refused, never rewritten; a SQLite file that is not a database is set aside
(renamed ``*.corrupt-<time>``), never deleted. A URL's password never appears in any message (:func:`safe_url`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from elastic_diag.errors import UsageError
from elastic_diag.ledger.verdicts import Verdict
from elastic_diag.redaction import mask_shapes

if TYPE_CHECKING:
    import sqlalchemy as sa

ENV_LEDGER = "ELASTIC_DIAG_LEDGER"
ENV_RETRY_S = "ELASTIC_DIAG_LEDGER_RETRY_S"
DEFAULT_RETRY_S = 10.0  # the bound on a write's retries: a ledger never holds a job's end longer
SCHEMA_VERSION = 1
T = TypeVar("T")
LEDGER_FILE = "ledger.sqlite"


class LedgerError(Exception):
    """The ledger cannot be used (a newer schema, a bad URL, the server unreachable after the retries)."""


def default_ledger_path(env: Mapping[str, str] | None = None) -> Path:
    e = os.environ if env is None else env
    state = e.get("XDG_STATE_HOME", "").strip() or str(Path(e.get("HOME", "~")).expanduser() / ".local" / "state")
    return Path(state) / "elastic_diag" / LEDGER_FILE


def ledger_url(value: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The ledger's SQLAlchemy URL from ``--diag-ledger`` (or ``ELASTIC_DIAG_LEDGER``, or the default file); None
    when it is off. A plain path is a SQLite file; ``postgresql://`` uses psycopg 3."""
    e = os.environ if env is None else env
    raw = (value if value is not None else e.get(ENV_LEDGER, "")).strip()
    if raw.lower() in ("off", "none", "0", "no"):
        return None
    if not raw:
        return f"sqlite:///{default_ledger_path(e)}"
    if raw.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + raw.split("://", 1)[1]
    if raw.startswith(("postgresql+psycopg://", "sqlite:///")):
        return raw
    if "://" in raw:
        raise UsageError(f"--diag-ledger: {safe_url(raw)}: use a file path, sqlite:///PATH or postgresql://...")
    return f"sqlite:///{Path(raw).expanduser().resolve()}"


def safe_url(url: str) -> str:
    """The URL with its password masked (``***``): the only form any message shows."""
    head, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    auth, _, host = rest.partition("@")
    user = auth.split(":", 1)[0]
    return f"{head}://{user}{':***' if ':' in auth else ''}@{host}"


@functools.cache
def _tables() -> tuple[sa.MetaData, sa.Table, sa.Table, sa.Table, sa.Table]:
    import sqlalchemy as sa

    meta = sa.MetaData()
    info = sa.Table("ledger_meta", meta, sa.Column("key", sa.String(64), primary_key=True),
                    sa.Column("value", sa.String(256), nullable=False))  # fmt: skip
    verdicts = sa.Table(
        "verdicts", meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.Column("job_id", sa.String(128), nullable=False),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("failure_class", sa.String(64)),
        sa.Column("blame", sa.String(16), nullable=False),
        sa.Column("signature", sa.String(128)),
        sa.Column("rule", sa.String(64)),
        sa.Column("proof", sa.String(16), nullable=False),
        sa.Column("initiating_rank", sa.Integer),
        sa.Column("initiating_host", sa.String(255)),
        sa.Column("exception_type", sa.String(255)),
        sa.Column("fingerprint", sa.String(32)),
        sa.Column("hosts", sa.Text, nullable=False),
        sa.Column("rank_hosts", sa.Text, nullable=False),
        sa.Column("summary", sa.Text, nullable=False),
        sa.Column("command", sa.Text),
        sa.Column("report_path", sa.Text),
        sa.UniqueConstraint("run_id", "attempt", "source", name="uq_verdict_attempt"),
    )  # fmt: skip
    sa.Index("ix_verdicts_time", verdicts.c.recorded_at)
    sa.Index("ix_verdicts_blame", verdicts.c.blame, verdicts.c.recorded_at)
    sa.Index("ix_verdicts_fingerprint", verdicts.c.fingerprint, verdicts.c.recorded_at, verdicts.c.initiating_host,
             verdicts.c.job_id)  # fmt: skip
    # the counts the fleet reads, kept on every write (a verdict recorded again moves its count): a window of a
    # million verdicts is a few thousand of these rows
    days = sa.Table(
        "host_days", meta,
        sa.Column("day", sa.Integer, primary_key=True),  # UTC days since the epoch
        sa.Column("host", sa.String(255), primary_key=True),  # '' when no host was named
        sa.Column("status", sa.String(32), primary_key=True),
        sa.Column("blame", sa.String(16), primary_key=True),
        sa.Column("fingerprint", sa.String(32), primary_key=True),  # '' for none
        sa.Column("failure_class", sa.String(64), primary_key=True),  # '' for none
        sa.Column("signature", sa.String(128)),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("last_at", sa.Float, nullable=False),
    )  # fmt: skip
    # the hosts each failure's fingerprint was seen on, per day: the widespread failures without a scan of the rows
    spread = sa.Table(
        "fingerprint_days", meta,
        sa.Column("day", sa.Integer, primary_key=True),
        sa.Column("fingerprint", sa.String(32), primary_key=True),
        sa.Column("host", sa.String(255), primary_key=True),
        sa.Column("count", sa.Integer, nullable=False),
    )  # fmt: skip
    return meta, info, verdicts, days, spread


def _migrate_to_1(conn: sa.Connection) -> None:
    meta, *_ = _tables()
    meta.create_all(conn)


# version N -> the step that brings a ledger at N-1 to N; add, never change a step that has shipped
MIGRATIONS = {1: _migrate_to_1}


@dataclass
class Ledger:
    """An open ledger: ``record`` appends verdicts (an attempt recorded again replaces its row), ``select`` reads."""

    url: str
    retry_s: float = DEFAULT_RETRY_S
    notes: list[str] = field(default_factory=list)
    _engine: Any = None
    _schema_ok: bool = False

    @property
    def shown(self) -> str:
        return safe_url(self.url)

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            self._engine = self._open()
        engine: sa.Engine = self._engine
        return engine

    def _open(self) -> sa.Engine:
        import sqlalchemy as sa

        if self.url.startswith("sqlite:///"):
            path = Path(self.url.removeprefix("sqlite:///"))
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            engine = sa.create_engine(self.url, connect_args={"timeout": 2.0})

            @sa.event.listens_for(engine, "connect")
            def _pragmas(dbapi: Any, _record: Any) -> None:
                cur = dbapi.cursor()
                cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writers
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.close()

        else:
            engine = sa.create_engine(self.url, pool_pre_ping=True, connect_args={"connect_timeout": 5})
        return engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # -- schema ----------------------------------------------------------------------------------------
    def ensure_schema(self) -> int:
        """Brings the ledger to :data:`SCHEMA_VERSION` (each missing migration in order, in one transaction);
        refuses one written by a newer version; sets aside a SQLite file that is not a database (a note says
        where it went) and starts a new one. Returns the version found before."""
        import sqlalchemy.exc as sa_exc

        if self._schema_ok:
            return SCHEMA_VERSION
        try:
            found = self._run("open", self._migrate)
        except LedgerError as e:
            cause = e.__cause__
            if not (self.url.startswith("sqlite:///") and cause is not None and is_not_a_database(cause)):
                raise
            self.close()
            path = Path(self.url.removeprefix("sqlite:///"))
            aside = set_aside(path)
            self.notes.append(f"the ledger {path} is not a SQLite database ({_reason(cause)}): set aside as "
                              f"{aside.name}, a new ledger started")  # fmt: skip
            found = self._run("open", self._migrate)
        del sa_exc
        self._schema_ok = True
        return found

    def _migrate(self) -> int:
        import sqlalchemy as sa

        _, info, *_ = _tables()
        with self.engine.begin() as conn:
            if self.url.startswith("postgresql"):  # one migrator at a time across the team's writers
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7305917)"))
            found = 0
            if sa.inspect(conn).has_table("ledger_meta"):
                row = conn.execute(sa.select(info.c.value).where(info.c.key == "schema_version")).first()
                found = int(row[0]) if row is not None and str(row[0]).isdigit() else 0
            if found > SCHEMA_VERSION:
                raise LedgerError(
                    f"the ledger at {self.shown} has schema {found}, written by a newer elastic_diag (this one "
                    f"knows {SCHEMA_VERSION}); it was not changed: upgrade elastic_diag or use another ledger"
                )
            for version in range(found + 1, SCHEMA_VERSION + 1):
                MIGRATIONS[version](conn)
            if found == 0:
                conn.execute(sa.insert(info).values(key="schema_version", value=str(SCHEMA_VERSION)))
            elif found < SCHEMA_VERSION:
                conn.execute(sa.update(info).where(info.c.key == "schema_version").values(value=str(SCHEMA_VERSION)))
        return found

    # -- writes ----------------------------------------------------------------------------------------
    def record(self, verdicts: Iterable[Verdict]) -> int:
        """Appends the verdicts and their counts in one transaction (the same run, attempt and source again
        replaces the row and moves its count: a later watch's merged verdict); retried up to ``retry_s``;
        raises LedgerError after."""
        rows = [v.to_row() for v in verdicts]
        if not rows:
            return 0
        self.ensure_schema()

        def write() -> None:
            with self.engine.begin() as conn:
                for row in rows:
                    self._write_one(conn, row)

        self._run("record the verdict", write)
        return len(rows)

    def _write_one(self, conn: sa.Connection, row: dict[str, Any]) -> None:
        import sqlalchemy as sa

        _, _, table, days, spread = _tables()
        upsert = self._upsert()
        key = (table.c.run_id == row["run_id"], table.c.attempt == row["attempt"], table.c.source == row["source"])
        cols = (table.c.recorded_at, table.c.initiating_host, table.c.status, table.c.blame, table.c.fingerprint,
                table.c.failure_class)  # fmt: skip
        old = conn.execute(sa.select(*cols).where(*key).with_for_update()).first()
        if old is not None:
            conn.execute(sa.update(days).where(*_day_key(days, *old)).values(count=days.c.count - 1))
            if old.fingerprint and old.initiating_host:
                conn.execute(sa.update(spread).where(
                    spread.c.day == int(old.recorded_at // DAY_S), spread.c.fingerprint == old.fingerprint,
                    spread.c.host == old.initiating_host).values(count=spread.c.count - 1))  # fmt: skip
            conn.execute(sa.update(table).where(*key).values(**{k: v for k, v in row.items() if k not in (
                "run_id", "attempt", "source")}))  # fmt: skip
        else:
            conn.execute(sa.insert(table).values(**row))
        day = dict(zip(DAY_KEY, _day_values(row["recorded_at"], row["initiating_host"], row["status"], row["blame"],
                                            row["fingerprint"], row["failure_class"]), strict=True))  # fmt: skip
        stmt = upsert(days).values(**day, signature=row["signature"], count=1, last_at=row["recorded_at"])
        conn.execute(stmt.on_conflict_do_update(
            index_elements=list(day), set_={"count": days.c.count + 1, "last_at": sa.case(
                (days.c.last_at > stmt.excluded.last_at, days.c.last_at), else_=stmt.excluded.last_at)}))  # fmt: skip
        if row["fingerprint"] and row["initiating_host"]:
            seen = upsert(spread).values(day=int(row["recorded_at"] // DAY_S), fingerprint=row["fingerprint"],
                                         host=row["initiating_host"], count=1)  # fmt: skip
            conn.execute(seen.on_conflict_do_update(index_elements=["day", "fingerprint", "host"],
                                                    set_={"count": spread.c.count + 1}))  # fmt: skip

    def _upsert(self) -> Any:
        if self.url.startswith("postgresql"):
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        return insert

    def insert_many(self, rows: list[dict[str, Any]], chunk: int = 20_000) -> None:
        """Bulk rows (benchmarks and imports): plain inserts and their counts, one transaction."""
        import sqlalchemy as sa

        _, _, table, days, spread = _tables()
        self.ensure_schema()
        counts: dict[tuple[Any, ...], list[Any]] = {}
        seen: dict[tuple[int, str, str], int] = {}
        for row in rows:
            if row["fingerprint"] and row["initiating_host"]:
                k3 = (int(row["recorded_at"] // DAY_S), row["fingerprint"], row["initiating_host"])
                seen[k3] = seen.get(k3, 0) + 1
        for row in rows:
            k = _day_values(row["recorded_at"], row["initiating_host"], row["status"], row["blame"], row["fingerprint"],
                            row["failure_class"])  # fmt: skip
            c = counts.setdefault(k, [0, 0.0, row["signature"]])
            c[0] += 1
            c[1] = max(c[1], row["recorded_at"])
        upsert = self._upsert()
        stmt = upsert(days)
        stmt = stmt.on_conflict_do_update(
            index_elements=list(DAY_KEY),
            set_={"count": days.c.count + stmt.excluded.count, "last_at": sa.case(
                (days.c.last_at > stmt.excluded.last_at, days.c.last_at), else_=stmt.excluded.last_at)})  # fmt: skip
        params = [
            {**dict(zip(DAY_KEY, k, strict=True)), "signature": sig, "count": n, "last_at": last}
            for k, (n, last, sig) in counts.items()
        ]
        with self.engine.begin() as conn:
            for i in range(0, len(rows), chunk):
                conn.execute(sa.insert(table), rows[i : i + chunk])
            for i in range(0, len(params), chunk):
                conn.execute(stmt, params[i : i + chunk])
            add = upsert(spread)
            add = add.on_conflict_do_update(index_elements=["day", "fingerprint", "host"],
                                            set_={"count": spread.c.count + add.excluded.count})  # fmt: skip
            hits = [{"day": d, "fingerprint": f, "host": h, "count": n} for (d, f, h), n in seen.items()]
            for i in range(0, len(hits), chunk):
                conn.execute(add, hits[i : i + chunk])

    # -- reads -----------------------------------------------------------------------------------------
    def read(self, what: str, fn: Callable[[sa.Connection], T]) -> T:
        """``fn(connection)``, retried like a write."""
        self.ensure_schema()

        def once() -> T:
            with self.engine.connect() as conn:
                return fn(conn)

        return self._run(what, once)

    def last_success(self, *, job_id: str | None = None, command: str | None = None) -> str | None:
        """The report path of the newest successful run of the same job: the same ``job_id`` when one is given
        (``ELASTIC_DIAG_JOB_ID``, a Slurm or Kubernetes job), else the same launch command (script and
        arguments); None when there is none."""
        if not job_id and not command:
            return None

        def newest(conn: sa.Connection) -> str | None:
            import sqlalchemy as sa

            t = self.table()
            same = t.c.job_id == job_id if job_id else t.c.command == command
            row = conn.execute(
                sa.select(t.c.report_path).where(same, t.c.status == "succeeded", t.c.report_path.is_not(None))
                .order_by(t.c.recorded_at.desc()).limit(1)
            ).first()  # fmt: skip
            return str(row[0]) if row is not None else None

        return self.read("find the last successful run", newest)

    def table(self) -> sa.Table:
        return _tables()[2]

    def days(self) -> sa.Table:
        return _tables()[3]

    def spread(self) -> sa.Table:
        return _tables()[4]

    # -- retries ---------------------------------------------------------------------------------------
    def _run(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` again while the database is unreachable or locked, up to ``retry_s`` seconds with jittered
        backoff; then LedgerError naming the ledger (its password masked) and the last error."""
        import sqlalchemy.exc as sa_exc
        import tenacity

        retrying = tenacity.Retrying(
            # unreachable or locked; two writers of one attempt at once (the second finds the first's row); not a
            # missing table or column (SQLite calls those operational too): they do not mend by waiting
            retry=tenacity.retry_if_exception(_transient),
            stop=tenacity.stop_after_delay(self.retry_s),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        )
        try:
            return retrying(fn)
        except sa_exc.DBAPIError as e:
            raise LedgerError(f"the ledger at {self.shown} could not {what}: {_reason(e, self.url)}") from e
        except sa_exc.ArgumentError as e:
            raise LedgerError(f"the ledger at {self.shown}: {_reason(e, self.url)}") from None


DAY_S = 86400


def _day_values(at: float, host: str | None, status: str, blame: str, fp: str | None,
               cls: str | None) -> tuple[Any, ...]:  # fmt: skip
    """The counts' key: a job-blamed failure's fingerprint is not kept per host (it never counts against one;
    the widespread view reads it from ``verdicts``), which keeps the counts a few rows per host and day."""
    return (int(at // DAY_S), host or "", status, blame, "" if blame in ("job", "none") else (fp or ""), cls or "")


def _day_key(days: sa.Table, *values: Any) -> list[Any]:
    return [c == v for c, v in zip(_day_columns(days), _day_values(*values), strict=True)]


DAY_KEY = ("day", "host", "status", "blame", "fingerprint", "failure_class")


def _day_columns(days: sa.Table) -> list[Any]:
    return [days.c[name] for name in DAY_KEY]


# SQLite's operational errors that waiting does not mend (a folder or file it may not write: a read-only home)
_PERMANENT = ("no such table", "no such column", "syntax error", "has no column named", "unable to open database file",
              "readonly database")  # fmt: skip


def _transient(e: BaseException) -> bool:
    import sqlalchemy.exc as sa_exc

    if not isinstance(e, sa_exc.OperationalError | sa_exc.IntegrityError):
        return False
    return not any(p in str(getattr(e, "orig", e)) for p in _PERMANENT)


def _reason(e: BaseException, url: str = "") -> str:
    """The driver's message in one line, any password (the URL's, or of a known shape) masked."""
    orig = getattr(e, "orig", None) or e
    text = " ".join(str(orig).split())[:300]
    password = _password(url)
    if password:
        text = text.replace(password, "***")
    return mask_shapes(text)


def _password(url: str) -> str:
    auth = url.partition("://")[2].split("/", 1)[0]
    return auth.rpartition("@")[0].partition(":")[2] if "@" in auth else ""


def is_not_a_database(e: BaseException) -> bool:
    return "file is not a database" in str(getattr(e, "orig", e)) or "database disk image is malformed" in str(
        getattr(e, "orig", e))  # fmt: skip


def set_aside(path: Path, now: float | None = None) -> Path:
    """A SQLite file that is not a database, renamed beside itself (never deleted), with its WAL files."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    path.rename(target)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    return target

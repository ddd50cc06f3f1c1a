"""The results store: one SQLite file of brick and model timings.

A result is keyed by (kind, digest, digest_version, system id, config key): the same
brick timed on another machine, or with other threads, is another result. Each
result is committed as soon as it is put, and the measurement engine checkpoints the
rounds of results not yet final (``partials``), so a run that dies loses at most the
rounds since its last checkpoint, and a rerun only measures what is :meth:`Store.missing`.

The file is recognised by its SQLite ``application_id``; ``user_version`` holds the
schema version, upgraded by the :data:`MIGRATIONS` list. A file that is not a
dlbricks store, or that a newer dlbricks wrote, is refused without being touched:
it is inspected through a read-only connection first.

Concurrency: WAL journal (readers never block the writer), ``BEGIN IMMEDIATE``
transactions and a busy timeout, so several processes can write one store and
nothing is lost.

One module on purpose (over the usual ~800 lines): the schema, its migrations and every
statement that reads or writes it, exports included, stay in one file, so that one place
says what the SQL is and a schema change cannot miss a query.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from dlbricks.errors import DlbricksError, os_error_text
from dlbricks.files import atomic_text
from dlbricks.timing import Failure, Measurement, RunnerConfig

if TYPE_CHECKING:  # pragma: no cover
    import pandas

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "ResultRecord", "Store", "StoreError", "default_store_path"]

#: ``PRAGMA application_id`` of dlbricks stores: "DLBR" in ASCII.
APPLICATION_ID = 0x444C4252
_SQLITE_MAGIC = b"SQLite format 3\x00"
KINDS = ("brick", "model")
# Runner settings flattened into every exported row as ``config.<name>``.
_CONFIG_COLUMNS = ("intra_op_threads", "inter_op_threads", "execution_mode", "graph_optimization", "cores",
                   "cache_state", "clock", "denormals_as_zero", "precision", "min_rounds", "max_rounds")
EXPORT_FORMATS = ("csv", "json", "parquet")

# Each entry upgrades the schema from version i to i + 1; SCHEMA_VERSION is their count.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE systems (
        id          TEXT PRIMARY KEY,
        fingerprint TEXT NOT NULL,
        created_at  TEXT NOT NULL
    );
    CREATE TABLE configs (
        key        TEXT PRIMARY KEY,
        config     TEXT NOT NULL,
        created_at TEXT NOT NULL
    );
    CREATE TABLE results (
        id             INTEGER PRIMARY KEY,
        kind           TEXT NOT NULL CHECK (kind IN ('brick', 'model')),
        digest         TEXT NOT NULL,
        digest_version INTEGER NOT NULL,
        system_id      TEXT NOT NULL REFERENCES systems(id),
        config_key     TEXT NOT NULL REFERENCES configs(key),
        status         TEXT NOT NULL CHECK (status IN ('ok', 'failed')),
        n              INTEGER,
        median_ns      REAL,
        min_ns         REAL,
        mean_ns        REAL,
        stddev_ns      REAL,
        ci_low_ns      REAL,
        ci_high_ns     REAL,
        cv             REAL,
        unstable       INTEGER,
        stats          TEXT,
        times          BLOB,
        meta           TEXT,
        error          TEXT,
        created_at     TEXT NOT NULL,
        UNIQUE (kind, digest, digest_version, system_id, config_key)
    );
    CREATE TABLE bricks (
        digest         TEXT NOT NULL,
        digest_version INTEGER NOT NULL,
        g              INTEGER,
        op_types       TEXT,
        shapes         TEXT,
        meta           TEXT,
        PRIMARY KEY (digest, digest_version)
    );
    CREATE TABLE models (
        digest         TEXT NOT NULL,
        digest_version INTEGER NOT NULL,
        name           TEXT,
        meta           TEXT,
        PRIMARY KEY (digest, digest_version)
    );
    """,
    # Machine calibrations measured with the results they correct (the fixed cost of
    # one call, timing.calibration), per system and configuration.
    """
    CREATE TABLE calibrations (
        system_id  TEXT NOT NULL REFERENCES systems(id),
        config_key TEXT NOT NULL REFERENCES configs(key),
        name       TEXT NOT NULL,
        value      TEXT NOT NULL,
        created_at TEXT NOT NULL,
        PRIMARY KEY (system_id, config_key, name)
    );
    """,
    # The measurement engine's rounds so far for results not yet final, so that a
    # killed run resumes where it was (timing.engine: a checkpoint per round or two).
    """
    CREATE TABLE partials (
        kind           TEXT NOT NULL,
        digest         TEXT NOT NULL,
        digest_version INTEGER NOT NULL,
        system_id      TEXT NOT NULL,
        config_key     TEXT NOT NULL,
        state          TEXT NOT NULL,
        updated_at     TEXT NOT NULL,
        PRIMARY KEY (kind, digest, digest_version, system_id, config_key)
    );
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
# Columns of a flat result row (exports, dataframes): what the result is (model names
# and paths, op types, G, shapes), how it was measured (its statistics, drift, rounds,
# stop reason) and the runner settings that produced it; raw times excluded.
_FLAT_COLUMNS = (
    "kind",
    "digest",
    "digest_version",
    "model",
    "model_path",
    "op_types",
    "layers",
    "G",
    "shapes",
    "occurrences",
    "status",
    "n",
    "median_ns",
    "min_ns",
    "mean_ns",
    "stddev_ns",
    "p90_ns",
    "p99_ns",
    "ci_low_ns",
    "ci_high_ns",
    "ci_rel_halfwidth",
    "cv",
    "drift",
    "rounds",
    "median_se_ns",
    "common_se_factor",
    "stop_reason",
    "converged",
    "system_id",
    "config_key",
    *(f"config.{k}" for k in _CONFIG_COLUMNS),
    "error",
    "created_at",
)
_BUSY_TIMEOUT_S = 60.0
_CHUNK = 500  # parameters per IN (...) query, well under SQLite's limit
_BATCH = 1000  # results fetched per query when iterating


class StoreError(DlbricksError):
    """A results store cannot be opened or used."""


def default_store_path() -> Path:
    """``$XDG_CACHE_HOME/dlbricks/results.sqlite`` (``~/.cache`` when unset)."""
    from dlbricks.files import user_cache_dir

    return user_cache_dir() / "results.sqlite"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _hex(digest: bytes | str) -> str:
    if isinstance(digest, (bytes, bytearray, memoryview)):
        return bytes(digest).hex()
    s = str(digest).lower()
    try:
        bytes.fromhex(s)
    except ValueError as exc:
        raise StoreError(f"digest must be bytes or a hex string, got {digest!r}") from exc
    return s


@dataclass
class ResultRecord:
    """One stored result.

    ``stats`` is the :class:`dlbricks.timing.Stats` dict (None when failed),
    ``times_ns`` every iteration (None when failed), ``meta`` the rest of the
    measurement (warm-up, stop reason, denormals, versions) or of the failure.
    """

    kind: str
    digest: str
    digest_version: int
    system_id: str
    config_key: str
    status: str
    stats: dict[str, Any] | None
    times_ns: np.ndarray | None
    meta: dict[str, Any]
    error: str | None
    created_at: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def median_ns(self) -> float | None:
        return None if self.stats is None else float(self.stats["median"])

    def flat(self, described: Mapping[str, Any] | None = None,
             config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """One row of scalars (see the CSV export).

        Args:
            described: what the result is (``model``, ``model_path``, ``op_types``,
                ``layers``, ``G``, ``shapes``, ``occurrences``), from the store's
                catalogue or the models given to the export.
            config: the runner settings under this result's key, for results stored
                without their own (older stores).
        """
        s = self.stats or {}
        meta = self.meta or {}
        d = dict(described or {})
        median = s.get("median")
        rel = None
        if isinstance(median, (int, float)) and median > 0 and s.get("ci_low") is not None:
            rel = max(median - s["ci_low"], s["ci_high"] - median) / median
        rounds = meta.get("rounds")
        cfg = meta.get("config") or config or {}
        ops = d.get("op_types")
        shapes = d.get("shapes")
        row = {
            "kind": self.kind,
            "digest": self.digest,
            "digest_version": self.digest_version,
            "model": d.get("model"),
            "model_path": d.get("model_path"),
            "op_types": "+".join(ops) if isinstance(ops, (list, tuple)) else ops,
            "layers": d.get("layers"),
            "G": d.get("G"),
            "shapes": json.dumps(shapes, separators=(",", ":")) if shapes is not None and not isinstance(shapes, str)
            else shapes,
            "occurrences": d.get("occurrences"),
            "status": self.status,
            "n": s.get("n"),
            "median_ns": median,
            "min_ns": s.get("min"),
            "mean_ns": s.get("mean"),
            "stddev_ns": s.get("stddev"),
            "p90_ns": s.get("p90"),
            "p99_ns": s.get("p99"),
            "ci_low_ns": s.get("ci_low"),
            "ci_high_ns": s.get("ci_high"),
            "ci_rel_halfwidth": rel,
            "cv": s.get("cv"),
            "drift": s.get("drift"),
            "rounds": rounds,
            "median_se_ns": meta.get("median_se_ns"),
            "common_se_factor": meta.get("common_se_factor"),
            "stop_reason": meta.get("stop_reason"),
            # Only the measurement engine has a stopping rule to judge by (rounds > 0).
            "converged": (meta.get("stop_reason") == "converged") if rounds else None,
            "system_id": self.system_id,
            "config_key": self.config_key,
            "error": self.error,
            "created_at": self.created_at,
        }
        for k in _CONFIG_COLUMNS:
            v = cfg.get(k)
            row[f"config.{k}"] = ",".join(str(c) for c in v) if isinstance(v, (list, tuple)) else v
        return row

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict with every field (times as a list)."""
        return {
            "kind": self.kind,
            "digest": self.digest,
            "digest_version": self.digest_version,
            "system_id": self.system_id,
            "config_key": self.config_key,
            "status": self.status,
            "stats": self.stats,
            "times_ns": None if self.times_ns is None else [int(t) for t in self.times_ns],
            "meta": self.meta,
            "error": self.error,
            "created_at": self.created_at,
        }


def _inspect(path: Path) -> tuple[int, int, set[str]]:
    """(application_id, user_version, table names) through a read-only connection.

    Raises:
        StoreError: the file is not an SQLite database.
    """
    with open(path, "rb") as fh:
        head = fh.read(len(_SQLITE_MAGIC))
    if head != _SQLITE_MAGIC:
        raise StoreError(f"{path}: not a dlbricks results store (not an SQLite file)")
    uri = f"{path.resolve().as_uri()}?mode=ro"
    try:
        con = sqlite3.connect(uri, uri=True, timeout=_BUSY_TIMEOUT_S)
        try:
            app_id = con.execute("PRAGMA application_id").fetchone()[0]
            version = con.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path}: cannot read as SQLite: {exc}") from exc
    return app_id, version, tables


class _Closed:
    """Stands in for a closed store's connection: any use is the caller's mistake."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def close(self) -> None:
        pass  # closing twice is harmless

    def __getattr__(self, name: str) -> Any:
        raise StoreError(f"{self._path}: the store is closed")


def _check_ours(path: Path, app_id: int, version: int, tables: set[str]) -> None:
    # "results" exists in every schema version; newer versions may add tables.
    if app_id != APPLICATION_ID or "results" not in tables:
        raise StoreError(f"{path}: not a dlbricks results store (an SQLite file of another application)")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path}: written by a newer dlbricks (store schema {version}, this version reads up to "
            f"{SCHEMA_VERSION}); upgrade dlbricks or use another store"
        )


class Store:
    """A results store backed by one SQLite file.

    Args:
        path: the file; None for :func:`default_store_path`.
        readonly: open for reading only (no creation, no migration, no writes).

    Raises:
        StoreError: the file is not a dlbricks store, a newer dlbricks wrote it, or
            (``readonly``) it does not exist or needs a migration. The file is not
            modified in any of these cases.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, readonly: bool = False):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise StoreError(f"Store() takes a path (str or os.PathLike) or None, got {type(path).__name__}")
        self.path = Path(path) if path is not None else default_store_path()
        self.readonly = readonly
        exists = self.path.exists()
        if exists and self.path.is_dir():
            raise StoreError(f"{self.path}: is a directory, not a results store")
        if exists and self.path.stat().st_size > 0:
            _check_ours(self.path, *_inspect(self.path))
        elif readonly:
            raise StoreError(f"{self.path}: no results store here")
        if readonly:
            uri = f"{self.path.resolve().as_uri()}?mode=ro"
            self._con = sqlite3.connect(uri, uri=True, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
            version = self._con.execute("PRAGMA user_version").fetchone()[0]
            if version < SCHEMA_VERSION:
                self._con.close()
                raise StoreError(f"{self.path}: store schema {version} needs an upgrade; open it writable once")
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot create the store's folder ({os_error_text(exc)})") from None
        if exists and not os.access(self.path, os.W_OK):
            raise StoreError(f"{self.path}: read-only file, cannot record results in it")
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves so that every write
        # transaction takes the write lock up front (no deadlock-prone lock upgrades).
        try:
            self._con = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the store ({exc})") from None
        try:
            self._con.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")
            self._initialise()
            mode = self._con.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self.journal_mode = str(mode)
            # NORMAL in WAL mode: a committed result survives the process being killed
            # (kill -9 loses at most the brick in flight); only a power cut can lose the
            # last commits. FULL would add an fsync per result (tens of milliseconds),
            # a large share of a sub-second brick timing.
            self._con.execute("PRAGMA synchronous = NORMAL")
            self._con.execute("PRAGMA foreign_keys = ON")
        except sqlite3.OperationalError as exc:  # e.g. no room for the journal beside it
            self._con.close()
            raise StoreError(f"{self.path}: cannot write to the store ({exc})") from None
        except BaseException:
            self._con.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _initialise(self) -> None:
        """Create or migrate the schema, atomically (one transaction)."""
        con = self._con
        with self._transaction():
            app_id = con.execute("PRAGMA application_id").fetchone()[0]
            version = con.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if app_id == 0 and version == 0 and not tables:
                # A new (empty) file: ours to set up. Header pragmas are transactional,
                # so a crash here leaves an empty file, never a half store.
                con.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            else:
                _check_ours(self.path, app_id, version, tables)
            for v in range(version, SCHEMA_VERSION):
                for stmt in _statements(MIGRATIONS[v]):
                    con.execute(stmt)
                con.execute(f"PRAGMA user_version = {v + 1}")

    def close(self) -> None:
        """Close the connection (committed results are already on disk); using the
        store after this raises a StoreError naming it."""
        self._con.close()
        self._con = _Closed(self.path)  # type: ignore[assignment]

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> None:
        if self.readonly:
            raise StoreError(f"{self.path}: opened read-only")
        con = self._con
        with self._transaction():
            for sql, params in statements:
                con.execute(sql, params)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One ``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on any exception.

        A KeyboardInterrupt can land between any two bytecodes, including right after
        BEGIN or inside COMMIT; so a transaction left open by an earlier interrupted
        write is rolled back first (nothing of it was committed), and the rollback here
        runs only while one is open, never masking the interrupt with a second error."""
        con = self._con
        try:
            if con.in_transaction:
                con.execute("ROLLBACK")
            try:
                con.execute("BEGIN IMMEDIATE")
                yield
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            # A store that cannot be written (read-only file or folder, a full disk, a
            # lock held past the busy timeout): the store's path and SQLite's cause.
            raise StoreError(f"{self.path}: cannot write to the store ({exc})") from None

    # ------------------------------------------------------------------ writing

    def put_system(self, fingerprint: Mapping[str, Any]) -> str:
        """Record a system fingerprint (see :mod:`dlbricks.timing.sysinfo`); returns its id."""
        from dlbricks.timing.sysinfo import fingerprint_id

        sid = fingerprint_id(fingerprint)
        self._write([(_SQL_SYSTEM, (sid, json.dumps(fingerprint, sort_keys=True), _now()))])
        return sid

    def put_calibration(self, system_id: str, config_key: str, name: str, value: Mapping[str, Any]) -> None:
        """Record (replace) a calibration of this system and configuration, e.g.
        ``"call_overhead"`` (see :mod:`dlbricks.timing.calibration`)."""
        self._write([(
            "INSERT OR REPLACE INTO calibrations (system_id, config_key, name, value, created_at) VALUES (?, ?, ?, ?, ?)",
            (system_id, config_key, name, json.dumps(dict(value), sort_keys=True), _now()),
        )])

    def put_partials(
        self, rows: Iterable[tuple[str, str, int, str, str, Mapping[str, Any]]]
    ) -> None:
        """Record (replace), in one transaction, the engine's state of results not yet
        final: (kind, digest hex, digest_version, system_id, config_key, state)."""
        now = _now()
        self._write([
            ("INSERT OR REPLACE INTO partials (kind, digest, digest_version, system_id, config_key, state, updated_at) "
             "VALUES (?, ?, ?, ?, ?, ?, ?)", (k, d, int(v), sid, ck, json.dumps(dict(st)), now))
            for k, d, v, sid, ck, st in rows
        ])

    def get_partials(self, kind: str, digest_version: int, system_id: str, config_key: str) -> dict[str, dict[str, Any]]:
        """The recorded partial states of one kind, by digest."""
        rows = self._con.execute(
            "SELECT digest, state FROM partials WHERE kind = ? AND digest_version = ? AND system_id = ? AND config_key = ?",
            (kind, int(digest_version), system_id, config_key),
        ).fetchall()
        return {d: json.loads(st) for d, st in rows}

    def get_calibration(self, system_id: str, config_key: str, name: str) -> dict[str, Any] | None:
        """A calibration recorded with :meth:`put_calibration`, or None."""
        row = self._con.execute(
            "SELECT value FROM calibrations WHERE system_id = ? AND config_key = ? AND name = ?",
            (system_id, config_key, name),
        ).fetchone()
        return json.loads(row[0]) if row else None

    def put_config(self, config: RunnerConfig) -> str:
        """Record a runner configuration; returns its key."""
        self._write([(_SQL_CONFIG, (config.key(), json.dumps(config.to_dict(), sort_keys=True), _now()))])
        return config.key()

    def put_result(
        self,
        kind: str,
        digest: bytes | str,
        digest_version: int,
        system: str | Mapping[str, Any],
        config: str | RunnerConfig,
        result: Measurement | Failure,
    ) -> None:
        """Store one result and commit at once; an existing result is replaced.

        Args:
            kind: ``"brick"`` or ``"model"``.
            digest: the brick or model digest (bytes or hex).
            digest_version: the version of the digest's canonical form.
            system: a system id already stored, or a fingerprint dict (stored too).
            config: a config key already stored, or a :class:`RunnerConfig` (stored too).
            result: a :class:`Measurement` (status ok) or a :class:`Failure`. The
                measurement's own config key is kept in ``meta["config_key"]``; it
                may differ from ``config`` (e.g. shards of one run pinned to
                different cores are stored under the run's config).

        Raises:
            StoreError: bad kind, unknown system id or config key, read-only store.
        """
        if kind not in KINDS:
            raise StoreError(f"kind must be one of {KINDS}, got {kind!r}")
        stmts: list[tuple[str, Sequence[Any]]] = []
        if isinstance(system, Mapping):
            from dlbricks.timing.sysinfo import fingerprint_id

            system_id = fingerprint_id(system)
            stmts.append((_SQL_SYSTEM, (system_id, json.dumps(system, sort_keys=True), _now())))
        else:
            system_id = str(system)
        if isinstance(config, RunnerConfig):
            config_key = config.key()
            stmts.append((_SQL_CONFIG, (config_key, json.dumps(config.to_dict(), sort_keys=True), _now())))
        else:
            config_key = str(config)
        row: tuple[Any, ...]  # the result columns: every value, or a failure's Nones
        if isinstance(result, Measurement):
            d = result.to_dict()
            s = result.stats
            # The settings that produced this result, whatever the config it is keyed
            # under first recorded (that keeps only what the key covers reliably).
            meta = {k: v for k, v in d.items() if k not in ("times_ns", "stats")}
            row = (
                "ok",
                s.n,
                s.median,
                s.min,
                s.mean,
                s.stddev,
                s.ci_low,
                s.ci_high,
                s.cv,
                int(s.unstable),
                json.dumps(s.to_dict()),
                np.ascontiguousarray(result.times_ns, dtype="<i8").tobytes(),
                json.dumps(meta),
                None,
            )
        elif isinstance(result, Failure):
            row = ("failed",) + (None,) * 11 + (json.dumps(result.to_dict()), result.error)
        else:
            raise TypeError(f"result must be a Measurement or a Failure, got {type(result).__name__}")
        key = (kind, _hex(digest), int(digest_version), system_id, config_key)
        stmts.append((_SQL_RESULT, key + row + (_now(),)))
        # A final result supersedes the rounds kept for it.
        stmts.append(("DELETE FROM partials WHERE kind = ? AND digest = ? AND digest_version = ? AND system_id = ? "
                      "AND config_key = ?", key))
        try:
            self._write(stmts)
        except sqlite3.IntegrityError as exc:
            raise StoreError(
                f"{self.path}: cannot store result for {kind} {_hex(digest)}: unknown system {system_id!r} "
                f"or config {config_key!r} ({exc})"
            ) from exc

    def put_bricks(self, bricks: Iterable[tuple[bytes | str, int, Mapping[str, Any]]]) -> None:
        """Record many bricks' metadata in one transaction: (digest, digest_version, fields),
        where fields may hold ``g``, ``op_types``, ``shapes`` and ``meta`` as in :meth:`put_brick`."""
        self._write([self._brick_statement(d, v, **f) for d, v, f in bricks])

    def put_brick_shapes(self, shapes: Iterable[tuple[bytes | str, int, Any]]) -> None:
        """Record the shapes of bricks already in the catalogue, in one transaction:
        (digest, digest_version, shapes); a brick not in the catalogue is left out."""
        self._write([
            ("UPDATE bricks SET shapes = ? WHERE digest = ? AND digest_version = ?",
             (json.dumps(s), _hex(d), int(v)))
            for d, v, s in shapes if s is not None
        ])

    def put_brick(
        self,
        digest: bytes | str,
        digest_version: int,
        *,
        g: int | None = None,
        op_types: Sequence[str] | None = None,
        shapes: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Record (or replace) a brick's metadata: G, op types, shapes (JSON-friendly).

        ``shapes`` None keeps the shapes already recorded: a planner that cannot read
        them cheaply (a model whose layers are not built) registers the brick without."""
        self._write([self._brick_statement(digest, digest_version, g=g, op_types=op_types, shapes=shapes, meta=meta)])

    @staticmethod
    def _brick_statement(
        digest: bytes | str,
        digest_version: int,
        *,
        g: int | None = None,
        op_types: Sequence[str] | None = None,
        shapes: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> tuple[str, Sequence[Any]]:
        return (
            "INSERT INTO bricks (digest, digest_version, g, op_types, shapes, meta) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (digest, digest_version) DO UPDATE SET g = excluded.g, op_types = excluded.op_types, "
            "shapes = COALESCE(excluded.shapes, bricks.shapes), meta = excluded.meta",
            (
                _hex(digest),
                int(digest_version),
                g,
                json.dumps(list(op_types)) if op_types is not None else None,
                json.dumps(shapes) if shapes is not None else None,
                json.dumps(dict(meta)) if meta is not None else None,
            ),
        )

    def put_model(
        self, digest: bytes | str, digest_version: int, *, name: str | None = None, meta: Mapping[str, Any] | None = None
    ) -> None:
        """Record (or replace) a model's name and metadata."""
        self._write(
            [
                (
                    "INSERT OR REPLACE INTO models (digest, digest_version, name, meta) VALUES (?, ?, ?, ?)",
                    (_hex(digest), int(digest_version), name, json.dumps(dict(meta)) if meta is not None else None),
                )
            ]
        )

    # ------------------------------------------------------------------ reading

    def get_result(
        self, kind: str, digest: bytes | str, digest_version: int, system_id: str, config_key: str
    ) -> ResultRecord | None:
        """The stored result for this key, or None."""
        row = self._con.execute(
            f"SELECT {_RECORD_COLUMNS} FROM results WHERE kind = ? AND digest = ? AND digest_version = ? "
            "AND system_id = ? AND config_key = ?",
            (kind, _hex(digest), int(digest_version), system_id, config_key),
        ).fetchone()
        return _record(row) if row else None

    def get_results(
        self,
        kind: str,
        digests: Iterable[bytes | str],
        digest_version: int,
        system_id: str,
        config_key: str,
        *,
        with_times: bool = False,
    ) -> dict[str, ResultRecord]:
        """The stored results of many digests under one key: hex digest -> record
        (digests without a result are absent). Raw times only ``with_times``."""
        wanted = list(dict.fromkeys(_hex(d) for d in digests))
        cols = _RECORD_COLUMNS if with_times else _RECORD_COLUMNS.replace("times,", "NULL,")
        out: dict[str, ResultRecord] = {}
        for row in self._rows_for_digests(cols, "", kind, wanted, digest_version, system_id, config_key):
            rec = _record(row)
            out[rec.digest] = rec
        return out

    def _rows_for_digests(
        self, cols: str, where: str, kind: str, digests: Sequence[str], digest_version: int, system_id: str,
        config_key: str,
    ) -> Iterator[Sequence[Any]]:
        """Rows of ``results`` for many digests under one key, ``_CHUNK`` digests a query
        (SQLite bounds the parameters of one statement); ``where`` adds a condition."""
        for i in range(0, len(digests), _CHUNK):
            chunk = digests[i : i + _CHUNK]
            marks = ",".join("?" * len(chunk))
            yield from self._con.execute(
                f"SELECT {cols} FROM results WHERE kind = ? AND digest_version = ? AND system_id = ? "
                f"AND config_key = ?{where} AND digest IN ({marks})",
                (kind, int(digest_version), system_id, config_key, *chunk),
            ).fetchall()

    def missing(
        self,
        kind: str,
        digests: Iterable[bytes | str],
        digest_version: int,
        system_id: str,
        config_key: str,
        *,
        retry_failed: bool = False,
    ) -> list[str]:
        """Digests (hex, input order, duplicates dropped) with no stored result.

        Args:
            retry_failed: also return digests whose stored result is a failure.
        """
        wanted = list(dict.fromkeys(_hex(d) for d in digests))
        status_clause = " AND status = 'ok'" if retry_failed else ""
        have = {r[0] for r in self._rows_for_digests("digest", status_clause, kind, wanted, digest_version,
                                                      system_id, config_key)}
        return [d for d in wanted if d not in have]

    def results(
        self,
        *,
        kind: str | None = None,
        system_id: str | None = None,
        config_key: str | None = None,
        status: str | None = None,
        with_times: bool = True,
    ) -> Iterator[ResultRecord]:
        """Stored results matching every given filter, oldest first.

        Args:
            with_times: load the raw iteration times (8 bytes per iteration; skip
                them for summaries of large stores, ``times_ns`` is then None).
        """
        where, params = [], []
        for col, val in (("kind", kind), ("system_id", system_id), ("config_key", config_key), ("status", status)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(val)
        cols = _RECORD_COLUMNS if with_times else _RECORD_COLUMNS.replace("times,", "NULL,")
        # Batches by row id, each fetched whole: a cursor held open across the caller's
        # work would pin a WAL read snapshot, and one fetchall of a large store with
        # its raw times would hold all of them in memory at once.
        last = 0
        while True:
            sql = f"SELECT id, {cols} FROM results WHERE " + " AND ".join(["id > ?", *where])
            rows = self._con.execute(sql + f" ORDER BY id LIMIT {_BATCH}", (last, *params)).fetchall()
            for row in rows:
                yield _record(row[1:])
            if len(rows) < _BATCH:
                return
            last = rows[-1][0]

    def systems(self) -> dict[str, dict[str, Any]]:
        """System id -> fingerprint."""
        return {r[0]: json.loads(r[1]) for r in self._con.execute("SELECT id, fingerprint FROM systems")}

    def configs(self) -> dict[str, dict[str, Any]]:
        """Config key -> config dict."""
        return {r[0]: json.loads(r[1]) for r in self._con.execute("SELECT key, config FROM configs")}

    def bricks(self) -> dict[tuple[str, int], dict[str, Any]]:
        """(digest, digest_version) -> brick metadata."""
        out = {}
        for d, v, g, ops, shapes, meta in self._con.execute(
            "SELECT digest, digest_version, g, op_types, shapes, meta FROM bricks"
        ):
            out[(d, v)] = {
                "g": g,
                "op_types": json.loads(ops) if ops else None,
                "shapes": json.loads(shapes) if shapes else None,
                "meta": json.loads(meta) if meta else None,
            }
        return out

    def bricks_with_shapes(self, digests: Iterable[bytes | str], digest_version: int) -> set[str]:
        """The digests (hex) among ``digests`` whose catalogue entry has shapes."""
        wanted = list(dict.fromkeys(_hex(d) for d in digests))
        out: set[str] = set()
        for i in range(0, len(wanted), _CHUNK):
            chunk = wanted[i : i + _CHUNK]
            out.update(r[0] for r in self._con.execute(
                f"SELECT digest FROM bricks WHERE digest_version = ? AND shapes IS NOT NULL "
                f"AND digest IN ({','.join('?' * len(chunk))})", (int(digest_version), *chunk)))
        return out

    def models(self) -> dict[tuple[str, int], dict[str, Any]]:
        """(digest, digest_version) -> {"name", "meta"}."""
        return {
            (d, v): {"name": n, "meta": json.loads(m) if m else None}
            for d, v, n, m in self._con.execute("SELECT digest, digest_version, name, meta FROM models")
        }

    def count(self, *, kind: str | None = None, status: str | None = None) -> int:
        """Number of stored results matching the filters."""
        where, params = [], []
        for col, val in (("kind", kind), ("status", status)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(val)
        sql = "SELECT COUNT(*) FROM results" + (" WHERE " + " AND ".join(where) if where else "")
        return int(self._con.execute(sql, params).fetchone()[0])

    # ------------------------------------------------------------------ export

    def describe(self) -> dict[tuple[str, str], dict[str, Any]]:
        """What each stored digest is, from the catalogue: (kind, digest) -> ``model``,
        ``model_path``, ``op_types``, ``layers``, ``G`` and ``shapes`` (what is known).

        A brick's ``model`` is the model it was first seen in; its path is that
        model's, when the model was measured end to end.
        """
        out: dict[tuple[str, str], dict[str, Any]] = {}
        paths: dict[str, str] = {}
        for (d, _v), m in self.models().items():
            meta = m.get("meta") or {}
            out[("model", d)] = {"model": m.get("name"), "model_path": meta.get("path"), "layers": meta.get("layers")}
            if m.get("name") and meta.get("path"):
                paths.setdefault(m["name"], meta["path"])
        for (d, _v), b in self.bricks().items():
            meta = b.get("meta") or {}
            source = meta.get("source_model")
            ops = b.get("op_types")
            known = paths.get(source) if source is not None else None
            out[("brick", d)] = {"model": source, "model_path": meta.get("source_path") or known,
                                 "op_types": ops, "layers": meta.get("layers", len(ops) if ops else None),
                                 "G": b.get("g"), "shapes": b.get("shapes")}
        return out

    def rows(
        self,
        *,
        kind: str | None = None,
        only: Iterable[tuple[str, str]] | None = None,
        described: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
        with_times: bool = False,
    ) -> Iterator[tuple[ResultRecord, dict[str, Any]]]:
        """Each result with its flat row (:meth:`ResultRecord.flat`), oldest first.

        Args:
            kind: only results of this kind.
            only: only these (kind, digest) pairs (e.g. the results of some models).
            described: per (kind, digest), what to say the result is, over the
                catalogue's :meth:`describe` (model names and paths, occurrences, shapes).
            with_times: load the raw iteration times.
        """
        catalogue = self.describe()
        configs = self.configs()
        keep = set(only) if only is not None else None
        for rec in self.results(kind=kind, with_times=with_times):
            key = (rec.kind, rec.digest)
            if keep is not None and key not in keep:
                continue
            info = dict(catalogue.get(key, {}))
            info.update({k: v for k, v in (described or {}).get(key, {}).items() if v is not None})
            yield rec, rec.flat(info, configs.get(rec.config_key))

    def to_dataframe(self, *, kind: str | None = None,
                     only: Iterable[tuple[str, str]] | None = None) -> pandas.DataFrame:
        """Flat results (one row per result, no raw times) as a pandas DataFrame.

        Raises:
            StoreError: pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError as exc:
            raise StoreError("to_dataframe needs pandas: pip install pandas") from exc
        rows = [row for _, row in self.rows(kind=kind, only=only)]
        return pd.DataFrame(rows, columns=list(_FLAT_COLUMNS))

    def export(
        self,
        fmt: str,
        file: str | os.PathLike | IO[Any],
        *,
        kind: str | None = None,
        with_times: bool = False,
        only: Iterable[tuple[str, str]] | None = None,
        described: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
    ) -> int:
        """Write results to ``file`` (a path, written whole or not at all, or an open file).

        Every format has the flat row of each result (:data:`_FLAT_COLUMNS`: what it
        is, its statistics, drift, rounds and stop reason, the runner settings).
        ``csv``: those rows. ``json``: an object with ``schema_version``, ``systems``,
        ``configs`` and ``results`` (each row plus its ``meta``, and ``times_ns``
        ``with_times``), written result by result, never built whole in memory.
        ``parquet``: the rows, plus a ``times_ns`` list column ``with_times`` (needs
        pyarrow; a file object must be binary).

        Args:
            fmt: ``"csv"``, ``"json"`` or ``"parquet"``.
            file: destination.
            kind, only, described: as for :meth:`rows`.
            with_times: include every raw iteration time (large).

        Returns:
            The number of results written.

        Raises:
            StoreError: unknown format, or pyarrow missing for parquet.
        """
        if fmt not in EXPORT_FORMATS:
            raise StoreError(f"export format must be one of {EXPORT_FORMATS}, got {fmt!r}")
        rows = self.rows(kind=kind, only=only, described=described, with_times=with_times)
        if fmt == "parquet":
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError as exc:
                raise StoreError("parquet export needs pyarrow: pip install pyarrow") from exc
            cols: dict[str, list[Any]] = {c: [] for c in _FLAT_COLUMNS}
            times: list[list[int] | None] = []
            n = 0
            for rec, row in rows:
                for c in _FLAT_COLUMNS:
                    cols[c].append(row[c])
                times.append(None if rec.times_ns is None else rec.times_ns.tolist())
                n += 1
            data: dict[str, Any] = dict(cols)
            if with_times:
                data["times_ns"] = pa.array(times, type=pa.list_(pa.int64()))
            target = os.fspath(file) if isinstance(file, (str, os.PathLike)) else file
            pq.write_table(pa.table(data), target)
            return n
        if isinstance(file, (str, os.PathLike)):
            with atomic_text(file) as fh:
                return self._write_text(fmt, fh, rows)
        return self._write_text(fmt, file, rows)

    def _write_text(self, fmt: str, fh: IO[str], rows: Iterator[tuple[ResultRecord, dict[str, Any]]]) -> int:
        n = 0
        if fmt == "csv":
            writer = csv.DictWriter(fh, fieldnames=list(_FLAT_COLUMNS), lineterminator="\n")
            writer.writeheader()
            for _, row in rows:
                writer.writerow(row)
                n += 1
            return n
        # One result per line inside a fixed envelope: streamed, and still one JSON document.
        fh.write(f'{{"schema_version": {SCHEMA_VERSION},\n"systems": {json.dumps(self.systems())},\n'
                 f'"configs": {json.dumps(self.configs())},\n"results": [')
        for rec, row in rows:
            entry = dict(row)
            entry["meta"] = {k: v for k, v in (rec.meta or {}).items() if k != "config"}
            if rec.times_ns is not None:
                entry["times_ns"] = rec.times_ns.tolist()
            fh.write(("\n" if n == 0 else ",\n") + json.dumps(entry, separators=(",", ":"), default=_json_default))
            n += 1
        fh.write("\n]}\n")
        return n


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


_SQL_SYSTEM = "INSERT OR IGNORE INTO systems (id, fingerprint, created_at) VALUES (?, ?, ?)"
_SQL_CONFIG = "INSERT OR IGNORE INTO configs (key, config, created_at) VALUES (?, ?, ?)"
# ON CONFLICT DO UPDATE rather than INSERT OR REPLACE: same row id, and no delete
# that a foreign key might one day cascade from.
_SQL_RESULT = """
INSERT INTO results (kind, digest, digest_version, system_id, config_key, status, n, median_ns, min_ns,
                     mean_ns, stddev_ns, ci_low_ns, ci_high_ns, cv, unstable, stats, times, meta, error,
                     created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (kind, digest, digest_version, system_id, config_key) DO UPDATE SET
    status = excluded.status, n = excluded.n, median_ns = excluded.median_ns, min_ns = excluded.min_ns,
    mean_ns = excluded.mean_ns, stddev_ns = excluded.stddev_ns, ci_low_ns = excluded.ci_low_ns,
    ci_high_ns = excluded.ci_high_ns, cv = excluded.cv, unstable = excluded.unstable, stats = excluded.stats,
    times = excluded.times, meta = excluded.meta, error = excluded.error, created_at = excluded.created_at
"""
_RECORD_COLUMNS = "kind, digest, digest_version, system_id, config_key, status, stats, times, meta, error, created_at"


def _record(row: Sequence[Any]) -> ResultRecord:
    kind, digest, version, system_id, config_key, status, stats, times, meta, error, created = row
    return ResultRecord(
        kind=kind,
        digest=digest,
        digest_version=int(version),
        system_id=system_id,
        config_key=config_key,
        status=status,
        stats=json.loads(stats) if stats else None,
        times_ns=np.frombuffer(times, dtype="<i8").astype(np.int64) if times is not None else None,
        meta=json.loads(meta) if meta else {},
        error=error,
        created_at=created,
    )


def _statements(script: str) -> list[str]:
    # executescript() would COMMIT our open transaction; split and run one by one.
    return [s.strip() for s in script.split(";") if s.strip()]

"""The migration runner: numbered schema migrations, then the current definition of every function.

`migrations/NNNN_name.sql` change the schema (tables, indexes, triggers, data moves) and are
applied once each, in order, each in its own transaction, recorded in `schema_migrations` with
the file's SHA-256, so an edited, already-applied migration is detected instead of silently
diverging. `migrations/functions/NAME.sql` hold the one current definition of each SQL function
(`CREATE OR REPLACE FUNCTION NAME ...`); like Flyway's repeatable migrations they are applied
after the numbered ones, recorded in `schema_functions` with their checksum, and applied again
whenever their text changed or a numbered migration ran. A numbered migration that calls a
function while it runs (a data step, a trigger) names it in a `-- requires: NAME, ...` line, and
the runner creates that function first, in the same transaction.

The numbered files of releases before the functions moved out defined the functions themselves;
`migrations/superseded.sha256` lists their checksums: a database that applied one of them has
the same schema, and keeps its record (so that release still starts on it).

Concurrent starts are safe: the runner holds a PostgreSQL advisory lock for the whole run.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import trio_asyncio

log = logging.getLogger(__name__)

_ADVISORY_KEY = 0x7265_6769_7374  # "regist"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_FUNCTION_NAME = re.compile(r"^([a-z0-9_]+)\.sql$")
_REQUIRES = re.compile(r"^--\s*requires:\s*(.+)$", re.M)
_SUPERSEDED = "superseded.sha256"


class MigrationError(Exception):
    """A migration is missing, edited after being applied, or failed to apply."""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Migration:
    """A numbered schema migration."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return _sha256(self.sql)

    @property
    def requires(self) -> tuple[str, ...]:
        """The functions it calls while it runs (its `-- requires:` lines)."""
        return tuple(
            name.strip()
            for line in _REQUIRES.findall(self.sql)
            for name in line.split(",")
            if name.strip()
        )


@dataclass(frozen=True)
class Function:
    """The current definition of one SQL function (a repeatable migration)."""

    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return _sha256(self.sql)


@dataclass(frozen=True)
class Migrations:
    numbered: list[Migration]
    functions: dict[str, Function] = field(default_factory=dict)
    # version -> checksums of earlier texts of that migration a database may have recorded
    superseded: dict[int, frozenset[str]] = field(default_factory=dict)


def migrations_dir() -> Path:
    """`migrations/` of a source checkout, else the copy packaged into the wheel."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "migrations", here.parent / "migrations_sql"):
        if candidate.is_dir():
            return candidate
    raise MigrationError("no migrations directory found")


def load_migrations(directory: Path | None = None) -> Migrations:
    directory = directory or migrations_dir()
    numbered = []
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise MigrationError(f"badly named migration file {path.name} (want NNNN_name.sql)")
        numbered.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
    versions = [m.version for m in numbered]
    if versions != list(range(1, len(numbered) + 1)):
        raise MigrationError(f"migration numbers must be 1..n without gaps, got {versions}")
    functions = {}
    for path in sorted((directory / "functions").glob("*.sql")):
        match = _FUNCTION_NAME.match(path.name)
        if not match:
            raise MigrationError(f"badly named function file {path.name} (want name.sql)")
        function = Function(match.group(1), path.read_text())
        if not re.search(rf"CREATE OR REPLACE FUNCTION {function.name}\(", function.sql):
            raise MigrationError(
                f"functions/{path.name} must define its function with"
                f" CREATE OR REPLACE FUNCTION {function.name}(...)"
            )
        functions[function.name] = function
    for migration in numbered:
        for name in migration.requires:
            if name not in functions:
                raise MigrationError(
                    f"migration {migration.version:04d}_{migration.name} requires function"
                    f" {name}, which has no file in functions/"
                )
    return Migrations(numbered, functions, _load_superseded(directory, numbered))


def _load_superseded(directory: Path, numbered: list[Migration]) -> dict[int, frozenset[str]]:
    path = directory / _SUPERSEDED
    if not path.exists():
        return {}
    by_name = {f"{m.version:04d}_{m.name}.sql": m.version for m in numbered}
    superseded: dict[int, set[str]] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        checksum, _, name = line.partition("  ")
        if name not in by_name or not re.fullmatch(r"[0-9a-f]{64}", checksum):
            raise MigrationError(f"{_SUPERSEDED}: bad line {line!r}")
        superseded.setdefault(by_name[name], set()).add(checksum)
    return {version: frozenset(sums) for version, sums in superseded.items()}


async def _apply_functions(conn: asyncpg.Connection, functions: Iterable[Function]) -> None:
    """Create or replace the functions and record their checksums (inside a transaction).

    Bodies are checked when they run, not when they are created (as pg_dump restores them), so
    the order of the files does not matter."""
    await conn.execute("SET LOCAL check_function_bodies = off")
    for function in functions:
        await conn.execute(function.sql)
        await conn.execute(
            "INSERT INTO schema_functions (name, checksum) VALUES ($1, $2)"
            " ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = now()",
            function.name,
            function.checksum,
        )


async def _migrate(dsn: str, migrations: Migrations) -> list[int]:
    conn = await asyncpg.connect(dsn)
    applied_now: list[int] = []
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", _ADVISORY_KEY)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY,"
            " name text NOT NULL, checksum text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now());"
            "CREATE TABLE IF NOT EXISTS schema_functions (name text PRIMARY KEY,"
            " checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        rows = await conn.fetch("SELECT version, checksum FROM schema_migrations")
        applied = {r["version"]: r["checksum"] for r in rows}
        # First: a database a newer release has migrated may also hold its texts of this
        # build's migrations (superseded there), which are not edits to refuse as such.
        unknown = set(applied) - {m.version for m in migrations.numbered}
        if unknown:
            raise MigrationError(
                f"the database has migrations this build does not know: {sorted(unknown)};"
                " a newer release has migrated it: run that release (or a later one)"
            )
        for migration in migrations.numbered:
            recorded = applied.get(migration.version)
            if recorded == migration.checksum:
                continue
            if recorded is not None:
                # Only a text this build supersedes (its functions moved to functions/) is
                # accepted; its record stays, so the release that applied it still starts.
                if recorded not in migrations.superseded.get(migration.version, frozenset()):
                    raise MigrationError(
                        f"migration {migration.version:04d}_{migration.name} was edited after"
                        " it was applied; add a new migration instead"
                    )
                continue
            async with conn.transaction():
                required = [migrations.functions[name] for name in migration.requires]
                await _apply_functions(conn, required)
                if re.sub(r"--[^\n]*", "", migration.sql).strip():  # not comments only
                    await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    migration.version,
                    migration.name,
                    migration.checksum,
                )
            applied_now.append(migration.version)
            log.info(
                "applied migration %04d_%s%s",
                migration.version,
                migration.name,
                f" (with function {', '.join(migration.requires)})" if required else "",
            )
        rows = await conn.fetch("SELECT name, checksum FROM schema_functions")
        current = {r["name"]: r["checksum"] for r in rows}
        stale = [
            function
            for function in migrations.functions.values()
            if applied_now or current.get(function.name) != function.checksum
        ]
        if stale:
            async with conn.transaction():
                await _apply_functions(conn, stale)
            log.info("applied functions %s", ", ".join(f.name for f in stale))
    finally:
        try:
            if not conn.is_closed():  # a lost connection's error is the one to report
                await conn.execute("SELECT pg_advisory_unlock_all()")
        finally:
            await conn.close()
    return applied_now


async def migrate(dsn: str, migrations: Migrations | None = None) -> list[int]:
    """Apply pending migrations (from Trio, inside a trio-asyncio loop). Returns the numbered
    migrations applied."""
    result: list[int] = await trio_asyncio.aio_as_trio(_migrate)(
        dsn, migrations or load_migrations()
    )
    return result

"""The migration runner: numbered SQL files applied in order, each in its own transaction.

Applied versions are recorded in `schema_migrations` with the file's SHA-256, so an edited,
already-applied migration is detected instead of silently diverging. Concurrent starts are safe:
the runner holds a PostgreSQL advisory lock for the whole run.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import trio_asyncio

log = logging.getLogger(__name__)

_ADVISORY_KEY = 0x7265_6769_7374  # "regist"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class MigrationError(Exception):
    """A migration is missing, edited after being applied, or failed to apply."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def migrations_dir() -> Path:
    """`migrations/` of a source checkout, else the copy packaged into the wheel."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "migrations", here.parent / "migrations_sql"):
        if candidate.is_dir():
            return candidate
    raise MigrationError("no migrations directory found")


def load_migrations(directory: Path | None = None) -> list[Migration]:
    directory = directory or migrations_dir()
    found = []
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise MigrationError(f"badly named migration file {path.name} (want NNNN_name.sql)")
        found.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration numbers must be 1..n without gaps, got {versions}")
    return found


async def _migrate(dsn: str, migrations: list[Migration]) -> list[int]:
    conn = await asyncpg.connect(dsn)
    applied_now: list[int] = []
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", _ADVISORY_KEY)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY,"
            " name text NOT NULL, checksum text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        rows = await conn.fetch("SELECT version, checksum FROM schema_migrations")
        applied = {r["version"]: r["checksum"] for r in rows}
        for migration in migrations:
            if migration.version in applied:
                if applied[migration.version] != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.version:04d}_{migration.name} was edited after"
                        " it was applied; add a new migration instead"
                    )
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    migration.version,
                    migration.name,
                    migration.checksum,
                )
            applied_now.append(migration.version)
            log.info("applied migration %04d_%s", migration.version, migration.name)
        unknown = set(applied) - {m.version for m in migrations}
        if unknown:
            raise MigrationError(
                f"the database has migrations this build does not know: {sorted(unknown)}"
            )
    finally:
        try:
            await conn.execute("SELECT pg_advisory_unlock_all()")
        finally:
            await conn.close()
    return applied_now


async def migrate(dsn: str, migrations: list[Migration] | None = None) -> list[int]:
    """Apply pending migrations (from Trio, inside a trio-asyncio loop). Returns those applied."""
    result: list[int] = await trio_asyncio.aio_as_trio(_migrate)(
        dsn, migrations or load_migrations()
    )
    return result

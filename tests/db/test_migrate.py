"""Upgrading: a database at any earlier release reaches exactly the schema of a fresh one.

`released_migrations.tar.gz` holds the numbered migrations as released before the functions moved
to `migrations/functions/` (0001-0015, the texts `superseded.sha256` lists): those are what
databases in the field applied. For every version k, a database migrated by that release up to k
(with an entry stored at version 1, so that the data steps have rows to move) is upgraded by this
build's runner and must then match a fresh database object for object: tables, columns, defaults,
constraints, indexes and their options, views, triggers and the text of every function.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import asyncpg
import pytest

from registry.store.migrate import (
    Function,
    Migration,
    MigrationError,
    Migrations,
    _migrate,
    load_migrations,
    migrations_dir,
)
from tests.conftest import LOCAL_ADMIN

RELEASED = Path(__file__).with_name("released_migrations.tar.gz")


def released_migrations() -> list[Migration]:
    """The numbered migrations as databases applied them: the archived texts, then the files
    of this checkout for versions released after them."""
    with tarfile.open(RELEASED) as archive:
        texts = {
            member.name: archive.extractfile(member).read().decode()  # type: ignore[union-attr]
            for member in archive.getmembers()
        }
    out = []
    for migration in load_migrations().numbered:
        name = f"{migration.version:04d}_{migration.name}.sql"
        out.append(replace(migration, sql=texts[name]) if name in texts else migration)
    return out


_FINGERPRINT = {
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull, pg_get_expr(d.adbin, d.adrelid)
          FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE n.nspname = 'public' AND a.attnum > 0 AND NOT a.attisdropped
           AND c.relkind IN ('r', 'v', 'p')""",
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, c.reloptions
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v', 'i', 'p', 'S')""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
          FROM pg_constraint WHERE connamespace = 'public'::regnamespace""",
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = 'public'",
    "triggers": """
        SELECT tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t
          JOIN pg_class c ON c.oid = t.tgrelid
         WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
          FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace""",
    "extensions": "SELECT extname FROM pg_extension",
}


async def fingerprint(url: str) -> dict[str, list[tuple[object, ...]]]:
    conn = await asyncpg.connect(url)
    try:
        return {
            part: sorted((tuple(r) for r in await conn.fetch(sql)), key=repr)
            for part, sql in _FINGERPRINT.items()
        }
    finally:
        await conn.close()


@pytest.fixture
def new_database(database_url: str) -> Iterator[Callable[[], str]]:
    """Empty databases on the test server, dropped after the test."""
    admin_url = LOCAL_ADMIN if "127.0.0.1:5432" in database_url else database_url
    names: list[str] = []

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def new() -> str:
        name = f"registry_migrate_{secrets.token_hex(4)}"
        asyncio.run(admin(f"CREATE DATABASE {name}"))
        names.append(name)
        return admin_url.rsplit("/", 1)[0] + "/" + name

    yield new
    for name in names:
        asyncio.run(admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


ENTRY_DOC = (
    '{"name":"Weather agent","description":"Forecasts","version":"1.0.0","tags":["weather"]}'
)


async def store_an_entry_at_version_1(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "UPDATE log_head SET seq = 1;"
            "INSERT INTO log (seq, kind, entry_did) VALUES (1, 'entry.created', 'did:web:a.test');"
            "INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type,"
            " lifecycle, doc) VALUES ('did:web:a.test', 1, 1, 'did:key:zP', 'agent', 'active', $1);"
            "INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc)"
            " VALUES (1, 'did:web:a.test', 'did:key:zP', 'active', $1)".replace(
                "$1", f"'{ENTRY_DOC}'"
            )
        )
    finally:
        await conn.close()


def test_upgrading_from_every_released_version_gives_the_schema_of_a_fresh_database(
    new_database: Callable[[], str],
) -> None:
    fresh = new_database()
    asyncio.run(_migrate(fresh, load_migrations()))
    expected = asyncio.run(fingerprint(fresh))
    assert {name for name, *_ in expected["functions"]} >= set(load_migrations().functions)
    released = released_migrations()
    for k in range(len(released) + 1):
        url = new_database()
        if k:
            asyncio.run(_migrate(url, Migrations(released[:1])))
            asyncio.run(store_an_entry_at_version_1(url))
            asyncio.run(_migrate(url, Migrations(released[:k])))
        asyncio.run(_migrate(url, load_migrations()))
        got = asyncio.run(fingerprint(url))
        for part in expected:
            assert got[part] == expected[part], f"upgraded from version {k}: {part} differ"
        if k:
            row = asyncio.run(_fetchrow(url, "SELECT name, tags FROM entry_search"))
            assert (row["name"], row["tags"]) == ("Weather agent", ["weather"]), k


async def _fetchrow(url: str, sql: str) -> asyncpg.Record:
    conn = await asyncpg.connect(url)
    try:
        row = await conn.fetchrow(sql)
        assert row is not None
        return row
    finally:
        await conn.close()


def test_a_changed_function_is_applied_on_the_next_run_and_only_then(
    new_database: Callable[[], str],
) -> None:
    url = new_database()
    migrations = load_migrations()
    asyncio.run(_migrate(url, migrations))
    before = asyncio.run(
        _fetchrow(url, "SELECT applied_at FROM schema_functions WHERE name = 'epoch_ms'")
    )
    asyncio.run(_migrate(url, migrations))  # nothing changed: nothing applied
    again = asyncio.run(
        _fetchrow(url, "SELECT applied_at FROM schema_functions WHERE name = 'epoch_ms'")
    )
    assert again["applied_at"] == before["applied_at"]

    epoch_ms = migrations.functions["epoch_ms"]
    edited = Function("epoch_ms", epoch_ms.sql.replace("SELECT (extract", "SELECT 7 + (extract"))
    assert edited.sql != epoch_ms.sql
    asyncio.run(
        _migrate(url, replace(migrations, functions={**migrations.functions, "epoch_ms": edited}))
    )
    row = asyncio.run(_fetchrow(url, "SELECT epoch_ms('1970-01-01 00:00:01+00') AS ms"))
    assert row["ms"] == 1007
    row = asyncio.run(
        _fetchrow(url, "SELECT checksum FROM schema_functions WHERE name = 'epoch_ms'")
    )
    assert row["checksum"] == edited.checksum


def test_an_edited_migration_is_refused_unless_its_old_text_is_superseded(
    new_database: Callable[[], str],
) -> None:
    url = new_database()
    released = released_migrations()
    asyncio.run(_migrate(url, Migrations(released)))
    current = load_migrations()
    # This build accepts the released texts it supersedes, and keeps their records (so the
    # release that applied them still starts on the database) ...
    asyncio.run(_migrate(url, current))
    row = asyncio.run(_fetchrow(url, "SELECT checksum FROM schema_migrations WHERE version = 1"))
    assert row["checksum"] == released[0].checksum != current.numbered[0].checksum
    asyncio.run(_migrate(url, Migrations(released)))
    # ... but no other edit of an applied migration.
    edited = replace(current.numbered[4], sql=current.numbered[4].sql + "\n-- edited\n")
    numbered = [*current.numbered[:4], edited, *current.numbered[5:]]
    with pytest.raises(
        MigrationError, match="0005_collation_c_ties was edited after it was applied"
    ):
        asyncio.run(_migrate(url, replace(current, numbered=numbered)))


def test_a_database_a_newer_release_migrated_is_refused_as_such_and_left_alone(
    new_database: Callable[[], str],
) -> None:
    """A newer release: one more migration, and its own text of 0005 (superseding this
    build's, as this build supersedes released texts). It was refused as if 0005 had been
    edited ('add a new migration instead'), which is not what happened nor what to do."""
    url = new_database()
    current = load_migrations()
    theirs = replace(current.numbered[4], sql=current.numbered[4].sql + "\n-- newer text\n")
    later = Migration(len(current.numbered) + 1, "later", "CREATE TABLE later (x int);")
    newer = replace(
        current,
        numbered=[*current.numbered[:4], theirs, *current.numbered[5:], later],
        superseded={5: frozenset({current.numbered[4].checksum})},
    )
    asyncio.run(_migrate(url, newer))
    # Its definition of a function (this build would put its own back).
    asyncio.run(
        _fetchrow(
            url,
            "UPDATE schema_functions SET checksum = 'theirs' WHERE name = 'epoch_ms' RETURNING 1",
        )
    )
    with pytest.raises(
        MigrationError, match=rf"does not know: \[{later.version}\]; a newer release has"
    ):
        asyncio.run(_migrate(url, current))
    row = asyncio.run(
        _fetchrow(url, "SELECT checksum FROM schema_functions WHERE name = 'epoch_ms'")
    )
    assert row["checksum"] == "theirs"


def test_migration_files_name_only_functions_that_exist(tmp_path: Path) -> None:
    (tmp_path / "functions").mkdir()
    (tmp_path / "0001_first.sql").write_text("-- requires: nowhere\nSELECT nowhere();\n")
    with pytest.raises(MigrationError, match="requires function nowhere"):
        load_migrations(tmp_path)
    (tmp_path / "0001_first.sql").write_text("SELECT 1;\n")
    (tmp_path / "functions" / "nowhere.sql").write_text("CREATE FUNCTION nowhere() ...")
    with pytest.raises(MigrationError, match="CREATE OR REPLACE FUNCTION nowhere"):
        load_migrations(tmp_path)


def test_every_function_of_the_numbered_migrations_lives_in_functions() -> None:
    """The numbered files change the schema only: no function is defined there."""
    for migration in load_migrations().numbered:
        assert "CREATE FUNCTION" not in migration.sql.upper().replace("OR REPLACE ", "")
        assert "CREATE OR REPLACE FUNCTION" not in migration.sql.upper()
    assert migrations_dir().joinpath("functions").is_dir()


def test_the_append_path_calls_every_handler_of_the_table_of_kinds() -> None:
    """append_changes calls each handler statically (a plan cached per session): its CASE has
    a branch for exactly the handlers registry/changes.py names."""
    from registry.changes import CHANGE_KINDS

    sql = load_migrations().functions["append_changes"].sql
    branches = set(
        re.findall(r"WHEN '(\w+)' THEN\s+SELECT x\.result, x\.refusal INTO h\s+FROM (\w+)\(", sql)
    )
    assert all(name == called for name, called in branches)
    assert {name for name, _ in branches} == {k.handler for k in CHANGE_KINDS.values() if k.handler}
    assert "EXECUTE format" not in sql  # no dynamic SQL on the append path

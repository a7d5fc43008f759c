"""Database faults classified once, by SQLSTATE (registry/store/pg.py): each condition of the
database is a 503 with a code that names it; anything else is a bug and propagates."""

from __future__ import annotations

import asyncpg
import pytest

from registry.errors import Invalid, Unavailable
from registry.store.pg import _translate

E = asyncpg.exceptions


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (
            E.ReadOnlySQLTransactionError("cannot execute INSERT in a read-only transaction"),
            "database_read_only",
        ),
        (E.DiskFullError("could not extend file"), "database_full"),
        (E.InternalServerError("could not write init file"), "database_full"),
        (E.OutOfMemoryError("out of memory"), "database_out_of_memory"),
        (E.TooManyConnectionsError("sorry, too many clients already"), "database_busy"),
        (E.QueryCanceledError("canceling statement due to statement timeout"), "database_timeout"),
        (
            E.AdminShutdownError("terminating connection due to administrator command"),
            "database_unavailable",
        ),
        (E.CannotConnectNowError("the database system is starting up"), "database_unavailable"),
        (E.SerializationError("could not serialize access"), "database_busy"),
        (E.DeadlockDetectedError("deadlock detected"), "database_busy"),
        (E.LockNotAvailableError("could not obtain lock"), "database_busy"),
        (E.InternalServerError("something else went wrong"), "database_unavailable"),
        (E.ConnectionDoesNotExistError("connection was closed"), "database_unavailable"),
        (asyncpg.InterfaceError("connection is closed"), "database_unavailable"),
        (
            asyncpg.InterfaceError(
                "cannot call Transaction.__aexit__(): the underlying connection is closed"
            ),
            "database_unavailable",
        ),
        (E.PostgresConnectionError("connection failure"), "database_unavailable"),
        (ConnectionResetError("reset"), "database_unavailable"),
        (OSError("no route"), "database_unavailable"),
        # Refused at connect (pg_hba, a rotated password), the database dropped, rights revoked.
        (E.InvalidAuthorizationSpecificationError("pg_hba.conf rejects"), "database_unavailable"),
        (E.InvalidPasswordError("password authentication failed"), "database_unavailable"),
        (E.InvalidCatalogNameError('database "app" does not exist'), "database_unavailable"),
        (E.InsufficientPrivilegeError("permission denied for table log"), "database_unavailable"),
    ],
)
def test_a_condition_of_the_database_is_a_503_that_names_it(exc: BaseException, code: str) -> None:
    translated = _translate(exc)
    assert isinstance(translated, Unavailable)
    assert translated.code == code
    assert translated.status == 503


@pytest.mark.parametrize(
    "exc",
    [
        E.CharacterNotInRepertoireError("invalid byte sequence"),
        E.ProgramLimitExceededError("index row size 3088 exceeds btree version 4 maximum 2704"),
    ],
)
def test_a_value_the_database_refuses_is_the_requests_fault(exc: BaseException) -> None:
    translated = _translate(exc)
    assert isinstance(translated, Invalid)
    assert translated.code == "value_not_storable"


@pytest.mark.parametrize(
    "exc",
    [
        E.UndefinedTableError('relation "nope" does not exist'),
        E.PostgresSyntaxError("syntax error"),
        E.UniqueViolationError("duplicate key"),
        asyncpg.InterfaceError("cannot perform operation: another operation is in progress"),
        RuntimeError("a bug"),
    ],
)
def test_anything_else_is_a_bug_and_propagates(exc: BaseException) -> None:
    assert _translate(exc) is exc

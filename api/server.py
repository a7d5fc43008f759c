"""The composition root: one process, one Trio nursery (design §1).

`serve` opens the trio-asyncio loop (asyncpg speaks asyncio), starts the embedded PostgreSQL when
no database URL is configured, migrates, opens the store, and runs in one nursery: Hypercorn
serving the Quart-Trio app, the rate-limiter actor and the log follower, each under the
supervisor. SIGINT/SIGTERM trigger a graceful stop: Hypercorn finishes in-flight requests within
`graceful_timeout_seconds`, then the actors are cancelled and the database is closed.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import hypercorn.trio
import trio
import trio_asyncio
from hypercorn.config import Config as HyperConfig

from actors.ratelimiter import RateLimiter
from actors.supervisor import supervise
from actors.writer import EntryWriter
from api.app import create_app
from api.http import Deps
from api.identity import HttpIdentityResolver
from registry.config import Config
from registry.identity import DidKeyIdentity, IdentityResolver
from registry.keys import load_or_create_key
from registry.ratelimit import Rate
from registry.service import FollowedCache, Registry, ResultCache, Served
from registry.store import SessionRecord
from registry.store.embedded import EmbeddedPostgres
from registry.store.migrate import migrate
from registry.store.pg import PgStore, open_pg_store

log = logging.getLogger("registry")


async def follow_log(
    store: PgStore,
    entries: FollowedCache[str, Served],
    sessions: FollowedCache[bytes, SessionRecord] | None = None,
    results: ResultCache | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep the in-process caches true as changes commit (in any process on this database).

    Caching is on only while the follower is connected; a lost notification clears the caches.
    Each entry change drops that entry's head and the discovery pages it can move: the follower
    reads the versions before and after the change to know which (a backlog clears them all).
    """
    caches: list[FollowedCache[Any, Any]] = [
        c for c in (entries, sessions, results) if c is not None
    ]
    try:
        async with store.listen("registry_log", "registry_session") as notes:
            for cache in caches:
                cache.clear()
                cache.enabled = True
            task_status.started()
            while True:
                batch = await notes.receive()
                if batch is None:
                    for cache in caches:
                        cache.clear()
                    continue
                changes: list[tuple[int, str]] = []
                for channel, payload in batch:
                    if channel == "registry_log":
                        seq, _, did = payload.partition(" ")
                        entries.invalidate(did)
                        changes.append((int(seq), did))
                    elif sessions is not None:
                        sessions.invalidate(bytes.fromhex(payload))
                if results is not None and changes:
                    await _drop_moved_pages(store, results, changes)
    finally:
        for cache in caches:
            cache.enabled = False
            cache.clear()


CHANGES_CHECKED_AT_ONCE = 64  # a larger batch of changes clears the discovery cache


async def _drop_moved_pages(
    store: PgStore, results: ResultCache, changes: list[tuple[int, str]]
) -> None:
    results.touch()  # pages being computed now may predate these changes: not cached
    if not len(results):
        return
    if len(changes) > CHANGES_CHECKED_AT_ONCE:
        results.clear()
        return
    texts = sorted(results.match_texts())
    versions = await store.change_versions(changes, texts)
    for seq, _ in changes:
        if not results.entry_changed_as_told(versions.get(seq), texts):
            results.entry_changed([None])  # unreadable (cannot be, after its commit): maybe all


class DataDirInUse(Exception):
    """Another registry process serves the embedded database of this data directory."""


@contextmanager
def _own_data_dir(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the data directory while its embedded cluster is ours.

    A second `serve` on the same directory would share the cluster and stop it on exit; it fails
    instead. The kernel releases the lock if we die, so after a kill -9 the next start takes over
    (and reuses the cluster, if PostgreSQL survived).
    """
    path = data_dir / "registry.lock"
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise DataDirInUse(
            f"{data_dir} is in use by a running registry ({owner}); give this one its own"
            " --data-dir, or a --database-url to share a database"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


async def run_janitor(store: PgStore, *, every_seconds: float = 3600.0) -> None:
    """Delete what has expired: idempotency records (24 h), sessions, challenges, stale claims."""
    while True:
        removed = await store.purge_expired()
        if removed:
            log.info("janitor removed %s", removed)
        await trio.sleep(every_seconds)


def _hypercorn_config(config: Config) -> HyperConfig:
    hconfig = HyperConfig()
    hconfig.bind = [f"{config.server.host}:{config.server.port}"]
    hconfig.graceful_timeout = config.server.graceful_timeout_seconds
    hconfig.accesslog = None
    hconfig.errorlog = logging.getLogger("hypercorn.error")
    hconfig.keep_alive_timeout = 75
    hconfig.include_server_header = False
    return hconfig


async def _watch_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            stop.set()
            return


async def serve(
    config: Config,
    *,
    stop: trio.Event | None = None,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the registry until `stop` is set (or a signal arrives). Reports the bound addresses."""
    stop = stop or trio.Event()
    data_dir = config.server.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    key, created = load_or_create_key(config.server.key_path)
    log.info("registry DID %s (%s)", key.did, "new key" if created else config.server.key_path)

    async with trio_asyncio.open_loop(), AsyncExitStack() as stack:
        dsn = config.database.url
        if not dsn:
            stack.enter_context(_own_data_dir(data_dir))
            embedded = EmbeddedPostgres(data_dir, logger=log)
            dsn = await trio.to_thread.run_sync(embedded.start)
            stack.push_async_callback(trio.to_thread.run_sync, embedded.stop)
            log.info("embedded PostgreSQL at %s", embedded.cluster_dir)
        applied = await migrate(dsn)
        if applied:
            log.info("applied migrations %s", applied)
        store = await stack.enter_async_context(
            open_pg_store(dsn, min_size=config.database.pool_min, max_size=config.database.pool_max)
        )
        identity: IdentityResolver = DidKeyIdentity()
        if config.auth.identity_resolver_url:
            identity = await stack.enter_async_context(
                HttpIdentityResolver.open(config.auth.identity_resolver_url)
            )
        writer = EntryWriter(store)
        registry = Registry(
            store=store, config=config, key=key, identity=identity, write_entry=writer.write
        )
        limits = config.limits
        limiter = RateLimiter(
            {
                "read": Rate(limits.read_per_minute),
                "write": Rate(limits.write_per_minute),
                "query": Rate(limits.query_per_minute),
            }
        )
        app = create_app(Deps(registry=registry, limiter=limiter, config=config))

        async with trio.open_nursery() as nursery:
            actors: dict[str, Callable[[], Any]] = {
                "rate-limiter": limiter.run,
                "entry-writer": writer.run,
                "log-follower": lambda: follow_log(
                    store, registry.cache, registry.sessions, registry.results
                ),
                "janitor": lambda: run_janitor(store),
            }
            for name, body in actors.items():
                nursery.start_soon(supervise, name, body)
            if handle_signals:
                nursery.start_soon(_watch_signals, stop)
            http_done = trio.Event()

            async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
                try:
                    await hypercorn.trio.serve(
                        app,
                        _hypercorn_config(config),
                        shutdown_trigger=stop.wait,
                        task_status=task_status,
                    )
                finally:
                    http_done.set()

            binds: list[str] = await nursery.start(run_http)
            # Everything allocated so far lives as long as the process (modules, models, the
            # app): keep it out of the collector's full passes, which otherwise stall requests.
            gc.collect()
            gc.freeze()
            log.info("serving on %s", ", ".join(binds))
            task_status.started(binds)
            # Hypercorn returns once `stop` is set and in-flight requests are drained
            # (bounded by graceful_timeout_seconds); then the actors are cancelled.
            await http_done.wait()
            nursery.cancel_scope.cancel()
    log.info("stopped")

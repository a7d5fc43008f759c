"""The process: one Trio nursery (design §1).

`serve` opens the trio-asyncio loop (asyncpg speaks asyncio), starts the embedded PostgreSQL when
no database URL is configured, migrates, opens the store, and runs in one nursery: the service of
`service.wiring` (its actors) and Hypercorn serving its Quart-Trio app (REST and WebSocket).
SIGINT/SIGTERM trigger a graceful stop: Hypercorn finishes in-flight requests within
`graceful_timeout_seconds`, then the actors are cancelled and the database is closed.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import resource
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager, nullcontext
from functools import partial
from pathlib import Path

import hypercorn.trio
import trio
import trio_asyncio
from hypercorn.config import Config as HyperConfig

from api.identity import HttpIdentityResolver
from registry.config import RELOADABLE, Config, changed_keys
from registry.identity import DidKeyIdentity, IdentityResolver
from registry.keys import SigningKey, load_or_create_key
from registry.store.embedded import EmbeddedPostgres
from registry.store.migrate import migrate
from registry.store.pg import open_pg_store
from service.memory import malloc_trimmer, trim_every
from service.metrics import connections
from service.wiring import Service, open_service
from ws.transport import (
    GUARD_ATTRIBUTE,
    PLAIN_ATTRIBUTE,
    ConnectionGuard,
    ConnectionLimits,
    bound_http2_heads,
    bound_request_heads,
    end_refused_handshakes,
    install_in_hypercorn,
    refuse_websocket_extensions,
)

log = logging.getLogger("registry")

# Header fields a request head may carry (Apache's LimitRequestFields; docs/limits.md).
MAX_HEADER_FIELDS = 100
GC_THRESHOLD = (50_000, 20, 20)  # bench/events.py; the default is (700, 10, 10)


class DataDirInUse(Exception):
    """Another registry process serves the embedded database of this data directory."""


@contextmanager
def own_data_dir(data_dir: Path) -> Iterator[None]:
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


FILES_RESERVED = 256  # descriptors kept for the database pool, logs, the embedded cluster


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit; return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open files limit raised from %d to %d", soft, hard)
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("open files limit stays at %d (hard %d): %s", soft, hard, exc)
    elif hard == resource.RLIM_INFINITY:
        soft = max(soft, 1 << 20)
    return soft


def connection_limits(config: Config, file_limit: int) -> ConnectionLimits:
    """The configured connection bounds, the total kept below the file limit (each connection
    is one descriptor: past the limit `accept` fails for everyone, health checks included)."""
    server = config.server
    room = max(16, file_limit - FILES_RESERVED)
    total = min(server.max_connections, room)
    if total < server.max_connections:
        log.warning(
            "server.max_connections lowered from %d to %d (open files limit %d)",
            server.max_connections,
            total,
            file_limit,
        )
    return ConnectionLimits(
        max_connections=total,
        max_per_client=min(server.max_connections_per_client, total),
        connections_per_minute_per_client=server.connections_per_minute_per_client,
        request_timeout=server.request_timeout_seconds,
        read_timeout=server.read_timeout_seconds,
        send_timeout=server.send_timeout_seconds,
        keep_alive_timeout=server.keep_alive_timeout_seconds,
        max_ws_message=config.events.max_message_bytes,
        ws_control_per_minute=config.events.messages_per_minute,
    )


def _hypercorn_config(config: Config, guard: ConnectionGuard, *, hooked: bool) -> HyperConfig:
    hconfig = HyperConfig()
    hconfig.bind = [f"{config.server.host}:{config.server.port}"]
    if config.metrics.listen:  # /metrics alone, open (api/app.py keeps the rest off it)
        hconfig.bind.append(config.metrics.listen)
    hconfig.graceful_timeout = config.server.graceful_timeout_seconds
    hconfig.accesslog = None
    hconfig.errorlog = logging.getLogger("hypercorn.error")
    hconfig.keep_alive_timeout = config.server.keep_alive_timeout_seconds
    hconfig.include_server_header = False
    # A request's header list over HTTP/2 (h2 counts 32 bytes a field on top of its name and
    # value): the bound HTTP/1.1 heads have (`bound_request_heads`), from the first frame on.
    hconfig.h2_max_header_list_size = hconfig.h11_max_incomplete_size
    hconfig.backlog = 1024  # connections the kernel queues before accept (a burst, not a cap)
    # The guard refuses an oversized message from its header; this is the second line.
    hconfig.websocket_max_message_size = config.events.max_message_bytes
    setattr(hconfig, GUARD_ATTRIBUTE, guard)
    setattr(hconfig, PLAIN_ATTRIBUTE, not hooked)
    return hconfig


async def _watch_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            stop.set()
            return


async def _watch_reloads(
    reload: Callable[[], Config], signals: AsyncIterator[int], service: Service
) -> None:
    """SIGHUP: read the configuration again and apply what can change while running (the
    federation peers, `auth.admin_dids`); anything else needs a restart, and the keys changed
    that are not applied are named. A bad file is logged and ignored."""
    async for _ in signals:
        try:
            fresh = reload()
        except Exception as exc:  # a bad file must not stop a running registry
            log.error("configuration reload refused, keeping the running one: %s", exc)
            continue
        ignored = [k for k in changed_keys(service.config, fresh) if k not in RELOADABLE]
        if ignored:
            log.warning(
                "configuration reload: %s changed, not applied: they take effect at the"
                " next restart",
                ", ".join(ignored),
            )
        before = {p.peer_did for p in service.federation.peers}
        after = {p.peer_did for p in fresh.federation.peers}
        service.federation.reconfigure(fresh.federation.peers)
        service.deps.sessions.admin_dids = tuple(fresh.auth.admin_dids)
        log.info(
            "configuration reloaded: %d federation peer(s) (%d added, %d removed),"
            " %d admin DID(s) (granted at the next sign-in)",
            len(after),
            len(after - before),
            len(before - after),
            len(fresh.auth.admin_dids),
        )


async def _start(
    config: Config, stack: AsyncExitStack, data_dir: Path, key: SigningKey, stop: trio.Event
) -> Service:
    """The embedded cluster (unless `database.url`), the migrations, the pool and the service,
    each closed by `stack`."""
    dsn = config.database.url
    if not dsn:
        stack.enter_context(own_data_dir(data_dir))
        embedded = EmbeddedPostgres(data_dir, logger=log)
        # Before the start: a start cancelled while its thread runs leaves the cluster
        # running when the thread returns (stop is a no-op on a cluster not running).
        stack.push_async_callback(_stop_embedded, embedded)
        dsn = await trio.to_thread.run_sync(embedded.start)
        log.info("embedded PostgreSQL at %s", embedded.cluster_dir)
    applied = await migrate(dsn)
    if applied:
        log.info("applied migrations %s", applied)
    store = await stack.enter_async_context(
        open_pg_store(
            dsn,
            min_size=config.database.pool_min,
            max_size=config.database.pool_max,
            read_dsn=config.database.read_url,
            read_poll_seconds=config.database.read_poll_seconds,
        )
    )
    if config.database.read_url:
        log.info("reads that may lag go to the replica at database.read_url")
    identity: IdentityResolver = DidKeyIdentity()
    if config.auth.identity_resolver_url:
        identity = await stack.enter_async_context(
            HttpIdentityResolver.open(config.auth.identity_resolver_url)
        )
    return await stack.enter_async_context(
        open_service(config, store, key=key, identity=identity, stopping=stop)
    )


async def serve(
    config: Config,
    *,
    reload: Callable[[], Config] | None = None,
    stop: trio.Event | None = None,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the registry until `stop` is set (or a signal arrives). Reports the bound addresses.

    A stop before it serves (SIGTERM while the embedded PostgreSQL starts or the migrations
    run) abandons the start: what was started is stopped again, the embedded cluster too, and
    no address is reported (`[]`)."""
    stop = stop or trio.Event()
    serving = trio.Event()
    # SIGHUP is taken for the whole run (its default ends the process): one that comes while
    # the service starts (the embedded PostgreSQL, the migrations) is applied once it runs,
    # and one after the service has stopped is dropped.
    reloads = handle_signals and reload is not None
    with trio.open_signal_receiver(signal.SIGHUP) if reloads else nullcontext() as hups:
        async with trio.open_nursery() as watchers:
            if handle_signals:
                watchers.start_soon(_watch_signals, stop)
            with trio.CancelScope() as whole:
                watchers.start_soon(_abandon_start, stop, serving, whole)
                await _serve(config, reload, hups, stop, serving, task_status)
            watchers.cancel_scope.cancel()
        if whole.cancelled_caught:  # abandoned before serving: no address was bound
            log.info("stopped")
            task_status.started([])


async def _abandon_start(stop: trio.Event, serving: trio.Event, whole: trio.CancelScope) -> None:
    """A stop before serving cancels the start (once serving, Hypercorn drains and returns)."""
    await stop.wait()
    if not serving.is_set():
        log.info("stopped before serving: abandoning the start")
        whole.cancel()


async def _stop_embedded(embedded: EmbeddedPostgres) -> None:
    with trio.CancelScope(shield=True):  # also when the start was cancelled
        await trio.to_thread.run_sync(embedded.stop)


async def _serve(
    config: Config,
    reload: Callable[[], Config] | None,
    hups: AsyncIterator[int] | None,
    stop: trio.Event,
    serving: trio.Event,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    data_dir = config.server.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    key, created = load_or_create_key(config.server.key_path)
    log.info("registry DID %s (%s)", key.did, "new key" if created else config.server.key_path)
    guard = ConnectionGuard(connection_limits(config, raise_file_limit()))

    async with trio_asyncio.open_loop(), AsyncExitStack() as stack:
        service = await _start(config, stack, data_dir, key, stop)
        service.deps.metrics.add_source(partial(connections, guard))
        app = service.app

        async with trio.open_nursery() as nursery:
            trim = malloc_trimmer() if config.server.memory_trim_seconds else None
            if trim is not None:
                nursery.start_soon(trim_every, config.server.memory_trim_seconds, trim)
            if reload is not None and hups is not None:
                nursery.start_soon(_watch_reloads, reload, hups, service)
            http_done = trio.Event()

            async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
                # The event fan-out writes frames to the socket; connections are bounded.
                refuse_websocket_extensions()  # no permessage-deflate (ws/transport.py)
                end_refused_handshakes()  # Hypercorn's refusals end their connection
                # A request head: 16 KiB (Hypercorn's bound of one still arriving), 100 fields.
                bound_request_heads(HyperConfig().h11_max_incomplete_size, MAX_HEADER_FIELDS)
                bound_http2_heads()  # Hypercorn's h2_max_header_list_size, before any ACK
                hooked = config.server.connection_hook and install_in_hypercorn()
                if not config.server.connection_hook:
                    log.warning(
                        "server.connection_hook is off: the per-connection limits are off and"
                        " events take the slower ASGI path (docs/limits.md)"
                    )
                try:
                    await hypercorn.trio.serve(
                        app,
                        _hypercorn_config(config, guard, hooked=hooked),
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
            # Long-lived per-connection objects (event subscribers, keep-alive connections)
            # are rescanned by every collection; with 1,000 subscribers the default threshold
            # (700 allocations) put 40% of the fan-out's CPU in the collector. Collect young
            # objects every GC_THRESHOLD allocations instead: request paths make few cycles.
            gc.set_threshold(*GC_THRESHOLD)
            log.info("serving on %s", ", ".join(binds))
            serving.set()
            task_status.started(binds)
            # Hypercorn returns once `stop` is set and in-flight requests are drained
            # (bounded by graceful_timeout_seconds); then the actors are cancelled.
            await http_done.wait()
            nursery.cancel_scope.cancel()
    log.info("stopped")

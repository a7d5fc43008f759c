"""Wiring: the service's objects and actors over one store, in one nursery (design §1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from functools import partial

import httpx
import trio
from quart_trio import QuartTrio

from actors.anchoring import AnchoringHandle, run_anchoring
from actors.caches import run_cache_keeper
from actors.chain import LocalChainClient, run_local_chain
from actors.federation import FederationHandle, HttpTransport, PeerDeps, run_federation
from actors.janitor import run_janitor
from actors.log import LogHandle, run_log
from actors.ratelimiter import RateLimiter, run_rate_limiter, share_limits
from actors.supervisor import database_ready, supervise
from actors.transparency import TransparencyHandle, run_checkpointer
from actors.writer import Writer, run_writer
from api.app import create_app
from api.http import Deps
from api.metrics import Metrics
from registry.chain import LocalChain
from registry.changes import ChangeLog
from registry.coherence import Caches
from registry.config import Config
from registry.discovery import CursorCodec
from registry.endpoints import EndpointPolicy
from registry.identity import IdentityResolver
from registry.keys import SigningKey
from registry.metering import DB_TIME_CLASS
from registry.ratelimit import Rate
from registry.store import Store
from registry.trust import Shares
from registry.usecases.anchors import Anchors
from registry.usecases.common import now_ms
from registry.usecases.discovery import Discovery
from registry.usecases.entries import Entries
from registry.usecases.federation import Federation
from registry.usecases.sessions import Sessions
from registry.usecases.transfers import Transfers
from registry.usecases.transparency import Transparency
from registry.usecases.trust import Attestations, Bonds, Reports
from service.metrics import Sources, collectors
from ws.events import EventDeps, register_events


@dataclass
class Service:
    """A running service: its app and the handles of its actors."""

    config: Config
    store: Store
    app: QuartTrio
    deps: Deps
    writer: Writer
    logs: LogHandle
    caches: Caches
    limiter: RateLimiter
    anchoring: AnchoringHandle
    federation: FederationHandle
    transparency: TransparencyHandle


@asynccontextmanager
async def open_service(
    config: Config,
    store: Store,
    *,
    key: SigningKey,
    identity: IdentityResolver,
    stopping: trio.Event | None = None,
) -> AsyncIterator[Service]:
    """Start the actors over `store` and build the app; everything stops when the block exits.

    Inside the block the caches follow the log live (the cache keeper has attached). Setting
    `stopping` closes the event subscribers (1001, with their resume point), so that a
    graceful stop does not wait for them."""
    limits = config.limits
    async with trio.open_nursery() as nursery:
        writer: Writer = await nursery.start(run_writer, store)
        caches = Caches(
            discover_capacity=limits.discover_cache_entries, max_bytes=limits.cache_mib << 20
        )
        logs: LogHandle = await nursery.start(
            lambda task_status: run_log(
                store,
                queue_size=config.events.queue_size,
                poll_seconds=config.events.poll_seconds,
                coalesce_seconds=config.events.coalesce_seconds,
                observers=[caches.observe],  # before any event goes out
                task_status=task_status,
            )
        )
        caches.follows_from(logs.statistics().head)
        await nursery.start(run_cache_keeper, logs, store, caches)
        rates = {
            "read": Rate(limits.read_per_minute),
            "write": Rate(limits.write_per_minute),
            "query": Rate(limits.query_per_minute),
            "write_address": Rate(limits.write_per_minute_per_address),  # every write, per address
            "query_address": Rate(limits.query_per_minute_per_address),  # every query, too
            "body_bytes": Rate(limits.body_bytes_per_minute_per_address),  # bytes, per address
            DB_TIME_CLASS: Rate(limits.query_db_ms_per_minute_per_address),  # paid afterwards
            "replay": Rate(config.events.replays_per_minute),  # event replays, per address
        }
        limiter: RateLimiter = await nursery.start(run_rate_limiter, rates)
        if limits.shared:
            await nursery.start(
                partial(share_limits, limiter, store, every=limits.share_refresh_seconds)
            )
        # Housekeeping: any failure of a pass is retried later (never worth stopping the service).
        nursery.start_soon(
            partial(
                supervise,
                "janitor",
                lambda: run_janitor(store),
                known=(Exception,),
                ready=database_ready(store, writes=True),
            )
        )

        changes = ChangeLog(writer.append, store)
        federation_handle = FederationHandle(config.federation.peers)
        sessions = Sessions(
            store=store,
            changes=changes,
            config=config,
            key=key,
            identity=identity,
            cache=caches.sessions,
            peer_dids=lambda: [p.peer_did for p in federation_handle.peers],
        )
        entries = Entries(
            store=store,
            changes=changes,
            config=config,
            caches=caches,
        )
        discovery = Discovery(
            store=store, config=config, cursors=CursorCodec(key.seed), results=caches.results
        )
        transparency = TransparencyHandle()
        if config.transparency.enabled:
            nursery.start_soon(
                partial(
                    supervise,
                    "transparency",
                    partial(
                        run_checkpointer,
                        store,
                        key,
                        config.transparency.origin or key.did,
                        every_seconds=config.transparency.checkpoint_seconds,
                        handle=transparency,
                    ),
                    ready=database_ready(store, writes=True),
                )
            )
        anchoring = AnchoringHandle()
        if config.anchoring.enabled:
            await _start_anchoring(nursery, config, store, writer, anchoring)
        bonds = Bonds(
            store=store,
            changes=changes,
            entries=entries,
            config=config,
            registry_did=key.did,
            shares=Shares(
                Decimal(config.bonds.harmed_share),
                Decimal(config.bonds.reporter_share),
                Decimal(config.bonds.treasury_share),
            ),
        )
        # Federation: the peers' HTTP client and the PeerActors, which wait (without taking
        # the federation lock) while no peer is configured; a reload may add some
        # (`federation_handle.reconfigure`).
        # The client closes only once the actors using it have stopped (their own task).
        # Redirects are never followed (the default, said here so nobody changes it).
        client = httpx.AsyncClient(
            timeout=config.federation.request_timeout_seconds, follow_redirects=False
        )
        transport = HttpTransport(
            client,
            max_bytes=limits.federation_body_bytes + 2 * limits.entry_body_bytes,
            policy=lambda: EndpointPolicy.of(
                allow_http=config.federation.allow_http_endpoints,
                configured=[p.endpoint for p in federation_handle.peers],
                allowed=config.federation.allowed_endpoint_hosts,
            ),
        )
        federation = Federation(
            store=store,
            changes=changes,
            config=config,
            key=key,
            live=federation_handle.live,
            discovery=discovery,
            call=transport.call,
            peer_list=lambda: federation_handle.peers,
        )
        federation_deps = PeerDeps(
            store=store,
            append=writer.append,
            key=key,
            transport=transport,
            config=config.federation,
            endpoint_of=federation.endpoint_of,
            handle=federation_handle,
            clock_ms=now_ms,
        )

        async def run_peers() -> None:
            async with client:
                await supervise(
                    "federation",
                    partial(run_federation, federation_deps),
                    ready=database_ready(store, writes=True),
                )

        nursery.start_soon(run_peers)
        event_deps = EventDeps(
            logs=logs,
            sessions=sessions,
            config=config.events,
            stopping=stopping if stopping is not None else trio.Event(),
            limiter=limiter,
            trusted_proxies=config.server.trusted_proxies,
        )
        metrics = Metrics(
            collectors(
                Sources(
                    events=event_deps,
                    now_ms=now_ms,
                    writer=writer,
                    logs=logs,
                    caches=caches,
                    store=store,
                    anchoring=anchoring,
                    federation=federation_handle,
                    transparency=transparency,
                )
            )
        )
        deps = Deps(
            metrics=metrics,
            entries=entries,
            sessions=sessions,
            discovery=discovery,
            store=store,
            limiter=limiter,
            config=config,
            caches=caches.all(),
            attestations=Attestations(store=store, changes=changes, entries=entries, config=config),
            reports=Reports(
                store=store, changes=changes, entries=entries, bonds=bonds, config=config
            ),
            bonds=bonds,
            transfers=Transfers(store=store, changes=changes, entries=entries, config=config),
            anchors=Anchors(
                store=store,
                changes=changes,
                entries=entries,
                config=config,
                secret=key.seed,
                on_change=anchoring.nudge,
            ),
            federation=federation,
            transparency=Transparency(store, page_bytes=config.limits.versions_page_bytes),
            write_condition=writer.condition,
        )
        app = create_app(deps)
        register_events(app, event_deps)
        yield Service(
            config,
            store,
            app,
            deps,
            writer,
            logs,
            caches,
            limiter,
            anchoring,
            federation_handle,
            transparency,
        )
        nursery.cancel_scope.cancel()


async def _start_anchoring(
    nursery: trio.Nursery,
    config: Config,
    store: Store,
    writer: Writer,
    handle: AnchoringHandle,
) -> None:
    """The built-in local chain (journaled in the data directory), its block producer, and the
    anchoring supervisor (which works only while this process holds the anchoring lock)."""
    settings = config.anchoring
    interval = settings.block_interval_seconds
    chain: LocalChain = await nursery.start(
        partial(
            run_local_chain,
            config.server.data_dir / "chain.jsonl",
            interval=interval,
            clock_ms=now_ms,
            settle=settings.finality_depth + 1,  # idle: no empty blocks, no journal growth
        )
    )
    client = LocalChainClient(chain, instant=interval == 0, clock_ms=now_ms)
    nursery.start_soon(
        partial(
            supervise,
            "anchoring",
            partial(
                run_anchoring,
                store,
                writer.append,
                client,
                settings,
                handle=handle,
                clock_ms=now_ms,
            ),
            ready=database_ready(store, writes=True),
        )
    )

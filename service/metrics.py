"""The service's metrics read at scrape time from its actors' state (`api/metrics.py` serves them).

Nothing here is counted per event: each family is read from what the writer, the log actor, the
caches, the store's pool, the peer actors and the anchoring supervisor keep anyway, when
Prometheus asks. Each process serves its own (Prometheus scrapes every process); the peers and
the anchoring are reported by the process that leads them (the others report none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from actors.anchoring import AnchoringHandle
from actors.federation import FederationHandle
from actors.log import LogHandle
from actors.transparency import TransparencyHandle
from actors.writer import Writer
from registry.coherence import Caches
from registry.histogram import Histogram
from registry.store import HealthStore
from registry.store.pg import RoutedPgStore
from registry.store.pool import RETRY_SECONDS
from ws.events import EventDeps
from ws.transport import ConnectionGuard

BREAKER_STATES = ("closed", "open", "half_open")
# The conditions in which the database refuses writes (docs/faults.md), until a write succeeds.
# A batch that met another (a deadlock, a timeout, a restart) says nothing of the next one.
WRITE_REFUSALS = frozenset({"database_read_only", "database_full"})


@dataclass(frozen=True)
class Sources:
    events: EventDeps
    now_ms: Callable[[], int]
    writer: Writer
    logs: LogHandle
    caches: Caches
    store: HealthStore
    anchoring: AnchoringHandle
    federation: FederationHandle
    transparency: TransparencyHandle


def collectors(s: Sources) -> list[Callable[[], Iterable[Metric]]]:
    return [
        lambda: _writer(s),
        lambda: _log(s),
        lambda: _events(s),
        lambda: _caches(s),
        lambda: _pool(s),
        lambda: _replica(s),
        lambda: _peers(s),
        lambda: _anchoring(s),
        lambda: _transparency(s),
    ]


def connections(guard: ConnectionGuard) -> Iterable[Metric]:
    """The server's connections (ws/transport.py): those refused or cut there never reach the
    app, so no request series or access line shows them."""
    stats = guard.statistics()
    yield _gauge("registry_connections_open", "Open TCP connections", stats["open"])
    yield _counter(
        "registry_connections_refused",
        "Connections refused over a cap (503 too_many_connections, docs/limits.md)",
        stats["refused"],
    )
    cut = CounterMetricFamily(
        "registry_connections_cut",
        "Connections cut for a deadline: request (its head or body did not come in time),"
        " send (the client took nothing)",
        labels=["reason"],
    )
    for reason, count in sorted(guard.cut.items()):
        cut.add_metric([reason], count)
    yield cut
    yield _counter(
        "registry_connections_failed",
        "Connections dropped for a protocol error Hypercorn did not handle",
        stats["failed"],
    )


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _histogram(name: str, text: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text)
    family.add_metric(
        [],
        [(str(bound), count) for bound, count in histogram.buckets.items()]
        + [("+Inf", histogram.count)],
        histogram.sum,
    )
    return family


def _writer(s: Sources) -> Iterable[Metric]:
    stats = s.writer.statistics()
    yield _counter("registry_writer_batches", "Batches the writer committed", stats["batches"])
    yield _counter(
        "registry_writer_changes",
        "Changes in those batches (changes / batches: the mean batch size)",
        stats["changes"],
    )
    yield _gauge(
        "registry_writer_largest_batch", "The largest batch so far", stats["largest_batch"]
    )
    yield _gauge("registry_writer_queued", "Changes waiting for the next batch", stats["queued"])
    yield _histogram(
        "registry_writer_batch_size",
        "Changes per committed batch (group commit)",
        s.writer.batch_sizes(),
    )
    yield _gauge(
        "registry_writer_failing",
        "1 while the database refuses writes (read-only, full), else 0",
        int(s.writer.condition() in WRITE_REFUSALS),
    )


def _log(s: Sources) -> Iterable[Metric]:
    stats = s.logs.statistics()
    yield _gauge("registry_log_head", "The log position this process has read up to", stats.head)
    yield _gauge(
        "registry_log_connected", "1 while the log actor listens for new records", stats.connected
    )
    yield _counter("registry_log_records_read", "Log records this process read", stats.records_read)
    yield _gauge(
        "registry_event_subscribers",
        "Subscriptions to the log (event sockets, the cache keeper)",
        stats.subscribers,
    )
    yield _counter(
        "registry_event_subscribers_dropped_slow",
        "Subscriptions closed because they fell behind their queue",
        stats.dropped_slow,
    )


def _events(s: Sources) -> Iterable[Metric]:
    yield _gauge("registry_event_sockets", "Open event sockets (/v1/events)", s.events.connections)
    yield _counter(
        "registry_event_messages_sent",
        "Events handed to event sockets (replayed and live)",
        s.events.messages_sent,
    )
    closes = CounterMetricFamily(
        "registry_event_socket_closes",
        "Event sockets closed by the server, by close code",
        labels=["code"],
    )
    for code, count in sorted(s.events.closes.items()):
        closes.add_metric([str(code)], count)
    yield closes


def _caches(s: Sources) -> Iterable[Metric]:
    hits = CounterMetricFamily("registry_cache_hits", "Cache lookups answered", labels=["cache"])
    misses = CounterMetricFamily("registry_cache_misses", "Cache lookups missed", labels=["cache"])
    size = GaugeMetricFamily("registry_cache_items", "Items cached", labels=["cache"])
    held = GaugeMetricFamily("registry_cache_bytes", "Bytes cached (as weighed)", labels=["cache"])
    for name, cache in (
        ("entries", s.caches.entries),
        ("sessions", s.caches.sessions),
        ("discovery", s.caches.results),
    ):
        stats = cache.statistics()
        hits.add_metric([name], stats["hits"])
        misses.add_metric([name], stats["misses"])
        size.add_metric([name], stats["size"])
        held.add_metric([name], stats["bytes"])
    yield from (hits, misses, size, held)
    yield _gauge("registry_cache_live", "1 while the caches follow the log live", s.caches.enabled)


def _pool(s: Sources) -> Iterable[Metric]:
    errors = CounterMetricFamily(
        "registry_db_errors",
        "Database errors by the code they were answered with (database_unavailable,"
        " database_timeout, database_read_only, database_full, ...)",
        labels=["code"],
    )
    for code, count in sorted(s.store.error_statistics().items()):
        errors.add_metric([code], count)
    yield errors
    stats = s.store.pool_statistics()
    if not stats:
        return
    yield _gauge("registry_db_connections_open", "Database connections open", stats["open"])
    yield _gauge("registry_db_connections_in_use", "Database connections in use", stats["in_use"])
    yield _gauge(
        "registry_db_connections_waiting",
        "Callers waiting for a database connection",
        stats["waiting"],
    )
    yield _gauge(
        "registry_db_connections_held_back",
        "Connections the pool lacks because PostgreSQL refused one in the last"
        f" {RETRY_SECONDS:g} s (max_connections reached); it serves with those it has",
        stats["held_back"],
    )


def _replica(s: Sources) -> Iterable[Metric]:
    if not isinstance(s.store, RoutedPgStore):
        return  # no database.read_url
    state = s.store.replica_state
    reads = CounterMetricFamily(
        "registry_db_reads",
        "Reads that may lag (GETs, the log), by the database that answered: replica, primary",
        labels=["database"],
    )
    for target in ("replica", "primary"):
        reads.add_metric([target], state.reads[target])
    yield reads
    yield _counter(
        "registry_replica_read_failures",
        "Reads the replica failed (lost connection, recovery conflict); the primary answered",
        state.failures,
    )
    yield _gauge(
        "registry_replica_replayed_sequence",
        "The log sequence the replica had replayed when last asked (-1: unknown or down)",
        state.replayed,
    )
    yield _gauge(
        "registry_replica_lag_records",
        "Log records this process wrote or saw that the replica had not replayed",
        state.lag,
    )
    stats = s.store.replica_pool_statistics()
    yield _gauge(
        "registry_replica_connections_open", "Connections open to the replica", stats["open"]
    )


def _peers(s: Sources) -> Iterable[Metric]:
    states = s.federation.live()
    now = s.now_ms()
    label = ["peer"]
    breaker = GaugeMetricFamily(
        "registry_peer_breaker_state",
        "1 for the breaker's state of each peer",
        labels=["peer", "state"],
    )
    failures = GaugeMetricFamily(
        "registry_peer_consecutive_failures", "Failed pulls in a row", labels=label
    )
    cursor = GaugeMetricFamily(
        "registry_peer_cursor", "The peer's log position imported up to", labels=label
    )
    lag = GaugeMetricFamily(
        "registry_peer_lag", "Log positions the cursor is behind the peer's head", labels=label
    )
    latency = GaugeMetricFamily(
        "registry_peer_latency_seconds", "Moving average of a pull's latency", labels=label
    )
    quarantines = CounterMetricFamily(
        "registry_peer_quarantines", "Entries of the peer refused into quarantine", labels=label
    )
    success = GaugeMetricFamily(
        "registry_peer_last_success_timestamp_seconds",
        "When a pull last succeeded",
        labels=label,
    )
    witnessed = GaugeMetricFamily(
        "registry_peer_log_tree_size",
        "The tree size of the peer's checkpoint this registry accepted last (witnessed)",
        labels=label,
    )
    inconsistent = GaugeMetricFamily(
        "registry_peer_log_inconsistent",
        "1 once the peer's log contradicted a checkpoint it signed (a fork: quarantined)",
        labels=label,
    )
    for did, state in sorted(states.items()):
        if state.witnessed_size is not None:
            witnessed.add_metric([did], state.witnessed_size)
        inconsistent.add_metric([did], int(state.log_fork is not None))
        # As GET /v1/admin/federation/peers shows it: an open breaker whose cooldown has
        # passed is half-open (its trial is due or under way).
        shown = state.breaker.state_at(now)
        for name in BREAKER_STATES:
            breaker.add_metric([did, name], int(shown == name))
        failures.add_metric([did], state.breaker.consecutive_failures)
        cursor.add_metric([did], state.cursor)
        lag.add_metric([did], state.lag)
        if state.breaker.latency.value_ms is not None:
            latency.add_metric([did], state.breaker.latency.value_ms / 1000)
        quarantines.add_metric([did], state.quarantines)
        if state.breaker.last_success_at_ms is not None:
            success.add_metric([did], state.breaker.last_success_at_ms / 1000)
    yield from (breaker, failures, cursor, lag, latency, quarantines, success)
    yield from (witnessed, inconsistent)
    yield _gauge(
        "registry_federation_leader",
        "1 in the process that pulls from the peers",
        s.federation.leader,
    )


def _anchoring(s: Sources) -> Iterable[Metric]:
    stats = s.anchoring.stats
    yield _gauge("registry_anchoring_leader", "1 in the process that anchors", stats.leader)
    yield _counter("registry_anchor_batches", "Batches claimed and submitted", stats.batches)
    yield _counter("registry_anchor_confirmed", "Intents confirmed final", stats.confirmed)
    yield _counter("registry_anchor_requeued", "Intents back to pending", stats.requeued)
    yield _counter("registry_anchor_failed", "Intents whose attempts ran out", stats.failed)
    yield _counter(
        "registry_anchor_chain_errors", "Calls to the chain that failed", stats.chain_errors
    )
    if not stats.leader:
        return
    yield _gauge("registry_anchor_pending", "Intents waiting for a batch", stats.pending)
    yield _gauge(
        "registry_anchor_batches_in_flight",
        "Batches claimed or submitted, not settled",
        stats.in_flight,
    )
    if stats.oldest_pending_ms is not None:
        yield _gauge(
            "registry_anchor_oldest_pending_age_seconds",
            "How long the oldest pending intent has waited",
            max(0.0, (s.now_ms() - stats.oldest_pending_ms) / 1000),
        )
    yield _histogram(
        "registry_anchor_finality_seconds",
        "From a batch's claim to its confirmation",
        stats.finality,
    )


def _transparency(s: Sources) -> Iterable[Metric]:
    handle = s.transparency
    yield _gauge(
        "registry_transparency_leader", "1 in the process that issues checkpoints", handle.leader
    )
    size = GaugeMetricFamily(
        "registry_log_checkpoint_size",
        "The tree size of the newest checkpoint this process issued (only the one that issues)",
    )
    if handle.latest is not None:
        size.add_metric([], handle.latest.size)
    yield size
    yield _counter(
        "registry_log_checkpoints_issued", "Checkpoints this process issued", handle.issued
    )
    yield _counter(
        "registry_log_records_hashed",
        "Log records this process hashed into the tree",
        handle.records_hashed,
    )

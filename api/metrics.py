"""The process's metrics (`GET /metrics`, Prometheus text format): one registry per app.

Counted as they happen (`api/observe.py`): request durations, rate-limit refusals, idempotent
replays. Read at scrape time from the state the service keeps anyway, at no cost per event
(`service/metrics.py`): the writer, the log, the caches, the database pool, the peers, the
anchoring; and the process (CPU, memory, open files).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

# Seconds: from a cached read (~1 ms) to a slow federated query (its budget is 3 s).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNROUTED = "unrouted"  # the route label of a request no route matched
# The method label: a client may send any token as a method (HTTP allows extension methods),
# and each distinct label value is a series kept for the life of the process. Methods outside
# the standard ones are counted as "other", so no client can grow the series without bound.
METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"}
)
OTHER_METHOD = "other"


class Metrics:
    """One process's metrics, in a registry of its own (so that every app, in tests several
    in one process, counts only its own)."""

    def __init__(self, sources: Iterable[Callable[[], Iterable[Metric]]] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Histogram(
            "registry_http_request_duration_seconds",
            "HTTP requests by route template, method and status class, and how long they took",
            ["route", "method", "status"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "registry_rate_limited",
            "Requests refused with 429 by a rate limit, by bucket class",
            ["bucket"],
            registry=self.registry,
        )
        self.replays = Counter(
            "registry_idempotent_replays",
            "Requests answered from their Idempotency-Key's record, by route template",
            ["route"],
            registry=self.registry,
        )
        self._request_series: dict[tuple[str, str, str], Histogram] = {}
        ProcessCollector(registry=self.registry)
        for source in sources:
            self.registry.register(_Source(source))

    def add_source(self, source: Callable[[], Iterable[Metric]]) -> None:
        """Read `source` at every scrape too (what is made after the app, e.g. the server's
        connection guard)."""
        self.registry.register(_Source(source))

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one answered request. `route` is a route template or UNROUTED (a bounded set);
        a method outside METHODS is counted as OTHER_METHOD."""
        key = (route, method if method in METHODS else OTHER_METHOD, f"{status // 100}xx")
        series = self._request_series.get(key)
        if series is None:  # bounded: routes x methods x five status classes
            series = self._request_series[key] = self.requests.labels(*key)
        series.observe(seconds)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric now."""
        return generate_latest(self.registry)


class _Source(Collector):
    """Metrics read at scrape time from state the service keeps anyway (no per-event cost)."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return list(self._read())

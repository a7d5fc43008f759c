"""Discovery: structured requests and RegistryQL over the store (spec 4.4, design §12).

Pages are cached by query (`ResultCache`); concurrent misses of one query are computed once.
"""

from __future__ import annotations

from typing import Any

import trio

from registry.caches import ResultCache
from registry.canonical import canonicalize
from registry.config import Config
from registry.discovery import CursorCodec
from registry.query import RegistryQuery
from registry.store import DiscoveryStore
from registry.store.discover import COUNT_CAP
from registry.usecases.common import page_size


class Discovery:
    def __init__(
        self, *, store: DiscoveryStore, config: Config, cursors: CursorCodec, results: ResultCache
    ) -> None:
        self.store = store
        self.config = config
        self.cursors = cursors
        self.results = results
        self._computing: dict[str, trio.Event] = {}  # pages being computed

    async def discover(self, query: RegistryQuery) -> str:
        """One page of results as JSON text: {entries, cursor?, hasMore, totalCount}."""
        body, _ = await self.discover_page(query)
        return body

    async def discover_page(self, query: RegistryQuery) -> tuple[str, bool]:
        """`discover`'s page, and whether it came from the result cache.

        Concurrent misses of one query are computed once: the others wait for that answer (a
        popular page dropped by a change would otherwise be recomputed by every request that
        arrives meanwhile), and compute it themselves only if it could not be cached."""
        caching = self.config.limits.discover_cache_entries > 0
        key = repr(query)
        if caching:
            cached = self.results.get(key)
            if cached is not None:
                return cached[1], True
            pending = self._computing.get(key)
            if pending is not None:
                await pending.wait()
                cached = self.results.get(key)
                if cached is not None:
                    return cached[1], True
        epoch = self.results.epoch
        leading = caching and key not in self._computing
        if leading:
            done = self._computing[key] = trio.Event()
        try:
            body = await self._discover(query)
            if caching:
                self.results.put(key, (query, body), epoch)
        finally:
            if leading:
                del self._computing[key]
                done.set()
        return body, False

    async def _discover(self, query: RegistryQuery) -> str:
        size = page_size(self.config.limits, query.limit)
        after = self.cursors.decode(query, query.cursor) if query.cursor else None
        rows, total = await self.store.discover(
            query, limit=size, after=after, page_bytes=self.config.limits.discover_page_bytes
        )
        has_more = len(rows) > size
        page: list[tuple[str, list[Any]]] = []
        for doc, keys in rows[:size]:
            if doc is None:  # the page's documents reached discover_page_bytes before it
                has_more = True
                break
            page.append((doc, keys))
        body = '{"entries":[' + ",".join(doc for doc, _ in page) + "]"
        if has_more:  # the first match always comes with its document: the page has a last
            body += ',"cursor":' + _json_str(self.cursors.encode(query, page[-1][1]))
        body += f',"hasMore":{"true" if has_more else "false"}'
        body += f',"totalCount":{min(total, COUNT_CAP)}'
        if total > COUNT_CAP:  # counted up to the cap: "at least COUNT_CAP"
            body += ',"totalCountExact":false'
        return body + "}"


def _json_str(text: str) -> str:
    return canonicalize(text).decode()

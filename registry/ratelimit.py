"""Token buckets (sans-IO): (state, now) in, (decision, new state) out; no clock reads.

Each (class, client) pair has a bucket holding up to `capacity` tokens that refills at
`per_minute / 60` tokens a second. A request takes one token or is refused with the time until
one is available. A full bucket is indistinguishable from a missing one, so idle buckets can be
forgotten to bound memory.
"""

from __future__ import annotations

import functools
import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    tokens: float
    updated: float


@dataclass(frozen=True)
class Decision:
    allowed: bool
    limit: int
    remaining: int
    retry_after: float  # seconds until one token is available (0 when allowed)
    reset_after: float  # seconds until the bucket is full again


@dataclass(frozen=True)
class Rate:
    per_minute: int

    @property
    def capacity(self) -> float:
        return float(self.per_minute)

    @property
    def per_second(self) -> float:
        return self.per_minute / 60.0


def refill(bucket: Bucket | None, rate: Rate, now: float) -> float:
    if bucket is None:
        return rate.capacity
    return min(rate.capacity, bucket.tokens + max(0.0, now - bucket.updated) * rate.per_second)


def take(
    bucket: Bucket | None, rate: Rate, now: float, cost: float = 1.0
) -> tuple[Decision, Bucket]:
    """Take `cost` tokens (a request: 1; a body: its bytes). A cost above the capacity takes a
    full bucket: however a rate is divided among processes, the largest request still passes."""
    cost = min(cost, rate.capacity)
    tokens = refill(bucket, rate, now)
    allowed = tokens >= cost
    if allowed:
        tokens -= cost
    retry = 0.0 if allowed else (cost - tokens) / rate.per_second
    decision = Decision(
        allowed=allowed,
        limit=rate.per_minute,
        remaining=math.floor(tokens),
        retry_after=retry,
        reset_after=(rate.capacity - tokens) / rate.per_second,
    )
    return decision, Bucket(tokens, now)


def charge(bucket: Bucket | None, rate: Rate, now: float, cost: float) -> Bucket:
    """Take `cost` tokens after the fact (work measured once done): the bucket goes into debt
    by what the work cost beyond it, and `take(..., cost=0)` refuses until that is repaid."""
    return Bucket(refill(bucket, rate, now) - max(0.0, cost), now)


def refund(bucket: Bucket | None, rate: Rate, now: float, cost: float) -> Bucket:
    """Give back `cost` tokens taken for work that turned out not to count (never above a
    full bucket)."""
    return Bucket(min(rate.capacity, refill(bucket, rate, now) + max(0.0, cost)), now)


def is_idle(bucket: Bucket, rate: Rate, now: float) -> bool:
    return refill(bucket, rate, now) >= rate.capacity


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with a ceiling; `delay(n)` for the n-th consecutive failure (n ≥ 1)."""

    initial: float = 0.5
    factor: float = 2.0
    maximum: float = 30.0

    def delay(self, failures: int) -> float:
        exponent = min(max(0, failures - 1), 64)  # bounded: factor ** 1024 overflows a float
        return min(self.maximum, self.initial * self.factor**exponent)

    def jittered(self, failures: int, draw: float) -> float:
        """`delay` with "equal jitter": uniformly in [delay/2, delay) for `draw` in [0, 1), so
        processes that failed together do not retry together."""
        base = self.delay(failures)
        return base / 2 + base / 2 * min(max(draw, 0.0), 1.0)


_LONGEST_ADDRESS = 64  # an IPv6 address's text is at most 45 characters, 64 with a zone


@functools.lru_cache(maxsize=4096)  # asked on every request; parsing an address is ~3 µs
def _address_key(host: str) -> str | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def address_key(host: str) -> str | None:
    """What a client at IP address `host` is counted as: the address, or an IPv6 address's /64
    (one host is given a /64 and picks any address in it); an IPv4-mapped address as the IPv4
    one. None when `host` is not an IP address."""
    return _address_key(host) if len(host) <= _LONGEST_ADDRESS else None


def client_key(host: str) -> str:
    """`address_key` of a TCP peer; a peer that is not an IP address (a Unix socket) as is."""
    return address_key(host) or host


def joined_lines(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str:
    """Every line of header `name` (lower case) in an ASGI header list, in order, joined by
    commas: the one list they mean together (RFC 9110 §5.3), e.g. X-Forwarded-For written by
    two proxies. Values decoded as Quart decodes them (latin-1)."""
    return ",".join(value.decode("latin-1") for key, value in headers if key == name)


def _without_port(element: str) -> str:
    """The address of an X-Forwarded-For element some proxies write with a port: `1.2.3.4:80`,
    `[2001:db8::1]:443`."""
    if element.startswith("["):
        end = element.find("]")
        return element[1:end] if end > 0 else element
    if element.count(":") == 1:
        return element.partition(":")[0]
    return element


def _forwarded_host(forwarded_for: str, trusted_proxies: int) -> str | None:
    """The `trusted_proxies`-th element from the right of `X-Forwarded-For` (every line of it,
    in order: `forwarded_for`), without a port, when that many proxies are trusted, the header
    has that many elements and that one is an IP address; else None."""
    if trusted_proxies:
        forwarded = [p.strip() for p in forwarded_for.split(",") if p.strip()]
        if len(forwarded) >= trusted_proxies:
            host = _without_port(forwarded[-trusted_proxies])
            if address_key(host) is not None:
                return host
    return None


def client_of(forwarded_for: str, peer: str | None, trusted_proxies: int) -> str:
    """The client a budget is kept for: `address_key` of the `trusted_proxies`-th address from
    the right of `X-Forwarded-For` (`_forwarded_host`); else of the TCP peer. (An element that
    is not an address was not written by a proxy that is trusted: it is never used as a key, so
    it can neither pick a budget nor reach the access log.)"""
    host = _forwarded_host(forwarded_for, trusted_proxies)
    if host is not None:
        return address_key(host) or host
    return client_key(peer) if peer else "unknown"


def client_host_of(forwarded_for: str, peer: str | None, trusted_proxies: int) -> str:
    """The client's address as `client_of` picks it, whole: an IPv6 address itself, not the
    /64 its budgets are kept for (what the access log names); an IPv4-mapped one as IPv4."""
    host = _forwarded_host(forwarded_for, trusted_proxies) or peer
    if not host:
        return "unknown"
    address = ipaddress.ip_address(host) if address_key(host) is not None else None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address) if address is not None else host

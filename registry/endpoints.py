"""Which URLs a peer may register as its endpoint (docs/federation.md, "Peer endpoints").

A peer's `PUT /v1/federation/peers/self` names a URL this registry will POST signed requests to:
without a rule, any configured peer could point the registry at its own loopback, the cloud
metadata address or the operator's private network (server-side request forgery). The rule:
- no user information (`user:pw@`): it would be sent along and shown on the public peer list;
- `https`, unless the operator allows `http` (`federation.allow_http_endpoints`);
- a host that is a public address or a DNS name: IP literals that are loopback, private,
  link-local, unspecified, reserved or multicast are refused, in every spelling an HTTP client
  accepts (`127.1`, `2130706433`, `0x7f.0.0.1`, `[::ffff:127.0.0.1]`), as are `localhost` and
  names under `.localhost`, `.local` and `.internal`;
- unless the operator's configuration names the host: the host of a configured peer endpoint, or
  one listed in `federation.allowed_endpoint_hosts` (a name, an address or a CIDR block), is
  allowed whatever it is, over http or https.
Redirects are never followed (the federation client does not follow them).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
INTERNAL_SUFFIXES = (".localhost", ".local", ".internal")


@dataclass(frozen=True)
class EndpointPolicy:
    allow_http: bool = False
    named: frozenset[str] = frozenset()  # hosts the operator's configuration names
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def of(
        cls, *, allow_http: bool, configured: Iterable[str], allowed: Iterable[str]
    ) -> EndpointPolicy:
        """From the configured peer endpoints (URLs) and the allowed hosts (names, addresses or
        CIDR blocks)."""
        named: set[str] = set()
        networks = []
        for url in configured:
            host = urlsplit(url).hostname
            if host:
                named.add(host.lower())
        for entry in allowed:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                named.add(entry.lower())
        return cls(allow_http, frozenset(named), tuple(networks))


def literal_address(host: str) -> IPAddress | None:
    """The address an IP literal names, in any spelling `inet_aton` accepts; None for a name."""
    bare = host.strip("[]")
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return _legacy_ipv4(bare)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _legacy_ipv4(text: str) -> ipaddress.IPv4Address | None:
    """An IPv4 address in the forms `inet_aton` (and so an HTTP client's resolver) accepts:
    one to four parts, each decimal, octal (leading 0) or hex (0x); the last fills the rest."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    numbers = []
    for part in parts:
        lowered = part.lower()
        try:
            if lowered.startswith("0x"):
                numbers.append(int(lowered[2:] or "0", 16))
            elif len(part) > 1 and part.startswith("0"):
                numbers.append(int(part, 8))
            else:
                numbers.append(int(part, 10) if part.isdigit() else -1)
        except ValueError:
            return None
    if any(n < 0 for n in numbers):
        return None
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    value = 0
    for n in head:
        value = value << 8 | n
    return ipaddress.IPv4Address(value << (8 * (4 - len(head))) | last)


def is_public(address: IPAddress) -> bool:
    return address.is_global and not address.is_multicast


def endpoint_problem(url: str, policy: EndpointPolicy) -> str | None:
    """Why `url` may not be a peer endpoint, or None. `url` is already a well-formed http(s)
    URL (checked by the caller)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "must not carry user information"
    host = (parts.hostname or "").lower()
    address = literal_address(host)
    named = host in policy.named or (
        address is not None and any(address in network for network in policy.networks)
    )
    if parts.scheme != "https" and not (policy.allow_http or named):
        return "must be an https URL"
    if named:
        return None
    if address is not None:
        return None if is_public(address) else "must not name a private or local address"
    last = host.rstrip(".").rsplit(".", 1)[-1]
    if last.isdigit():  # a numeric last label is an address to a resolver, never a DNS name
        return "must not name a private or local address"
    if host.rstrip(".") == "localhost" or host.rstrip(".").endswith(INTERNAL_SUFFIXES):
        return "must not name a private or local address"
    return None

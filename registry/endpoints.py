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
- unless the operator's configuration names the host: the host and port of a configured peer
  endpoint, or a host listed in `federation.allowed_endpoint_hosts` (a name, an address or a
  CIDR block; any port), is allowed whatever it is, over http or https.
Hosts are compared as a resolver sees them (IDNA-mapped: fullwidth `ｌｏｃａｌｈｏｓｔ` is
`localhost`), and an IPv6 address is judged by the IPv4 address it carries too (mapped, 6to4,
Teredo, NAT64, IPv4-compatible).
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
    named: frozenset[str] = frozenset()  # hosts the operator allows on any port
    endpoints: frozenset[tuple[str, int]] = frozenset()  # configured peers' (host, port)
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def of(
        cls, *, allow_http: bool, configured: Iterable[str], allowed: Iterable[str]
    ) -> EndpointPolicy:
        """From the configured peer endpoints (URLs: their host and port) and the allowed
        hosts (names, addresses or CIDR blocks, on any port)."""
        named: set[str] = set()
        endpoints: set[tuple[str, int]] = set()
        networks = []
        for url in configured:
            found = _host_port(url)
            if found is not None:
                endpoints.add(found)
        for entry in allowed:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                named.add(entry.lower())
        return cls(allow_http, frozenset(named), frozenset(endpoints), tuple(networks))

    def names(self, url: str) -> bool:
        """Whether the operator's configuration names this URL's host (and, for a configured
        peer's endpoint, its port)."""
        found = _host_port(url)
        if found is None:
            return False
        host, _ = found
        address = literal_address(host)
        return (
            found in self.endpoints
            or host in self.named
            or (address is not None and any(address in network for network in self.networks))
        )


def _host_port(url: str) -> tuple[str, int] | None:
    """The URL's host, as a resolver sees it (IDNA-mapped: fullwidth letters are ASCII ones),
    and its port (the scheme's default when absent)."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").rstrip(".")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if not host:
            return None
        if not host.startswith("[") and ":" not in host:
            host = host.encode("idna").decode("ascii")
        return host.lower(), port
    except (ValueError, UnicodeError):
        return None


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


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SIIT = ipaddress.IPv6Network("::ffff:0:0:0/96")  # IPv4-translated (RFC 2765)
_COMPATIBLE = ipaddress.IPv6Network("::/96")  # IPv4-compatible (deprecated) addresses


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 one carries and a router may reach: mapped, 6to4, Teredo's
    client, NAT64, IPv4-translated and IPv4-compatible."""
    found = [a for a in (address.ipv4_mapped, address.sixtofour) if a is not None]
    if address.teredo is not None:
        found.append(address.teredo[1])
    if address in _NAT64 or address in _SIIT or (address in _COMPATIBLE and int(address) > 1):
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def is_public(address: IPAddress) -> bool:
    if not address.is_global or address.is_multicast:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        return all(is_public(inner) for inner in _embedded_ipv4(address))
    return True


def endpoint_problem(url: str, policy: EndpointPolicy) -> str | None:
    """Why `url` may not be a peer endpoint, or None. `url` is already a well-formed http(s)
    URL (checked by the caller)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "must not carry user information"
    found = _host_port(url)
    if found is None:
        return "must name a valid host"
    host, _ = found
    named = policy.names(url)
    if parts.scheme != "https" and not (policy.allow_http or named):
        return "must be an https URL"
    if named:
        return None
    address = literal_address(host)
    if address is not None:
        return None if is_public(address) else "must not name a private or local address"
    last = host.rsplit(".", 1)[-1]
    if last.isdigit():  # a numeric last label is an address to a resolver, never a DNS name
        return "must not name a private or local address"
    if host == "localhost" or host.endswith(INTERNAL_SUFFIXES):
        return "must not name a private or local address"
    return None

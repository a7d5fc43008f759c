"""The federation client refuses a registered endpoint whose name resolves to a private or local
address, before any byte is sent (registry/endpoints.py; the name check at registration cannot
see what a name resolves to)."""

from __future__ import annotations

import httpx
import pytest
import trio

from actors.federation import HttpTransport, PeerUnreachable
from registry.endpoints import EndpointPolicy


def never_called(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"a request went out to {request.url}")


async def test_a_name_that_resolves_to_loopback_is_refused() -> None:
    policy = EndpointPolicy.of(allow_http=False, configured=[], allowed=[])
    async with httpx.AsyncClient(transport=httpx.MockTransport(never_called)) as client:
        transport = HttpTransport(client, max_bytes=1024, policy=lambda: policy)
        with trio.fail_after(10), pytest.raises(PeerUnreachable, match="private or local"):
            await transport.post("https://localhost:9/v1/federation/sync", b"{}")
        with trio.fail_after(10), pytest.raises(PeerUnreachable, match="private or local"):
            await transport.post("https://10.1.2.3/v1/federation/sync", b"{}")


async def test_a_host_the_configuration_names_is_not_checked() -> None:
    policy = EndpointPolicy.of(allow_http=False, configured=["http://localhost:9"], allowed=[])
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, content=b"{}")

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        transport = HttpTransport(client, max_bytes=1024, policy=lambda: policy)
        with trio.fail_after(10):
            answered = await transport.post("http://localhost:9/v1/federation/sync", b"{}")
    assert answered.status == 200
    assert seen == ["http://localhost:9/v1/federation/sync"]


async def test_a_name_the_resolver_cannot_encode_is_refused_not_raised() -> None:
    """A name IDNA 2008 refuses (trio encodes names with it before resolving) raised IDNAError
    out of `post`: not `PeerUnreachable`, so the PeerActor took it for a bug, and it ended the
    process at each pull of a peer that registered such an endpoint."""
    policy = EndpointPolicy.of(allow_http=False, configured=[], allowed=[])
    async with httpx.AsyncClient(transport=httpx.MockTransport(never_called)) as client:
        transport = HttpTransport(client, max_bytes=1024, policy=lambda: policy)
        with trio.fail_after(10), pytest.raises(PeerUnreachable, match="cannot resolve"):
            await transport.post("https://\u2603.example/v1/federation/sync", b"{}")


@pytest.mark.parametrize(
    "endpoint",
    [
        pytest.param("https://peer.example:99999", id="port_out_of_range"),
        pytest.param("https://peer.example:https", id="port_not_a_number"),
        pytest.param("https://[::1", id="unclosed_ipv6_literal"),
    ],
)
async def test_a_configured_endpoint_no_url_parser_takes_is_refused_not_raised(
    endpoint: str,
) -> None:
    """A peer's endpoint in the configuration is any string (a typo, loaded at start or by a
    SIGHUP reload): one whose port or host `urlsplit` refuses raised ValueError out of `post`
    before the request (the destination check read `parts.port` outside its handling), not
    `PeerUnreachable`, so the PeerActor took it for a bug and the first pull ended the
    process, at every start until the file was fixed. It fails each pull of that peer."""
    policy = EndpointPolicy.of(allow_http=False, configured=[endpoint], allowed=[])
    async with httpx.AsyncClient(transport=httpx.MockTransport(never_called)) as client:
        transport = HttpTransport(client, max_bytes=1024, policy=lambda: policy)
        with trio.fail_after(10), pytest.raises(PeerUnreachable, match="not a URL"):
            await transport.post(endpoint + "/v1/federation/sync", b"{}")
        with trio.fail_after(10), pytest.raises(PeerUnreachable, match="not a URL"):
            await transport.get(endpoint + "/v1/log/checkpoint")

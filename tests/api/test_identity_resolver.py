"""The HTTP identity resolver: `GET <url>?did=<signer>` → {rootDid, rootKind, hmrDid}; anything
else is an upstream failure (502 at sign-in), never our own error."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import trio
import trio.testing

from api.identity import HttpIdentityResolver
from registry.errors import UpstreamFailed
from registry.identity import Identity

SIGNER = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"


def _resolver(handler: httpx.MockTransport) -> HttpIdentityResolver:
    return HttpIdentityResolver("https://idp.example/lookup", httpx.AsyncClient(transport=handler))


async def test_resolves_and_asks_for_the_signer() -> None:
    asked: list[httpx.URL] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url)
        return httpx.Response(
            200, json={"rootDid": "did:web:org.example", "rootKind": "org", "hmrDid": SIGNER}
        )

    identity = await _resolver(httpx.MockTransport(answer)).resolve(SIGNER)
    assert identity == Identity("did:web:org.example", "org", SIGNER)
    assert asked[0].params["did"] == SIGNER


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(500, json={"error": "boom"}),
        httpx.Response(404),
        httpx.Response(200, text="not json"),
        httpx.Response(200, json={"rootDid": "did:web:x"}),  # no rootKind
        httpx.Response(200, json={"rootDid": None, "rootKind": "org"}),
        httpx.Response(200, json={"rootDid": "not a did", "rootKind": "org"}),
        httpx.Response(200, json=["rootDid"]),
        # What no store can keep or no parse survives: they were a 400 value_not_storable (a
        # lone surrogate, U+0000) and a 500 (RecursionError) of the sign-in, not the 502 of a
        # failed lookup (spec 4.6).
        httpx.Response(200, content=b'{"rootDid":"did:web:x","rootKind":"\\ud800"}'),
        httpx.Response(200, content=b'{"rootDid":"did:web:x","rootKind":"a\\u0000"}'),
        httpx.Response(200, content=b"[" * 20_000 + b"]" * 20_000),
    ],
    ids=[
        "500",
        "404",
        "not-json",
        "missing-kind",
        "null-root",
        "non-did",
        "array",
        "lone-surrogate",
        "nul",
        "nested-too-deep",
    ],
)
async def test_bad_answers_are_upstream_failures(response: httpx.Response) -> None:
    resolver = _resolver(httpx.MockTransport(lambda request: response))
    with pytest.raises(UpstreamFailed) as raised:
        await resolver.resolve(SIGNER)
    assert raised.value.status == 502
    assert raised.value.code == "identity_lookup_failed"


async def test_transport_failure_is_an_upstream_failure() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(UpstreamFailed):
        await _resolver(httpx.MockTransport(refuse)).resolve(SIGNER)


# httpx's inner stream generators are left unexhausted when a read stops early (as in
# tests/db/test_process.py): collected later, with a ResourceWarning from trio.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_resolver_that_trickles_or_answers_without_end_is_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The 5 s timeout (docs/signin.md) was httpx's, for each read: a resolver sending a byte
    every 4 s held the sign-in for good, and one answering without end was read into memory
    whole. The whole lookup is bounded by the 5 s, and the answer by 64 KiB."""

    class Answer(httpx.AsyncByteStream):
        """A body that never ends: a byte every 4 s (`trickle`), or 64 KiB at a time."""

        def __init__(self, trickle: bool) -> None:
            self.trickle = trickle

        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b'{"rootDid": "did:web:x", "rootKind": "'
            while True:
                await trio.sleep(4 if self.trickle else 0)
                yield b"x" if self.trickle else b" " * 65_536

    for trickle in (True, False):
        resolver = _resolver(
            httpx.MockTransport(lambda request, t=trickle: httpx.Response(200, stream=Answer(t)))
        )
        started = trio.current_time()
        with trio.fail_after(60), pytest.raises(UpstreamFailed) as raised:
            await resolver.resolve(SIGNER)
        assert raised.value.code == "identity_lookup_failed"
        assert raised.value.details == {"reason": "timeout" if trickle else "answer_too_large"}
        assert trio.current_time() - started <= 5.0

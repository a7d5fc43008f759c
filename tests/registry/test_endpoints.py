"""The rule for the endpoints a peer registers (registry/endpoints.py): table-driven."""

from __future__ import annotations

import pytest

from registry.endpoints import EndpointPolicy, endpoint_problem

POLICY = EndpointPolicy.of(
    allow_http=False,
    configured=["http://127.0.0.1:8081", "https://peer.internal:9443"],
    allowed=["10.20.0.0/16", "registry.corp"],
)


@pytest.mark.parametrize(
    "url",
    [
        "https://peer.example.com",
        "https://peer.example.com:8443/registry",
        "https://93.184.215.14/",
        "https://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/",
        "http://127.0.0.1:8081/x",  # a configured peer's host and port, over http too
        "https://peer.internal:9443/",  # likewise, whatever its name says
        "http://10.20.3.4/",  # in an allowed block
        "http://registry.corp/",  # an allowed name
    ],
)
def test_allowed(url: str) -> None:
    assert endpoint_problem(url, POLICY) is None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://peer.example.com", "https"),
        ("https://user:pw@peer.example.com", "user information"),
        ("https://user@peer.example.com", "user information"),
        ("https://10.0.0.1/", "private"),
        ("https://192.168.1.1/", "private"),
        ("https://172.16.0.1/", "private"),
        ("https://169.254.169.254/latest/meta-data", "private"),
        ("https://127.0.0.2/", "private"),
        ("https://0.0.0.0/", "private"),
        ("https://[::1]/", "private"),
        ("https://[fe80::1]/", "private"),
        ("https://[fd00::1]/", "private"),
        ("https://[::ffff:127.0.0.1]/", "private"),
        ("https://127.1/", "private"),
        ("https://2130706433/", "private"),
        ("https://0x7f.0.0.1/", "private"),
        ("https://017700000001/", "private"),
        ("https://localhost/", "private"),
        ("https://LocalHost./", "private"),
        ("https://printer.local/", "private"),
        ("https://metadata.google.internal/", "private"),
        ("https://224.0.0.1/", "private"),
        ("https://[::7f00:1]/", "private"),  # IPv4-compatible 127.0.0.1
        ("https://[::ffff:0:7f00:1]/", "private"),  # (SIIT) 127.0.0.1
        ("https://[64:ff9b::7f00:1]/", "private"),  # NAT64 of 127.0.0.1
        ("https://[2002:7f00:1::]/", "private"),  # 6to4 of 127.0.0.1
        ("https://ｌｏｃａｌｈｏｓｔ/", "private"),  # fullwidth: localhost to a resolver
        ("http://127.0.0.1:6379/", "https"),  # a configured peer's host, another port
        ("https://127.0.0.1:6379/", "private"),
    ],
)
def test_refused(url: str, why: str) -> None:
    problem = endpoint_problem(url, POLICY)
    assert problem is not None
    assert why in problem


def test_http_is_allowed_where_the_operator_says_so() -> None:
    policy = EndpointPolicy.of(allow_http=True, configured=[], allowed=[])
    assert endpoint_problem("http://peer.example.com", policy) is None
    assert endpoint_problem("http://10.0.0.1", policy) is not None  # still not private

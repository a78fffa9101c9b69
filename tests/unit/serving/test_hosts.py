"""The ``Host`` header read strictly (issue 36, item 7): ``host`` or ``host:port``, nothing
else. Pure Python; the real server's answers are in test_security.py."""

from __future__ import annotations

import pytest

from pagedinfer.serving.hosts import admits_host, host_allowed, parse_host
from pagedinfer.serving.options import LOOPBACK_HOSTS


@pytest.mark.parametrize(
    ("value", "host"),
    [
        ("localhost", "localhost"),
        ("LocalHost:8000", "localhost"),
        ("localhost.:8000", "localhost"),  # the absolute name is the same host
        ("127.0.0.1:65535", "127.0.0.1"),
        ("[::1]", "::1"),
        ("[::1]:8000", "::1"),
        ("[0:0:0:0:0:0:0:1]:80", "::1"),  # IPv6 compared in its compressed form
        ("[::FFFF:127.0.0.1]", "::ffff:7f00:1"),
        ("api.example.com", "api.example.com"),
        ("my_host-1.corp.example:1", "my_host-1.corp.example"),
        (" localhost ", "localhost"),  # optional whitespace around a field value
    ],
)
def test_well_formed_hosts_are_read(value: str, host: str) -> None:
    assert parse_host(value) == host


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        " ",
        "[::1]evil.example",  # the two: a bracketed host is followed by :port only
        "[::1].evil.example",
        "[::1]:8000evil.example",
        "[::1]:",
        "[::1]8000",
        "[::1",
        "[]",
        "[evil.example]",
        "[127.0.0.1]",
        "[fe80::1%25eth0]",  # zone ids name the client's interface: never our host
        "localhost:",  # an empty port
        "localhost:0x50",
        "localhost:65536",
        "localhost:123456",
        "localhost:-1",
        "localhost:80:80",
        "::1",  # an IPv6 address needs its brackets
        "user@localhost",
        "localhost/evil",
        "local host",
        "localhost\tx",
        "evil.example#.localhost",
        "localhost..",
        ".localhost",
        "a..localhost",
        "-localhost",
        "localhost-",
        "x" * 64 + ".example",  # a label is at most 63 characters
        ("a" * 63 + ".") * 4 + "com",  # a name at most 253
        "localhost\x00",
        "lócalhost",
    ],
)
def test_malformed_hosts_are_refused(value: str | None) -> None:
    assert parse_host(value) is None
    assert not host_allowed(value, ("*",))
    assert not host_allowed(value, LOOPBACK_HOSTS)


@pytest.mark.parametrize(
    ("value", "allowed", "expected"),
    [
        ("[::1]:8000", LOOPBACK_HOSTS, True),
        ("[0::1]", LOOPBACK_HOSTS, True),
        ("[::2]", LOOPBACK_HOSTS, False),
        ("localhost.evil", LOOPBACK_HOSTS, False),
        ("127.0.0.1.evil.example", LOOPBACK_HOSTS, False),
        ("a.corp.example", ("*.corp.example",), True),
        ("a.b.corp.example:443", ("*.corp.example",), True),
        ("corp.example", ("*.corp.example",), False),
        ("evilcorp.example", ("*.corp.example",), False),
        ("anything.example:1", ("*",), True),
        ("[::1]", ("[::1]",), True),  # an allowed IPv6 host may be written with brackets
        ("[::1]", ("0:0::1",), True),
        ("api.example.com", ("api.example.com.",), True),
    ],
)
def test_allowed_hosts_match_the_host_part(
    value: str, allowed: tuple[str, ...], expected: bool
) -> None:
    assert host_allowed(value, allowed) is expected


def test_a_request_carries_one_well_formed_host_header() -> None:
    """RFC 9112: two Host headers, or a malformed one, are a 400 even when any host is
    allowed; an HTTP/1.1 request needs one (HTTP/1.0 had none)."""
    one = [(b"host", b"localhost:1"), (b"accept", b"*/*")]
    two = [(b"host", b"localhost"), (b"host", b"evil.example")]
    same_twice = [(b"host", b"localhost"), (b"host", b"localhost")]
    none = [(b"accept", b"*/*")]
    for allowed in (None, ("*",), LOOPBACK_HOSTS):
        assert admits_host(one, allowed)
        assert not admits_host(two, allowed)
        assert not admits_host(same_twice, allowed)
        assert not admits_host(none, allowed)
        assert not admits_host([(b"host", b"[::1]evil.example")], allowed)
    assert admits_host(none, None, http_version="1.0")
    assert not admits_host(none, LOOPBACK_HOSTS, http_version="1.0")
    assert not admits_host([(b"host", b"evil.example")], LOOPBACK_HOSTS)
    assert admits_host([(b"host", b"evil.example")], None)

"""The ``Host`` header, read strictly (against DNS rebinding; docs/serving.md, "Deploying").

A value is ``host`` or ``host:port`` (RFC 9110, 7.2; RFC 3986, 3.2.2), and nothing else:

* ``host`` is a DNS name (labels of letters, digits, ``-`` and ``_``, 1 to 63 characters,
  at most 253 in all, one trailing dot allowed), an IPv4 address, or an IPv6 address in
  brackets (``[::1]``), which may be followed only by ``:port``: ``[::1]evil.example`` and
  ``[::1].evil.example`` are no hosts;
* ``port`` is 1 to 5 digits, at most 65535.

Anything else (an empty value, user info, a path, spaces inside, two colons outside brackets,
an empty or out-of-range port) is refused, as is a request with no ``Host`` or with two
(:func:`admits_host`). Names compare lowercased and without their trailing dot; IPv6
addresses in their compressed form (``[0:0::1]`` is ``::1``).

Pure Python.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

__all__ = ["admits_host", "host_allowed", "parse_host"]

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")
_MAX_NAME = 253


def parse_host(value: str | None) -> str | None:
    """The host a ``Host`` header value names (lowercase, no trailing dot, IPv6 compressed
    and without brackets), or ``None`` when the value is not ``host`` or ``host:port``."""
    if value is None:
        return None
    text = value.strip(" \t").lower()
    if not text:
        return None
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            return None
        rest = text[close + 1 :]
        if rest and not (rest.startswith(":") and _valid_port(rest[1:])):
            return None
        return _ipv6(text[1:close])
    name, colon, port = text.partition(":")
    if colon and not _valid_port(port):
        return None
    return _name(name)


def admits_host(
    headers: Iterable[tuple[bytes, bytes]],
    allowed: Sequence[str] | None,
    *,
    http_version: str = "1.1",
) -> bool:
    """Whether a request with these raw ASGI ``headers`` may go on: one well-formed ``Host``
    naming one of ``allowed`` (``None``: any host). RFC 9112, 3.2: a request with two
    ``Host`` headers or a malformed one is a 400 whatever the allowed hosts, as is an
    HTTP/1.1 request with none (HTTP/1.0 had no ``Host``: such a request passes only when
    any host is allowed)."""
    values = [value for name, value in headers if name.lower() == b"host"]
    if not values:
        return allowed is None and http_version == "1.0"
    if len(values) > 1:
        return False
    value = values[0].decode("latin-1")
    if allowed is None:
        return parse_host(value) is not None
    return host_allowed(value, allowed)


def host_allowed(header: str | None, allowed: Sequence[str]) -> bool:
    """Whether a ``Host`` header value is well formed (:func:`parse_host`) and names one of
    ``allowed`` (the port is not compared): ``"*"`` allows any well-formed host,
    ``"*.example.com"`` the subdomains of ``example.com``, other patterns one host."""
    host = parse_host(header)
    if host is None:
        return False
    for pattern in allowed:
        if pattern == "*":
            return True
        if pattern.startswith("*."):
            suffix = pattern[1:].rstrip(".")
            if host.endswith(suffix) and len(host) > len(suffix):
                return True
        elif host == _normalized_pattern(pattern):
            return True
    return False


def _valid_port(text: str) -> bool:
    return _PORT.fullmatch(text) is not None and int(text) <= 65535


def _ipv6(text: str) -> str | None:
    if "%" in text:  # zone ids (RFC 6874) name an interface of the client's host
        return None
    try:
        return ipaddress.IPv6Address(text).compressed
    except ValueError:
        return None


def _name(text: str) -> str | None:
    """A DNS name or IPv4 address, without its one trailing dot; ``None`` if not one."""
    name = text[:-1] if text.endswith(".") else text
    if not name or len(name) > _MAX_NAME:
        return None
    if not all(_LABEL.fullmatch(label) for label in name.split(".")):
        return None
    return name


def _normalized_pattern(pattern: str) -> str:
    """An allowed host as :func:`parse_host` gives hosts (``[::1]`` and ``0::1`` are
    ``::1``; a trailing dot is dropped)."""
    bare = pattern.strip("[]")
    try:
        return ipaddress.IPv6Address(bare).compressed
    except ValueError:
        return pattern.rstrip(".")

"""Where SSH connects: a host name or an IP literal, with an optional port.

`10.0.0.11`, `gpu-1.example`, `fd00::11` (a bare IPv6 address has no port), and with a
port `10.0.0.11:2201`, `gpu-1.example:2201`, `[fd00::11]:2201`. Anything else (spaces, a
newline, a scheme, a path) is refused where it is typed, with the reason.
"""

from __future__ import annotations

import ipaddress
import re

EXPECTED = "expected a host name or an IP address, with :PORT if not 22 ([IPv6]:PORT)"
ADDRESS_CHARS = re.compile(r"[A-Za-z0-9.:\[\]-]+")
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")


def _host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return len(text) <= 253 and HOST_NAME.fullmatch(text) is not None


def split(text: str) -> tuple[str, int | None]:
    """(host, port or None); ValueError saying what is wrong."""
    host, port = text, None
    if not ADDRESS_CHARS.fullmatch(text):  # a URL, a path, spaces, user@: not where SSH connects
        raise ValueError(EXPECTED)
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("expected [IPv6]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None
        port = _port(rest[1:]) if rest else None
        return host, port
    if text.count(":") == 1:
        host, _, p = text.partition(":")
        port = _port(p)
    if not _host(host):
        raise ValueError(EXPECTED)
    return host, port


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"port {text!r} is not a number from 1 to 65535")
    return int(text)

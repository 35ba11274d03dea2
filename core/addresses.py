"""Host and port parsing, once for the whole package: the command line, the services file, the environment,
the services, the deployment code and the clients (``RedisStore(hosts=...)`` included) all take ``host``,
``port``, ``host:port`` and ``{"host": h, "port": p}`` through these functions.

One rule: a host is an IP address or a DNS name, returned bare; brackets go only around an IPv6 address and
are required around one in ``host:port`` (``::1:7000`` is ambiguous); a port is an int in 1..65535 (0 too
for a port to bind, where it picks a free one) or a string of ASCII digits only (no sign, no spaces, no
full-width digits); ``host:port`` puts an IPv6 host in brackets. One error type:
:class:`~.errors.ConfigurationError` (a ``ValueError``), naming where the value came from, the value and what
to give instead; an address's error names the whole address and then the part that is wrong.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from .errors import ConfigurationError

__all__ = ["check_host", "check_port", "format_address", "is_ascii_number", "is_loopback", "parse_address",
           "parse_host_list", "parse_server"]

_HOST_NAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def is_ascii_number(text: str) -> bool:
    """True for ASCII decimal digits only: no sign, no spaces (``int`` would accept ``" 80"``), nothing else
    (``str.isdigit`` also accepts ``²`` and ``٣``, which ``int`` then rejects or reads as another number)."""
    return bool(text) and text.isascii() and text.isdigit()


def check_port(port: Any, what: str = "port", *, bind: bool = False) -> int:
    """``port`` as an int in 1..65535 (0..65535 with ``bind``: 0 picks a free port); :class:`ConfigurationError`
    naming ``what`` and the value otherwise."""
    if isinstance(port, str) and is_ascii_number(port):
        port = int(port)
    low = 0 if bind else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        hint = "0..65535 (0 picks a free one)" if bind else "1..65535"
        raise ConfigurationError(f"{what} {port!r} is not a TCP port; give a number in {hint}.")
    return port


def check_host(host: Any, what: str = "host") -> str:
    """``host`` (bare) when it is an IP address (IPv6 bare or in brackets) or a DNS name;
    :class:`ConfigurationError` otherwise."""
    if isinstance(host, str):
        bracketed = host.startswith("[") and host.endswith("]")
        bare = host[1:-1] if bracketed else host
        try:
            if ipaddress.ip_address(bare).version == 6 or not bracketed:
                return bare
        except ValueError:
            if _HOST_NAME.fullmatch(bare) and not bracketed:
                return bare
        if bracketed:
            raise ConfigurationError(f"{what} {host!r} is not an IPv6 address in brackets; brackets go only around "
                                     "one, as in [::1].")
    raise ConfigurationError(f"{what} {host!r} is not a host name or IP address; give e.g. 127.0.0.1.")


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost``."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def parse_address(text: Any, what: str = "address", *, bind: bool = False) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> ``(host, port)``, both validated (``bind``: port 0 allowed).

    Whitespace around the whole address is dropped (a pasted value); inside it, it is an error.
    """
    if not isinstance(text, str) or ":" not in text:
        raise ConfigurationError(f"{what} {text!r} is not host:port; give e.g. 127.0.0.1:7000.")
    host, _, port = text.strip().rpartition(":")
    where = f"{what} {text!r}:"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigurationError(f"{where} host {host!r} is not in brackets; an IPv6 address is written "
                                 "[::1]:7000.")
    return check_host(host, f"{where} host"), check_port(port, f"{where} port", bind=bind)


def parse_server(item: Any, what: str = "server") -> tuple[str, int]:
    """One server given as ``"host:port"``, ``{"host": h, "port": p}`` (Bagua's form; the port an int or a
    string of digits) or ``(host, port)`` -> ``(host, port)``, validated as :func:`parse_address` does."""
    if isinstance(item, str):
        return parse_address(item, what)
    if isinstance(item, Mapping):
        host, port = item.get("host"), item.get("port")
    elif isinstance(item, tuple) and len(item) == 2:
        host, port = item
    else:
        raise ConfigurationError(f"{what} {item!r} is not a server; give '10.0.0.1:7000' or "
                                 "{'host': '10.0.0.1', 'port': 7000}.")
    return check_host(host, f"{what} {item!r}: host"), check_port(port, f"{what} {item!r}: port")


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (a host already in brackets kept as it is)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def parse_host_list(text: str, what: str) -> list[dict[str, Any]]:
    """``"h:p,h:p"`` -> ``[{"host", "port"}, ...]``, every item validated."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigurationError(f"{what} {text!r} names no server; give host:port[,host:port...].")
    return [dict(zip(("host", "port"), parse_address(item, what), strict=True)) for item in items]

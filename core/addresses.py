"""Host and port parsing, once for the whole package: the command line, the services file, the environment,
the services and the clients all take ``host``, ``port`` and ``host:port`` through these functions.

One rule: a host is an IP address (IPv6 bare or in brackets, returned bare) or a DNS name; a port is an int
in 1..65535 or a string of ASCII digits only (no sign, no spaces); ``host:port`` puts an IPv6 host in
brackets. One error type: :class:`~.errors.ConfigurationError` (a ``ValueError``), naming the value and
what to give instead.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from .errors import ConfigurationError

__all__ = ["check_host", "check_port", "format_address", "is_ascii_number", "is_loopback", "parse_address",
           "parse_host_list"]

_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def is_ascii_number(text: str) -> bool:
    """True for ASCII decimal digits only: no sign, no spaces (``int`` would accept ``" 80"``), nothing else
    (``str.isdigit`` also accepts ``²`` and ``٣``, which ``int`` then rejects or reads as another number)."""
    return bool(text) and text.isascii() and text.isdigit()


def check_port(port: Any, what: str = "port") -> int:
    """``port`` as an int in 1..65535; :class:`ConfigurationError` naming ``what`` and the value otherwise."""
    if isinstance(port, str) and is_ascii_number(port):
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigurationError(f"{what} {port!r} is not a TCP port; give a number in 1..65535.")
    return port


def check_host(host: Any, what: str = "host") -> str:
    """``host`` when it is an IP address or a DNS name; :class:`ConfigurationError` otherwise."""
    if isinstance(host, str):
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ipaddress.ip_address(bare)
            return bare
        except ValueError:
            if _HOST_NAME.match(bare):
                return bare
    raise ConfigurationError(f"{what} {host!r} is not a host name or IP address; give e.g. 127.0.0.1.")


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost``."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def parse_address(text: Any, what: str = "address") -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> ``(host, port)``, both validated."""
    if not isinstance(text, str) or ":" not in text:
        raise ConfigurationError(f"{what} {text!r} is not host:port; give e.g. 127.0.0.1:7000.")
    host, _, port = text.strip().rpartition(":")
    if not is_ascii_number(port):
        raise ConfigurationError(f"{what} {text!r} has no numeric port; give e.g. 127.0.0.1:7000.")
    return check_host(host, what), check_port(int(port), f"{what} {text!r}: port")


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_host_list(text: str, what: str) -> list[dict[str, Any]]:
    """``"h:p,h:p"`` -> ``[{"host", "port"}, ...]``, every item validated."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigurationError(f"{what} {text!r} names no server; give host:port[,host:port...].")
    return [dict(zip(("host", "port"), parse_address(item, what), strict=True)) for item in items]

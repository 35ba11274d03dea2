"""The addresses ``bagua-lightning up`` binds and announces: host names resolved once, where they enter, and
the machine's own reachable address for a wildcard bind. No torch, no Redis here.

Why resolve: Redis Cluster nodes meet and announce each other by IP address (``CLUSTER MEET localhost``
fails with "Invalid node address"), and every client must be given an address that reaches the node.
Why a non-loopback default for ``--host 0.0.0.0``: a node bound to every interface that announced
``127.0.0.1`` would send clients on other machines to themselves.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

from ..core.addresses import check_host
from ..core.errors import ConfigurationError

WILDCARDS = ("0.0.0.0", "::")  # bind addresses meaning "every interface"


def resolve_host(host: str, what: str) -> str:
    """``host`` as an IP address: a host name (``localhost``) is resolved; one line naming it otherwise."""
    host = check_host(host, what)
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigurationError(f"--{what.replace('_', '-')} {host!r} does not resolve ({exc}); give an IP "
                                 "address such as 127.0.0.1.") from None
    # Prefer IPv4 (what `localhost` means to most tools); Redis binds and announces one address.
    addresses = sorted({str(i[4][0]) for i in infos}, key=lambda a: ":" in a)
    return addresses[0]


def machine_address() -> str:
    """A non-loopback IPv4 (else IPv6) address of an interface that is up: what ``--host 0.0.0.0`` announces.

    Raises:
        ConfigurationError: the machine has none; name one with ``--announce-ip``.
    """
    stats = psutil.net_if_stats()
    found = []
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                ip = ipaddress.ip_address(a.address.split("%")[0])
                if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                    found.append(ip)
    if not found:
        raise ConfigurationError("--host 0.0.0.0: this machine has no non-loopback address to announce; give "
                                 "--announce-ip ADDRESS (one other machines reach this one at).")
    return str(sorted(found, key=lambda ip: ip.version)[0])

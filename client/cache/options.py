"""Connection options of the Redis stores and the parsing of ``hosts``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ...core.addresses import parse_server
from ...core.errors import ConfigurationError
from ...core.pinned_redis import pinned_kwargs
from ...core.services_file import resolve_redis_password, resolve_redis_read_port_offset, resolve_redis_tls
from ...core.tls_trust import ClientTLS

# bytes per socket read: a batch of samples is hundreds of KB per node, read in a few large chunks
SOCKET_READ_SIZE = 1024 * 1024


@dataclass(kw_only=True)
class RedisOptions:
    """Connection options of :class:`RedisStore` (its ``**options``).

    Attributes:
        password: AUTH password; None: ``$BAGUA_LIGHTNING_REDIS_PASSWORD``, else the deployment's password
            when every host is a node the services file records (:meth:`resolve_password`), else none.
        username: ACL user (Redis 6+); None: the default user.
        ssl: connect with TLS.
        ssl_ca_certs: CA bundle to verify the servers (TLS); with ``ssl_cert_reqs="required"`` the only
            trusted roots, as ``tls_ca``. ``ssl=True`` without it trusts the system's roots (a managed Redis).
        ssl_certfile: client certificate (mutual TLS).
        ssl_keyfile: client key (mutual TLS).
        ssl_cert_reqs: ``"required"`` (default), ``"optional"`` or ``"none"``.
        tls_ca: PEM of the deployment's CA: speak TLS and verify every node against this CA alone (host
            name or IP checked) before the password is sent. None: ``$BAGUA_LIGHTNING_TLS_CA``, else the
            services file's CA when every host is a node it records (:meth:`resolve_tls`), else plaintext.
        tls_cert: PEM client certificate shown to the nodes; None: ``$BAGUA_LIGHTNING_TLS_CERT``, else the
            services file's (as for ``tls_ca``).
        tls_key: PEM private key of ``tls_cert``; None: ``$BAGUA_LIGHTNING_TLS_KEY``, else the services file's.
        socket_timeout_s: deadline of one read or write on a connection, in seconds.
        connect_timeout_s: deadline of a TCP connect, in seconds.
        retries: retries of a failed network call (exponential backoff), 0 for none.
        backoff_cap_s: longest wait between retries, in seconds.
        start_timeout_s: deadline for a spawned local server to answer, in seconds.
        read_port_offset: sealed entries are read from each node's plaintext read port, its port plus this
            offset, as the password-less read-only user (no secret sent; docs/deployment.md, "Open reads").
            None: ``$BAGUA_LIGHTNING_REDIS_READ_PORT_OFFSET``, else the services file's for the nodes it
            records (:meth:`resolve_read_plane`), else every read goes through the client port.
    """

    password: str | None = None
    username: str | None = None
    ssl: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    retries: int = 2
    backoff_cap_s: float = 0.5
    start_timeout_s: float = 30.0
    read_port_offset: int | None = None
    tls: ClientTLS | None = field(default=None, init=False)  # resolved by resolve_tls

    def __post_init__(self) -> None:
        if self.ssl_cert_reqs not in ("required", "optional", "none"):
            raise ConfigurationError(f"ssl_cert_reqs={self.ssl_cert_reqs!r}; use 'required', 'optional' or 'none'.")
        for name in ("socket_timeout_s", "connect_timeout_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name}={getattr(self, name)} must be > 0 seconds.")
        if self.retries < 0 or self.backoff_cap_s < 0:
            raise ConfigurationError(f"retries={self.retries}, backoff_cap_s={self.backoff_cap_s} must be >= 0.")

    def resolve_password(self, hosts: Sequence[tuple[str, int]]) -> None:
        """Fill in an unset password for ``hosts`` (:func:`~bagua_lightning.core.services_file.resolve_redis_password`:
        the services file's password goes only to the nodes it records)."""
        if self.password is None:
            self.password = resolve_redis_password(hosts)

    def resolve_tls(self, hosts: Sequence[tuple[str, int]]) -> None:
        """Settle TLS for ``hosts`` (:func:`~bagua_lightning.core.services_file.resolve_redis_tls`: arguments,
        environment, the services file's CA for the nodes it records, else plaintext)."""
        ca, cert, key = self.tls_ca, self.tls_cert, self.tls_key
        if ca is None and self.ssl and self.ssl_ca_certs and self.ssl_cert_reqs == "required":
            # redis-py's own TLS options with a CA: pinned to it as well (redis-py would add the system's roots)
            ca, cert, key = self.ssl_ca_certs, cert or self.ssl_certfile, key or self.ssl_keyfile
        self.tls = resolve_redis_tls(hosts, ca=ca, cert=cert, key=key)

    def resolve_read_plane(self, hosts: Sequence[tuple[str, int]]) -> None:
        """Settle the read port offset for ``hosts`` (:func:`~bagua_lightning.core.services_file.\
resolve_redis_read_port_offset`), unless given."""
        if self.read_port_offset is None:
            self.read_port_offset = resolve_redis_read_port_offset(hosts)
        elif isinstance(self.read_port_offset, bool) or not isinstance(self.read_port_offset, int) \
                or not 0 < abs(self.read_port_offset) <= 65535:
            raise ConfigurationError(f"read_port_offset={self.read_port_offset!r}; give the difference between a "
                                     "node's read port and its port (e.g. 20000), or None.")

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> RedisOptions:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown RedisStore option(s) {unknown}; valid options are {sorted(known)}.")
        return cls(**options)

    def retry(self) -> Retry:
        return Retry(ExponentialBackoff(cap=self.backoff_cap_s, base=0.01), self.retries)

    def connection_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "password": self.password, "username": self.username, "socket_read_size": SOCKET_READ_SIZE,
            "socket_timeout": self.socket_timeout_s, "socket_connect_timeout": self.connect_timeout_s,
        }
        if self.tls is not None:  # the deployment's CA: verified before AUTH is sent
            kw.update(pinned_kwargs(self.tls))
        elif self.ssl:
            kw.update(ssl=True, ssl_ca_certs=self.ssl_ca_certs, ssl_certfile=self.ssl_certfile,
                      ssl_keyfile=self.ssl_keyfile, ssl_cert_reqs=self.ssl_cert_reqs)
        return kw


def parse_hosts(hosts: Sequence[Any]) -> list[tuple[str, int]]:
    """``[{"host": h, "port": p}]`` (Bagua's form, port may be a str) or ``"h:p"`` strings -> ``[(h, p)]``,
    by the package's one address rule (:func:`~...core.addresses.parse_server`); one string is read as
    ``$BAGUA_LIGHTNING_REDIS_HOSTS`` is (``"h:p,h:p"``)."""
    if isinstance(hosts, str):
        hosts = [item for item in hosts.split(",") if item.strip()]
    out = [parse_server(item, "hosts item") for item in hosts]
    if not out:
        raise ConfigurationError("hosts is empty; pass None to spawn a local Redis, or list at least one server.")
    if len(set(out)) != len(out):
        raise ConfigurationError(f"hosts lists a server twice: {hosts!r}")
    return out

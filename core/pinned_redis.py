"""Redis clients whose TLS trusts the deployment's CA alone.

redis-py's ``SSLConnection`` builds its context with ``ssl.create_default_context()`` and then adds the given
CA: the system's roots stay trusted beside it (and ``SSL_CERT_FILE``/``SSL_CERT_DIR`` add more), so any server
with a certificate of a public CA for the address would receive the password. :class:`PinnedSSLConnection`
is redis-py's ``SSLConnection`` with the context of :meth:`ClientTLS.context
<bagua_lightning.core.tls_trust.ClientTLS.context>` instead: the pinned CA only, host name or IP checked, TLS
1.2+, the client certificate. Every TLS client to the deployment's Redis goes through it:

* ``redis.Redis`` takes no ``connection_class``: :func:`redis_client` builds it on a ``ConnectionPool`` of
  this class;
* ``RedisCluster`` hands a ``connection_class`` to its nodes' pools only when built from a URL (redis-py 8:
  ``NodesManager.create_redis_node`` with ``from_url``): :func:`cluster_client` passes a plain ``redis://``
  URL of the first node (the scheme says nothing; the class speaks TLS) beside the startup nodes.

Only the CA, certificate and key are taken from the connection's arguments; ``ssl_cert_reqs``,
``ssl_check_hostname``, ``ssl_ca_path``/``ssl_ca_data`` and OCSP settings cannot weaken or widen it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from redis.connection import SSLConnection

from .addresses import format_address
from .errors import ConfigurationError
from .tls_trust import ClientTLS, unchecked

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster


class PinnedSSLConnection(SSLConnection):
    """redis-py's ``SSLConnection`` (same arguments, same errors) whose context trusts ``ssl_ca_certs`` alone."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not self.ca_certs:
            raise ConfigurationError("a pinned TLS connection needs the CA to verify the server with (ssl_ca_certs); "
                                     "give tls_ca= or $BAGUA_LIGHTNING_TLS_CA.")
        # Read at each connect (a file gone then is an OSError, a store error like any failed connect).
        self.tls: ClientTLS = unchecked(self.ca_certs, self.certfile, self.keyfile)

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        return self.tls.context().wrap_socket(sock, server_hostname=self.host)


def pinned_kwargs(tls: ClientTLS) -> dict[str, Any]:
    """redis-py connection arguments of a pinned TLS connection to the deployment whose CA (and client
    certificate) ``tls`` names: :class:`PinnedSSLConnection`, this CA only. They name a ``connection_class``,
    which ``redis.Redis`` does not take: build clients with :func:`redis_client` / :func:`cluster_client`."""
    return {"connection_class": PinnedSSLConnection, "ssl_ca_certs": tls.ca, "ssl_certfile": tls.cert,
            "ssl_keyfile": tls.key, "ssl_cert_reqs": "required", "ssl_check_hostname": True}


def pinned(kwargs: dict[str, Any]) -> bool:
    """Whether connection arguments name a pinned TLS connection (:func:`pinned_kwargs`)."""
    cls = kwargs.get("connection_class")
    return isinstance(cls, type) and issubclass(cls, PinnedSSLConnection)


def redis_client(host: str, port: int, **kwargs: Any) -> redis.Redis:
    """``redis.Redis(host=, port=, **kwargs)``; with a pinned ``connection_class`` (TLS, the deployment's CA
    only) on a pool of that class (``redis.Redis`` takes no connection class), closed with the client."""
    import redis

    if "connection_class" not in kwargs:
        return redis.Redis(host=host, port=port, **kwargs)
    client = redis.Redis(connection_pool=redis.ConnectionPool(host=host, port=port, **kwargs))
    client.auto_close_connection_pool = True
    return client


def _url(host: str, port: int) -> str:
    return f"redis://{format_address(host, port)}"


def cluster_client(hosts: Sequence[tuple[str, int]], **kwargs: Any) -> RedisCluster:
    """``RedisCluster`` over ``hosts`` (startup nodes); with a pinned ``connection_class``, every node's pool
    makes connections of that class (see the module's text). :func:`close_cluster` closes it."""
    from redis.cluster import ClusterNode, RedisCluster

    nodes = [ClusterNode(h, p) for h, p in hosts]
    if "connection_class" not in kwargs:
        return RedisCluster(startup_nodes=nodes, **kwargs)
    # ``url`` makes the nodes' pools of kwargs' connection_class; its host is also one of the startup nodes.
    return RedisCluster(url=_url(*hosts[0]), startup_nodes=nodes, **kwargs)


def close_cluster(client: Any) -> None:
    """Close a cluster client and every node's pool (pools given by URL are not closed with their client)."""
    try:
        client.disconnect_connection_pools()
    finally:
        client.close()

"""Health checks of the deployed services, each with a deadline: the autotune service's gRPC health, the
fault-tolerance coordinator's status page (torchft's Lighthouse) and the Redis nodes (every node answering;
for a cluster, all 16384 slots served and no node in ``CLUSTER NODES`` that is not the deployment's own).

Used by ``bagua-lightning up``/``status`` and by the services image's healthcheck
(``bagua-lightning status --autotune HOST:PORT``); no torch here.
"""

from __future__ import annotations

import http.client
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import procs
from ..core.errors import ServiceUnavailableError
from ..core.redis_server import CLUSTER_SLOTS, client_for, cluster_info
from ..core.tls_trust import ClientTLS, explain_untrusted, handshake_failed

if TYPE_CHECKING:
    import redis


@dataclass(frozen=True)
class Health:
    """Result of one health check: ``healthy`` and a one-line ``detail`` for people.

    ``stale``: not a failure but a leftover record of something that is gone (the node-local cache server
    after a reboot); reported as "stale record", it does not make ``status`` fail, and ``down`` removes it.
    """

    healthy: bool
    detail: str
    stale: bool = False

    @property
    def label(self) -> str:
        return "healthy" if self.healthy else "stale record" if self.stale else "UNHEALTHY"

    @property
    def ok(self) -> bool:
        """Nothing to fix: healthy, or only a stale record."""
        return self.healthy or self.stale


def check_autotune(address: str, timeout_s: float = 2.0, *, token: str | None = None,
                   tls_ca: Path | None = None) -> Health:
    """gRPC ``grpc.health.v1`` check of the whole server, with a deadline.

    Args:
        address: ``host:port``.
        timeout_s: deadline of the call, in seconds.
        token: bearer token sent as ``authorization`` metadata (the service checks it when it has one).
        tls_ca: PEM file of the CA that signed the service's certificate: speak TLS (None: plaintext).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.enable_http_proxy", 0)]  # services are local or named explicitly; never proxied
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        with channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, metadata=metadata
            )
    except OSError as exc:
        return Health(False, f"TLS CA file {tls_ca} cannot be read ({exc.strerror})")
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if tls_ca is not None and handshake_failed(details or ""):
            return Health(False, f"{address} is not this deployment's: it did not prove itself with a certificate "
                                 f"of the CA {tls_ca}; no token was sent")
        return Health(False, f"not answering ({code.name if code else exc})")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return Health(status == "SERVING", status)


def check_lighthouse(address: str, timeout_s: float = 2.0) -> Health:
    """GET of the Lighthouse's status page (torchft serves it over HTTP beside its gRPC service, on one port).

    A health check must not take part: a heartbeat would make the Lighthouse wait for a node that never joins,
    so only the page is read. Healthy when it is torchft's (it names the current quorum id).

    Args:
        address: ``host:port``, or the ``http://host:port`` of ``TORCHFT_LIGHTHOUSE``.
        timeout_s: deadline of the request, in seconds.
    """
    address = address.split("://", 1)[-1].rstrip("/")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local or named: never proxied
    try:
        with opener.open(f"http://{address}/status", timeout=timeout_s) as response:
            page = response.read(1 << 16).decode(errors="replace")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return Health(False, f"{address} not answering ({reason})")
    quorum = re.search(r"quorum_id:\s*(-?\d+)", page)
    if quorum is None:
        return Health(False, f"{address} answers, but not as torchft's Lighthouse (no quorum id on /status)")
    beating = re.search(r"(\d+) heartbeating", page)
    return Health(True, f"quorum {quorum.group(1)}, {beating.group(1) if beating else '?'} node(s) heartbeating")


def check_redis(hosts: Sequence[dict[str, Any]], cluster: bool, password: str | None = None,
                timeout_s: float = 2.0, node_ids: Collection[str] | None = None, tls: ClientTLS | None = None) -> Health:
    """Every node answers PING; for a cluster, each reports ``cluster_state:ok`` with all slots served.

    Args:
        tls: speak TLS, verifying each node against this CA before the password is sent (None: plaintext).
        node_ids: the cluster's own node ids (recorded when it was created): a node any of ``hosts`` lists
            in ``CLUSTER NODES`` beyond these is foreign, and the cluster unhealthy (a node that joined
            through the bus can take slots and receive the clients' passwords). None: not checked.
    """
    import redis

    if not hosts:
        return Health(False, "no Redis hosts recorded")
    for node in hosts:
        where = f"{node['host']}:{node['port']}"
        try:
            with client_for(node["host"], int(node["port"]), password, timeout_s, tls=tls) as client:
                client.ping()
                if not cluster:
                    continue
                fields = cluster_info(client)
                foreign = _foreign_nodes(client, node_ids) if node_ids is not None else []
        except (redis.RedisError, OSError) as exc:
            untrusted = explain_untrusted(exc, where)
            if untrusted is not exc:
                return Health(False, str(untrusted))
            return Health(False, f"{where} not answering ({exc})")
        if foreign:
            return Health(False, f"{where} lists foreign node(s) {', '.join(foreign)} in CLUSTER NODES (not this "
                                 "deployment's; stop them, then restart with `bagua-lightning down` and `up`)")
        slots_ok = int(fields.get("cluster_slots_ok", "0") or 0)
        if fields.get("cluster_state") != "ok" or slots_ok != CLUSTER_SLOTS:
            return Health(False, f"{where}: cluster_state {fields.get('cluster_state')}, "
                                 f"{slots_ok}/{CLUSTER_SLOTS} slots served")
    if cluster:
        return Health(True, f"cluster ok, {CLUSTER_SLOTS}/{CLUSTER_SLOTS} slots served by {len(hosts)} masters")
    return Health(True, f"{len(hosts)} server(s) answering")


def _foreign_nodes(client: redis.Redis, node_ids: Collection[str]) -> list[str]:
    """``"<id> at <address> (<flags>)"`` for each node in ``CLUSTER NODES`` whose id is not in ``node_ids``."""
    # The raw text: redis-py's parsed form is keyed by address, and two nodes may claim one address.
    client.set_response_callback("CLUSTER NODES", lambda response, **_: response)
    raw = client.execute_command("CLUSTER NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    entries = [(f[0], f[1], f[2]) for f in (line.split() for line in text.splitlines()) if len(f) > 2]
    return [f"{nid} at {addr} ({flags})" for nid, addr, flags in entries if nid not in node_ids]


def wait_healthy(check: Callable[[], Health], deadline: float, what: str,
                  proc: subprocess.Popen[bytes] | None = None, log_path: Path | None = None) -> Health:
    """Poll ``check`` until healthy; fail fast when ``proc`` exits, and after the monotonic ``deadline``."""
    last: list[Health] = []

    def healthy() -> Health | None:
        health = check()
        last[:] = [health]
        if health.healthy:
            return health
        if proc is not None and proc.poll() is not None:
            raise ServiceUnavailableError(
                f"{what} exited with code {proc.returncode} before it became healthy; see {log_path}"
                " (is the port already in use?)"
            )
        return None
    try:
        return procs.poll(healthy, deadline - time.monotonic(), what, interval_s=0.05, max_interval_s=0.5)
    except procs.PollTimeoutError:
        if not last:
            raise
        raise ServiceUnavailableError(f"{what} is not healthy before the deadline: {last[0].detail}"
                                      + (f"; see {log_path}" if log_path else "")) from None

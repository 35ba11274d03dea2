"""``bagua-lightning up`` on a partly healthy deployment: keep what is alive, restart only what is dead.

A component is alive when its recorded process is still ours (pid, start time and deployment id match,
:mod:`bagua_lightning.core.procs`) and it answers: a Redis node PING with the deployment's password, the
autotune service its gRPC health check with the deployment's token (each retried for a few seconds, so a
node that is only slow on a loaded machine is not taken for dead). What is alive keeps running untouched;
the secrets, the certificates, the data folders and the cluster membership stay.

A dead Redis node is restarted from its own folder: the same ``redis.conf`` (ports, certificates, limits),
the same ``nodes.conf`` (its node id and the cluster it belongs to) and the password on its standard input.
Redis does the rest: a master whose replica took over rejoins as that replica's replica and copies its data.
Before a dead master is restarted, ``up`` waits (a bounded time) for its replica to take over, so that the
empty restarted master does not come back as the owner of its slots and wipe the replica's copy.
The autotune service is restarted on its port with its token; its plans are in Redis. The Lighthouse
(fault-tolerance coordinator) is restarted on its port; it keeps no state worth keeping (a job's nodes rejoin
its quorum at their next step, or, while it was away, have ended naming it). A deployment recorded without
one gets one.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..core import procs
from ..core.errors import ConfigurationError, ServiceUnavailableError
from ..core.procs import ProcessRecord
from ..core.redis_server import (
    BUS_PORT_OFFSET,
    CONFIG_FILE,
    NodeConfig,
    check_reader,
    client_for,
    redis_server_binary,
    tls_port,
    wait_ready,
)
from ..core.services_file import ServicesInfo, write_services_file
from ..core.tls_trust import ClientTLS
from .deploy_config import AUTOTUNE_LOG, LIGHTHOUSE_LOG, UpConfig, redis_state_url
from .deploy_ports import claim_ports, require_free, with_lighthouse_port
from .deploy_state import previous_redis_password, start_autotune, start_lighthouse
from .health import Health, check_autotune, check_lighthouse, check_redis, wait_healthy
from .redis_records import ClusterInfo, NodeInfo, read_deployments, write_deployment

log = logging.getLogger(__name__)

ALIVE_PATIENCE_S = 10.0  # how long a running process may take to answer before it counts as hung
FAILOVER_WAIT_S = 20.0  # at most this long for a dead master's replica to take over before restarting it


def _cluster_of(info: ServicesInfo) -> ClusterInfo | None:
    if not info.redis_hosts or not info.state_dir:
        return None
    port = int(info.redis_hosts[0]["port"])
    found = [c for c in read_deployments(Path(info.state_dir), port) if c.deployment == info.deployment]
    return found[0] if found else None


def report_kept(info: ServicesInfo, report: Callable[[str], None]) -> None:
    """One ``kept`` line per component of a healthy deployment."""
    cluster = _cluster_of(info)
    for node in cluster.nodes if cluster is not None else []:
        report(f"redis node {node.host}:{node.port}: kept (pid {node.pid})")
    auto = info.processes.get("autotune") or []
    if info.autotune:
        report(f"autotune service {info.autotune}: kept" + (f" (pid {auto[0].pid})" if auto else ""))
    lighthouse = info.processes.get("lighthouse") or []
    if info.lighthouse:
        report(f"lighthouse {info.lighthouse}: kept" + (f" (pid {lighthouse[0].pid})" if lighthouse else ""))


def _answers(check: Callable[[], Health], patience_s: float) -> Health:
    """``check`` until it is healthy or ``patience_s`` passed; its last result."""
    last: list[Health] = []

    def healthy() -> bool:
        last[:] = [check()]
        return last[0].healthy
    with contextlib.suppress(procs.PollTimeoutError):  # unhealthy all along: the last answer says why
        procs.poll(healthy, patience_s, "a healthy answer", retry_on=(), interval_s=0.25)
    return last[-1]


def _node_state(node: NodeInfo, password: str | None, tls: ClientTLS | None) -> str | None:
    """None when ``node`` is alive; else why it is not."""
    if not procs.is_running(node.process):
        return f"process {node.pid} is gone"
    health = _answers(lambda: check_redis([{"host": node.host, "port": node.port}], False, password, tls=tls),
                      ALIVE_PATIENCE_S)
    return None if health.healthy else f"process {node.pid} runs but does not answer ({health.detail})"


def recover(info: ServicesInfo, cfg: UpConfig, report: Callable[[str], None]) -> ServicesInfo:
    """Restart the dead components of the deployment ``info`` records; keep the others; rewrite the file.

    Raises:
        ConfigurationError: a record or file the restart needs is missing (use ``up --fresh``), or a dead
            node's port is taken by another process.
        ServiceUnavailableError: a restarted component did not become healthy before ``cfg.timeout_s``.
    """
    deadline = time.monotonic() + cfg.timeout_s
    secrets = {name: procs.read_secret(path) for name, path in info.secrets.items()}
    password = secrets.get("redis_password")
    cluster = _cluster_of(info)
    if info.redis_hosts and cluster is None:
        raise ConfigurationError(f"the Redis deployment's record under {info.state_dir}/redis is missing or not "
                                 "its own; `bagua-lightning up --fresh` starts over (new secrets, empty cache).")
    if cluster is not None:
        restarted = _recover_redis(cluster, cfg, password, deadline, report)
        tls = cluster.client_tls()
        info.processes["redis"] = cluster.processes
        # the new records first: `down` stops them even if what follows fails (they are in the Redis
        # deployment's own record already: _recover_redis wrote it before it reported them)
        write_services_file(info)
        if not restarted:
            health = _answers(lambda: check_redis(info.redis_hosts, info.redis_cluster, password,
                                                  node_ids=info.redis_node_ids or None, tls=tls), ALIVE_PATIENCE_S)
            if not health.healthy:
                raise ServiceUnavailableError(
                    f"redis: {health.detail}; every node is alive and answers, so `up` restarted none; "
                    "`bagua-lightning up --fresh` starts over (new secrets, empty cache).")
        wait_healthy(lambda: check_redis(info.redis_hosts, info.redis_cluster, password,
                                         node_ids=info.redis_node_ids or None, tls=tls),
                     deadline, "the Redis deployment")
    if info.autotune:
        info.processes["autotune"] = [_recover_autotune(info, cfg, secrets, deadline, report)]
        write_services_file(info)
    if cfg.lighthouse:
        _recover_lighthouse(info, cfg, deadline, report)
    return info


def _recover_redis(cluster: ClusterInfo, cfg: UpConfig, password: str | None, deadline: float,
                   report: Callable[[str], None]) -> int:
    """Restart the dead nodes of ``cluster`` (its records are updated); return how many."""
    dead: list[tuple[NodeInfo, str]] = []
    tls = cluster.client_tls()
    for node in cluster.nodes:
        reason = _node_state(node, password, tls)
        if reason is None:
            report(f"redis node {node.host}:{node.port}: kept (pid {node.pid})")
        else:
            dead.append((node, reason))
    if not dead:
        return 0
    for node, _ in dead:
        procs.stop(node.process, timeout_s=5.0)  # a hung one of ours; nothing when it is gone
    if cluster.cluster:
        _wait_failover(cluster, [n for n, _ in dead], password, deadline, tls)
    ports = [p for n, _ in dead for p in _node_ports(n.port, cluster)]
    require_free(cfg.host, [(f"(Redis node {p})", p) for p in ports])
    started: list[tuple[subprocess.Popen[bytes], NodeInfo, str]] = []
    with claim_ports(ports):
        try:
            for node, reason in dead:
                proc = relaunch_node(cluster, node, password)
                old = node.pid
                node.process = procs.record(proc.pid, cluster.deployment)
                started.append((proc, node, f"was pid {old}: {reason}"))
            for proc, node, _ in started:
                wait_ready(node.host, node.port, password, proc, timeout_s=max(1.0, deadline - time.monotonic()),
                           tls=tls)
                if cluster.read_port_offset is not None:  # its redis.conf opened the read port and the reader
                    check_reader(node.host, node.port + cluster.read_port_offset)
                _readd_previous_password(node, password, tls)
            write_deployment(cluster)  # recorded, or stopped again: never running unrecorded
        except BaseException:
            for proc, _, _ in started:
                procs.stop_child(proc)
            raise
    for proc, node, why in started:
        report(f"redis node {node.host}:{node.port}: restarted (pid {proc.pid}; {why})")
    return len(started)


def _node_ports(port: int, cluster: ClusterInfo) -> list[int]:
    # With client TLS the node's port is its TLS port; a TLS bus alone (`redis up`) adds a TLS port. The read
    # port (its redis.conf opens it again, with the reader user) must be free too.
    extra_tls = cluster.tls_dir is not None and cluster.client_tls() is None
    offset = cluster.read_port_offset
    return [port, *([port + BUS_PORT_OFFSET] if cluster.cluster else []), *([tls_port(port)] if extra_tls else []),
            *([port + offset] if offset is not None else [])]


def relaunch_node(cluster: ClusterInfo, node: NodeInfo, password: str | None) -> subprocess.Popen[bytes]:
    """Start ``node`` again from its folder: its own ``redis.conf`` and ``nodes.conf``, the password on stdin."""
    data_dir = cluster.state_dir / f"node-{node.port}"
    conf = data_dir / CONFIG_FILE
    if not conf.is_file() or (cluster.cluster and not (data_dir / "nodes.conf").is_file()):
        raise ConfigurationError(f"{data_dir} lacks its redis.conf or nodes.conf, so node {node.port} cannot rejoin; "
                                 "`bagua-lightning up --fresh` starts over (new secrets, empty cache).")
    secret = NodeConfig(port=node.port, data_dir=data_dir, deployment=cluster.deployment,
                        password=password).secret_text()
    proc = subprocess.Popen([redis_server_binary(), str(conf), "-"], cwd=data_dir, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=procs.child_env(cluster.deployment), start_new_session=True)
    if proc.stdin is not None:
        try:
            proc.stdin.write(secret.encode())
        finally:
            proc.stdin.close()
    return proc


def _readd_previous_password(node: NodeInfo, password: str | None, tls: ClientTLS | None) -> None:
    # During a password rotation's grace period the other nodes accept the previous password as well.
    previous = previous_redis_password(password)
    if previous:
        with client_for(node.host, node.port, password, tls=tls) as c:
            c.execute_command("ACL", "SETUSER", "default", f">{previous}")


def _cluster_nodes(node: NodeInfo, password: str | None, tls: ClientTLS | None) -> list[list[str]]:
    with client_for(node.host, node.port, password, timeout_s=2.0, tls=tls) as c:
        c.set_response_callback("CLUSTER NODES", lambda response, **_: response)
        raw = c.execute_command("CLUSTER NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return [line.split() for line in text.splitlines() if len(line.split()) >= 8]


def _wait_failover(cluster: ClusterInfo, dead: list[NodeInfo], password: str | None, deadline: float,
                   tls: ClientTLS | None) -> None:
    """Wait until no dead node still owns slots that a live replica of it could take over."""
    import redis

    dead_ids = {n.node_id for n in dead if n.node_id}
    live = [n for n in cluster.nodes if n not in dead]
    if not dead_ids or not live:
        return

    def settled() -> bool:
        entries = _cluster_nodes(live[0], password, tls)
        for fields in entries:
            node_id, flags = fields[0], fields[2]
            if node_id not in dead_ids or "master" not in flags or len(fields) < 9:
                continue  # not one of ours, a replica, or a master that owns no slot (any more)
            if any(f[3] == node_id and f[0] not in dead_ids and "fail" not in f[2] for f in entries):
                return False  # a live replica will take its slots over
        return True
    wait_s = min(FAILOVER_WAIT_S, max(0.0, deadline - time.monotonic()))
    try:
        procs.poll(settled, wait_s, "the replicas of the dead masters to take over",
                   retry_on=(redis.RedisError, OSError))
    except procs.PollTimeoutError:
        log.warning("the replica of a dead master did not take over within %.0f s; restarting it anyway", wait_s)


def _recover_autotune(info: ServicesInfo, cfg: UpConfig, secrets: dict[str, str], deadline: float,
                      report: Callable[[str], None]) -> ProcessRecord:
    address = str(info.autotune)
    token = secrets.get("autotune_token")
    ca = Path(info.tls.ca) if info.tls else None
    tls_dir = Path(info.tls.ca).parent if info.tls else None
    root = Path(str(info.state_dir))
    return _recover_process(
        info, "autotune", f"autotune service {address}", lambda: check_autotune(address, token=token, tls_ca=ca),
        lambda: start_autotune(cfg, redis_state_url(cfg.client_host, cfg.first_redis_port), root, info.deployment,
                               info.secrets, tls_dir),
        cfg.host, ("--autotune-port", int(cfg.autotune_port or 0)), root / AUTOTUNE_LOG, deadline, report)


def _recover_lighthouse(info: ServicesInfo, cfg: UpConfig, deadline: float, report: Callable[[str], None]) -> None:
    """Keep the recorded Lighthouse when it answers, else restart it on its port (a deployment recorded without
    one gets one, on a free port); record it."""
    if not info.lighthouse:
        cfg = with_lighthouse_port(cfg)
        info.lighthouse = cfg.lighthouse_address
    address = info.lighthouse
    root = Path(str(info.state_dir))
    _recover_process(info, "lighthouse", f"lighthouse {address}", lambda: check_lighthouse(address),
                     lambda: start_lighthouse(cfg, root, info.deployment), cfg.host,
                     ("--lighthouse-port", int(cfg.lighthouse_port or 0)), root / LIGHTHOUSE_LOG, deadline, report)


def _recover_process(info: ServicesInfo, key: str, what: str, check: Callable[[], Health],
                     start: Callable[[], subprocess.Popen[bytes]], host: str, port: tuple[str, int], log_path: Path,
                     deadline: float, report: Callable[[str], None]) -> ProcessRecord:
    """The process ``info`` records under ``key`` when it is alive and answers ``check``; else a new one from
    ``start`` on its ``port`` (flag, number), healthy and recorded (or stopped again: never running unrecorded)."""
    recs = info.processes.get(key) or []
    if recs and procs.is_running(recs[0]):
        health = _answers(check, ALIVE_PATIENCE_S)
        if health.healthy:
            report(f"{what}: kept (pid {recs[0].pid})")
            return recs[0]
        reason = f"process {recs[0].pid} runs but does not answer ({health.detail})"
        procs.stop(recs[0], timeout_s=5.0)
    else:
        reason = f"process {recs[0].pid} is gone" if recs else "no process recorded"
    require_free(host, [port])
    with claim_ports([port[1]]):
        proc = start()
        try:
            wait_healthy(check, deadline, f"the {what}", proc, log_path)
            record = procs.record(proc.pid, info.deployment)
            info.processes[key] = [record]
            write_services_file(info)
        except BaseException:
            procs.stop_child(proc)
            raise
    report(f"{what}: {'started' if not recs else 'restarted'} (pid {proc.pid}; was: {reason})")
    return record


__all__ = ["recover", "relaunch_node", "report_kept"]

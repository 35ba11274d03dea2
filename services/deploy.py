"""``bagua-lightning up | down | status``: the autotune service, a Redis deployment and the fault-tolerance
coordinator as local processes.

The embedded counterpart of ``docker-compose.yml``: the same services, started natively as detached
background processes (own session, logs under :func:`~bagua_lightning.core.services_file.state_dir`), the
autotune service keeping its persisted plans in the Redis deployment, and torchft's Lighthouse
(``bagua-lightning lighthouse``, no credentials or TLS in torchft 0.2.0: loopback unless ``--host`` says
otherwise, with a warning) for ``FaultTolerance()``. ``up`` waits until all are healthy (gRPC health
``SERVING``; every Redis node answering and, for a cluster, all 16384 slots served; the Lighthouse's status
page), then records their addresses, process records and the paths of their secret files in the services file, where
``BaguaStrategy(autotune=True)``, ``CachedDataset`` and ``FaultTolerance()`` find them. ``up`` on healthy recorded services does
nothing; on a partly healthy deployment it restarts only what is dead and keeps the secrets, the data and
the processes of what is alive (:mod:`.deploy_recovery`); on one whose every process is gone (a reboot) it
restarts everything from its state folder: the same secrets and CA, each Redis node from its ``nodes.conf``
and append-only file with its data; ``up --fresh`` starts over. ``down`` stops what
``up`` started and the node-local cache server, and removes the file. With no port named, ``up`` takes the
default ports when they are free, else a free block (:mod:`.deploy_ports`).

Authentication is on by default: ``up`` creates a Redis password, an autotune token and a cache key
(``$BAGUA_LIGHTNING_REDIS_PASSWORD`` & co. when set, else random) in ``<state_dir>/secrets/`` (0600 files,
0700 folder). They reach the services through a pipe (Redis) and as file paths (autotune), trainers
through the services file's paths; never through a command line. ``--no-auth`` is refused beyond loopback.
``up`` never changes the secrets of a live deployment; ``bagua-lightning rotate-secrets`` does (:mod:`.rotate`).

High availability: by default 3 masters with one replica each (replicas on the next ports); a killed
master's replica takes over within seconds (failover settings in :mod:`bagua_lightning.core.redis_server`,
measured in docs/deployment.md). ``--replicas 0`` gives up failover: a dead master's keys miss until ``up``
runs again. Only the deployment's nodes join its cluster: the bus and replication run over mutual TLS
with certificates from a CA that ``up`` makes in ``<state_dir>/secrets/redis-tls`` (its key is deleted once
the node certificates are signed), and the node ids are recorded so ``status`` names any foreign node.

Open reads: with client TLS and a password (the default), every Redis node also listens in plaintext on its
read port, port + 20000 (:func:`~bagua_lightning.core.redis_server.read_port_offset`), where only the
password-less, read-only user of :mod:`bagua_lightning.core.read_plane` logs in; the services file records the
offset (``redis.read_port_offset``). ``--no-auth`` starts none.

Identity: every process carries the deployment's id; ``down`` signals a recorded process only when pid,
start time and id match, and only when the state folder's marker names this deployment, this folder and
this services file (a copied state folder or a stale file stops nothing; see :mod:`bagua_lightning.core.procs`).

The argv of the autotune service comes from one function, :func:`autotune_service_args`, which both this
launcher and ``docker-compose.yml`` use (a test compares them). No torch is imported here: the module runs
in the torch-free service image, whose healthcheck is ``bagua-lightning status --autotune HOST:PORT``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core import procs
from ..core.addresses import is_loopback, parse_address
from ..core.errors import ConfigurationError
from ..core.file_trust import check_own_folder
from ..core.procs import parse_bytes
from ..core.services_file import (
    ServicesInfo,
    read_services_file,
    remove_services_file,
    services_file_path,
    state_dir,
    write_services_file,
)
from . import deploy_recovery
from .deploy_config import (
    AUTOTUNE_LOG,
    DEFAULT_AUTOTUNE_PORT,
    DEFAULT_HOST,
    DEFAULT_LIGHTHOUSE_PORT,
    DEFAULT_MAXMEMORY,
    DEFAULT_REDIS_PORT,
    LIGHTHOUSE_LOG,
    REDIS_TLS_DIR,
    SECRETS,
    SECRETS_DIR,
    UpConfig,
    autotune_service_args,
    deployment_ports,
    lighthouse_warning,
    redis_state_url,
)
from .deploy_ports import all_free, claim_ports, claimed, port_free
from .deploy_state import exclusive, owned, running_services, start_autotune, start_lighthouse
from .health import check_autotune, check_lighthouse, wait_healthy
from .redis_tls import client_tls, remove_tls_dir

log = logging.getLogger(__name__)

# One line per component and what `up` did with it: "autotune service 127.0.0.1:29600: kept (pid 42)".
Report = Callable[[str], None]

__all__ = ["AUTOTUNE_LOG", "DEFAULT_AUTOTUNE_PORT", "DEFAULT_HOST", "DEFAULT_LIGHTHOUSE_PORT", "DEFAULT_MAXMEMORY",
           "DEFAULT_REDIS_PORT", "LIGHTHOUSE_LOG",
           "REDIS_TLS_DIR", "SECRETS_DIR", "DownReport", "UpConfig", "autotune_service_args", "down", "ensure_up",
           "is_loopback", "parse_bytes", "redis_state_url", "running_services", "stop_all", "up"]

_claim_ports = claim_ports  # the name tests and older callers use


# ------------------------------------------------------------------------------------------ up


def up(cfg: UpConfig, *, fresh: bool = False, report: Report | None = None) -> ServicesInfo:
    """Start both services, keep the healthy ones that run, restart only what is dead; write the services file.

    Args:
        cfg: what to start; ports left None are taken from the record, else picked free.
        fresh: stop whatever is recorded (new secrets, empty cache) and start over.
        report: called with one line per component: ``kept``, ``restarted`` or ``started`` (default: logged).

    Calls are serialised through a lock file beside the services file.

    Raises:
        ConfigurationError: bad settings, services running with other settings, a port is taken, or a
            file cannot be written (the message names it; what this call made is removed again).
        UntrustedFileError: the state folder is another user's, or the services or a secret file could have
            been forged (:mod:`bagua_lightning.core.file_trust`); nothing is started or changed.
        ServiceUnavailableError: a service did not become healthy before ``cfg.timeout_s``; everything
            this call started is stopped again.
    """
    check_own_folder(state_dir())  # never adopt (chmod, fill with secrets) a folder another user made
    for warning in (read_port_warning(cfg), _lighthouse_warning(cfg)):
        if warning:
            log.warning("%s", warning)
    with exclusive():
        return _up(cfg, fresh, report or log.info)


def read_port_warning(cfg: UpConfig) -> str | None:
    """One line saying what the read ports expose when they listen beyond loopback; None on loopback."""
    offset = cfg.read_port_offset
    if offset is None or is_loopback(cfg.host):
        return None
    return (f"--host {cfg.host}: the Redis read ports (each node's port {offset:+d}) listen in plaintext without a "
            "password for whoever reaches them: they serve sealed cache entries only (ciphertext, key names, "
            "lengths), never a secret; `up --fresh --no-read-ports` starts none (trainers then read over TLS).")


def _lighthouse_warning(cfg: UpConfig) -> str | None:
    warning = lighthouse_warning(cfg.host, cfg.lighthouse_port or DEFAULT_LIGHTHOUSE_PORT) if cfg.lighthouse else None
    return warning and warning.rstrip(".") + " (`up --no-lighthouse` starts none)."


def _up(cfg: UpConfig, fresh: bool, report: Report) -> ServicesInfo:
    existing = read_services_file()
    if existing is not None and fresh:
        _down()
        existing = None
    if existing is None:
        return _start_fresh(cfg, report)
    health = running_services(existing)
    asked, cfg = cfg, _with_recorded_ports(existing, cfg)
    differences = _differences(existing, cfg)
    missing = cfg.lighthouse and not existing.lighthouse  # a deployment of an `up` that started none: add it
    if health and all(h.healthy for h in health.values()) and not missing:
        if differences:
            raise ConfigurationError(
                f"services are already running with other settings ({'; '.join(differences)}); stop them with "
                "`bagua-lightning down` first, or run `up` with the same options."
            )
        deploy_recovery.report_kept(existing, report)
        return existing
    if not owned(existing):  # a copied or foreign record: nothing of it is ours to bring back
        log.info("recorded services are not this state folder's own (%s); starting afresh",
                 ", ".join(f"{k}: {h.detail}" for k, h in health.items()))
        _down()
        # The recorded ports again when they are all free; else, where none was named, a free block.
        again = cfg if all_free(cfg, int(cfg.autotune_port or 0), cfg.first_redis_port) else asked
        return _start_fresh(again, report)
    records = [r for rs in existing.processes.values() for r in rs]
    stopped = not any(procs.is_running(r) for r in records)  # every process gone: a reboot, say
    if differences:
        state = "is stopped (every process is gone)" if stopped else "runs partly"
        raise ConfigurationError(
            f"the recorded deployment {state}, with other settings ({'; '.join(differences)}); run `up` with "
            "its options to restart what is dead from its own state, or `up --fresh` to start over with these.")
    if stopped:
        _require_ports(existing, cfg)
    # Whatever is dead restarts from its own state: the same secrets and CA, each Redis node from its
    # nodes.conf and append-only file (its data), the autotune service with its plans.
    try:
        return deploy_recovery.recover(existing, cfg, report)
    except OSError as exc:
        if exc.errno not in _DISK_ERRORS:
            raise
        raise ConfigurationError(
            f"cannot write {exc.filename or existing.state_dir} ({exc.strerror}); free space there and run `up` "
            "again. What this `up` restarted is recorded (`down` stops it) or was stopped again.") from None


def _require_ports(info: ServicesInfo, cfg: UpConfig) -> None:
    """Every port of the stopped deployment ``info`` is free again, or one line naming the one that is not."""
    for flag, port in deployment_ports(cfg, int(cfg.autotune_port or 0), cfg.first_redis_port):
        exc = port_free(cfg.host, port)
        if exc is not None:
            raise ConfigurationError(
                f"the recorded deployment {info.deployment[:12]} is stopped (every process is gone) and its port "
                f"{port} on {cfg.host} ({flag}) is taken ({exc.strerror}); stop what uses it and run `up` again to "
                "bring the deployment back with its data and secrets, or `up --fresh` to start over elsewhere.")


def _with_recorded_ports(info: ServicesInfo, cfg: UpConfig) -> UpConfig:
    """``cfg`` with the ports it leaves open taken from the record (an `up` with no ports repeats itself)."""
    if cfg.ports_chosen:
        return cfg
    autotune = parse_address(info.autotune, "'autotune'")[1] if info.autotune else DEFAULT_AUTOTUNE_PORT
    redis_port = int(info.redis_hosts[0]["port"]) if info.redis_hosts else DEFAULT_REDIS_PORT
    lighthouse = parse_address(info.lighthouse, "'lighthouse'")[1] if info.lighthouse else None
    return cfg.with_ports(cfg.autotune_port or autotune, cfg.redis_port or redis_port, cfg.lighthouse_port or lighthouse)


def _start_fresh(cfg: UpConfig, report: Report) -> ServicesInfo:
    with claimed(cfg) as cfg:
        folder = state_dir()
        try:
            return _start(cfg, folder, report)
        except OSError as exc:
            if exc.errno not in _DISK_ERRORS:
                raise
            raise ConfigurationError(
                f"cannot write {exc.filename or folder} ({exc.strerror}); free space there (or point "
                "XDG_STATE_HOME elsewhere) and run `up` again. Nothing was left running or behind.") from None


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EMLINK, errno.EACCES,
                errno.EPERM}


def _start(cfg: UpConfig, folder: Path, report: Report) -> ServicesInfo:
    from . import redis_cluster

    deployment = procs.new_deployment_id()
    cluster = None
    proc: subprocess.Popen[bytes] | None = None
    coordinator: subprocess.Popen[bytes] | None = None
    secret_files: dict[str, str] = {}
    try:
        procs.private_dir(folder)
        procs.write_marker(folder, deployment, services_file=str(services_file_path().resolve()))
        secret_files = _make_secrets(folder, secret_files) if cfg.auth else {}
        secrets = {name: procs.read_secret(path) for name, path in secret_files.items()}
        deadline = time.monotonic() + cfg.timeout_s
        tls_dir = folder / SECRETS_DIR / REDIS_TLS_DIR
        spec = redis_cluster.ClusterSpec(
            nodes=1 if cfg.single else cfg.nodes, replicas=cfg.replicas_per_master, port=cfg.first_redis_port,
            host=cfg.host, announce_ip=cfg.announce_ip, maxmemory=cfg.maxmemory,
            password=secrets.get("redis_password", ""), cluster=not cfg.single, bus_tls=cfg.bus_tls,
            client_tls=cfg.bus_tls, read_port_offset=cfg.read_port_offset,
            service_hosts=[cfg.client_host] if cfg.bus_tls else None,
            tls_dir=tls_dir, state_root=folder, timeout_s=cfg.timeout_s, deployment=deployment, persist=True,
        )
        cluster = redis_cluster.start_cluster(spec)
        tls = client_tls(tls_dir) if cfg.bus_tls else None
        proc = start_autotune(cfg, redis_state_url(cfg.client_host, cfg.first_redis_port), folder, deployment,
                              secret_files, tls_dir if tls is not None else None)
        autotune = procs.record(proc.pid, deployment)
        processes = {"autotune": [autotune], "redis": cluster.processes}
        if cfg.lighthouse:
            coordinator = start_lighthouse(cfg, folder, deployment)
            processes["lighthouse"] = [procs.record(coordinator.pid, deployment)]
        wait_healthy(lambda: check_autotune(cfg.autotune_address, token=secrets.get("autotune_token"),
                                            tls_ca=Path(tls.ca) if tls else None),
                     deadline, f"the autotune service on {cfg.autotune_address}", proc, folder / AUTOTUNE_LOG)
        if coordinator is not None:
            wait_healthy(lambda: check_lighthouse(cfg.lighthouse_address), deadline,
                         f"the lighthouse on {cfg.lighthouse_address}", coordinator, folder / LIGHTHOUSE_LOG)
        info = ServicesInfo(
            autotune=cfg.autotune_address, lighthouse=cfg.lighthouse_address if cfg.lighthouse else None,
            redis_hosts=cluster.hosts, redis_cluster=cluster.cluster,
            redis_node_ids=cluster.node_ids, state_dir=str(folder), deployment=deployment, secrets=secret_files,
            processes=processes, tls=tls,
            redis_read_port_offset=cluster.read_port_offset,
        )
        write_services_file(info)
    except BaseException:
        for child in (proc, coordinator):
            if child is not None:
                procs.stop_child(child)
        if cluster is not None:
            redis_cluster.stop_deployment(cluster, timeout_s=5.0)
        _remove_files(folder, secret_files, deployment)
        raise
    offset = cluster.read_port_offset
    for node in cluster.nodes:
        read = f", read port {node.port + offset}" if offset is not None else ""
        report(f"redis node {node.host}:{node.port}: started (pid {node.pid}, {node.role}{read})")
    report(f"autotune service {info.autotune}: started (pid {autotune.pid})")
    if coordinator is not None:
        report(f"lighthouse {info.lighthouse}: started (pid {coordinator.pid})")
    return info


def _make_secrets(folder: Path, made: dict[str, str]) -> dict[str, str]:
    """The secret files of a new deployment: the environment's value when set, else a random one.

    ``made`` is filled as they are written, so a failure half-way leaves the caller the list to remove.
    """
    for name, (filename, env) in SECRETS.items():
        path = folder / SECRETS_DIR / filename
        made[name] = str(path)
        value = os.environ.get(env)
        if value:
            procs.write_private(path, value)
        else:
            procs.new_secret_file(path)
    return made


def _remove_files(root: Path, secrets: dict[str, str], deployment: str | None) -> list[Path]:
    """Delete what ``up`` made in ``root`` besides the Redis folders: the secret files, the certificates
    and the marker (when it is ``deployment``'s, or any with None); return the secret files removed."""
    removed = []
    for secret in secrets.values():
        path = Path(secret)
        if path.parent == root / SECRETS_DIR and path.exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    remove_tls_dir(root / SECRETS_DIR / REDIS_TLS_DIR)
    with contextlib.suppress(OSError):
        (root / SECRETS_DIR).rmdir()  # only when empty
    marker = procs.read_marker(root)
    if deployment is None or (marker is not None and marker.get("deployment") == deployment):
        (root / procs.MARKER_FILE).unlink(missing_ok=True)
    return removed


def ensure_up(cfg: UpConfig | None = None, report: Report | None = None) -> ServicesInfo:
    """The recorded services when they are healthy, whatever their settings; else :func:`up` with ``cfg``.

    For callers that only need services to exist (the demo), not particular ports.
    """
    check_own_folder(state_dir())
    with exclusive():
        existing = read_services_file()
        health = running_services(existing)
        if existing is not None and health and all(h.healthy for h in health.values()):
            return existing
        return _up(cfg or UpConfig(), False, report or log.info)


def _differences(info: ServicesInfo, cfg: UpConfig) -> list[str]:
    found = []
    if info.autotune != cfg.autotune_address:
        found.append(f"autotune on {info.autotune}, asked {cfg.autotune_address}")
    first = info.redis_hosts[0] if info.redis_hosts else {}
    if (first.get("host"), first.get("port")) != (cfg.client_host, cfg.redis_port):
        found.append(f"Redis from {first.get('host')}:{first.get('port')}, asked {cfg.client_host}:{cfg.redis_port}")
    if info.redis_cluster == cfg.single:
        found.append("a cluster, asked --single" if info.redis_cluster else "--single, asked a cluster")
    if info.lighthouse and not cfg.lighthouse:
        found.append(f"a lighthouse on {info.lighthouse}, asked --no-lighthouse")
    elif info.lighthouse and info.lighthouse != cfg.lighthouse_address:
        found.append(f"the lighthouse on {info.lighthouse}, asked {cfg.lighthouse_address}")
    nodes = len(info.processes.get("redis") or [])
    if nodes and nodes != cfg.redis_node_count:
        found.append(f"{nodes} Redis nodes, asked {cfg.redis_node_count}")
    return found


# ------------------------------------------------------------------------------------------ down


@dataclass
class DownReport:
    """What :func:`stop_all` did: the pids it stopped and one line per record it removed."""

    stopped: list[int] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def down(timeout_s: float = 10.0, local: bool = True) -> list[int]:
    """Stop what the services file records (and, with ``local``, the node-local cache server); remove the
    file; return the pids stopped. :func:`stop_all` also says which records it removed.

    Raises:
        ServicesFileError: the services file is malformed (nothing is stopped or removed).
        ConfigurationError: the file's state folder is a copy or another deployment's (idem).
    """
    return stop_all(timeout_s, local).stopped


def stop_all(timeout_s: float = 10.0, local: bool = True) -> DownReport:
    """:func:`down`, reporting every record removed (a stale one of another run too)."""
    out = DownReport()
    with exclusive():
        _down(timeout_s, out)
        _stop_orphans(timeout_s, out)
    if local:
        from ..core.local_redis import local_dir, read_server, stop_server

        server = read_server()
        if server is not None:
            stale = not procs.is_running(server.process)
            stopped = stop_server(timeout_s=timeout_s)
            out.stopped += stopped
            out.removed.append(f"removed the node-local cache server's record {local_dir()}" + (
                f" (stale: its process {server.pid} was already gone)" if stale
                else f" (stopped pid {', '.join(map(str, stopped))})" if stopped else ""))
    out.stopped = sorted(set(out.stopped))
    return out


def _stop_orphans(timeout_s: float, out: DownReport) -> None:
    """Stop what a deployment of this state folder started before the folder was deleted (with the services
    file in it, no record is left): found by the deployment id they carry and their deleted working folder."""
    folder = state_dir()
    found = procs.orphans(folder)
    if not found:
        return
    stopped = procs.stop_many(found, timeout_s)
    out.stopped += stopped
    ids = sorted({r.deployment[:12] for r in found})
    out.removed.append(f"stopped pid {', '.join(map(str, stopped))} of deployment {', '.join(ids)}, whose state "
                       f"folder {folder} was deleted (found by the deployment id they carry and their deleted "
                       "working folder)")


def _down(timeout_s: float = 10.0, out: DownReport | None = None) -> list[int]:
    from . import redis_cluster

    out = out if out is not None else DownReport()
    path = services_file_path()
    info = read_services_file()
    if info is None:
        return []
    root = Path(info.state_dir) if info.state_dir else None
    records = [r for rs in info.processes.values() for r in rs]
    # Only a state folder whose marker names this deployment and this very services file proves that the
    # recorded processes are ours to stop. Without that proof (a copied or edited file, a state_dir that
    # points elsewhere or nowhere), nothing is signalled; a file whose processes are all gone is just removed.
    if not owned(info) or root is None:
        if any(procs.is_running(r) for r in records):
            raise ConfigurationError(
                f"services file {path} records deployment {info.deployment} in {root or 'no state folder'}, "
                "but that folder is not its own (a copy, another deployment's, or missing); nothing was "
                f"stopped. If its services are gone, delete {path}."
            )
        remove_services_file(path)
        out.removed.append(f"removed {path}: a stale record of deployment {info.deployment[:12]} (its processes "
                           "were already gone; nothing stopped)")
        return []
    clusters = []
    if info.redis_hosts:
        port = int(info.redis_hosts[0]["port"])
        clusters = [c for c in redis_cluster.read_deployments(root, port) if c.deployment == info.deployment]
    # Every process at once: SIGTERM all, then wait for all (a node waits for no other to stop first).
    stopped = procs.stop_many(records + [n.process for c in clusters for n in c.nodes], timeout_s)
    for cluster in clusters:
        redis_cluster.stop_deployment(cluster, timeout_s=timeout_s)
        out.removed.append(f"removed the Redis deployment's folder {cluster.state_dir}")
    remove_services_file(path)
    gone = len(set(r.pid for r in records) - set(stopped))
    out.removed.append(f"removed {path} (deployment {info.deployment[:12]}"
                       + (f"; {gone} of its processes were already gone)" if gone else ")"))
    secrets = _remove_files(root, info.secrets, info.deployment)
    if secrets:
        out.removed.append(f"removed {len(secrets)} secret file(s) and the certificates in {root / SECRETS_DIR}")
    out.stopped += stopped
    return sorted(set(stopped))

"""``bagua-lightning rotate-secrets``: new secrets for a running deployment, online where Redis allows it.

Never part of ``up`` (which keeps the secrets of everything alive); always an explicit command.

- **Redis password**, online, in two steps. Start: every node gets the new password *beside* the old one
  (``ACL SETUSER default >new``) and authenticates to its master with the new one (``CONFIG SET
  masterauth``), the password file is replaced atomically (new jobs read the new one), the old one is kept
  in ``redis-password.previous`` (0600) and the autotune service is restarted with the new one (it keeps
  its plans in Redis). Both passwords work until the finish: ``rotate-secrets --finish`` (or ``--grace
  SECONDS`` in the same call) removes the old one from every node (``ACL SETUSER default <old``); jobs
  started before the rotation then fail their next reconnect, so finish once they have ended. A node that
  ``up`` restarts during the grace period accepts both too.
- **Autotune token**: the service holds one token, so it is restarted with the new one (seconds; plans
  are in Redis); jobs started before then must be restarted too.
- **Cache key**, online, in two steps, with key ids (:mod:`bagua_lightning.client.cache.keyring`): every
  sealed entry names the key that sealed it. Start: the old key is kept in ``cache-key.previous`` (0600) and
  a new one replaces ``cache-key``. During the grace period both keys open entries and new entries are sealed
  with the new one: a job started before learns the new key from the files when it meets an entry of it, a
  job started after reads both, so both keep hitting. ``rotate-secrets --cache-key --finish`` removes the old
  key's file; entries still sealed with it are misses from then on and are written again with the new one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psutil

from ..core import procs
from ..core.addresses import check_host, parse_address
from ..core.errors import ConfigurationError
from ..core.redis_server import client_for
from ..core.services_file import PREVIOUS_SUFFIX, ServicesInfo, read_services_file, write_services_file
from .deploy_config import AUTOTUNE_LOG, SECRETS, UpConfig
from .deploy_state import exclusive, owned, previous_password_file, running_services, start_autotune
from .health import check_autotune, wait_healthy
from .redis_records import PASSWORD_FILE, NodeInfo, read_deployments

Report = Callable[[str], None]


def _healthy_own() -> ServicesInfo:
    info = read_services_file()
    if info is None:
        raise ConfigurationError("no services are recorded; `bagua-lightning up` starts them.")
    if not owned(info):
        raise ConfigurationError(f"the recorded services (state folder {info.state_dir}) are not this services "
                                 "file's own; nothing was rotated.")
    bad = {k: h.detail for k, h in running_services(info).items() if not h.healthy}
    if bad:
        raise ConfigurationError(f"the services are not all healthy ({'; '.join(f'{k}: {d}' for k, d in bad.items())}); "
                                 "run `bagua-lightning up` first, then rotate.")
    return info


def _nodes(info: ServicesInfo) -> tuple[list[NodeInfo], Path | None]:
    port = int(info.redis_hosts[0]["port"])
    found = [c for c in read_deployments(Path(str(info.state_dir)), port) if c.deployment == info.deployment]
    if not found:
        raise ConfigurationError(f"the Redis deployment's record under {info.state_dir}/redis is missing.")
    cluster = found[0]
    return cluster.nodes, cluster.state_dir / PASSWORD_FILE if cluster.password_file else None


def rotate(*, redis_password: bool = False, autotune_token: bool = False, cache_key: bool = False,
           grace_s: float | None = None, report: Report = print) -> None:
    """Rotate the named secrets of the recorded deployment (see the module doc); ``grace_s``: then wait that
    long and :func:`finish` the Redis password rotation in the same call."""
    if not (redis_password or autotune_token or cache_key):
        raise ConfigurationError("name what to rotate: --redis-password, --autotune-token and/or --cache-key "
                                 "(or --finish to end a password rotation).")
    with exclusive():
        info = _healthy_own()
        if redis_password:
            _start_password_rotation(info, report)
        if autotune_token:
            procs.new_secret_file(Path(info.secrets["autotune_token"]))
            report(f"autotune token: new one in {info.secrets['autotune_token']}")
        if cache_key:
            _start_cache_key_rotation(info, report)
        if redis_password or autotune_token:
            _restart_autotune(info, report)
    if redis_password and grace_s is not None:
        report(f"redis password: both passwords work for {grace_s:.0f} s (--grace), then the old one is removed")
        time.sleep(grace_s)
        finish(report)
    elif redis_password:
        report("redis password: both passwords work until `bagua-lightning rotate-secrets --finish`")


def _start_password_rotation(info: ServicesInfo, report: Report) -> None:
    if "redis_password" not in info.secrets:
        raise ConfigurationError("the deployment has no Redis password (--no-auth); nothing to rotate.")
    path = Path(info.secrets["redis_password"])
    previous = previous_password_file(info)
    assert previous is not None
    if previous.exists():
        raise ConfigurationError(f"a password rotation is still open ({previous} exists); end it with "
                                 "`bagua-lightning rotate-secrets --finish` first.")
    old = procs.read_secret(path)
    new = _token()
    nodes, cluster_copy = _nodes(info)
    procs.write_private(previous, old)  # first: a failure below leaves a rotation that --finish can end
    for node in nodes:
        with client_for(node.host, node.port, old, tls=info.tls) as c:
            c.execute_command("ACL", "SETUSER", "default", f">{new}")
            c.execute_command("CONFIG", "SET", "masterauth", new)
    procs.write_private(path, new)
    if cluster_copy is not None:
        procs.write_private(cluster_copy, new)
    report(f"redis password: the new one is in {path} and works on all {len(nodes)} nodes; the old one too, "
           "for now")


def _cache_key_files(info: ServicesInfo) -> tuple[Path, Path]:
    if "cache_key" not in info.secrets:
        raise ConfigurationError("the deployment has no cache key (--no-auth); nothing to rotate.")
    path = Path(info.secrets["cache_key"])
    return path, Path(str(path) + PREVIOUS_SUFFIX)


def _start_cache_key_rotation(info: ServicesInfo, report: Report) -> None:
    path, previous = _cache_key_files(info)
    if previous.exists():
        raise ConfigurationError(f"a cache key rotation is still open ({previous} exists); end it with "
                                 "`bagua-lightning rotate-secrets --cache-key --finish` first.")
    procs.write_private(previous, procs.read_secret(path))  # first: the old key stays valid whatever follows
    procs.new_secret_file(path)
    report(f"cache key: the new one is in {path} and seals new entries; the old one ({previous}) still opens "
           "entries until `bagua-lightning rotate-secrets --cache-key --finish`")


def finish_cache_key(report: Report = print) -> None:
    """End a cache key rotation: delete the old key's file (entries sealed with it are misses from then on)."""
    with exclusive():
        info = read_services_file()
        if info is None:
            raise ConfigurationError("no services are recorded; nothing to finish.")
        _, previous = _cache_key_files(info)
        if not previous.is_file():
            raise ConfigurationError("no cache key rotation is open; nothing to finish.")
        previous.unlink()
        report(f"cache key: the old one is retired ({previous} removed); entries still sealed with it are misses "
               "and are written again with the new one")


def _token() -> str:
    import secrets

    return secrets.token_urlsafe(32)


def finish(report: Report = print) -> None:
    """End a Redis password rotation: remove the old password from every node and its file."""
    with exclusive():
        info = read_services_file()
        previous = previous_password_file(info) if info is not None else None
        if info is None or previous is None or not previous.is_file():
            raise ConfigurationError("no password rotation is open; nothing to finish.")
        old = procs.read_secret(previous)
        new = procs.read_secret(info.secrets["redis_password"])
        nodes, _ = _nodes(info)
        for node in nodes:
            with client_for(node.host, node.port, new, tls=info.tls) as c:
                if old != new:
                    c.execute_command("ACL", "SETUSER", "default", f"<{old}")
        previous.unlink()
        report(f"redis password: the old one is removed from all {len(nodes)} nodes")


def _restart_autotune(info: ServicesInfo, report: Report) -> None:
    """Restart the recorded autotune service (same bind address and port) with the secret files' values."""
    recs = info.processes.get("autotune") or []
    if not recs or not info.autotune or not info.state_dir:
        return
    rec = recs[0]
    argv = psutil.Process(rec.pid).cmdline()  # ours: _healthy_own checked the record
    host = check_host(argv[argv.index("--host") + 1], "the autotune service's --host")
    port = int(argv[argv.index("--port") + 1])
    state = argv[argv.index("--state") + 1]
    secrets = {name: procs.read_secret(path) for name, path in info.secrets.items() if name in SECRETS}
    procs.stop(rec, timeout_s=10.0)
    root = Path(info.state_dir)
    cfg = UpConfig(host=host, autotune_port=port, announce_ip=None if host not in ("0.0.0.0", "::")
                   else parse_address(str(info.autotune), "'autotune'")[0])
    tls_dir = Path(info.tls.ca).parent if info.tls else None
    proc = start_autotune(cfg, state, root, info.deployment, info.secrets, tls_dir)
    try:
        wait_healthy(lambda: check_autotune(str(info.autotune), token=secrets.get("autotune_token"),
                                            tls_ca=Path(info.tls.ca) if info.tls else None),
                     time.monotonic() + 60.0, f"the autotune service on {info.autotune}", proc, root / AUTOTUNE_LOG)
    except BaseException:
        procs.stop_child(proc)
        raise
    info.processes["autotune"] = [procs.record(proc.pid, info.deployment)]
    write_services_file(info)
    report(f"autotune service {info.autotune}: restarted with the new secrets (pid {proc.pid})")

"""What ``up``, its recovery and ``rotate-secrets`` share: starting the autotune service, the health of the
recorded services, their secrets, the lock that serialises them and the proof that a record is ours."""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ..core import procs
from ..core.errors import ConfigurationError
from ..core.file_trust import check_trusted
from ..core.services_file import (
    ENV_REDIS_PASSWORD,
    FILE_SUFFIX,
    PREVIOUS_SUFFIX,
    ServicesInfo,
    read_services_file,
    services_file_path,
)
from ..core.tls_trust import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, TLS_ENV
from .deploy_config import (
    AUTOTUNE_LOG,
    AUTOTUNE_PLANS,
    AUTOTUNE_SAMPLES,
    LIGHTHOUSE_LOG,
    UpConfig,
    autotune_service_args,
    lighthouse_args,
)
from .health import Health, check_autotune, check_lighthouse, check_redis
from .redis_tls import client_tls, service_certificate


def start_autotune(cfg: UpConfig, state: str, folder: Path, deployment: str,
                   secret_files: dict[str, str], tls_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """Start the autotune service detached (own session, stdin closed), logging to ``folder/autotune.log``.

    Its token and the Redis password reach it as the paths of their 0600 files (``--token-file``,
    ``$BAGUA_LIGHTNING_REDIS_PASSWORD_FILE``), never as values in its environment or on its command line,
    where ``/proc/PID/environ`` and ``ps`` would show them.
    With the certificates of ``tls_dir`` it listens with TLS only and reaches Redis over TLS (their paths in
    ``$BAGUA_LIGHTNING_TLS_*``). Plans are kept in ``state`` and mirrored in ``folder/autotune-plans``, so
    they survive the restart of any one Redis node or of the service.
    """
    folder.mkdir(parents=True, exist_ok=True)
    served = service_certificate(tls_dir) if tls_dir is not None else None
    argv = [sys.executable, "-m", "bagua_lightning.cli",
            *autotune_service_args(host=cfg.host, port=int(cfg.autotune_port or 0), state=state,
                                   log_dir=str(folder / AUTOTUNE_SAMPLES), mirror=str(folder / AUTOTUNE_PLANS),
                                   tls_cert=str(served[0]) if served else None,
                                   tls_key=str(served[1]) if served else None,
                                   token_file=secret_files.get("autotune_token"))]
    env = procs.child_env(deployment)
    for name in TLS_ENV:
        env.pop(name, None)
    tls = client_tls(tls_dir) if tls_dir is not None else None
    if tls is not None:
        env.update({ENV_TLS_CA: tls.ca, ENV_TLS_CERT: tls.cert or "", ENV_TLS_KEY: tls.key or ""})
    if "redis_password" in secret_files:
        env[ENV_REDIS_PASSWORD + FILE_SUFFIX] = secret_files["redis_password"]
    with open(folder / AUTOTUNE_LOG, "ab") as log_file:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, cwd=folder, start_new_session=True, close_fds=True)


def start_lighthouse(cfg: UpConfig, folder: Path, deployment: str) -> subprocess.Popen[bytes]:
    """Start the fault-tolerance coordinator (``bagua-lightning lighthouse``) detached on ``cfg.host`` and
    ``cfg.lighthouse_port``, logging to ``folder/lighthouse.log``. It needs no secret (it has none to check)."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "bagua_lightning.cli",
            *lighthouse_args(host=cfg.host, port=int(cfg.lighthouse_port or 0))]
    with open(folder / LIGHTHOUSE_LOG, "ab") as log_file:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=procs.child_env(deployment), cwd=folder, start_new_session=True, close_fds=True)


def running_services(info: ServicesInfo | None, password: str | None = None,
                     token: str | None = None) -> dict[str, Health]:
    """Health of each service recorded in ``info`` (``autotune``, ``lighthouse``, ``redis``); empty when none.

    A service whose recorded process is no longer ours (gone, or its pid reused) is unhealthy, even when
    something else answers on its port. ``password``/``token``: default the recorded secret files.
    """
    if info is None:
        return {}
    password = password if password is not None else recorded_secret(info, "redis_password")
    token = token if token is not None else recorded_secret(info, "autotune_token")
    out: dict[str, Health] = {}
    if info.autotune:
        gone = [r.pid for r in info.processes.get("autotune") or [] if not procs.is_running(r)]
        out["autotune"] = (Health(False, f"process {gone[0]} is gone") if gone
                           else check_autotune(info.autotune, token=token,
                                               tls_ca=Path(info.tls.ca) if info.tls else None))
    if info.lighthouse:
        gone = [r.pid for r in info.processes.get("lighthouse") or [] if not procs.is_running(r)]
        out["lighthouse"] = Health(False, f"process {gone[0]} is gone") if gone else check_lighthouse(info.lighthouse)
    if info.redis_hosts:
        gone = [r.pid for r in info.processes.get("redis") or [] if not procs.is_running(r)]
        out["redis"] = (Health(False, f"processes {gone} are gone") if gone
                        else check_redis(info.redis_hosts, info.redis_cluster, password,
                                         node_ids=info.redis_node_ids or None, tls=info.tls))
    return out


def recorded_secret(info: ServicesInfo, name: str) -> str | None:
    """The secret ``name`` from the file ``info`` records; None when none is recorded or it is unreadable."""
    path = info.secrets.get(name)
    if not path:
        return None
    try:
        return procs.read_secret(path)
    except ConfigurationError:
        return None  # reported as unhealthy by the check that needs it


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    # Two `up`s at once (two shells, the ranks of a job) would race for the same ports: one at a time.
    path = services_file_path().with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    check_trusted(path, "lock file")  # and the folders above it: another user's lock could hold `up` forever
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def owned(info: ServicesInfo) -> bool:
    """True when the file's state folder proves the recorded processes are ours: its marker names this
    deployment and this very services file, and every record carries the deployment's id."""
    root = Path(info.state_dir) if info.state_dir else None
    marker = procs.read_marker(root) if root is not None else None
    records = [r for rs in info.processes.values() for r in rs]
    return (root is not None and marker is not None and marker.get("deployment") == info.deployment
            and marker.get("services_file") == str(services_file_path().resolve())
            and all(r.deployment == info.deployment for r in records))




def previous_password_file(info: ServicesInfo) -> Path | None:
    """Where the old Redis password waits while a rotation is open (see :mod:`.rotate`)."""
    path = info.secrets.get("redis_password")
    return Path(path + PREVIOUS_SUFFIX) if path else None


def previous_redis_password(password: str | None) -> str | None:
    """The old Redis password while a rotation's grace period runs (None otherwise)."""
    info = read_services_file()
    previous = previous_password_file(info) if info is not None else None
    if previous is None or not previous.is_file():
        return None
    old = procs.read_secret(previous)
    return old if old != password else None

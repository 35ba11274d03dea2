"""The services file: where ``bagua-lightning up`` records the addresses of the services it started.

Trainers read it to find the autotune service and the Redis cache without
configuration. Lookup order for every consumer:

1. explicit arguments (``BaguaStrategy(autotune_service=...)``, ``RedisStore(hosts=...)``);
2. environment variables ``BAGUA_LIGHTNING_AUTOTUNE_SERVICE`` (``host:port``) and
   ``BAGUA_LIGHTNING_REDIS_HOSTS`` (``host:port,host:port``);
3. this file, at ``$BAGUA_LIGHTNING_SERVICES_FILE`` or
   ``$XDG_STATE_HOME/bagua-lightning/services.json`` (``~/.local/state/...`` by default);
4. the defaults: autotune ``127.0.0.1:29600``; Redis: spawn a local server.

The file is JSON (mode 0600)::

    {"version": 2,
     "deployment": "3f9c...",                      # id of the `up` that wrote it
     "autotune": "127.0.0.1:29600",
     "lighthouse": "127.0.0.1:29510",             # the fault-tolerance coordinator (torchft's Lighthouse)
     "redis": {"hosts": [{"host": "127.0.0.1", "port": 7000}, ...], "cluster": true,
               "node_ids": ["e4c1...", ...],             # the cluster's own nodes, recorded at creation
               "read_port_offset": 20000},               # each node's plaintext read port: port + this
     "state_dir": "/home/me/.local/state/bagua-lightning",
     "secrets": {"redis_password": "<state_dir>/secrets/redis-password",
                 "autotune_token": "<state_dir>/secrets/autotune-token",
                 "cache_key": "<state_dir>/secrets/cache-key"},
     "tls": {"ca": "<state_dir>/secrets/redis-tls/ca.crt",        # the deployment's CA, pinned by clients
             "cert": "<state_dir>/secrets/redis-tls/client.crt",  # the trainers' client certificate
             "key": "<state_dir>/secrets/redis-tls/client.key"},
     "processes": {"autotune": [{"pid": 1234, "create_time": 1795000000.12, "deployment": "3f9c..."}],
                   "redis": [...]}}

Secrets are never written here, only the paths of the owner-only (0600) files that hold them. Each secret
is resolved as: its environment variable (``BAGUA_LIGHTNING_REDIS_PASSWORD``,
``BAGUA_LIGHTNING_AUTOTUNE_TOKEN``, ``BAGUA_LIGHTNING_CACHE_KEY``), else the file the services file names,
but only for an address the same services file records: the recorded password goes only to the recorded
Redis nodes and the recorded token only to the recorded autotune service, whoever names the address (an
argument, ``BAGUA_LIGHTNING_REDIS_HOSTS``, ``status --redis``). Another address gets a secret only when
the user passes that secret explicitly (argument or environment variable). The recorded CA (``tls``) is pinned the same way:
a client speaks TLS to the recorded addresses and sends a secret only after the server proved, with a
certificate of that CA, that it is the deployment's (:mod:`bagua_lightning.core.tls_trust`, which also
names the ``BAGUA_LIGHTNING_TLS_*`` overrides).

Every address is validated where it enters (here for the environment and the file): a parseable host and
a port in 1..65535. A services file that exists but cannot be parsed is an error naming the file, never a
silent fall-back to the default addresses. Nor is a file that another user could have forged read: the
services file, the secret files, the CA and the client key it names, and the folders above them, must be this
user's or root's and not writable by others (secrets: not readable either), or every reader refuses in one
line naming the file (:mod:`bagua_lightning.core.file_trust`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .addresses import format_address, parse_address, parse_host_list, parse_server
from .errors import ConfigurationError
from .file_trust import check_trusted, read_trusted
from .procs import ProcessRecord, read_secret
from .read_plane import READ_PORT_OFFSET_ENV
from .tls_trust import ClientTLS, resolve_client_tls

DEFAULT_AUTOTUNE_ADDRESS = "127.0.0.1:29600"
DEFAULT_LIGHTHOUSE_ADDRESS = "127.0.0.1:29510"  # `bagua-lightning lighthouse` and `up` when the port is free
FILE_VERSION = 2

ENV_FILE = "BAGUA_LIGHTNING_SERVICES_FILE"
ENV_AUTOTUNE = "BAGUA_LIGHTNING_AUTOTUNE_SERVICE"
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # torchft's variable: http://HOST:PORT of the Lighthouse
ENV_REDIS_HOSTS = "BAGUA_LIGHTNING_REDIS_HOSTS"
ENV_REDIS_PASSWORD = "BAGUA_LIGHTNING_REDIS_PASSWORD"
ENV_AUTOTUNE_TOKEN = "BAGUA_LIGHTNING_AUTOTUNE_TOKEN"
ENV_CACHE_KEY = "BAGUA_LIGHTNING_CACHE_KEY"
SECRET_NAMES = ("redis_password", "autotune_token", "cache_key")
FILE_SUFFIX = "_FILE"  # $BAGUA_LIGHTNING_REDIS_PASSWORD_FILE & co.: the secret's file instead of its value
PREVIOUS_SUFFIX = ".previous"  # beside a secret's file while its rotation's grace period runs (the old value)


class ServicesFileError(ConfigurationError):
    """The services file exists but cannot be used; the message names the file and the fix."""


def state_dir() -> Path:
    """Folder for the services' state (data directories, logs, persisted plans, secrets)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "bagua-lightning"


def services_file_path() -> Path:
    return Path(os.environ.get(ENV_FILE) or state_dir() / "services.json")


# ------------------------------------------------------------------------------------------- addresses


def _host_entries(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ValueError(f"{where} is not a list")
    out = []
    for item in value:
        if not isinstance(item, dict):
            raise ValueError(f"{where} item {item!r} is not {{host, port}}")
        out.append(dict(zip(("host", "port"), parse_server(item, f"{where} item"), strict=True)))
    return out


def _offset(value: Any, where: str) -> int | None:
    """A read port offset: None, or a non-zero int with ``abs(value) <= 65535``; ValueError naming ``value``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < abs(value) <= 65535:
        raise ValueError(f"{where} {value!r} is not a read port offset (a non-zero whole number of at most "
                         "65535 either way)")
    return value


# ------------------------------------------------------------------------------------------- the file


@dataclass(kw_only=True)
class ServicesInfo:
    """What the services file holds.

    Attributes:
        autotune: ``host:port`` of the autotune gRPC service, or None.
        lighthouse: ``host:port`` of the fault-tolerance coordinator (torchft's Lighthouse), or None.
        redis_hosts: Redis nodes as ``{"host", "port"}`` dicts; empty when none runs.
        redis_cluster: True when ``redis_hosts`` form a Redis Cluster.
        redis_node_ids: the cluster's node ids, recorded when it was created (``status`` names any other
            node in ``CLUSTER NODES`` as foreign); empty: not checked.
        state_dir: where the services keep their state.
        deployment: id of the deployment that wrote the file (its processes carry it).
        processes: what ``bagua-lightning up`` started, by service, for ``down``.
        secrets: paths of the 0600 files holding ``redis_password``, ``autotune_token``, ``cache_key``.
        tls: the deployment's CA and the trainers' client certificate and key (paths), or None: plaintext.
        redis_read_port_offset: every Redis node's plaintext read port is its port + this offset (the
            password-less reader of :mod:`~bagua_lightning.core.read_plane`); None: no read ports.
    """

    autotune: str | None = None
    lighthouse: str | None = None
    redis_hosts: list[dict[str, Any]] = field(default_factory=list)
    redis_cluster: bool = False
    redis_node_ids: list[str] = field(default_factory=list)
    state_dir: str | None = None
    deployment: str = ""
    processes: dict[str, list[ProcessRecord]] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    tls: ClientTLS | None = None
    redis_read_port_offset: int | None = None

    @property
    def pids(self) -> dict[str, Any]:
        """``{"autotune": pid, "lighthouse": pid, "redis": [pid, ...]}`` of the recorded processes."""
        auto = self.processes.get("autotune") or []
        lighthouse = self.processes.get("lighthouse") or []
        return {"autotune": auto[0].pid if auto else None, "lighthouse": lighthouse[0].pid if lighthouse else None,
                "redis": [r.pid for r in self.processes.get("redis") or []]}

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FILE_VERSION,
            "deployment": self.deployment,
            "autotune": self.autotune,
            **({"lighthouse": self.lighthouse} if self.lighthouse is not None else {}),
            "redis": {"hosts": self.redis_hosts, "cluster": self.redis_cluster, "node_ids": self.redis_node_ids,
                      **({"read_port_offset": self.redis_read_port_offset}
                         if self.redis_read_port_offset is not None else {})},
            "state_dir": self.state_dir,
            "secrets": dict(self.secrets),
            "processes": {k: [r.to_json() for r in v] for k, v in self.processes.items()},
            **({"tls": self.tls.to_json()} if self.tls is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> ServicesInfo:
        """Parse and validate; ``ValueError`` naming the first bad field."""
        if not isinstance(data, dict):
            raise ValueError("it is not a JSON object")
        if data.get("version") != FILE_VERSION:
            raise ValueError(f"version {data.get('version')!r} is not {FILE_VERSION}")
        redis = data.get("redis") or {}
        if not isinstance(redis, dict):
            raise ValueError("'redis' is not an object")
        autotune = data.get("autotune")
        if autotune is not None:
            parse_address(autotune, "'autotune'")
        lighthouse = data.get("lighthouse")
        if lighthouse is not None:
            parse_address(lighthouse, "'lighthouse'")
        state = data.get("state_dir")
        if state is not None and not isinstance(state, str):
            raise ValueError(f"'state_dir' {state!r} is not a path")
        deployment = data.get("deployment")
        if not isinstance(deployment, str) or not deployment:
            raise ValueError(f"'deployment' {deployment!r} is not an id")
        node_ids = redis.get("node_ids") or []
        if not isinstance(node_ids, list) or not all(isinstance(i, str) and i for i in node_ids):
            raise ValueError(f"'redis.node_ids' {node_ids!r} is not a list of node ids")
        secrets, processes = data.get("secrets") or {}, data.get("processes") or {}
        if not isinstance(secrets, dict) or not all(isinstance(v, str) for v in secrets.values()):
            raise ValueError("'secrets' is not an object of file paths")
        if not isinstance(processes, dict) or not all(isinstance(v, list) for v in processes.values()):
            raise ValueError("'processes' is not an object of lists")
        return cls(
            autotune=autotune,
            lighthouse=lighthouse,
            redis_hosts=_host_entries(redis.get("hosts") or [], "'redis.hosts'"),
            redis_cluster=bool(redis.get("cluster", False)),
            redis_node_ids=list(node_ids),
            state_dir=state,
            deployment=deployment,
            processes={str(k): [ProcessRecord.from_json(r) for r in v] for k, v in processes.items()},
            secrets={str(k): v for k, v in secrets.items()},
            tls=ClientTLS.from_json(data.get("tls")),
            redis_read_port_offset=_offset(redis.get("read_port_offset"), "'redis.read_port_offset'"),
        )


def read_services_file(path: Path | None = None) -> ServicesInfo | None:
    """The recorded services, or None when no file exists.

    Raises:
        ServicesFileError: the file exists but is not a valid services file.
    """
    path = path or services_file_path()
    try:
        text = read_trusted(path, "services file")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ServicesFileError(f"services file {path} cannot be read ({exc.strerror}); fix its permissions "
                                f"or point {ENV_FILE} elsewhere.") from exc
    try:
        info = ServicesInfo.from_json(json.loads(text))
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        reason = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ServicesFileError(
            f"services file {path} is not valid ({reason}); if nothing it records still runs, delete it, "
            f"or point {ENV_FILE} elsewhere."
        ) from None
    if info.tls is not None:  # the pinned CA is only as good as the file it is read from
        check_trusted(info.tls.ca, "CA certificate")
        for name in (info.tls.cert, info.tls.key):
            if name:
                check_trusted(name, "TLS client file", secret=name == info.tls.key)
    return info


def write_services_file(info: ServicesInfo, path: Path | None = None) -> Path:
    """Write atomically (rename) with mode 0600, so readers never see a half-written file."""
    path = path or services_file_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".services.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(info.to_json(), f, indent=2)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def remove_services_file(path: Path | None = None) -> None:
    (path or services_file_path()).unlink(missing_ok=True)


# -------------------------------------------------------------------------------------------- resolving


def resolve_autotune_address(explicit: str | None = None) -> str:
    """Explicit argument, else env, else services file, else the default ``127.0.0.1:29600``; validated."""
    if explicit:
        return format_address(*parse_address(explicit, "autotune_service"))
    if os.environ.get(ENV_AUTOTUNE):
        return format_address(*parse_address(os.environ[ENV_AUTOTUNE], f"${ENV_AUTOTUNE}"))
    info = read_services_file()
    if info is not None and info.autotune:
        return info.autotune
    return DEFAULT_AUTOTUNE_ADDRESS


def recorded_lighthouse_url() -> str | None:
    """``http://host:port`` of the fault-tolerance coordinator the services file records (``up`` started it), for
    ``TORCHFT_LIGHTHOUSE``; None without one. No secret goes to it (torchft 0.2.0's Lighthouse has none)."""
    info = read_services_file()
    return f"http://{info.lighthouse}" if info is not None and info.lighthouse else None


def resolve_redis_hosts() -> tuple[list[dict[str, Any]], bool] | None:
    """Redis hosts and whether they form a cluster, from env or the services file; None: spawn locally."""
    env = os.environ.get(ENV_REDIS_HOSTS)
    if env:
        hosts = parse_host_list(env, f"${ENV_REDIS_HOSTS}")
        return hosts, len(hosts) > 1
    info = read_services_file()
    if info is not None and info.redis_hosts:
        return info.redis_hosts, info.redis_cluster
    return None


def _address_key(host: str, port: int) -> tuple[str, int]:
    """``(host, port)`` in one spelling: IP addresses compressed, names lower-cased."""
    bare = host
    try:
        bare = ipaddress.ip_address(bare).compressed
    except ValueError:
        bare = bare.lower()
    return bare, int(port)


def _addresses(hosts: Iterable[Any]) -> set[tuple[str, int]]:
    """``{(host, port)}`` of ``[{"host", "port"}, ...]``, ``[(host, port), ...]`` or ``["host:port", ...]``."""
    return {_address_key(*parse_server(item, "Redis host")) for item in hosts}


def env_secret(name: str) -> str | None:
    """The secret the user gives through the environment: ``$NAME``, else the content of the file
    ``$NAME_FILE`` names (the convention of Docker and Kubernetes secrets: a file, 0600 or a tmpfs mount,
    not the environment that ``/proc/PID/environ`` shows); None when neither is set.

    Raises:
        ConfigurationError: the file cannot be read, is empty, or others could read or write it.
    """
    value = os.environ.get(name)
    if value:
        return value
    path = os.environ.get(name + FILE_SUFFIX)
    return read_secret(path) if path else None


def _recorded_secret(name: str, info: ServicesInfo | None) -> str | None:
    path = info.secrets.get(name) if info is not None else None
    return read_secret(path) if path else None


def is_recorded_redis(hosts: Iterable[Any], info: ServicesInfo | None = None) -> bool:
    """True when every address of ``hosts`` is a Redis node that the services file records."""
    info = info if info is not None else read_services_file()
    wanted = _addresses(hosts)
    return info is not None and bool(wanted) and wanted <= _addresses(info.redis_hosts)


def is_recorded_autotune(address: str, info: ServicesInfo | None = None) -> bool:
    """True when ``address`` (``host:port``) is the autotune service that the services file records."""
    info = info if info is not None else read_services_file()
    if info is None or not info.autotune:
        return False
    return _address_key(*parse_address(address, "autotune address")) == _address_key(
        *parse_address(info.autotune, "'autotune'"))


# A secret the services file names goes only to an address the same file records: a server named by an
# argument, an environment variable or a command-line flag gets a secret only when the user passes that
# secret explicitly too (argument or environment variable). A listener on a port the user typed, a stale
# address, or a server that took over a recorded port after `down` never sees the deployment's secrets.


def resolve_redis_password(hosts: Iterable[Any]) -> str | None:
    """The password to send to the Redis nodes ``hosts``.

    ``$BAGUA_LIGHTNING_REDIS_PASSWORD`` when set (the user's explicit choice), else the password file the
    services file names when every node of ``hosts`` is one the same file records, else None.

    Args:
        hosts: the nodes the password would be sent to: ``{"host", "port"}`` dicts, ``(host, port)`` pairs or
            ``"host:port"`` strings.
    """
    explicit = env_secret(ENV_REDIS_PASSWORD)
    if explicit:
        return explicit
    info = read_services_file()
    return _recorded_secret("redis_password", info) if is_recorded_redis(hosts, info) else None


def resolve_autotune_token(address: str) -> str | None:
    """The bearer token to send to the autotune service at ``address`` (``host:port``).

    ``$BAGUA_LIGHTNING_AUTOTUNE_TOKEN`` when set, else the token file the services file names when
    ``address`` is the autotune service the same file records, else None.
    """
    explicit = env_secret(ENV_AUTOTUNE_TOKEN)
    if explicit:
        return explicit
    info = read_services_file()
    return _recorded_secret("autotune_token", info) if is_recorded_autotune(address, info) else None


def resolve_cache_key(hosts: Iterable[Any] | None = None) -> bytes | None:
    """The key that authenticates cache entries: ``$BAGUA_LIGHTNING_CACHE_KEY``, else the key file the services
    file names, else None (unkeyed digests).

    The key never leaves the process (entries carry a MAC, not the key). The recorded key belongs to the
    recorded Redis: with ``hosts`` (or ``$BAGUA_LIGHTNING_REDIS_HOSTS``) naming other servers it is not used.
    """
    key = env_secret(ENV_CACHE_KEY)
    if not key:
        info = read_services_file()
        if hosts is None and os.environ.get(ENV_REDIS_HOSTS):
            hosts = parse_host_list(os.environ[ENV_REDIS_HOSTS], f"${ENV_REDIS_HOSTS}")
        if hosts is None or is_recorded_redis(hosts, info):
            key = _recorded_secret("cache_key", info)
    return key.encode() if key else None


def resolve_cache_keys(hosts: Iterable[Any] | None = None) -> list[bytes]:
    """The cache keys entries may be sealed with, the current one first: :func:`resolve_cache_key`, then, while a
    rotation's grace period runs (``rotate-secrets --cache-key`` until ``--finish``), the previous key of the
    deployment (the file beside its key file, ``.previous``); empty without a key. Read afresh at each call."""
    current = resolve_cache_key(hosts)
    if current is None:
        return []
    keys = [current]
    if not env_secret(ENV_CACHE_KEY):
        info = read_services_file()
        path = info.secrets.get("cache_key") if info is not None else None
        previous = Path(path + PREVIOUS_SUFFIX) if path else None
        if previous is not None and previous.is_file() and (hosts is None or is_recorded_redis(hosts, info)):
            old = read_secret(previous).encode()
            if old != current:
                keys.append(old)
    return keys


def resolve_redis_read_port_offset(hosts: Iterable[Any]) -> int | None:
    """The offset from a Redis node's port to its plaintext read port (:mod:`~bagua_lightning.core.read_plane`).

    ``$BAGUA_LIGHTNING_REDIS_READ_PORT_OFFSET`` when set (``""`` or ``none``: no read ports), else the services
    file's offset when every node of ``hosts`` is one the same file records, else None (no read ports: read
    over the client port).

    Raises:
        ConfigurationError: the variable is not a whole number with ``0 < abs(offset) <= 65535`` (the message
            names the value).
    """
    if READ_PORT_OFFSET_ENV in os.environ:
        text = os.environ[READ_PORT_OFFSET_ENV].strip()
        if text.lower() in ("", "none"):
            return None
        try:
            value: Any = int(text) if re.fullmatch(r"[+-]?[0-9]{1,6}", text) else text
            return _offset(value, f"${READ_PORT_OFFSET_ENV}")
        except ValueError as exc:
            raise ConfigurationError(f"{exc}; give e.g. 20000, or none for no read ports.") from None
    info = read_services_file()
    return info.redis_read_port_offset if info is not None and is_recorded_redis(hosts, info) else None


def resolve_redis_tls(hosts: Iterable[Any], *, ca: Any = None, cert: Any = None, key: Any = None) -> ClientTLS | None:
    """TLS settings for the Redis nodes ``hosts``: arguments, else ``$BAGUA_LIGHTNING_TLS_*``, else the services
    file's when every node of ``hosts`` is one it records, else None (plaintext)."""
    info = read_services_file()
    return resolve_client_tls(info.tls if info is not None and is_recorded_redis(hosts, info) else None,
                              ca=ca, cert=cert, key=key)


def resolve_autotune_tls(address: str, *, ca: Any = None) -> ClientTLS | None:
    """The CA to verify the autotune service at ``address`` with: argument, else ``$BAGUA_LIGHTNING_TLS_CA``, else
    the services file's when ``address`` is the service it records, else None (plaintext)."""
    info = read_services_file()
    recorded = info.tls if info is not None and is_recorded_autotune(address, info) else None
    found = resolve_client_tls(recorded, ca=ca)
    return ClientTLS(ca=found.ca) if found is not None else None  # gRPC: server authentication only

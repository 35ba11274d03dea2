"""The services file: where ``bagua-lightning up`` records the addresses of the services it started.

Trainers read it to find the autotune service and the Redis cache without
configuration. Lookup order for every consumer:

1. explicit arguments (``BaguaStrategy(autotune_service=...)``, ``RedisStore(hosts=...)``);
2. environment variables ``BAGUA_LIGHTNING_AUTOTUNE_SERVICE`` (``host:port``) and
   ``BAGUA_LIGHTNING_REDIS_HOSTS`` (``host:port,host:port``);
3. this file, at ``$BAGUA_LIGHTNING_SERVICES_FILE`` or
   ``$XDG_STATE_HOME/bagua-lightning/services.json`` (``~/.local/state/...`` by default);
4. the defaults: autotune ``127.0.0.1:29600``; Redis: spawn a local server.

The file is JSON::

    {"version": 1,
     "autotune": "127.0.0.1:29600",
     "redis": {"hosts": [{"host": "127.0.0.1", "port": 7000}, ...], "cluster": true},
     "state_dir": "/home/me/.local/state/bagua-lightning",
     "pids": {"autotune": 1234, "redis": [1235, 1236, 1237]}}

Secrets (passwords) are never written here; they come from ``BAGUA_LIGHTNING_REDIS_PASSWORD``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_AUTOTUNE_ADDRESS = "127.0.0.1:29600"
FILE_VERSION = 1

ENV_FILE = "BAGUA_LIGHTNING_SERVICES_FILE"
ENV_AUTOTUNE = "BAGUA_LIGHTNING_AUTOTUNE_SERVICE"
ENV_REDIS_HOSTS = "BAGUA_LIGHTNING_REDIS_HOSTS"
ENV_REDIS_PASSWORD = "BAGUA_LIGHTNING_REDIS_PASSWORD"
ENV_AUTOTUNE_TOKEN = "BAGUA_LIGHTNING_AUTOTUNE_TOKEN"
ENV_CACHE_KEY = "BAGUA_LIGHTNING_CACHE_KEY"


def state_dir() -> Path:
    """Folder for the services' state (data directories, logs, persisted plans)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "bagua-lightning"


def services_file_path() -> Path:
    return Path(os.environ.get(ENV_FILE) or state_dir() / "services.json")


@dataclass(kw_only=True)
class ServicesInfo:
    """What the services file holds.

    Attributes:
        autotune: ``host:port`` of the autotune gRPC service, or None.
        redis_hosts: Redis nodes as ``{"host", "port"}`` dicts; empty when none runs.
        redis_cluster: True when ``redis_hosts`` form a Redis Cluster.
        state_dir: where the services keep their state.
        pids: process ids of what ``bagua-lightning up`` started, for ``down``.
    """

    autotune: str | None = None
    redis_hosts: list[dict[str, Any]] = field(default_factory=list)
    redis_cluster: bool = False
    state_dir: str | None = None
    pids: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FILE_VERSION,
            "autotune": self.autotune,
            "redis": {"hosts": self.redis_hosts, "cluster": self.redis_cluster},
            "state_dir": self.state_dir,
            "pids": self.pids,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServicesInfo:
        if data.get("version") != FILE_VERSION:
            raise ValueError(f"services file version {data.get('version')!r} is not {FILE_VERSION}")
        redis = data.get("redis") or {}
        return cls(
            autotune=data.get("autotune"),
            redis_hosts=list(redis.get("hosts") or []),
            redis_cluster=bool(redis.get("cluster", False)),
            state_dir=data.get("state_dir"),
            pids=dict(data.get("pids") or {}),
        )


def read_services_file(path: Path | None = None) -> ServicesInfo | None:
    """The recorded services, or None when no (valid) file exists."""
    path = path or services_file_path()
    try:
        return ServicesInfo.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def write_services_file(info: ServicesInfo, path: Path | None = None) -> Path:
    """Write atomically (rename), so readers never see a half-written file."""
    path = path or services_file_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".services.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(info.to_json(), f, indent=2)
    os.replace(tmp, path)
    return path


def remove_services_file(path: Path | None = None) -> None:
    (path or services_file_path()).unlink(missing_ok=True)


def resolve_autotune_address(explicit: str | None = None) -> str:
    """Explicit argument, else env, else services file, else the default ``127.0.0.1:29600``."""
    if explicit:
        return explicit
    if os.environ.get(ENV_AUTOTUNE):
        return os.environ[ENV_AUTOTUNE]
    info = read_services_file()
    if info is not None and info.autotune:
        return info.autotune
    return DEFAULT_AUTOTUNE_ADDRESS


def resolve_redis_hosts() -> tuple[list[dict[str, Any]], bool] | None:
    """Redis hosts and whether they form a cluster, from env or the services file; None: spawn locally."""
    env = os.environ.get(ENV_REDIS_HOSTS)
    if env:
        hosts = []
        for item in env.split(","):
            host, _, port = item.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{ENV_REDIS_HOSTS} item {item!r} is not host:port")
            hosts.append({"host": host, "port": int(port)})
        return hosts, len(hosts) > 1
    info = read_services_file()
    if info is not None and info.redis_hosts:
        return info.redis_hosts, info.redis_cluster
    return None


def resolve_redis_password() -> str | None:
    """The Redis password trainers and tools use: ``$BAGUA_LIGHTNING_REDIS_PASSWORD``, else None."""
    return os.environ.get(ENV_REDIS_PASSWORD) or None


def resolve_autotune_token() -> str | None:
    """The bearer token for the autotune service: ``$BAGUA_LIGHTNING_AUTOTUNE_TOKEN``, else None."""
    return os.environ.get(ENV_AUTOTUNE_TOKEN) or None


def resolve_cache_key() -> bytes | None:
    """The secret that authenticates cache entries: ``$BAGUA_LIGHTNING_CACHE_KEY``, else None (CRC only)."""
    key = os.environ.get(ENV_CACHE_KEY)
    return key.encode() if key else None

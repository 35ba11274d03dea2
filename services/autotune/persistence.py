"""Best plans that survive a service restart: a directory of JSON files, or Redis.

Keys identify a model's shape and placement: the tensor-list fingerprint, the
world size and the ranks per node (which decide whether hierarchical reduce is
a choice). Values are JSON, never pickles, so a shared Redis cannot make the
service execute code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from ...proto.plan import BucketPlan
from .choice import AlgorithmChoice

logger = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
REDIS_PREFIX = "bagua_lightning:autotune:plan:"


def plan_key(fingerprint: str, world_size: int, nproc_per_node: int) -> str:
    """The persistence key of a model shape on a placement."""
    return f"{fingerprint}-w{world_size}-n{nproc_per_node}"


def parse_plan_key(key: str) -> tuple[str, int, int]:
    """``(fingerprint, world_size, nproc_per_node)`` of a :func:`plan_key`; ValueError for another string."""
    match = re.fullmatch(r"(.+)-w(\d+)-n(\d+)", key)
    if match is None:
        raise ValueError(f"{key!r} is not a plan key '<fingerprint>-w<world_size>-n<nproc_per_node>'")
    return match.group(1), int(match.group(2)), int(match.group(3))


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """A remembered plan.

    Attributes:
        plan: the best plan measured (version as issued).
        score: its score (speed in samples/s, or minus the step time in ms).
        completed: whether tuning had completed when it was stored.
        model_name: the model it was tuned for (informational).
        saved_at: Unix time it was stored, in seconds.
        job_id: the job whose session measured it (informational; empty: none).
        selection: what ``algorithm="auto"`` measured and kept for a job of this shape (None: none
            reported); sessions that start from this plan show it.
        reports: how many reports the score is the mean of (0: unknown, e.g. a resumed plan).
        samples: how many plans the job had measured when it stored this one.
    """

    plan: BucketPlan
    score: float
    completed: bool
    model_name: str
    saved_at: float = 0.0
    job_id: str = ""
    selection: AlgorithmChoice | None = None
    reports: int = 0
    samples: int = 0

    def to_json(self) -> str:
        return json.dumps({"plan": self.plan.to_dict(), "score": self.score, "completed": self.completed,
                           "model_name": self.model_name, "saved_at": self.saved_at or time.time(),
                           "job_id": self.job_id, "reports": self.reports, "samples": self.samples,
                           **({"selection": self.selection.to_dict()} if self.selection is not None else {})})

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredPlan:
        """Parse and range-check a stored plan; ValueError/KeyError/TypeError when it is malformed."""
        if len(text) > MAX_STORED_BYTES:
            raise ValueError(f"stored plan is {len(text)} bytes, more than {MAX_STORED_BYTES}")
        data: dict[str, Any] = json.loads(text)
        score = float(data["score"])
        if not math.isfinite(score) or abs(score) > 1e12:
            raise ValueError(f"stored score must be finite and within 1e12, got {score}")
        completed = data["completed"]
        if not isinstance(completed, bool):
            raise TypeError(f"stored completed must be a bool, got {completed!r}")
        selection = data.get("selection")
        counts = {name: int(data.get(name, 0)) for name in ("reports", "samples")}
        if not all(0 <= n < 2**63 for n in counts.values()):
            raise ValueError(f"stored reports and samples must be in [0, 2**63), got {counts}")
        return cls(plan=BucketPlan.from_dict(data["plan"]), score=score, completed=completed,
                   model_name=str(data.get("model_name", ""))[:1024], saved_at=float(data.get("saved_at", 0.0)),
                   job_id=str(data.get("job_id", ""))[:1024],
                   selection=AlgorithmChoice.from_dict(selection) if selection is not None else None, **counts)


MAX_STORED_BYTES = 64 * 1024**2  # a stored plan of 100k tensors with long names stays well below


class PlanStore(Protocol):
    """Where best plans are kept; ``load`` returns None for unknown or unreadable keys.

    Calls may block up to the store's deadline and raise on failure; the service calls
    them outside its locks. ``ping`` raises when the store cannot be used now. ``keys``
    lists at most ``limit`` stored keys (any order); ``delete`` removes one, True when it was there.
    """

    def load(self, key: str) -> StoredPlan | None: ...

    def save(self, key: str, stored: StoredPlan) -> None: ...

    def delete(self, key: str) -> bool: ...

    def keys(self, limit: int) -> list[str]: ...

    def ping(self) -> None: ...


class DirectoryPlanStore:
    """One JSON file per key under ``path``; writes are atomic (temporary file, then rename)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
            raise ValueError(f"plan key {key!r} has characters outside [A-Za-z0-9_.-]")
        return self.path / f"{key}.json"

    def load(self, key: str) -> StoredPlan | None:
        file = self._file(key)
        try:
            if file.stat().st_size > MAX_STORED_BYTES:
                raise ValueError(f"{file} is larger than {MAX_STORED_BYTES} bytes")
            return StoredPlan.from_json(file.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("event=plan_unreadable file=%s error=%r; ignoring it", file, exc)
            return None

    def save(self, key: str, stored: StoredPlan) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".plan-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(stored.to_json())
            os.replace(tmp, self._file(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def delete(self, key: str) -> bool:
        try:
            self._file(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def keys(self, limit: int) -> list[str]:
        out: list[str] = []
        for file in self.path.glob("*.json"):
            if len(out) >= limit:
                break
            out.append(file.name[:-len(".json")])
        return out

    def ping(self) -> None:
        """Raise OSError when the directory cannot take a write (gone, read-only, full)."""
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".ping-", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)

    def __repr__(self) -> str:
        return f"DirectoryPlanStore({str(self.path)!r})"


class RedisPlanStore:
    """One Redis string per key (``bagua_lightning:autotune:plan:<key>``), JSON encoded.

    Whether the server runs in cluster mode is asked on first use and asked again after
    every failure until it is known, so a store that was down at start connects in the
    right mode (a cluster client for a cluster) once it is up.
    """

    def __init__(self, url: str, *, timeout_s: float = 1.0) -> None:
        self.url = url
        self._options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        # A password is never put in a URL that lands in logs or process lists: take it from the
        # environment, or from the file $BAGUA_LIGHTNING_REDIS_PASSWORD_FILE names (what `up` gives).
        from ...core.services_file import ENV_REDIS_PASSWORD, env_secret

        password = env_secret(ENV_REDIS_PASSWORD)
        if password and "@" not in url:
            self._options["password"] = password
        # The deployment's CA and client certificate ($BAGUA_LIGHTNING_TLS_*): the server proves itself before
        # the password is sent.
        from ...core.pinned_redis import pinned_kwargs
        from ...core.tls_trust import resolve_client_tls, unchecked

        tls = resolve_client_tls(None)
        query = parse_qs(urlsplit(url).query)
        if tls is None and url.startswith("rediss://") and query.get("ssl_ca_certs"):  # the URL names the CA
            tls = unchecked(query["ssl_ca_certs"][0], query.get("ssl_certfile", [None])[0],
                            query.get("ssl_keyfile", [None])[0])
        self._connect_url = url
        if tls is not None and url.startswith(("redis://", "rediss://")):
            # The pinned connection class speaks TLS, this CA alone (a URL's own ssl_* arguments win, as redis-py
            # has it: then they name the CA). A rediss:// URL would make redis-py's cluster client use its own
            # SSLConnection, which trusts the system's roots beside the CA.
            self._connect_url = "redis://" + url.split("://", 1)[1]
            self._options.update(pinned_kwargs(tls))
        self._client: Any = None
        self._lock = threading.Lock()
        with contextlib.suppress(Exception):  # down now: the first call connects
            self._connected()

    @property
    def cluster(self) -> bool | None:
        """True/False once the server's mode is known, None before."""
        client = self._client
        if client is None:
            return None
        from redis.cluster import RedisCluster
        return isinstance(client, RedisCluster)

    def _connected(self) -> Any:
        with self._lock:
            if self._client is not None:
                return self._client
            import redis  # imported here: a directory store needs no redis client
            from redis.cluster import RedisCluster

            probe = redis.Redis.from_url(self._connect_url, **self._options)
            try:
                cluster = bool(probe.info("cluster").get("cluster_enabled"))
            except BaseException:
                probe.close()
                raise
            if cluster:
                probe.close()
                self._client = RedisCluster.from_url(self._connect_url, **self._options)
            else:
                self._client = probe
            return self._client

    def load(self, key: str) -> StoredPlan | None:
        raw = self._connected().get(REDIS_PREFIX + key)
        if raw is None:
            return None
        try:
            return StoredPlan.from_json(raw)
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("event=plan_unreadable key=%s error=%r; ignoring it", key, exc)
            return None

    def save(self, key: str, stored: StoredPlan) -> None:
        self._connected().set(REDIS_PREFIX + key, stored.to_json())

    def delete(self, key: str) -> bool:
        return bool(self._connected().delete(REDIS_PREFIX + key))

    def keys(self, limit: int) -> list[str]:
        out: list[str] = []
        # SCAN, not KEYS: the store may share a big cache's Redis. A cluster client scans every primary.
        for raw in self._connected().scan_iter(match=REDIS_PREFIX + "*", count=1000):
            if len(out) >= limit:
                break
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            out.append(name[len(REDIS_PREFIX):])
        return out

    def ping(self) -> None:
        client = self._connected()
        if client.ping() is False:
            raise ConnectionError(f"redis at {self.url} did not answer PING")

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            from redis.cluster import RedisCluster

            from ...core.pinned_redis import close_cluster

            if isinstance(client, RedisCluster):
                close_cluster(client)  # its nodes' pools too (made from the URL, not closed with it)
            else:
                client.close()

    def __repr__(self) -> str:
        return f"RedisPlanStore({self.url!r})"


Location = str | os.PathLike[str]

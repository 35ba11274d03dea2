"""Best plans that survive a service restart: a directory of JSON files, or Redis.

Keys identify a model's shape and placement: the tensor-list fingerprint, the
world size and the ranks per node (which decide whether hierarchical reduce is
a choice). Values are JSON, never pickles, so a shared Redis cannot make the
service execute code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bagua_lightning.proto.plan import BucketPlan

logger = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
REDIS_PREFIX = "bagua_lightning:autotune:plan:"


def plan_key(fingerprint: str, world_size: int, nproc_per_node: int) -> str:
    """The persistence key of a model shape on a placement."""
    return f"{fingerprint}-w{world_size}-n{nproc_per_node}"


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """A remembered plan.

    Attributes:
        plan: the best plan measured (version as issued).
        score: its score (speed in samples/s, or minus the step time in ms).
        completed: whether tuning had completed when it was stored.
        model_name: the model it was tuned for (informational).
        saved_at: Unix time it was stored, in seconds.
    """

    plan: BucketPlan
    score: float
    completed: bool
    model_name: str
    saved_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"plan": self.plan.to_dict(), "score": self.score, "completed": self.completed,
                           "model_name": self.model_name, "saved_at": self.saved_at or time.time()})

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredPlan:
        data: dict[str, Any] = json.loads(text)
        return cls(plan=BucketPlan.from_dict(data["plan"]), score=float(data["score"]),
                   completed=bool(data["completed"]), model_name=str(data.get("model_name", "")),
                   saved_at=float(data.get("saved_at", 0.0)))


class PlanStore(Protocol):
    """Where best plans are kept; ``load`` returns None for unknown or unreadable keys."""

    def load(self, key: str) -> StoredPlan | None: ...

    def save(self, key: str, stored: StoredPlan) -> None: ...


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
            return StoredPlan.from_json(file.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("event=plan_unreadable file=%s error=%r; ignoring it", file, exc)
            return None

    def save(self, key: str, stored: StoredPlan) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".plan-", suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            handle.write(stored.to_json())
        os.replace(tmp, self._file(key))

    def __repr__(self) -> str:
        return f"DirectoryPlanStore({str(self.path)!r})"


class RedisPlanStore:
    """One Redis string per key (``bagua_lightning:autotune:plan:<key>``), JSON encoded."""

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        import redis  # imported here: a directory store needs no redis client
        from redis.cluster import RedisCluster

        self.url = url
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        # A password is never put in a URL that lands in logs or process lists: take it from the env.
        password = os.environ.get("BAGUA_LIGHTNING_REDIS_PASSWORD")
        if password and "@" not in url:
            options["password"] = password
        probe = redis.Redis.from_url(url, **options)
        try:
            cluster = bool(probe.info("cluster").get("cluster_enabled"))
        except redis.RedisError:
            cluster = False  # unreachable now: the session logs failed loads/saves and keeps serving
        if cluster:
            probe.close()
            self._client: Any = RedisCluster.from_url(url, **options)
        else:
            self._client = probe

    def load(self, key: str) -> StoredPlan | None:
        raw = self._client.get(REDIS_PREFIX + key)
        if raw is None:
            return None
        try:
            return StoredPlan.from_json(raw)  # type: ignore[arg-type]
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("event=plan_unreadable key=%s error=%r; ignoring it", key, exc)
            return None

    def save(self, key: str, stored: StoredPlan) -> None:
        self._client.set(REDIS_PREFIX + key, stored.to_json())

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisPlanStore({self.url!r})"


def open_store(location: str | os.PathLike[str] | None) -> PlanStore | None:
    """A Redis store for ``redis://``, ``rediss://`` and ``unix://`` URLs, a directory store otherwise.

    None or an empty string keeps plans in memory only.
    """
    if location is None or str(location) == "":
        return None
    text = str(location)
    if text.startswith(REDIS_SCHEMES):
        return RedisPlanStore(text)
    return DirectoryPlanStore(text)

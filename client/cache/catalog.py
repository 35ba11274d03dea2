"""The datasets catalog: one Redis hash next to the samples, listing what is cached.

Key ``__bagua_lightning_catalog__`` (reserved, not counted by ``num_keys``); fields per dataset version:
``<name>:<version>:created`` (unix time of the first write), ``...:samples`` (entries created; evictions are
not subtracted) and ``...:bytes`` (bytes of those entries). Sample keys are ``<name>:<version>:<index>``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from bagua_lightning.errors import ConfigurationError

from .store import RESERVED_KEYS, RedisStore

CATALOG_KEY = RESERVED_KEYS[0]
_NAME_RE = re.compile(r"[A-Za-z0-9._/+=@-]*")
_SCAN_BATCH = 1000


def check_name(what: str, value: str, allow_empty: bool) -> str:
    """Validate a dataset name or version: no ``:`` (the key separator), no braces (Redis hash tags),
    no glob characters (``cache rm`` matches keys by pattern)."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or (not value and not allow_empty):
        raise ConfigurationError(
            f"{what} {value!r} is not valid: use letters, digits and . _ / + = @ -"
            + ("" if allow_empty else " (at least one)") + "; ':' separates the parts of a cache key."
        )
    return value


def entry_prefix(name: str, version: str) -> str:
    return f"{name}:{version}:"


@dataclass(kw_only=True)
class CatalogEntry:
    """One cached dataset version."""

    name: str
    version: str
    samples: int
    bytes: int
    created: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "samples": self.samples, "bytes": self.bytes,
                "created": self.created}


def record_writes(store: RedisStore, name: str, version: str, samples: int, nbytes: int) -> None:
    """Account entries newly written for ``name:version`` (raises the store's error on failure)."""
    client = store.backend.client_for_key(CATALOG_KEY)
    field = f"{name}:{version}"
    pipe = client.pipeline(transaction=False)
    pipe.hsetnx(CATALOG_KEY, f"{field}:created", repr(time.time()))
    if samples:
        pipe.hincrby(CATALOG_KEY, f"{field}:samples", samples)
        pipe.hincrby(CATALOG_KEY, f"{field}:bytes", nbytes)
    pipe.execute()


def list_datasets(store: RedisStore) -> list[CatalogEntry]:
    """Every dataset version in the catalog, by name then creation time."""
    raw = store.backend.client_for_key(CATALOG_KEY).hgetall(CATALOG_KEY)
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for f, v in raw.items():
        name, version, what = (f.decode() if isinstance(f, bytes) else f).rsplit(":", 2)
        entries.setdefault((name, version), {})[what] = v.decode() if isinstance(v, bytes) else v
    out = [CatalogEntry(name=n, version=ver, samples=int(d.get("samples", 0)), bytes=int(d.get("bytes", 0)),
                        created=float(d.get("created", 0.0))) for (n, ver), d in entries.items()]
    return sorted(out, key=lambda e: (e.name, e.created))


def remove_dataset(store: RedisStore, name: str, version: str | None = None) -> int:
    """Delete the entries of ``name`` (one version, or every catalogued version); return keys deleted."""
    check_name("dataset name", name, allow_empty=True)
    if version is not None:
        versions = [check_name("version", version, allow_empty=False)]
    else:
        versions = [e.version for e in list_datasets(store) if e.name == name]
    deleted = 0
    for ver in versions:
        pattern = entry_prefix(name, ver) + "*"
        for primary in store.backend.primaries():
            batch: list[bytes] = []
            for key in primary.scan_iter(match=pattern, count=_SCAN_BATCH):
                batch.append(key)
                if len(batch) >= _SCAN_BATCH:
                    deleted += _unlink(primary, batch)
                    batch = []
            if batch:
                deleted += _unlink(primary, batch)
        store.backend.client_for_key(CATALOG_KEY).hdel(
            CATALOG_KEY, *(f"{name}:{ver}:{what}" for what in ("created", "samples", "bytes")))
    return deleted


def _unlink(primary: Any, keys: list[bytes]) -> int:
    # One UNLINK per key: in a cluster, keys of one node still live in different slots.
    pipe = primary.pipeline(transaction=False)
    for k in keys:
        pipe.unlink(k)
    return sum(int(n) for n in pipe.execute())

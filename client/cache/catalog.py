"""The datasets catalog: what is cached, kept in one Redis hash next to the samples.

The loader and ``bagua-lightning cache ls|rm`` see it only through :class:`Catalog` (``Store.catalog()``);
a store without a catalog returns None and the loader skips the bookkeeping.

Key ``__bagua_lightning_catalog__`` (reserved, not counted by ``num_keys``); fields per dataset version, with
name and version encoded as in the sample keys (below): ``<name>:<version>:created`` (unix time of
the first write), ``...:samples`` (entries created; evictions are not subtracted) and ``...:bytes``.

**Keys** (:func:`entry_prefix`): cache keys: ``{name}:{version}:{index}``, with the name and version percent-encoded.

Any string is a valid dataset name or version. The parts are encoded so that a key can always be split
back and matched by pattern: characters outside ``A-Z a-z 0-9 . _ - ~ / + = @`` (among them ``:`` the
separator, ``{ }`` Redis hash tags, ``* ? [ ] \\`` glob characters, ``%`` itself, spaces and non-ASCII) are
written as ``%XX`` of their UTF-8 bytes: ``"my data"`` -> ``my%20data``, ``"ds:v1"`` -> ``ds%3Av1``.
Names made only of the plain characters are their own encoding.

Why not Bagua's ``{dataset_name}_{index}``: ``_`` may appear in names, so ``("a_1", 2)`` and ``("a", "1_2")``
share a key; and there is no version, so a changed dataset would serve stale samples.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from ...core.read_plane import SEALED_KEY_PREFIX

_SAFE = "/+=@"  # on top of the letters, digits and "_.-~" that quote() never encodes


def encode_part(what: str, value: str, allow_empty: bool) -> str:
    """``value`` encoded for a key; raises ``TypeError``/``ValueError`` naming ``what`` when it is unusable."""
    if not isinstance(value, str):
        raise TypeError(f"{what}={value!r} is a {type(value).__name__}; give a string.")
    if not value and not allow_empty:
        raise ValueError(f"{what} is empty; give at least one character.")
    return quote(value, safe=_SAFE, errors="surrogatepass")


def decode_part(raw: str) -> str:
    """Inverse of :func:`encode_part`."""
    return unquote(raw, errors="surrogatepass")


def entry_prefix(name: str, version: str) -> str:
    """The key prefix of the entries of ``name`` at ``version``."""
    return f"{encode_part('dataset_name', name, True)}:{encode_part('version', version, False)}:"


CATALOG_KEY = "__bagua_lightning_catalog__"
RESERVED_KEYS = (CATALOG_KEY,)
_SCAN_BATCH = 1000


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


class Catalog(ABC):
    """What a store offers for the datasets catalog."""

    @abstractmethod
    def record(self, name: str, version: str, samples: int, nbytes: int) -> None:
        """Account ``samples`` entries (``nbytes`` bytes) newly written for ``name``/``version``; may raise."""

    @abstractmethod
    def datasets(self) -> list[CatalogEntry]:
        """Every dataset version in the catalog, by name then creation time."""

    @abstractmethod
    def remove(self, name: str, version: str | None = None) -> int:
        """Delete the entries of ``name`` (one version, or every catalogued one); return keys deleted."""


class RedisCatalog(Catalog):
    """The catalog of a Redis store: ``hash_client`` serves the catalog key, ``primaries`` every master."""

    def __init__(self, hash_client: Any, primaries: Callable[[], list[Any]]) -> None:
        self.client = hash_client
        self.primaries = primaries

    def record(self, name: str, version: str, samples: int, nbytes: int) -> None:
        field = entry_prefix(name, version)
        pipe = self.client.pipeline(transaction=False)
        pipe.hsetnx(CATALOG_KEY, f"{field}created", repr(time.time()))
        if samples:
            pipe.hincrby(CATALOG_KEY, f"{field}samples", samples)
            pipe.hincrby(CATALOG_KEY, f"{field}bytes", nbytes)
        pipe.execute()

    def datasets(self) -> list[CatalogEntry]:
        raw = self.client.hgetall(CATALOG_KEY)
        entries: dict[tuple[str, str], dict[str, Any]] = {}
        for f, v in raw.items():
            name, version, what = (f.decode() if isinstance(f, bytes) else f).rsplit(":", 2)
            key = (decode_part(name), decode_part(version))
            entries.setdefault(key, {})[what] = v.decode() if isinstance(v, bytes) else v
        out = [CatalogEntry(name=n, version=ver, samples=int(d.get("samples", 0)), bytes=int(d.get("bytes", 0)),
                            created=float(d.get("created", 0.0))) for (n, ver), d in entries.items()]
        return sorted(out, key=lambda e: (e.name, e.created))

    def remove(self, name: str, version: str | None = None) -> int:
        encode_part("dataset name", name, allow_empty=True)
        versions = [version] if version is not None else [e.version for e in self.datasets() if e.name == name]
        deleted = 0
        for ver in versions:
            prefix = entry_prefix(name, ver)
            for primary, match in ((p, m) for p in self.primaries() for m in (prefix, SEALED_KEY_PREFIX + prefix)):
                batch: list[bytes] = []
                for key in primary.scan_iter(match=match + "*", count=_SCAN_BATCH):
                    batch.append(key)
                    if len(batch) >= _SCAN_BATCH:
                        deleted += _unlink(primary, batch)
                        batch = []
                if batch:
                    deleted += _unlink(primary, batch)
            self.client.hdel(CATALOG_KEY, *(f"{prefix}{what}" for what in ("created", "samples", "bytes")))
        return deleted


def _unlink(primary: Any, keys: list[bytes]) -> int:
    # One UNLINK per key: in a cluster, keys of one node still live in different slots.
    pipe = primary.pipeline(transaction=False)
    for k in keys:
        pipe.unlink(k)
    return sum(int(n) for n in pipe.execute())


def _catalog_of(store: Any) -> Catalog:
    catalog = store.catalog()
    if catalog is None:
        raise ValueError(f"{store!r} keeps no datasets catalog")
    return catalog


def list_datasets(store: Any) -> list[CatalogEntry]:
    """Every dataset version in ``store``'s catalog, by name then creation time."""
    return _catalog_of(store).datasets()


def remove_dataset(store: Any, name: str, version: str | None = None) -> int:
    """Delete the entries of ``name`` in ``store`` (one version, or every catalogued one); return keys deleted."""
    return _catalog_of(store).remove(name, version)

"""Cache keys by id, so that a cache key rotation keeps hitting (Vault's and Kubernetes' key ids and grace periods).

Every sealed entry names the cache key that sealed it: the 12 bytes after its nonce in the digest field are
:func:`key_field` of that key, an 8-byte key id (HKDF-SHA256 of the cache key, its own ``info``, so it reveals
nothing of the key) and 4 zero bytes. A reader opens an entry only with the key it names; another key's entry
is refused at once, before any decryption.

During a rotation (``bagua-lightning rotate-secrets --cache-key``) the deployment holds two keys: the new one
in its ``cache-key`` file, the old one in ``cache-key.previous``. A :class:`Keyring` holds every key it knows,
the current one first; new entries are sealed with the current one. An entry sealed with a key it does not
know makes it read the deployment's key files again (:func:`~bagua_lightning.core.services_file.resolve_cache_keys`):

* a job started before the rotation meets the new job's entries, learns the new key (and seals with it from
  then on) and keeps the old one: both kinds of entry are hits;
* a job started during the grace period reads both files: both kinds are hits;
* ``rotate-secrets --cache-key --finish`` deletes the old file: jobs that read the files again drop the old
  key; entries still sealed with it are misses then and are written again with the new one.

A key given explicitly (``cache_key=...``, ``$BAGUA_LIGHTNING_CACHE_KEY``) is the only key of its ring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .digests import (  # the key id of an entry lives beside its digest field (entry.py checks it there)
    _FIELD_AT,
    _FIELD_END,
    KEY_ID_INFO,
    KEY_ID_SIZE,
    check_key,
    key_field,
    key_id,
    named_key_id,
)
from .values import CorruptEntryError

__all__ = ["KEY_ID_INFO", "KEY_ID_SIZE", "Keyring", "check_key", "key_field", "key_id", "named_key_id"]

class Keyring:
    """The cache keys a loader opens entries with, by id; :attr:`current` seals new ones.

    Args:
        keys: the keys, the current one first (``rotate-secrets``: the new one, then the previous one).
        refreshable: read the deployment's key files again on meeting an entry of a key not held (False for
            a key given explicitly).
    """

    def __init__(self, keys: Sequence[bytes], refreshable: bool = False) -> None:
        if not keys:
            raise ValueError("a keyring needs at least one cache key")
        self.refreshable = refreshable
        self._set(keys)

    def _set(self, keys: Sequence[bytes]) -> None:
        self.current = bytes(keys[0])
        self.by_field = {key_field(k): bytes(k) for k in keys}

    @classmethod
    def resolve(cls) -> Keyring | None:
        """The deployment's keys (:func:`~bagua_lightning.core.services_file.resolve_cache_keys`), refreshable;
        None when there is no cache key."""
        from ...core.services_file import resolve_cache_keys

        keys = resolve_cache_keys()
        return cls(keys, refreshable=True) if keys else None

    def refresh(self) -> None:
        """Read the deployment's key files again (a rotation started or finished); keep the ring as it is when
        they name no key any more."""
        if not self.refreshable:
            return
        from ...core.services_file import resolve_cache_keys

        keys = resolve_cache_keys()
        if keys:
            self._set(keys)

    def reopen(self, decoded: list[Any], values: Sequence[Any], keys: Sequence[bytes], allow_pickle: bool) -> bytes:
        """Open again, each with the key it names, the sealed entries among ``values`` that did not decode with
        :attr:`current` (``decoded`` holds :class:`~.entry.Bad` for them; replaced in place by the sample when one
        opens); return :attr:`current` afterwards (it changes when the key files were read again)."""
        from .entry import Bad, decode

        if all(type(d) is not Bad for d in decoded):
            return self.current
        others = [j for j, (d, v) in enumerate(zip(decoded, values, strict=True))
                  if type(d) is Bad and v is not None and named_key_id(v) is not None
                  and bytes(memoryview(v)[_FIELD_AT:_FIELD_END]) != key_field(self.current)]
        if not others:
            return self.current
        if any(bytes(memoryview(values[j])[_FIELD_AT:_FIELD_END]) not in self.by_field for j in others):
            self.refresh()  # an entry of a key this ring does not hold: a rotation began (or ended)
        for j in others:
            secret = self.by_field.get(bytes(memoryview(values[j])[_FIELD_AT:_FIELD_END]))
            if secret is None:
                continue
            try:
                decoded[j] = decode(values[j], keys[j], allow_pickle=allow_pickle, secret=secret)
            except CorruptEntryError as exc:
                decoded[j] = Bad(exc)
        return self.current

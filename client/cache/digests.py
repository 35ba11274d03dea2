"""The digests of cache entries: one per entry, over the key it is stored under and its bytes.

Kinds (the byte after the format version in an entry's header, :mod:`.codec`); every kind fills the same
24-byte field:

* ``gmac-aes256``: written when a cache key is configured. The field is a random 12-byte nonce, drawn for
  each written entry, then the first 12 bytes of the AES-256-GCM tag of (nonce, plaintext = the redis key,
  associated data = the entry from the flags on), under an AES key derived from the cache key with
  HKDF-SHA256. GCM's tag covers the associated data and the ciphertext of the key (their lengths too), so
  the entry and the key it is stored under are both bound, and no copy of the entry is made. Needs the
  ``cryptography`` package; without it, keyed entries are written as ``hmac-sha256`` (logged once).
* ``hmac-sha256``, truncated to 24 bytes: HMAC-SHA256 with the cache key of ``u64(len(redis key)) | redis
  key | entry from the flags on``. Written by earlier releases (and where ``cryptography`` is missing);
  still verified, so a cache written by both is read.
* ``xxh3-64`` (the ``xxhash`` package) or ``crc32`` (zlib) without a key: corruption, not forgery.

Why GMAC and why it is secure: docs/cache.md ("What the keyed digest is").
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from typing import Any

from .values import CorruptEntryError

log = logging.getLogger("bagua_lightning.client.cache")


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


xxhash: Any = _optional("xxhash")  # ~30 GB/s checksums when installed; zlib's crc32 otherwise

DIGEST_CRC32, DIGEST_XXH3, DIGEST_HMAC, DIGEST_GMAC = 1, 2, 3, 4
DIGEST_NAMES = {DIGEST_CRC32: "crc32", DIGEST_XXH3: "xxh3-64", DIGEST_HMAC: "hmac-sha256",
                DIGEST_GMAC: "gmac-aes256"}
KEYED_KINDS = frozenset((DIGEST_HMAC, DIGEST_GMAC))
DIGEST_SIZE = 24  # bytes of the digest field
NONCE_SIZE = 12  # bytes: GCM's 96-bit nonce, the first part of a gmac-aes256 field
TAG_SIZE = DIGEST_SIZE - NONCE_SIZE  # bytes of the GCM tag kept (of 16): NIST SP 800-38D allows 96 bits
GMAC_MAX_BYTES = 2**31 - 1  # cryptography's AEAD limit on associated data: a larger entry is written hmac-sha256
GMAC_KEY_INFO = b"bagua-lightning cache entry digest gmac-aes256 v1"  # HKDF info: this key serves only this

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_BLOCK = 64  # bytes: SHA-256's block, HMAC's key length
_PAD16 = bytes(16)
_PAD20 = bytes(20)


@functools.cache
def _aesgcm_class() -> Any:
    """``cryptography``'s AESGCM, or None where the package is missing (imported on first keyed use only)."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return None
    return AESGCM


def gmac_available() -> bool:
    """Whether this process can write and verify ``gmac-aes256`` digests (``cryptography`` is installed)."""
    return _aesgcm_class() is not None


@functools.cache
def keyed_digest_kind() -> int:
    """The keyed digest this process writes: ``gmac-aes256``, or ``hmac-sha256`` without ``cryptography``."""
    if not gmac_available():
        log.warning("the cryptography package is not installed: cache entries are authenticated with "
                    "HMAC-SHA256, about 4x slower to read than AES-GMAC; to read at full speed, install it with "
                    "`pip install -U cryptography`")
        return DIGEST_HMAC
    return DIGEST_GMAC


def _hkdf_sha256(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869) with an empty salt: ``length`` bytes of key for the purpose ``info``."""
    import hmac

    prk = hmac.digest(bytes(32), secret, "sha256")
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.digest(prk, block + info + bytes((i,)), "sha256")
        out += block
    return out[:length]


@functools.lru_cache(maxsize=8)
def _gmac_cipher(secret: bytes) -> Any:
    """AES-256-GCM under the key derived from the cache key ``secret`` (its ``encrypt`` method)."""
    aesgcm = _aesgcm_class()
    if aesgcm is None:
        raise CorruptEntryError("entry is authenticated with AES-GMAC; install the cryptography package "
                                "(`pip install -U cryptography`) to read it")
    return aesgcm(_hkdf_sha256(secret, GMAC_KEY_INFO)).encrypt


def gmac_digest(secret: bytes, key: bytes, covered: Any, nonce: Any) -> bytes:
    """The ``gmac-aes256`` field for the entry part ``covered`` stored under ``key``: ``nonce`` (12 bytes) then
    the first :data:`TAG_SIZE` bytes of the AES-256-GCM tag of (``nonce``, plaintext ``key``, associated data
    ``covered``)."""
    nonce = bytes(nonce)
    return nonce + _gmac_cipher(secret)(nonce, key, covered)[-16:TAG_SIZE - 16]


def default_digest_kind() -> int:
    """The unkeyed digest this process writes: xxh3-64 when ``xxhash`` is installed, else crc32."""
    return DIGEST_XXH3 if xxhash is not None else DIGEST_CRC32


@functools.lru_cache(maxsize=8)
def _hmac_pads(secret: bytes) -> tuple[Any, Any]:
    """SHA-256 states after ``secret ^ ipad`` and ``secret ^ opad`` (RFC 2104), copied for each entry: the same
    digest as ``hmac.new``, with a few C calls per entry instead of its Python wrapper (about 1 us less)."""
    if len(secret) > _BLOCK:
        secret = hashlib.sha256(secret).digest()
    secret = secret.ljust(_BLOCK, b"\0")
    return (hashlib.sha256(bytes(b ^ 0x36 for b in secret)), hashlib.sha256(bytes(b ^ 0x5C for b in secret)))


def hmac_digest(secret: bytes, key: bytes, covered: Any) -> bytes:
    """The ``hmac-sha256`` digest of the entry part ``covered`` stored under ``key``: HMAC-SHA256 with the cache
    key of ``u64(len(key)) | key | covered``, its first :data:`DIGEST_SIZE` bytes."""
    inner, outer = _hmac_pads(secret)
    h = inner.copy()
    h.update(_U64.pack(len(key)) + key)
    h.update(covered)  # the GIL is released while OpenSSL hashes a large buffer
    o = outer.copy()
    o.update(h.digest())
    return o.digest()[:DIGEST_SIZE]


def gmac_tags(secret: bytes, buf: Any, starts: Sequence[int], length: int, keys: Sequence[bytes]) -> bytes:
    """The truncated GCM tags of many ``gmac-aes256`` entries lying in one buffer, joined: to be compared at
    once with the entries' tag fields. Entry ``i``'s covered part is ``buf[starts[i]:starts[i] + length]``, its
    digest field the :data:`DIGEST_SIZE` bytes before it, and it is stored under ``keys[i]``. One call each
    into OpenSSL (AES-NI and carry-less multiplication: ~2.5 us per 12 KB entry on the 2-core VM)."""
    enc, size, nonce = _gmac_cipher(secret), DIGEST_SIZE, DIGEST_SIZE - NONCE_SIZE
    return b"".join([enc(buf[a - size:a - nonce], key, buf[a:a + length])[-16:TAG_SIZE - 16]
                     for a, key in zip(starts, keys, strict=True)])


def digest(kind: int, key: bytes, secret: bytes | None, covered: Any, stored: Any = None) -> bytes:
    """Digest field of kind ``kind`` for ``key`` and the ``covered`` part of an entry (all after the field).

    ``stored``: the field as read from the entry, when checking one (a ``gmac-aes256`` field takes its nonce
    from it); None when writing (a ``gmac-aes256`` field then gets a fresh random nonce: a nonce repeated under
    one key would reveal GHASH's key, so it is never derived from anything that could repeat).
    """
    if kind == DIGEST_XXH3:
        if xxhash is None:
            raise CorruptEntryError("entry carries an xxh3 digest; install xxhash to verify it")
        return _U64.pack(xxhash.xxh3_64_intdigest(covered, xxhash.xxh3_64_intdigest(key))) + _PAD16
    if kind in KEYED_KINDS:
        if secret is None:
            raise CorruptEntryError("entry is authenticated with a cache key, and none is configured here")
        if kind == DIGEST_HMAC:
            return hmac_digest(secret, key, covered)
        nonce = os.urandom(NONCE_SIZE) if stored is None else stored[:NONCE_SIZE]
        return gmac_digest(secret, key, covered, nonce)
    if kind == DIGEST_CRC32:
        return _U32.pack(zlib.crc32(covered, zlib.crc32(key))) + _PAD20
    raise CorruptEntryError(f"unknown digest kind {kind}")

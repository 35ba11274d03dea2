"""The digests of cache entries: one per entry, over the key it is stored under and its bytes.

Kinds (the byte after the format version in an entry's header, :mod:`.codec`); every kind fills the same
24-byte field:

* ``aes256-gcm`` (sealed): written when a cache key is configured. The field is a random 12-byte nonce, drawn
  for each written entry, then the 8-byte id of the cache key and 4 zero bytes (:mod:`.keyring`); everything after the 52-byte header (skeleton, tail, pad, data
  region) is AES-256-GCM ciphertext (under an AES key derived from the cache key with HKDF-SHA256, its own
  ``info``), and the full 16-byte tag follows it, at the very end of the entry. Associated data:
  ``u64(len(redis key)) | redis key | flags and lengths`` (the header's bytes after the digest field). So the
  sample is confidential (only the lengths stay in clear), and the entry, its lengths and the key it is stored
  under are authenticated: what :func:`seal_into` writes and :func:`opener` opens. Needs ``cryptography``;
  without it, keyed entries are written as ``hmac-sha256``.
* ``gmac-aes256``: what a cache key gave before sealing (still read; written with ``seal=False``). The field
  is a random 12-byte nonce, drawn for each written entry, then the first 12 bytes of the AES-256-GCM tag of
  (nonce, plaintext = the redis key, associated data = the entry from the flags on), under an AES key derived
  from the cache key with HKDF-SHA256. GCM's tag covers the associated data and the ciphertext of the key
  (their lengths too), so the entry and the key it is stored under are both bound, and no copy of the entry
  is made. The entry itself stays in clear. Needs the ``cryptography`` package; without it, keyed entries are
  written as ``hmac-sha256`` (logged once).
* ``hmac-sha256``, truncated to 24 bytes: HMAC-SHA256 with the cache key of ``u64(len(redis key)) | redis
  key | entry from the flags on``. Written by earlier releases (and where ``cryptography`` is missing);
  still verified, so a cache written by both is read.
* ``xxh3-64`` (the ``xxhash`` package) or ``crc32`` (zlib) without a key: corruption, not forgery.

Why GMAC, what sealing adds and why both are secure: docs/cache.md ("What the keyed digest is", "What
sealing adds").
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from .values import CorruptEntryError

log = logging.getLogger("bagua_lightning.client.cache")


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


xxhash: Any = _optional("xxhash")  # ~30 GB/s checksums when installed; zlib's crc32 otherwise

DIGEST_CRC32, DIGEST_XXH3, DIGEST_HMAC, DIGEST_GMAC, DIGEST_SEAL = 1, 2, 3, 4, 5
DIGEST_NAMES = {DIGEST_CRC32: "crc32", DIGEST_XXH3: "xxh3-64", DIGEST_HMAC: "hmac-sha256",
                DIGEST_GMAC: "gmac-aes256", DIGEST_SEAL: "aes256-gcm"}
MAC_KINDS = frozenset((DIGEST_HMAC, DIGEST_GMAC))  # keyed kinds whose 24-byte field is all there is to check
KEYED_KINDS = MAC_KINDS | {DIGEST_SEAL}  # the kinds accepted where a cache key is configured
DIGEST_SIZE = 24  # bytes of the digest field
NONCE_SIZE = 12  # bytes: GCM's 96-bit nonce, the first part of a gmac-aes256 or aes256-gcm field
TAG_SIZE = DIGEST_SIZE - NONCE_SIZE  # bytes of the GCM tag kept (of 16): NIST SP 800-38D allows 96 bits
GMAC_MAX_BYTES = 2**31 - 1  # cryptography's AEAD limit per call: a larger entry is written hmac-sha256
GMAC_KEY_INFO = b"bagua-lightning cache entry digest gmac-aes256 v1"  # HKDF info: this key serves only this
SEAL_KEY_INFO = b"bagua-lightning cache entry seal aes256-gcm v1"  # HKDF info of the sealing key: another key
SEAL_TAG_SIZE = 16  # bytes: a sealed entry ends with GCM's whole tag
SEALED_NO_KEY = ("entry is sealed (aes256-gcm) with a cache key, and none is configured here: configure the job's "
                 "cache key (cache_key=..., $BAGUA_LIGHTNING_CACHE_KEY or the services file) to read it")
SEAL_MISMATCH = ("sealed entry does not open (corrupted, truncated, stored under another key, or not written "
                 "with this cache key)")

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
    """The keyed kind this process writes by default: ``aes256-gcm`` (sealed), or ``hmac-sha256`` without
    ``cryptography`` (neither encrypted nor as fast to read; logged once)."""
    if not gmac_available():
        log.warning("the cryptography package is not installed: cache entries are authenticated with "
                    "HMAC-SHA256, about 4x slower to read than AES-GCM, and not encrypted; to seal them and read "
                    "at full speed, install it with `pip install -U cryptography`")
        return DIGEST_HMAC
    return DIGEST_SEAL


def mac_digest_kind() -> int:
    """The keyed kind written where sealing is turned off (``seal=False``): ``gmac-aes256``, or ``hmac-sha256``
    without ``cryptography``."""
    return DIGEST_GMAC if keyed_digest_kind() == DIGEST_SEAL else DIGEST_HMAC


def _hkdf_sha256(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869) with an empty salt: ``length`` bytes of key for the purpose ``info``."""
    import hmac

    prk = hmac.digest(bytes(32), secret, "sha256")
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.digest(prk, block + info + bytes((i,)), "sha256")
        out += block
    return out[:length]


def _aes_gcm(secret: bytes, info: bytes, what: str) -> Any:
    """``cryptography``'s AESGCM under the key derived from the cache key ``secret`` for the purpose ``info``;
    :class:`CorruptEntryError` saying to install the package (for an entry ``what``) where it is missing."""
    aesgcm = _aesgcm_class()
    if aesgcm is None:
        raise CorruptEntryError(f"entry is {what}; install the cryptography package "
                                "(`pip install -U cryptography`) to read it")
    return aesgcm(_hkdf_sha256(secret, info))


@functools.lru_cache(maxsize=8)
def _gmac_cipher(secret: bytes) -> Any:
    """AES-256-GCM under the GMAC key derived from the cache key ``secret`` (its ``encrypt`` method)."""
    return _aes_gcm(secret, GMAC_KEY_INFO, "authenticated with AES-GMAC").encrypt


@functools.lru_cache(maxsize=8)
def seal_cipher(secret: bytes) -> Any:
    """AES-256-GCM (``cryptography``'s AESGCM object) under the sealing key derived from the cache key."""
    return _aes_gcm(secret, SEAL_KEY_INFO, "sealed with AES-256-GCM")


@functools.lru_cache(maxsize=8)
def seal_key(secret: bytes) -> bytes:
    """The AES-256 key (32 bytes) that entries are sealed with, derived from the cache key ``secret``."""
    return _hkdf_sha256(secret, SEAL_KEY_INFO)


def seal_aad(key: bytes, clear: Any) -> bytes:
    """The associated data of a sealed entry stored under ``key`` whose header bytes after the digest field
    (flags, lengths) are ``clear``: ``u64(len(key)) | key | clear``."""
    return b"".join((_U64.pack(len(key)), key, clear))


def seal_into(secret: bytes, key: bytes, nonce: bytes, clear: Any, plain: Any, out: Any) -> None:
    """Encrypt ``plain`` (the data region) into ``out`` (``len(plain) + 16`` bytes: ciphertext, then the tag)."""
    cipher, aad = seal_cipher(secret), seal_aad(key, clear)
    if hasattr(cipher, "encrypt_into"):  # cryptography >= 45: straight into the entry
        cipher.encrypt_into(nonce, plain, aad, out)
    else:
        out[:] = cipher.encrypt(nonce, plain, aad)


def raw_opener(secret: bytes) -> Any:
    """``decrypt_into(nonce, sealed, associated data, out)`` of the sealing key derived from ``secret`` (raises
    ``InvalidTag`` and the like, not :class:`CorruptEntryError`); None where ``cryptography`` is missing or
    older than 45."""
    try:
        return getattr(seal_cipher(secret), "decrypt_into", None)
    except CorruptEntryError:
        return None


def opener(secret: bytes) -> Callable[[bytes, Any, Any, Any, Any], None]:
    """``open_into(key, nonce, clear, sealed, out)``: decrypt and check ``sealed`` (ciphertext then tag) into
    ``out`` (``len(sealed) - 16`` bytes), for an entry stored under ``key`` whose header bytes after the digest
    field (flags, lengths) are ``clear``, with the AES key derived from ``secret``. A wrong tag (any change to the entry, another
    key, another cache key), a wrong length, anything: :class:`CorruptEntryError` (``out`` then holds nothing to
    use). One of these serves a whole batch."""
    cipher = seal_cipher(secret)
    into = getattr(cipher, "decrypt_into", None)  # cryptography >= 45: straight into the caller's buffer
    pack, join = _U64.pack, b"".join

    def open_into(key: bytes, nonce: Any, clear: Any, sealed: Any, out: Any) -> None:
        aad = join((pack(len(key)), key, clear))  # seal_aad's, inline: once per entry read
        try:
            if into is not None:
                into(nonce, sealed, aad, out)
            else:
                out[:] = cipher.decrypt(nonce, sealed, aad)
        except Exception as exc:  # InvalidTag, or a length or type that does not fit: never anything but a miss
            raise CorruptEntryError(SEAL_MISMATCH if type(exc).__name__ == "InvalidTag"
                                    else f"sealed entry does not open ({type(exc).__name__}: {exc})") from None

    return open_into


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
    if kind == DIGEST_SEAL:  # not a digest of the field alone: opened by opener()
        raise CorruptEntryError(SEALED_NO_KEY if secret is None else "a sealed entry has no digest to compare")
    if kind in MAC_KINDS:
        if secret is None:
            raise CorruptEntryError("entry is authenticated with a cache key, and none is configured here")
        if kind == DIGEST_HMAC:
            return hmac_digest(secret, key, covered)
        nonce = os.urandom(NONCE_SIZE) if stored is None else stored[:NONCE_SIZE]
        return gmac_digest(secret, key, covered, nonce)
    if kind == DIGEST_CRC32:
        return _U32.pack(zlib.crc32(covered, zlib.crc32(key))) + _PAD20
    raise CorruptEntryError(f"unknown digest kind {kind}")


# ---------------------------------------------------------------------------- key ids (keyring.py uses them)

KEY_ID_INFO = b"bagua-lightning cache key id v1"  # HKDF info: the key id, never a key
KEY_ID_SIZE = 8  # bytes
_FIELD_AT = 8 + NONCE_SIZE  # where the key field lies in an entry: after magic/version/kind/pad and the nonce
_FIELD_END = 8 + DIGEST_SIZE


@functools.lru_cache(maxsize=16)
def key_field(secret: bytes) -> bytes:
    """The 12 bytes after the nonce of an entry sealed with the cache key ``secret``: its key id, 4 zeros."""
    return _hkdf_sha256(bytes(secret), KEY_ID_INFO, KEY_ID_SIZE) + bytes(DIGEST_SIZE - NONCE_SIZE - KEY_ID_SIZE)


def key_id(secret: bytes) -> str:
    """The id of the cache key ``secret`` as hex (what ``status`` and errors print)."""
    return key_field(secret)[:KEY_ID_SIZE].hex()


def named_key_id(entry: Any) -> str | None:
    """The key id a sealed entry names (hex), or None for anything else."""
    view = memoryview(entry)
    if view.nbytes < _FIELD_END or view[4] != DIGEST_SEAL:
        return None
    return bytes(view[_FIELD_AT:_FIELD_AT + KEY_ID_SIZE]).hex()


def check_key(entry: Any, secret: bytes) -> None:
    """:class:`CorruptEntryError` unless the sealed ``entry`` names the key ``secret``."""
    if bytes(memoryview(entry)[_FIELD_AT:_FIELD_END]) != key_field(secret):
        raise CorruptEntryError(f"sealed entry names cache key {named_key_id(entry)}, this reader's key is "
                                f"{key_id(secret)} (another deployment's, or one rotated out)")

"""The safe sample codec: one self-describing, checked entry per sample, without pickle.

Entry layout (little endian)::

    header   (52 bytes): b"BLC" | format version u8 | digest kind u8 | 3 zero bytes | digest (24 bytes, zero
                         padded) | flags u8 | 3 zero bytes | skeleton_len u32 | tail_len u32 | data_len u64
    skeleton (skeleton_len): types, dtypes, ranks, lengths, names (:mod:`.values`); shared by the samples
                         of a dataset, compiled once into a decoder (:mod:`.skeletons`)
    tail     (tail_len): the fixed-size fields of this sample (numbers, shapes, offsets), 8 bytes each
    pad                : zeros up to a multiple of 64 bytes
    data     (data_len): array, image, string and bytes contents, arrays on 64-byte boundaries, then up to 31
                         zero bytes (safe-codec entries) so that the entry's ``GET`` reply spans a multiple of 16
                         bytes (:func:`~.values.reply_pad`); readers of this version ignore them
    tag          (16 B): sealed entries only (digest kind ``aes256-gcm``): the data region is then AES-256-GCM
                         ciphertext (data_len is the plaintext's length, padding included) and GCM's tag follows

The digest (a sealed entry's tag) covers the key the entry was written under and everything after the
digest (flags, lengths, skeleton, tail, data: one contiguous region, hashed in one call); magic, version and
digest kind are checked by value. A flipped bit, a truncated value or a valid entry copied under another key all fail
:func:`decode` with :class:`CorruptEntryError`; the loader counts that as a miss and rewrites the entry.
Digest kinds:

* ``aes256-gcm`` (sealed; a random 12-byte nonce, then the id of the key that sealed it, 8 bytes, and 4 zero
  bytes: :mod:`.keyring`): written when a cache key (a secret
  shared by the job, see :func:`bagua_lightning.core.services_file.resolve_cache_key`) is configured and the
  ``cryptography`` package is installed. Everything after the header is encrypted (skeleton, tail, pad, data
  region; a pickled entry's too), and GCM's 16-byte tag, at the end of the entry, authenticates the redis
  key, the flags and lengths, and the ciphertext; the key id and zeros are checked by value. So an entry can be
  read over a connection that protects nothing (an eavesdropper sees the lengths, never types, shapes,
  numbers or contents) and a forged, altered or moved entry is a miss. ``encode(..., seal=False)`` writes
  ``gmac-aes256`` instead.
* ``gmac-aes256`` (a random 12-byte nonce, then 12 bytes of AES-256-GCM tag over the entry, in clear): what
  a cache key gave before sealing, still read. ``hmac-sha256`` (first 24 bytes), what earlier releases wrote
  (and this one without ``cryptography``), is verified too. Only holders of the key can write an entry that
  reads back, so an entry forged by someone who can write to Redis is a miss. With a key, entries without a
  keyed digest are refused; the keyed digest also detects corruption, so it replaces the checksum
  (:mod:`.digests`). Without a key, a keyed entry is a miss (a sealed one says that a cache key is needed).
* ``xxh3-64`` (when the ``xxhash`` package is installed, ~30 GB/s) or ``crc32`` (zlib) otherwise: without
  a key. These detect corruption, not forgery: anyone who can write to Redis can write a valid entry.

A reader verifies whichever unkeyed kind an entry carries (an ``xxh3`` entry without ``xxhash`` installed is a
miss). Entries of format version 1 are misses, rewritten in this format.

Decoding a reply buffer (``bytes``) that the caller hands over (``owned=True``) builds tensors directly on it,
with no copy; otherwise arrays view one writable copy of the data region. :func:`decode_many` decodes a batch
of entries (views of receive buffers, say) by column. When the fetch says that its entries lie evenly in one
receive buffer (:class:`~.resp.Replies`), the tensors of the batch are views of that buffer where they lie
(it is then the samples' own: the buffer pool hands it out again only once no sample holds it); otherwise the
array leaves of the batch are copied into one block. The sealed entries of a batch are decrypted into one new
block (:mod:`.batch_sealed`), and their tensors view it: decrypting is the copy. Pickle (flag bit 0) is
written and read only with ``allow_pickle``; a pickled entry is a miss for a reader that did not opt in, never
unpickled.

Modules: the header and one entry's reader are :mod:`.entry`'s; a batch is decoded by :mod:`.batches`
(one skeleton and one length: numpy rows; or else grouped by skeleton, by column), its sealed
entries opened first by :mod:`.batch_sealed`.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from . import digests
from .batch_sealed import decode_sealed, open_uniform, sealed_indices
from .batches import UNIFORM_MIN, decode_columns, decode_rows
from .digests import (
    DIGEST_CRC32,
    DIGEST_GMAC,
    DIGEST_HMAC,
    DIGEST_NAMES,
    DIGEST_SEAL,
    DIGEST_XXH3,
    NONCE_SIZE,
    SEAL_TAG_SIZE,
    default_digest_kind,
    seal_into,
)
from .digests import digest as _digest
from .entry import (
    COVERED,
    DIGEST_OFFSET,
    FLAG_PICKLE,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_ENTRY_BYTES,
    MISSING,
    Bad,
    decode,
)
from .keyring import key_field
from .values import PICKLE_HINT, REPLY_ALIGN, CorruptEntryError, Encoder, pad, reply_pad

__all__ = ["DIGEST_CRC32", "DIGEST_GMAC", "DIGEST_HMAC", "DIGEST_NAMES", "DIGEST_SEAL", "DIGEST_XXH3",
           "FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "MAX_ENTRY_BYTES", "MISSING", "PICKLE_HINT", "Bad",
           "CorruptEntryError", "decode", "decode_many", "default_digest_kind", "encode", "is_pickled"]


def encode(obj: Any, key: bytes = b"", *, allow_pickle: bool = False, secret: bytes | None = None,
           seal: bool | None = None) -> memoryview:
    """Serialize ``obj`` into one entry for ``key``.

    Args:
        obj: the sample.
        key: the Redis key it is stored under (bound into the digest).
        allow_pickle: store with pickle (protocol 5) instead of the safe codec.
        secret: the cache key; when given the entry is sealed with it (``aes256-gcm``: encrypted and
            authenticated), or authenticated with HMAC-SHA256 where the ``cryptography`` package is missing.
        seal: with ``secret``: None (the default) as just said; False authenticates without encrypting
            (``gmac-aes256``, what earlier releases wrote); True seals, or raises where ``cryptography`` is
            missing. Without ``secret`` only None and False are accepted. An entry past ``cryptography``'s
            limit for one call (2 GiB) is written ``hmac-sha256`` whatever ``seal`` says.

    Returns:
        A view of the entry's bytes, accepted by redis-py as a value without another copy.

    Raises:
        TypeError: a value the safe codec does not store (message names it, where it is and the opt-in).
        ValueError: ``seal=True`` without a ``secret``.
        RuntimeError: ``seal=True`` where ``cryptography`` is missing.
    """
    if secret is None:
        if seal:
            raise ValueError("sealing an entry needs a cache key (secret)")
        kind = default_digest_kind()
    elif seal is None:
        kind = digests.keyed_digest_kind()
    elif seal:
        if not digests.gmac_available():
            raise RuntimeError("sealing cache entries needs the cryptography package "
                               "(`pip install -U cryptography`)")
        kind = DIGEST_SEAL
    else:
        kind = digests.mac_digest_kind()
    if allow_pickle:
        data = pickle.dumps(obj, protocol=5)
        return _assemble(key, secret, kind, FLAG_PICKLE, b"", b"", [(0, memoryview(data))], len(data))
    enc = Encoder()
    enc.add(obj, "the sample")
    return _assemble(key, secret, kind, 0, enc.meta, enc.tail(), enc.arrays, enc.data_len)


def _assemble(key: bytes, secret: bytes | None, kind: int, flags: int, skeleton: bytes | bytearray,
              tail: bytes, arrays: list[tuple[int, memoryview]], data_len: int) -> memoryview:
    meta_len = len(skeleton) + len(tail)
    data_start = HEADER_SIZE + meta_len
    data_start += pad(data_start)
    if (kind in (DIGEST_GMAC, DIGEST_SEAL)
            and data_start + data_len + 2 * REPLY_ALIGN - COVERED > digests.GMAC_MAX_BYTES):
        kind = DIGEST_HMAC  # past cryptography's limit for one call (whatever the padding)
    tag = SEAL_TAG_SIZE if kind == DIGEST_SEAL else 0
    if not flags:  # zeros after the arrays, so that entries keep their alignment back to back in a reply buffer
        data_len += reply_pad(data_start + data_len + tag)
    out = bytearray(data_start + data_len + tag)
    HEADER.pack_into(out, 0, MAGIC, FORMAT_VERSION, kind, b"", flags, len(skeleton), len(tail), data_len)
    mv = memoryview(out)
    if tag:  # sealed: everything after the header laid out apart, then encrypted into the entry, the tag after it
        assert secret is not None
        nonce = os.urandom(NONCE_SIZE)
        out[DIGEST_OFFSET:DIGEST_OFFSET + NONCE_SIZE] = nonce
        out[DIGEST_OFFSET + NONCE_SIZE:COVERED] = key_field(secret)  # the entry names its key (.keyring)
        plain = bytearray(data_start - HEADER_SIZE + data_len)
        plain[:meta_len] = bytes(skeleton) + tail
        at = data_start - HEADER_SIZE
        for off, view in arrays:
            plain[at + off:at + off + view.nbytes] = view
        seal_into(secret, key, nonce, mv[COVERED:HEADER_SIZE], plain, mv[HEADER_SIZE:])
        return mv
    out[HEADER_SIZE:HEADER_SIZE + meta_len] = bytes(skeleton) + tail
    for off, view in arrays:
        out[data_start + off:data_start + off + view.nbytes] = view
    out[DIGEST_OFFSET:COVERED] = _digest(kind, key, secret, mv[COVERED:])
    return mv


def is_pickled(value: bytes | memoryview) -> bool:
    """True when ``value`` looks like an entry written with ``serializer="pickle"``."""
    return len(value) >= HEADER_SIZE and bytes(value[:3]) == MAGIC and bool(value[COVERED] & FLAG_PICKLE)


def decode_many(values: list[Any], keys: list[bytes], allow_pickle: bool = False,
                secret: bytes | None = None) -> list[Any]:
    """Decode many entries (``bytes`` or byte buffers, e.g. views of one receive buffer) read under ``keys``.

    The result has one item per entry: the sample, a :class:`Bad` carrying the :class:`CorruptEntryError`, or
    :data:`MISSING` where the value is None.
    Checks are :func:`decode`'s. Entries that share a skeleton (a dataset's samples do) are built together
    by their decoder's column: the tensors and arrays of one leaf across the batch are copied into one block
    and split into per-sample views in one call, so nothing refers to ``values`` afterwards
    (:mod:`.batches`). A batch of entries of one skeleton and one length is decoded by numpy first
    (:mod:`.batches`; its tensors may view the receive buffer it lies in). With a ``secret``, the sealed
    entries of the batch are opened into one block first and decoded there (:mod:`.batch_sealed`; their tensors
    view that block), the others as just said.
    """
    if secret is not None:
        if len(values) >= UNIFORM_MIN:  # the usual batch: every entry sealed alike, opened side by side
            done = open_uniform(values, keys, secret)
            if done is not None:
                return done
        sealed = sealed_indices(values)
        if sealed:
            n = len(values)
            if len(sealed) == n:
                return decode_sealed(values, keys, allow_pickle, secret)
            rest = sorted(set(range(n)).difference(sealed))
            out: list[Any] = [None] * n
            for idx, got in ((sealed, decode_sealed([values[j] for j in sealed], [keys[j] for j in sealed],
                                                    allow_pickle, secret)),
                             (rest, _decode_unsealed([values[j] for j in rest], [keys[j] for j in rest],
                                                     allow_pickle, secret))):
                for j, sample in zip(idx, got, strict=True):
                    out[j] = sample
            return out
    return _decode_unsealed(values, keys, allow_pickle, secret)


def _decode_unsealed(values: list[Any], keys: list[bytes], allow_pickle: bool,
                     secret: bytes | None) -> list[Any]:
    if (secret is not None or digests.xxhash is not None) and len(values) >= UNIFORM_MIN:
        done = decode_rows(values, keys, secret)
        if done is not None:
            return done
    return decode_columns(values, keys, allow_pickle, secret)

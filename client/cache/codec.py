"""The safe sample codec: one self-describing, checked entry per sample, without pickle.

Entry layout (little endian)::

    header   (52 bytes): b"BLC" | format version u8 | digest kind u8 | 3 zero bytes | digest (24 bytes, zero
                         padded) | flags u8 | 3 zero bytes | skeleton_len u32 | tail_len u32 | data_len u64
    skeleton (skeleton_len): types, dtypes, ranks, lengths, names (:mod:`.values`); shared by the samples
                         of a dataset, compiled once into a decoder (:mod:`.plans`)
    tail     (tail_len): the fixed-size fields of this sample (numbers, shapes, offsets), 8 bytes each
    pad                : zeros up to a multiple of 64 bytes
    data     (data_len): array, image, string and bytes contents, arrays on 64-byte boundaries, then up to 31
                         zero bytes (safe-codec entries) so that the entry's ``GET`` reply spans a multiple of 16
                         bytes (:func:`~.values.reply_pad`); readers of this version ignore them

The digest covers the key the entry was written under and everything after the digest (flags, lengths,
skeleton, tail, data: one contiguous region, hashed in one call); magic, version and digest kind are
checked by value. A flipped bit, a truncated value or a valid entry copied under another key all fail
:func:`decode` with :class:`CorruptEntryError`; the loader counts that as a miss and rewrites the entry.
Digest kinds:

* ``gmac-aes256`` (a random 12-byte nonce, then 12 bytes of AES-256-GCM tag): written when a cache key (a
  secret shared by the job, see :func:`bagua_lightning.core.services_file.resolve_cache_key`) is configured.
  Only holders of the key can write an entry that reads back, so an entry forged by someone who can write to
  Redis is a miss. ``hmac-sha256`` (first 24 bytes), what earlier releases wrote, is verified too. With a key,
  entries without a keyed digest are refused; the keyed digest also detects corruption, so it replaces the
  checksum (:mod:`.digests`).
* ``xxh3-64`` (when the ``xxhash`` package is installed, ~30 GB/s) or ``crc32`` (zlib) otherwise: without
  a key. These detect corruption, not forgery: anyone who can write to Redis can write a valid entry.

A reader verifies whichever unkeyed kind an entry carries (an ``xxh3`` entry without ``xxhash`` installed is a
miss). Entries of format version 1 are misses, rewritten in this format.

Decoding a reply buffer (``bytes``) that the caller hands over (``owned=True``) builds tensors directly on it,
with no copy; otherwise arrays view one writable copy of the data region. :func:`decode_many` decodes a batch
of entries (views of receive buffers, say) by column. When the fetch says that its entries lie evenly in one
receive buffer (:class:`~.backends.Replies`), the tensors of the batch are views of that buffer where they lie
(it is then the samples' own: the buffer pool hands it out again only once no sample holds it); otherwise the
array leaves of the batch are copied into one block. Pickle (flag bit 0) is written and
read only with ``allow_pickle``; a pickled entry is a miss for a reader that did not opt in, never unpickled.

Modules: the header and one entry's reader are :mod:`.entry`'s; a batch is decoded by :mod:`.batch_vector`
(one skeleton and one length: numpy rows) or else by :mod:`.batch_column` (grouped by skeleton).
"""

from __future__ import annotations

import pickle
from typing import Any

from . import digests
from .batch_column import decode_columns
from .batch_vector import UNIFORM_MIN, decode_rows
from .digests import DIGEST_CRC32, DIGEST_GMAC, DIGEST_HMAC, DIGEST_NAMES, DIGEST_XXH3, default_digest_kind
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
from .values import PICKLE_HINT, CorruptEntryError, Encoder, pad, reply_pad

__all__ = ["DIGEST_CRC32", "DIGEST_GMAC", "DIGEST_HMAC", "DIGEST_NAMES", "DIGEST_XXH3", "FORMAT_VERSION",
           "HEADER_SIZE", "MAGIC", "MAX_ENTRY_BYTES", "MISSING", "PICKLE_HINT", "Bad", "CorruptEntryError",
           "decode", "decode_many", "default_digest_kind", "encode", "is_pickled"]


def encode(obj: Any, key: bytes = b"", *, allow_pickle: bool = False, secret: bytes | None = None) -> memoryview:
    """Serialize ``obj`` into one entry for ``key``.

    Args:
        obj: the sample.
        key: the Redis key it is stored under (bound into the digest).
        allow_pickle: store with pickle (protocol 5) instead of the safe codec.
        secret: the cache key; when given the entry is authenticated with it (AES-GMAC, or HMAC-SHA256 where
            the ``cryptography`` package is missing).

    Returns:
        A view of the entry's bytes, accepted by redis-py as a value without another copy.

    Raises:
        TypeError: a value the safe codec does not store (message names it, where it is and the opt-in).
    """
    kind = digests.keyed_digest_kind() if secret is not None else default_digest_kind()
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
    if not flags:  # zeros after the arrays, so that entries keep their alignment back to back in a reply buffer
        data_len += reply_pad(data_start + data_len)
    out = bytearray(data_start + data_len)
    out[HEADER_SIZE:HEADER_SIZE + meta_len] = bytes(skeleton) + tail
    for off, view in arrays:
        out[data_start + off:data_start + off + view.nbytes] = view
    if kind == DIGEST_GMAC and len(out) - COVERED > digests.GMAC_MAX_BYTES:
        kind = DIGEST_HMAC
    HEADER.pack_into(out, 0, MAGIC, FORMAT_VERSION, kind, b"", flags, len(skeleton), len(tail), data_len)
    mv = memoryview(out)
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
    by their plan's column: the tensors and arrays of one leaf across the batch are copied into one block
    and split into per-sample views in one call, so nothing refers to ``values`` afterwards
    (:mod:`.batch_column`). A batch of entries of one skeleton and one length is decoded by numpy first
    (:mod:`.batch_vector`; its tensors may view the receive buffer it lies in).
    """
    if (secret is not None or digests.xxhash is not None) and len(values) >= UNIFORM_MIN:
        done = decode_rows(values, keys, secret)
        if done is not None:
            return done
    return decode_columns(values, keys, allow_pickle, secret)

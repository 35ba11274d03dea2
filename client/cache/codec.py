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
"""

from __future__ import annotations

import hmac
import pickle
import struct
from typing import Any

from . import digests
from .digests import (
    DIGEST_CRC32,
    DIGEST_GMAC,
    DIGEST_HMAC,
    DIGEST_NAMES,
    DIGEST_SIZE,
    DIGEST_XXH3,
    KEYED_KINDS,
    NONCE_SIZE,
    default_digest_kind,
    gmac_tags,
    hmac_digest,
)
from .digests import digest as _digest
from .plans import PLANS, Rows, plan_for
from .values import ALIGN, PICKLE_HINT, CorruptEntryError, Encoder, pad, reply_pad

__all__ = ["DIGEST_CRC32", "DIGEST_GMAC", "DIGEST_HMAC", "DIGEST_NAMES", "DIGEST_XXH3", "PICKLE_HINT", "Bad", "CorruptEntryError",
           "decode", "decode_many", "default_digest_kind", "encode", "is_pickled"]

MAGIC = b"BLC"
FORMAT_VERSION = 2
FLAG_PICKLE = 0x01
MAX_ENTRY_BYTES = 4 * 1024**3  # a larger value is refused before any work

_HEADER = struct.Struct(f"<3sBB3x{DIGEST_SIZE}sB3xIIQ")
HEADER_SIZE = _HEADER.size  # 52
_HEADER_XXH = struct.Struct(f"<3sBB3xQ{DIGEST_SIZE - 8}sB3xIIQ")  # the same, an xxh3 digest read as its integer
_DIGEST_OFFSET = 8
_COVERED = _DIGEST_OFFSET + DIGEST_SIZE  # the digest covers the entry from here on
_U64 = struct.Struct("<Q")
_PAD16 = bytes(16)


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
    if kind == DIGEST_GMAC and len(out) - _COVERED > digests.GMAC_MAX_BYTES:
        kind = DIGEST_HMAC
    _HEADER.pack_into(out, 0, MAGIC, FORMAT_VERSION, kind, b"", flags, len(skeleton), len(tail), data_len)
    mv = memoryview(out)
    out[_DIGEST_OFFSET:_COVERED] = _digest(kind, key, secret, mv[_COVERED:])
    return mv


def is_pickled(value: bytes | memoryview) -> bool:
    """True when ``value`` looks like an entry written with ``serializer="pickle"``."""
    return len(value) >= HEADER_SIZE and bytes(value[:3]) == MAGIC and bool(value[_COVERED] & FLAG_PICKLE)


def decode(value: bytes | bytearray | memoryview, key: bytes = b"", allow_pickle: bool = False,
           secret: bytes | None = None, owned: bool = False) -> Any:
    """Rebuild the sample from an entry read under ``key``.

    Args:
        value: the entry.
        key: the key it was read under.
        allow_pickle: accept (and unpickle) entries written with pickle.
        secret: the cache key; when given only entries authenticated with it are accepted.
        owned: ``value`` is a ``bytes`` object nobody else uses (a fresh reply): tensors view it directly.

    Raises:
        CorruptEntryError: not a valid entry of this format for this key, for any reason (digest, format,
            budget, an unknown class, a pickled entry without ``allow_pickle``); never another exception.
    """
    try:
        mv = memoryview(value)
        if type(value) is not bytes and (mv.format != "B" or mv.ndim != 1):
            mv = mv.cast("B")
        size = mv.nbytes
        if size < HEADER_SIZE:
            raise CorruptEntryError(f"entry of {size} bytes is shorter than the {HEADER_SIZE}-byte header")
        if size > MAX_ENTRY_BYTES:
            raise CorruptEntryError(f"entry of {size} bytes is over the {MAX_ENTRY_BYTES}-byte budget")
        magic, version, kind, digest, flags, skel_len, tail_len, data_len = _HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise CorruptEntryError("not a bagua-lightning cache entry (bad magic)")
        if version != FORMAT_VERSION:
            raise CorruptEntryError(f"entry format version {version}, this reader understands {FORMAT_VERSION}")
        tail_start = HEADER_SIZE + skel_len
        data_start = (tail_start + tail_len + ALIGN - 1) & -ALIGN
        if data_start + data_len != size:
            raise CorruptEntryError(f"entry length {size} does not match its header ({data_start + data_len})")
        if secret is not None and kind not in KEYED_KINDS:
            raise CorruptEntryError(f"entry carries a {DIGEST_NAMES.get(kind, kind)} digest; a cache key is "
                                    "configured, so only entries authenticated with it are accepted")
        xxhash = digests.xxhash
        if kind == DIGEST_XXH3 and xxhash is not None:  # the common case, without a call to _digest
            expected = _U64.pack(xxhash.xxh3_64_intdigest(mv[_COVERED:], xxhash.xxh3_64_intdigest(key))) + _PAD16
        else:
            expected = _digest(kind, key, secret, mv[_COVERED:], digest)
        if not hmac.compare_digest(expected, digest):
            raise CorruptEntryError(_MISMATCH_KEYED if kind in KEYED_KINDS else _MISMATCH)
        if flags:
            if flags != FLAG_PICKLE:
                raise CorruptEntryError(f"unknown flags {flags:#x}")
            if not allow_pickle:
                raise CorruptEntryError('entry was written with serializer="pickle"; not unpickling it')
            return pickle.loads(mv[data_start:])
        skeleton = bytes(mv[HEADER_SIZE:tail_start])
        plan = PLANS.get(skeleton) or plan_for(skeleton)
        if plan.tail.size != tail_len:
            raise CorruptEntryError(f"tail of {tail_len} bytes, its skeleton says {plan.tail.size}")
        tail = plan.tail.unpack_from(mv, tail_start)
        data = mv[data_start:]
        shared = owned and type(value) is bytes
        # numpy arrays need a writable buffer; tensors view the reply when the caller owns it
        writable = bytearray(data) if plan.arrays or (plan.tensors and not shared) else None
        return plan.build(tail, data if shared or writable is None else writable, writable)
    except CorruptEntryError:
        raise
    except Exception as exc:  # a damaged structure can fail anywhere in the decoder: always a miss
        raise CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})") from exc


_XXH_PREFIX = MAGIC + bytes((FORMAT_VERSION, DIGEST_XXH3, 0, 0, 0))
_KEYED_PREFIXES = tuple(MAGIC + bytes((FORMAT_VERSION, kind, 0, 0, 0)) for kind in (DIGEST_GMAC, DIGEST_HMAC))


def _whole_entry_reader(skeleton: bytes, tail: struct.Struct) -> tuple[Any, int, bytes, int]:
    """For entries of one skeleton: (unpack_from of header + skeleton + tail, its size, the fixed bytes after the
    digest (flags, lengths), where the data region starts). Fields: prefix, digest, digest padding, fixed,
    data length, skeleton, then the tail's."""
    whole = struct.Struct(f"<8sQ{DIGEST_SIZE - 8}s12sQ{len(skeleton)}s{tail.format[1:]}")
    fixed = struct.pack("<B3xII", 0, len(skeleton), tail.size)
    data_start = (HEADER_SIZE + len(skeleton) + tail.size + ALIGN - 1) & -ALIGN
    return whole.unpack_from, whole.size, fixed, data_start


UNIFORM_MIN = 8  # entries in a batch from which one of one skeleton and one length is decoded by numpy
_QS: dict[int, Any] = {}  # n -> struct of n u64, for digests compared at once


def _uniform_checks(plan: Any, tail_start: int, tail_len: int, start: int, np: Any) -> tuple[Any, Any]:
    """The byte columns that every entry of ``plan``'s skeleton has in common with the others of its length in a
    batch: all before the data region but the digest and the tail's numbers (ints and floats vary by sample;
    shapes, offsets and lengths may not, for the batch to be decoded together). Two sets: for xxh3 entries
    (whose digest is 8 bytes, then zeros that every entry shares) and for keyed entries (24 bytes of digest)."""
    cols = [*range(0, _DIGEST_OFFSET), *range(_DIGEST_OFFSET + 8, tail_start)]
    for j, code in enumerate(plan.tail.format[1:]):
        if code == "Q":
            cols += range(tail_start + 8 * j, tail_start + 8 * j + 8)
    cols += range(tail_start + tail_len, start)
    xxh3_cols = np.array(cols, np.intp)
    return xxh3_cols, xxh3_cols[(xxh3_cols < _DIGEST_OFFSET) | (xxh3_cols >= _COVERED)]


def _decode_uniform(values: list[Any], keys: list[bytes], secret: bytes | None) -> list[Any] | None:
    """Entries of one skeleton and one length (a batch of a dataset of fixed-size samples), decoded with numpy
    doing the per-entry work: the batch is one ``(n, length)`` array, where the entries lie if the fetch says
    they lie evenly in one receive buffer (:class:`~.backends.Replies`), else a copy of them side by side; every
    byte the entries must share compared at once, one digest per entry (xxh3, or with ``secret`` the keyed
    digest the entries carry) and all of them compared at once, tail numbers read as
    columns, each tensor leaf split into per-sample views by one call. None when the batch is not such (a miss,
    another length, another kind of entry, shapes that differ, a damaged entry): :func:`decode_many` then goes
    entry by entry, and finds any culprit.
    """
    import numpy as np

    try:
        if len(set(map(len, values))) != 1:
            return None
    except TypeError:  # a None: a miss among them
        return None
    n = len(values)
    run: Any = getattr(values, "run", None)
    order: list[int] | None = None
    if run is not None and len(run[3]) == n:
        order = run[3]
        head = values[order[0]]
    else:
        head = values[0]
    head = memoryview(head)
    length = len(head)
    if head.itemsize != 1 or head.ndim != 1 or length < HEADER_SIZE:
        return None
    magic, version, kind, _, rest, flags, skel_len, tail_len, data_len = _HEADER_XXH.unpack_from(head, 0)
    if flags or magic != MAGIC or version != FORMAT_VERSION:
        return None
    if (kind != DIGEST_XXH3 or rest != _PAD16) if secret is None else kind not in KEYED_KINDS:
        return None
    tail_start = HEADER_SIZE + skel_len
    skeleton = bytes(head[HEADER_SIZE:tail_start])
    try:
        plan = PLANS.get(skeleton) or plan_for(skeleton)
    except CorruptEntryError:
        return None
    if plan.vector is None or plan.tail.size != tail_len:
        return None
    if plan.fast is None:
        plan.fast = _whole_entry_reader(plan.skeleton, plan.tail)
    start = plan.fast[3]
    if start + data_len != length:
        return None
    if plan.uniform is None:
        plan.uniform = _uniform_checks(plan, tail_start, tail_len, start, np)
    if order is not None:  # the entries where they lie: row r is the value of key order[r]
        buf, first, stride = run[0], run[1], run[2]
        if first + (n - 1) * stride + length > len(buf):
            return None
        rows = np.ndarray((n, length), np.uint8, buf, first, (stride, 1))
        keys = list(map(keys.__getitem__, order))
    else:
        buf = bytearray().join(values)
        first, stride = 0, length
        rows = np.frombuffer(buf, np.uint8).reshape(n, length)
    # The bytes every entry shares, equal to the first's; then the digests, all at once.
    same = rows[:, plan.uniform[secret is not None]]
    if same.tobytes() != same[0].tobytes() * n:
        return None
    flat, covered = memoryview(buf), length - _COVERED
    at = first + _COVERED
    if secret is not None:  # every entry has the first's digest kind: it is among the bytes compared above
        starts = range(at, at + n * stride, stride)
        if kind == DIGEST_GMAC:  # the nonces are the entries' own; only the tags need comparing
            if not digests.gmac_available():
                return None
            tags = gmac_tags(secret, flat, starts, covered, keys)
            if not hmac.compare_digest(tags, rows[:, _DIGEST_OFFSET + NONCE_SIZE:_COVERED].tobytes()):
                return None
        else:
            macs = [hmac_digest(secret, k, flat[a:a + covered]) for a, k in zip(starts, keys, strict=True)]
            if not hmac.compare_digest(b"".join(macs), rows[:, _DIGEST_OFFSET:_COVERED].tobytes()):
                return None
    else:
        xxh3 = digests.xxhash.xxh3_64_intdigest
        sums = [xxh3(flat[a:a + covered], xxh3(k)) for a, k in zip(range(at, at + n * stride, stride), keys, strict=True)]
        qs = _QS.get(n)
        if qs is None:
            qs = _QS[n] = struct.Struct(f"<{n}Q")
        if qs.pack(*sums) != rows[:, _DIGEST_OFFSET:_DIGEST_OFFSET + 8].tobytes():
            return None
    tail = np.ascontiguousarray(rows[:, tail_start:tail_start + tail_len]) if tail_len else None
    align = (first | stride | 16) & -(first | stride | 16)  # receive buffers start on 16-byte boundaries
    try:
        built = plan.vector(Rows(rows, tail, start, plan.tail.unpack_from(head, tail_start), align))
    except Exception:  # shapes that numpy will not split, say: entry by entry
        return None
    if order is None:
        return built
    out: list[Any] = [None] * n
    for j, sample in zip(order, built, strict=True):
        out[j] = sample
    return out


_MISMATCH = "digest mismatch (corrupted, truncated, stored under another key)"
_MISMATCH_KEYED = "digest mismatch (corrupted, truncated, stored under another key, or not written with this cache key)"


def _batch_macs(values: list[Any], keys: list[bytes], secret: bytes) -> list[Any]:
    """The expected digests of the keyed entries among ``values`` (None for the others, and for those this
    process cannot verify)."""
    out: list[Any] = [None] * len(values)
    for j, value in enumerate(values):
        if value is None:
            continue
        mv = value if type(value) is memoryview else memoryview(value)
        if mv.itemsize != 1 or mv.ndim != 1:
            mv = mv.cast("B")
        if len(mv) >= HEADER_SIZE and mv[3] == FORMAT_VERSION and mv[4] in KEYED_KINDS:
            try:
                out[j] = _digest(mv[4], keys[j], secret, mv[_COVERED:], mv[_DIGEST_OFFSET:_COVERED])
            except CorruptEntryError:  # a kind this process cannot verify: decode() says why
                pass
    return out


class Bad:
    """Stands in :func:`decode_many`'s result for an entry that did not decode; ``error`` says why."""

    __slots__ = ("error",)

    def __init__(self, error: CorruptEntryError | None) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"Bad({self.error!r})" if self.error is not None else "MISSING"


MISSING = Bad(None)  # decode_many's result for a value that is None (a missing key)


def decode_many(values: list[Any], keys: list[bytes], allow_pickle: bool = False,
                secret: bytes | None = None) -> list[Any]:
    """Decode many entries (``bytes`` or byte buffers, e.g. views of one receive buffer) read under ``keys``.

    The result has one item per entry: the sample, a :class:`Bad` carrying the :class:`CorruptEntryError`, or
    :data:`MISSING` where the value is None.
    Checks are :func:`decode`'s. Entries that share a skeleton (a dataset's samples do) are built together
    by their plan's column: the tensors and arrays of one leaf across the batch are copied into one block
    and split into per-sample views in one call, so nothing refers to ``values`` afterwards.
    """
    n = len(values)
    xxhash = digests.xxhash
    # The common cases are checked inline: unkeyed xxh3 entries, and keyed entries with their MACs computed
    # for the whole batch first. Any other entry goes through decode() on its own.
    fast = secret is not None or xxhash is not None
    if fast and n >= UNIFORM_MIN:
        done = _decode_uniform(values, keys, secret)
        if done is not None:
            return done
    macs = _batch_macs(values, keys, secret) if secret is not None else None
    prefixes, wanted = ((_XXH_PREFIX,), (DIGEST_XXH3,)) if macs is None else (_KEYED_PREFIXES, KEYED_KINDS)
    out: list[Any] = [None] * n
    groups: dict[int, tuple[Any, list[int], list[tuple[Any, ...]], list[Any]]] = {}
    unpack, plans, same = _HEADER_XXH.unpack_from, PLANS, hmac.compare_digest
    xxh3: Any = xxhash.xxh3_64_intdigest if xxhash is not None else None
    # The last skeleton seen, read with its whole-entry struct (header, skeleton and tail in one unpack).
    l_unpack: Any = None
    l_size = l_start = 0
    l_fixed = l_skeleton = b""
    l_idx: list[int] = []
    l_tails: list[tuple[Any, ...]] = []
    l_datas: list[Any] = []
    for j in range(n):
        value = values[j]
        if value is None:
            out[j] = MISSING
            continue
        try:
            mv = value if type(value) is memoryview else memoryview(value)
            if mv.itemsize != 1 or mv.ndim != 1:
                mv = mv.cast("B")
            size = len(mv)
            if l_unpack is not None and size >= l_size:
                t = l_unpack(mv, 0)
                if t[0] in prefixes and t[3] == l_fixed and t[5] == l_skeleton and (
                        t[2] == _PAD16 if macs is None else macs[j] is not None):
                    if l_start + t[4] != size:
                        raise CorruptEntryError(f"entry length {size} does not match its header ({l_start + t[4]})")
                    if (xxh3(mv[_COVERED:], xxh3(keys[j])) != t[1] if macs is None
                            else not same(macs[j], mv[_DIGEST_OFFSET:_COVERED])):
                        raise CorruptEntryError(_MISMATCH if macs is None else _MISMATCH_KEYED)
                    l_idx.append(j)
                    l_tails.append(t[6:])
                    l_datas.append(mv[l_start:])
                    continue
            if fast and size >= HEADER_SIZE:
                magic, version, kind, digest, rest, flags, skel_len, tail_len, data_len = unpack(mv, 0)
                if (kind in wanted and not flags and magic == MAGIC and version == FORMAT_VERSION
                        and (macs is None or macs[j] is not None)):
                    tail_start = HEADER_SIZE + skel_len
                    data_start = (tail_start + tail_len + ALIGN - 1) & -ALIGN
                    if data_start + data_len != size:
                        raise CorruptEntryError(f"entry length {size} does not match its header "
                                                f"({data_start + data_len})")
                    if macs is None:
                        if xxh3(mv[_COVERED:], xxh3(keys[j])) != digest or rest != _PAD16:
                            raise CorruptEntryError(_MISMATCH)
                    elif not same(macs[j], mv[_DIGEST_OFFSET:_COVERED]):
                        raise CorruptEntryError(_MISMATCH_KEYED)
                    skeleton = bytes(mv[HEADER_SIZE:tail_start])
                    plan = plans.get(skeleton) or plan_for(skeleton)
                    if plan.tail.size != tail_len:
                        raise CorruptEntryError(f"tail of {tail_len} bytes, its skeleton says {plan.tail.size}")
                    group = groups.get(id(plan))
                    if group is None:
                        group = groups[id(plan)] = (plan, [], [], [])
                    group[1].append(j)
                    group[2].append(plan.tail.unpack_from(mv, tail_start))
                    group[3].append(mv[data_start:])
                    if plan.fast is None:
                        plan.fast = _whole_entry_reader(plan.skeleton, plan.tail)
                    l_unpack, l_size, l_fixed, l_start = plan.fast
                    l_skeleton, l_idx, l_tails, l_datas = plan.skeleton, group[1], group[2], group[3]
                    continue
            out[j] = decode(value, keys[j], allow_pickle, secret)  # any other entry, on its own
        except CorruptEntryError as exc:
            out[j] = Bad(exc)
        except Exception as exc:
            out[j] = Bad(CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})"))
    for plan, idx, tails, datas in groups.values():
        try:
            built = plan.column(tails, datas)
        except Exception:  # a damaged entry among them: each on its own, so only that one is a miss
            built = None
        if built is not None and len(built) == len(idx):
            for j, sample in zip(idx, built, strict=True):
                out[j] = sample
            continue
        for j in idx:
            try:
                out[j] = decode(values[j], keys[j], allow_pickle, secret)
            except CorruptEntryError as exc:
                out[j] = Bad(exc)
    return out

"""Decoding a batch of entries: by numpy rows where they are of one skeleton and one length, else by column.

**Rows.** A dataset of fixed-size samples fetches batches of entries of one skeleton and one length. The batch
is one ``(n, length)`` array: where the entries lie, if the fetch says they lie evenly in one receive buffer
(:class:`~.resp.Replies`), else a copy of them side by side. Every byte the entries must share is compared at
once, one digest per entry is computed (xxh3, or with a cache key the keyed digest the entries carry) and all
of them compared at once, the tail numbers are read as columns, and each tensor leaf is split into per-sample
views by one call (the decoder's :data:`~.decoder.Vector`). Anything else (a miss, another length, another
kind of entry, shapes that differ, a damaged entry) is not such a batch: :func:`decode_rows` returns None and
:func:`.codec.decode_many` goes on by column, which finds any culprit.

Sealed entries are opened first (:mod:`.batch_sealed`), into one block of this process's making where opened
entry ``i`` lies at ``i * stride``: :func:`decode_opened_rows` decodes that block the same way, where it lies,
with no digest to verify (GCM's tags were). It is the only way in to that: :func:`decode_rows` refuses the
opened entries' marker kind (:data:`~.entry.OPENED`), as every check of a value read does.

**Columns** (:func:`decode_columns`). The batch is read entry by entry, the common cases checked inline
(unkeyed xxh3 entries; keyed entries, their MACs computed for the whole batch first) and grouped by decoder;
an entry of the skeleton seen last is read with one ``struct`` unpack of its header, skeleton and tail. Each
group is then built by its decoder's :data:`~.decoder.Column`: the tensors and arrays of one leaf across the
group are copied into one block and split into per-sample views in one call, so nothing refers to the values
afterwards. Any other entry, and every entry of a group that fails to build, goes through
:func:`.entry.decode` on its own, so only a damaged entry is a miss.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Callable
from typing import Any

from . import digests
from .decoder import Decoder, Rows, Vector
from .digests import DIGEST_GMAC, DIGEST_XXH3, MAC_KINDS, NONCE_SIZE, gmac_tags, hmac_digest
from .digests import digest as _digest
from .entry import (
    COVERED,
    DIGEST_OFFSET,
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_XXH,
    KEYED_PREFIXES,
    MAGIC,
    MISMATCH,
    MISMATCH_KEYED,
    MISSING,
    OPENED,
    PAD16,
    XXH_PREFIX,
    Bad,
    decode,
    whole_entry_reader,
)
from .skeletons import DECODERS, decoder_for
from .values import ALIGN, CorruptEntryError

UNIFORM_MIN = 8  # entries in a batch from which one of one skeleton and one length is decoded by numpy
_QS: dict[int, Any] = {}  # n -> struct of n u64, for digests compared at once


def _uniform_checks(decoder: Any, tail_start: int, tail_len: int, start: int, np: Any) -> tuple[Any, Any]:
    """The byte columns that every entry of ``decoder``'s skeleton has in common with the others of its length in a
    batch: all before the data region but the digest and the tail's numbers (ints and floats vary by sample;
    shapes, offsets and lengths may not, for the batch to be decoded together). Two sets: for xxh3 entries
    (whose digest is 8 bytes, then zeros that every entry shares) and for keyed entries (24 bytes of digest)."""
    cols = [*range(0, DIGEST_OFFSET), *range(DIGEST_OFFSET + 8, tail_start)]
    for j, code in enumerate(decoder.tail.format[1:]):
        if code == "Q":
            cols += range(tail_start + 8 * j, tail_start + 8 * j + 8)
    cols += range(tail_start + tail_len, start)
    xxh3_cols = np.array(cols, np.intp)
    return xxh3_cols, xxh3_cols[(xxh3_cols < DIGEST_OFFSET) | (xxh3_cols >= COVERED)]


def _head_plan(head: memoryview, secret: bytes | None, np: Any,
               opened: bool = False) -> tuple[Decoder, Vector, int, int, int] | None:
    """The decoder of the batch's first entry, with its vector reader, its digest kind, where its tail starts and its tail's
    length; None when that entry is not one a batch can be decoded by (flags, another version or digest kind,
    a skeleton without a vector reader, a length that its header does not give). ``opened``: the entries are
    opened ones (kind :data:`~.entry.OPENED`), the only kind then accepted; else that kind never is."""
    length = len(head)
    if head.itemsize != 1 or head.ndim != 1 or length < HEADER_SIZE:
        return None
    magic, version, kind, _, rest, flags, skel_len, tail_len, data_len = HEADER_XXH.unpack_from(head, 0)
    if flags or magic != MAGIC or version != FORMAT_VERSION:
        return None
    if opened:
        if kind != OPENED:
            return None
    elif (kind != DIGEST_XXH3 or rest != PAD16) if secret is None else kind not in MAC_KINDS:
        return None
    tail_start = HEADER_SIZE + skel_len
    skeleton = bytes(head[HEADER_SIZE:tail_start])
    try:
        decoder = DECODERS.get(skeleton) or decoder_for(skeleton)
    except CorruptEntryError:
        return None
    vector = decoder.vector
    if vector is None or decoder.tail.size != tail_len:
        return None
    if decoder.fast is None:
        decoder.fast = whole_entry_reader(decoder.skeleton, decoder.tail)
    start = decoder.fast[3]
    if start + data_len != length:
        return None
    if decoder.uniform is None:
        decoder.uniform = _uniform_checks(decoder, tail_start, tail_len, start, np)
    return decoder, vector, kind, tail_start, tail_len


def _digests_match(rows: Any, buf: Any, first: int, stride: int, length: int, keys: list[bytes], kind: int,
                   secret: bytes | None) -> bool:
    """Whether every row's digest is the one of its key and its bytes (all compared at once)."""
    n = len(keys)
    flat, covered = memoryview(buf), length - COVERED
    at = first + COVERED
    starts = range(at, at + n * stride, stride)
    if secret is not None:  # every entry has the first's digest kind: it is among the bytes compared before
        if kind == DIGEST_GMAC:  # the nonces are the entries' own; only the tags need comparing
            if not digests.gmac_available():
                return False
            tags = gmac_tags(secret, flat, starts, covered, keys)
            return hmac.compare_digest(tags, rows[:, DIGEST_OFFSET + NONCE_SIZE:COVERED].tobytes())
        macs = [hmac_digest(secret, k, flat[a:a + covered]) for a, k in zip(starts, keys, strict=True)]
        return hmac.compare_digest(b"".join(macs), rows[:, DIGEST_OFFSET:COVERED].tobytes())
    xxh3 = digests.xxhash.xxh3_64_intdigest
    sums = [xxh3(flat[a:a + covered], xxh3(k)) for a, k in zip(starts, keys, strict=True)]
    qs = _QS.get(n)
    if qs is None:
        qs = _QS[n] = struct.Struct(f"<{n}Q")
    return bool(qs.pack(*sums) == rows[:, DIGEST_OFFSET:DIGEST_OFFSET + 8].tobytes())


def decode_rows(values: list[Any], keys: list[bytes], secret: bytes | None) -> list[Any] | None:
    """The samples of ``values`` read under ``keys``, when they are entries of one skeleton and one length
    (see the module's docstring); else None."""
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
    if order is not None:  # the entries where they lie: row r is the value of key order[r]
        buf, first, stride = run[0], run[1], run[2]
        if first + (n - 1) * stride + len(head) > len(buf):
            return None
        keys = list(map(keys.__getitem__, order))
    else:
        buf = None
        first = stride = 0
    built = _decode(np, head, n, buf, first, stride, keys, secret, False, values)
    if order is None or built is None:
        return built
    out: list[Any] = [None] * n
    for j, sample in zip(order, built, strict=True):
        out[j] = sample
    return out


def decode_opened_rows(block: Any, stride: int, length: int, m: int, first: int = 0) -> list[Any] | None:
    """The samples of the ``m`` entries that :mod:`.batch_sealed` opened into ``block``, each ``length``
    bytes, entry ``i`` at ``first + i * stride``, when they are of one skeleton; else None. Their tags have been
    checked, so no digest is (only ever called on entries it opened: never on values as read)."""
    import numpy as np

    return _decode(np, memoryview(block)[first:first + length], m, block, first, stride, [], None, True, None)


def _decode(np: Any, head: memoryview, n: int, buf: Any, first: int, stride: int, keys: list[bytes],
            secret: bytes | None, opened: bool, values: list[Any] | None) -> list[Any] | None:
    """The samples of ``n`` entries of ``head``'s length, row ``r`` at ``first + r * stride`` in ``buf`` (or,
    where ``buf`` is None, ``values`` side by side in a copy), read under ``keys`` in row order; None where
    they are not a batch this module decodes."""
    found = _head_plan(head, secret, np, opened)
    if found is None:
        return None
    decoder, vector, kind, tail_start, tail_len = found
    length, start = len(head), decoder.fast[3]
    if buf is not None:
        rows = np.ndarray((n, length), np.uint8, buf, first, (stride, 1))
    else:
        assert values is not None
        buf = bytearray().join(values)
        first, stride = 0, length
        rows = np.frombuffer(buf, np.uint8).reshape(n, length)
    # The bytes every entry shares, equal to the first's; then the digests, all at once.
    same = rows[:, decoder.uniform[secret is not None or opened]]
    if same.tobytes() != same[0].tobytes() * n:
        return None
    if not opened and not _digests_match(rows, buf, first, stride, length, keys, kind, secret):
        return None
    tail = np.ascontiguousarray(rows[:, tail_start:tail_start + tail_len]) if tail_len else None
    align = (first | stride | 16) & -(first | stride | 16)  # receive buffers start on 16-byte boundaries
    try:
        return vector(Rows(rows, tail, start, decoder.tail.unpack_from(head, tail_start), align))
    except Exception:  # shapes that numpy will not split, say: entry by entry
        return None


# decoder id -> (decoder, entry indices, their tail values, their data regions)
Groups = dict[int, tuple[Decoder, list[int], list[tuple[Any, ...]], list[Any]]]


def decode_columns(values: list[Any], keys: list[bytes], allow_pickle: bool = False,
                   secret: bytes | None = None) -> list[Any]:
    """The samples of ``values`` read under ``keys`` (see :func:`.codec.decode_many` for the result)."""
    out: list[Any] = [None] * len(values)
    groups = _group(values, keys, allow_pickle, secret, out)
    build_groups(groups, lambda j: decode(values[j], keys[j], allow_pickle, secret), out)
    return out


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
        if len(mv) >= HEADER_SIZE and mv[3] == FORMAT_VERSION and mv[4] in MAC_KINDS:
            try:
                out[j] = _digest(mv[4], keys[j], secret, mv[COVERED:], mv[DIGEST_OFFSET:COVERED])
            except CorruptEntryError:  # a kind this process cannot verify: decode() says why
                pass
    return out


def _group(values: list[Any], keys: list[bytes], allow_pickle: bool, secret: bytes | None,
           out: list[Any]) -> Groups:
    """Check every entry of ``values``: fill ``out`` with :data:`MISSING`, :class:`Bad` or the samples decoded on
    their own, and return the entries of the common cases grouped by decoder (still to be built)."""
    n = len(values)
    xxhash = digests.xxhash
    fast = secret is not None or xxhash is not None
    macs = _batch_macs(values, keys, secret) if secret is not None else None
    prefixes, wanted = ((XXH_PREFIX,), (DIGEST_XXH3,)) if macs is None else (KEYED_PREFIXES, MAC_KINDS)
    groups: Groups = {}
    unpack, same = HEADER_XXH.unpack_from, hmac.compare_digest
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
                        t[2] == PAD16 if macs is None else macs[j] is not None):
                    if l_start + t[4] != size:
                        raise CorruptEntryError(f"entry length {size} does not match its header ({l_start + t[4]})")
                    if (xxh3(mv[COVERED:], xxh3(keys[j])) != t[1] if macs is None
                            else not same(macs[j], mv[DIGEST_OFFSET:COVERED])):
                        raise CorruptEntryError(MISMATCH if macs is None else MISMATCH_KEYED)
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
                        if xxh3(mv[COVERED:], xxh3(keys[j])) != digest or rest != PAD16:
                            raise CorruptEntryError(MISMATCH)
                    elif not same(macs[j], mv[DIGEST_OFFSET:COVERED]):
                        raise CorruptEntryError(MISMATCH_KEYED)
                    group = join_group(groups, j, mv, tail_start, tail_len, mv[data_start:])
                    decoder = group[0]
                    if decoder.fast is None:
                        decoder.fast = whole_entry_reader(decoder.skeleton, decoder.tail)
                    l_unpack, l_size, l_fixed, l_start = decoder.fast
                    l_skeleton, l_idx, l_tails, l_datas = decoder.skeleton, group[1], group[2], group[3]
                    continue
            out[j] = decode(value, keys[j], allow_pickle, secret)  # any other entry, on its own
        except CorruptEntryError as exc:
            out[j] = Bad(exc)
        except Exception as exc:
            out[j] = Bad(CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})"))
    return groups


def join_group(groups: Groups, j: int, mv: memoryview, tail_start: int, tail_len: int, data: Any
               ) -> tuple[Decoder, list[int], list[tuple[Any, ...]], list[Any]]:
    """Put entry ``j`` (``mv``, checked already; its data region ``data``) in the group of its skeleton's decoder;
    the group. Raises :class:`CorruptEntryError` where its tail is not the decoder's."""
    skeleton = bytes(mv[HEADER_SIZE:tail_start])
    decoder = DECODERS.get(skeleton) or decoder_for(skeleton)
    if decoder.tail.size != tail_len:
        raise CorruptEntryError(f"tail of {tail_len} bytes, its skeleton says {decoder.tail.size}")
    group = groups.get(id(decoder))
    if group is None:
        group = groups[id(decoder)] = (decoder, [], [], [])
    group[1].append(j)
    group[2].append(decoder.tail.unpack_from(mv, tail_start))
    group[3].append(data)
    return group


def build_groups(groups: Groups, one: Callable[[int], Any], out: list[Any]) -> None:
    """Build each group by its decoder's column into ``out``; a group that fails, entry by entry: ``one(j)``."""
    for decoder, idx, tails, datas in groups.values():
        try:
            built = decoder.column(tails, datas)
        except Exception:  # a damaged entry among them: each on its own, so only that one is a miss
            built = None
        if built is not None and len(built) == len(idx):
            for j, sample in zip(idx, built, strict=True):
                out[j] = sample
            continue
        for j in idx:
            try:
                out[j] = one(j)
            except CorruptEntryError as exc:
                out[j] = Bad(exc)

"""Decoding a batch's sealed entries: each opened once, all into one block, then decoded where they lie.

A sealed entry (``aes256-gcm``, :mod:`.digests`) is opened with one AES-GCM call that checks its tag and
decrypts everything after its header. The sealed entries of a batch are opened into one block: opened entry
``i`` at ``offsets[i]`` (``i * stride`` where the entries have one length), a copy of its 52-byte header with
the kind byte set to :data:`~.entry.OPENED`, then its decrypted skeleton, tail and data where its ciphertext
was; the tag is dropped. That copy is the only one: the decryption writes the plaintext into the block, and
when the batch is one of one skeleton and one length the block is handed to
:func:`~.batches.decode_opened_rows` (as a receive buffer would be: numpy rows, tensors viewing the
block). Otherwise the opened entries are grouped by decoder and built by column, or read one by one
(:func:`~.entry.decode_opened`). :func:`open_uniform` takes the usual batch (every entry sealed alike) in one
tight loop into a pooled block; anything else goes through :func:`decode_sealed`, which says why an entry fails.

Only what this module opened is read without a digest: the block is made here, the reader it calls takes the
block from it alone, and the marker kind is refused wherever a value read is checked. An entry that does not
open (a wrong tag: any change, another key, another cache key; a damaged header) is a :class:`~.entry.Bad`,
and its place in the block is not read.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any

from .batches import UNIFORM_MIN, Groups, build_groups, decode_opened_rows, join_group
from .digests import DIGEST_SEAL, DIGEST_SIZE, NONCE_SIZE, SEAL_TAG_SIZE, opener, raw_opener, seal_cipher
from .entry import (
    COVERED,
    DIGEST_OFFSET,
    HEADER,
    HEADER_SIZE,
    MAX_ENTRY_BYTES,
    OPENED,
    SEAL_PREFIX,
    Bad,
    check_sealed,
    decode_opened,
)
from .keyring import key_field
from .resp import BufferPool
from .values import ALIGN, CorruptEntryError

_U64 = struct.Struct("<Q")
_BLOCKS = BufferPool()  # the blocks batches are opened into, reused once no sample views them
# A sealed entry's header: prefix (magic, version, kind, zeros), nonce, zeros, (flags,) the three lengths
_SEALED = struct.Struct(f"<8s{NONCE_SIZE}s{DIGEST_SIZE - NONCE_SIZE}s4xIIQ")


def _decrypt_threads() -> int:
    """Threads that decrypt a large batch beside the reader: one per four cores beyond the first four, at most
    three (none on a small machine, where the redis-servers and the DataLoader need the cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(0, min(3, (cores - 4) // 4))


DECRYPT_THREADS = _decrypt_threads()
PARALLEL_MIN_BYTES = 256 * 1024  # a batch's ciphertext below which the reader decrypts it alone
_POOL: list[Any] = [None, -1]  # the executor of this process, and its pid (a forked child makes its own)


def in_spans(work: Callable[[int, int], int], n: int, nbytes: int) -> list[tuple[int, int, int]]:
    """``work(lo, hi)`` (returns how many of its entries ``lo..hi-1`` it did, in order, stopping at the first
    that fails) over the ``n`` entries of a batch of ``nbytes``: where the host has the cores and the batch is
    large, split among the reader and :data:`DECRYPT_THREADS` threads (AES-GCM releases the GIL, so they
    decrypt at once); else the reader does all. Each span as (lo, hi, done)."""
    parts = min(DECRYPT_THREADS + 1, n) if nbytes >= PARALLEL_MIN_BYTES else 1
    if parts <= 1:
        return [(0, n, work(0, n))]
    if _POOL[1] != os.getpid():
        _POOL[:] = [ThreadPoolExecutor(DECRYPT_THREADS, thread_name_prefix="bagua-cache-open"), os.getpid()]
    cuts = [n * i // parts for i in range(parts + 1)]
    spans = list(pairwise(cuts))
    futures = [_POOL[0].submit(work, lo, hi) for lo, hi in spans[1:]]
    first = work(0, cuts[1])
    return [(0, cuts[1], first)] + [(lo, hi, f.result()) for (lo, hi), f in zip(spans[1:], futures, strict=True)]


def sealed_indices(values: list[Any]) -> list[int]:
    """Where ``values`` holds entries whose kind byte says sealed (whether they are is checked when opened)."""
    out = []
    for j, value in enumerate(values):
        if value is not None and len(value) > HEADER_SIZE and value[4] == DIGEST_SEAL:
            out.append(j)
    return out


def decode_sealed(values: list[Any], keys: list[bytes], allow_pickle: bool, secret: bytes) -> list[Any]:
    """The samples of the sealed entries ``values`` read under ``keys`` (see :func:`.codec.decode_many`)."""
    n = len(values)
    out: list[Any] = [None] * n
    try:
        open_into = opener(secret)
    except CorruptEntryError as exc:  # no cryptography here
        return [Bad(exc)] * n
    found = []  # (index, entry, nonce, data start, opened length)
    unpack = _SEALED.unpack_from
    field = key_field(secret)  # what follows the nonce of an entry sealed with this key (.keyring)
    for j in range(n):
        value = values[j]
        try:
            mv = value if type(value) is memoryview else memoryview(value)
            if mv.itemsize != 1 or mv.ndim != 1:
                mv = mv.cast("B")
            size = len(mv)
            if size < HEADER_SIZE + SEAL_TAG_SIZE or size > MAX_ENTRY_BYTES:
                raise CorruptEntryError(f"sealed entry of {size} bytes")
            prefix, nonce, zeros, skel_len, tail_len, data_len = unpack(mv, 0)
            data_start = (HEADER_SIZE + skel_len + tail_len + ALIGN - 1) & -ALIGN
            if prefix != SEAL_PREFIX or zeros != field or data_start + data_len + SEAL_TAG_SIZE != size:
                check_sealed(mv, size, data_start, data_len, secret)  # raises, saying what
            found.append((j, mv, nonce, data_start, size - SEAL_TAG_SIZE))
        except CorruptEntryError as exc:
            out[j] = Bad(exc)
        except Exception as exc:
            out[j] = Bad(CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})"))
    if not found:
        return out
    length = found[0][4]
    stride = (length + ALIGN - 1) & -ALIGN
    uniform = all(f[4] == length for f in found)
    if uniform:
        offsets: list[int] = list(range(0, len(found) * stride, stride))
        total = len(found) * stride
    else:
        offsets, total = [], 0
        for f in found:
            offsets.append(total)
            total += (f[4] + ALIGN - 1) & -ALIGN
    block = bytearray(total)
    bmv = memoryview(block)
    opened = []  # (index, offset, opened length)
    for (j, mv, nonce, _, size), at in zip(found, offsets, strict=True):
        try:
            bmv[at:at + HEADER_SIZE] = mv[:HEADER_SIZE]
            open_into(keys[j], nonce, mv[COVERED:HEADER_SIZE], mv[HEADER_SIZE:], bmv[at + HEADER_SIZE:at + size])
        except CorruptEntryError as exc:
            out[j] = Bad(exc)
            continue
        block[at + 4] = OPENED
        opened.append((j, at, size))
    if uniform and len(opened) == len(found) >= UNIFORM_MIN:
        built = decode_opened_rows(block, stride, length, len(opened))
        if built is not None and len(built) == n:  # every value opened, in order
            return built
        if built is not None:
            for (j, _, _), sample in zip(opened, built, strict=True):
                out[j] = sample
            return out
    _columns(bmv, opened, allow_pickle, out)
    return out


def open_uniform(values: list[Any], keys: list[bytes], secret: bytes) -> list[Any] | None:
    """The common batch, fast: every value a sealed entry of one length and one header but the nonce, every
    one opening, and of one skeleton; None for anything else (then entry by entry, saying why)."""
    try:
        lengths = set(map(len, values))
    except TypeError:  # a None: a miss among them
        return None
    if len(lengths) != 1:
        return None
    size = lengths.pop()
    views = [v if type(v) is memoryview and v.itemsize == 1 and v.ndim == 1 else memoryview(v).cast("B")
             for v in values]
    head = views[0]
    if size < HEADER_SIZE + SEAL_TAG_SIZE or size > MAX_ENTRY_BYTES:
        return None
    prefix, _, zeros, skel_len, tail_len, data_len = _SEALED.unpack_from(head, 0)
    data_start = (HEADER_SIZE + skel_len + tail_len + ALIGN - 1) & -ALIGN
    if prefix != SEAL_PREFIX or zeros != key_field(secret) or data_start + data_len + SEAL_TAG_SIZE != size:
        return None
    rest = bytes(head[DIGEST_OFFSET + NONCE_SIZE:HEADER_SIZE])  # the zeros, flags and lengths: shared by all
    clear = rest[DIGEST_SIZE - NONCE_SIZE:]
    if clear[0]:  # flags (a pickle): decode_sealed, which knows whether to unpickle
        return None
    into = raw_opener(secret)
    if into is None:
        return None
    length = size - SEAL_TAG_SIZE
    n = len(views)
    run = getattr(values, "run", None)
    if run is not None and len(run[3]) == n and not any(v.readonly for v in views):
        return _open_in_place(views, keys, secret, run, length, rest, clear)
    stride = (length + ALIGN - 1) & -ALIGN
    block = _BLOCKS.take(n * stride)  # no view of it left: samples that still hold theirs keep theirs
    bmv = memoryview(block)
    pack = _U64.pack

    def into_block(lo: int, hi: int) -> int:
        for i in range(lo, hi):
            mv, key, at = views[i], keys[i], i * stride
            if mv[:DIGEST_OFFSET] != SEAL_PREFIX or mv[DIGEST_OFFSET + NONCE_SIZE:HEADER_SIZE] != rest:
                return i - lo
            bmv[at:at + HEADER_SIZE] = mv[:HEADER_SIZE]
            try:
                into(mv[DIGEST_OFFSET:DIGEST_OFFSET + NONCE_SIZE], mv[HEADER_SIZE:], pack(len(key)) + key + clear,
                     bmv[at + HEADER_SIZE:at + length])
            except Exception:  # a tag that does not match, say: entry by entry, which says which and why
                return i - lo
        return hi - lo

    if any(done != hi - lo for lo, hi, done in in_spans(into_block, n, n * size)):
        return None
    block[4:n * stride:stride] = bytes((OPENED,)) * n
    built = decode_opened_rows(block, stride, length, n)
    bmv.release()  # (the span workers' closure still holds the view: released, the pool sees the block free)
    _BLOCKS.give([block])
    return built


def _open_in_place(views: list[memoryview], keys: list[bytes], secret: bytes, run: Any, length: int, rest: bytes,
                   clear: bytes) -> list[Any] | None:
    """:func:`open_uniform` for entries that lie evenly in one writable receive buffer (``run``, see
    :class:`~.resp.Replies`): each decrypted where it lies, so the batch is read without a copy, then decoded
    there. Where one does not open, those already opened are sealed again as they were (GCM is deterministic
    under a nonce) and None is returned, for :func:`decode_sealed` to say which and why."""
    into, cipher = raw_opener(secret), seal_cipher(secret)
    pack = _U64.pack

    def in_place(lo: int, hi: int) -> int:
        for i in range(lo, hi):
            mv, key = views[i], keys[i]
            if mv[:DIGEST_OFFSET] != SEAL_PREFIX or mv[DIGEST_OFFSET + NONCE_SIZE:HEADER_SIZE] != rest:
                return i - lo
            nonce, aad = mv[DIGEST_OFFSET:DIGEST_OFFSET + NONCE_SIZE], pack(len(key)) + key + clear
            try:
                into(nonce, mv[HEADER_SIZE:], aad, mv[HEADER_SIZE:length])
            except Exception:
                # OpenSSL wrote the unauthenticated plaintext before it checked the tag: the keystream put back
                # over it gives the ciphertext as received (the new tag goes to scratch, never into the entry).
                scratch = bytearray(length - HEADER_SIZE + SEAL_TAG_SIZE)
                cipher.encrypt_into(bytes(nonce), mv[HEADER_SIZE:length], aad, scratch)
                mv[HEADER_SIZE:length] = memoryview(scratch)[:length - HEADER_SIZE]
                return i - lo
        return hi - lo

    spans = in_spans(in_place, len(views), len(views) * length)
    if any(done != hi - lo for lo, hi, done in spans):
        for lo, _, done in spans:
            for mv, key in zip(views[lo:lo + done], keys[lo:lo + done], strict=True):
                cipher.encrypt_into(bytes(mv[DIGEST_OFFSET:DIGEST_OFFSET + NONCE_SIZE]), mv[HEADER_SIZE:length],
                                    pack(len(key)) + key + clear, mv[HEADER_SIZE:])
        return None
    for mv in views:
        mv[4] = OPENED
    buf, first, stride, order = run
    built = decode_opened_rows(buf, stride, length, len(views), first)
    out: list[Any] = [None] * len(views)
    if built is None:  # not a batch numpy takes: grouped by decoder and built by column, where they lie
        _columns(memoryview(buf), [(j, first + r * stride, length) for r, j in enumerate(order)], False, out)
        return out
    for j, sample in zip(order, built, strict=True):
        out[j] = sample
    return out


def _columns(bmv: memoryview, opened: list[tuple[int, int, int]], allow_pickle: bool, out: list[Any]) -> None:
    """Decode the entries ``opened`` (index, offset, length) in the block ``bmv`` into ``out``: grouped by decoder and
    built by column (:mod:`.batches`), pickled ones and any that fails on their own."""
    groups: Groups = {}
    views: dict[int, memoryview] = {}
    for j, at, size in opened:
        view = views[j] = bmv[at:at + size]
        try:
            _, _, _, _, flags, skel_len, tail_len, _ = HEADER.unpack_from(view, 0)
            if flags:
                out[j] = decode_opened(view, allow_pickle)
                continue
            tail_start = HEADER_SIZE + skel_len
            join_group(groups, j, view, tail_start, tail_len, view[(tail_start + tail_len + ALIGN - 1) & -ALIGN:])
        except CorruptEntryError as exc:
            out[j] = Bad(exc)
        except Exception as exc:
            out[j] = Bad(CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})"))
    build_groups(groups, lambda j: decode_opened(views[j], allow_pickle), out)

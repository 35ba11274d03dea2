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

import struct
from typing import Any

from .batches import UNIFORM_MIN, Groups, build_groups, decode_opened_rows, join_group
from .digests import (
    DIGEST_SEAL,
    DIGEST_SIZE,
    NONCE_SIZE,
    SEAL_TAG_SIZE,
    opener,
    raw_opener,
    seal_cipher,
    seal_key,
)
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
from .native_gcm import row_opener, worth_it
from .resp import BufferPool
from .values import ALIGN, CorruptEntryError

_U64 = struct.Struct("<Q")
_BLOCKS = BufferPool()  # the blocks batches are opened into, reused once no sample views them
# A sealed entry's header: prefix (magic, version, kind, zeros), nonce, zeros, (flags,) the three lengths
_LENGTHS = [_U64.pack(n) for n in range(512)]  # the associated data's first 8 bytes, by key length
_SEALED = struct.Struct(f"<8s{NONCE_SIZE}s{DIGEST_SIZE - NONCE_SIZE}s4xIIQ")


def _aad_head(n: int) -> bytes:
    return _LENGTHS[n] if n < 512 else _U64.pack(n)


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
    if size < HEADER_SIZE + SEAL_TAG_SIZE or size > MAX_ENTRY_BYTES:
        return None
    n = len(values)
    run = getattr(values, "run", None)
    if run is not None and len(run[3]) == n and type(run[0]) is bytearray:
        return _open_in_place(keys, secret, run, size)
    views = [v if type(v) is memoryview and v.itemsize == 1 and v.ndim == 1 else memoryview(v).cast("B")
             for v in values]
    found = _batch_header(views[0], size, secret)
    if found is None:
        return None
    rest, clear, into = found
    length = size - SEAL_TAG_SIZE
    stride = (length + ALIGN - 1) & -ALIGN
    block = _BLOCKS.take(n * stride)  # no view of it left: samples that still hold theirs keep theirs
    bmv = memoryview(block)
    pack = _U64.pack
    try:
        for at, mv, key in zip(range(0, n * stride, stride), views, keys, strict=True):
            if mv[:DIGEST_OFFSET] != SEAL_PREFIX or mv[DIGEST_OFFSET + NONCE_SIZE:HEADER_SIZE] != rest:
                return None
            bmv[at:at + HEADER_SIZE] = mv[:HEADER_SIZE]
            into(mv[DIGEST_OFFSET:DIGEST_OFFSET + NONCE_SIZE], mv[HEADER_SIZE:], pack(len(key)) + key + clear,
                 bmv[at + HEADER_SIZE:at + length])
    except Exception:  # a tag that does not match, say: entry by entry, which says which and why
        return None
    block[4:n * stride:stride] = bytes((OPENED,)) * n
    built = decode_opened_rows(block, stride, length, n)
    del bmv
    _BLOCKS.give([block])
    return built


def _batch_header(head: Any, size: int, secret: bytes) -> tuple[bytes, bytes, Any] | None:
    """For a batch whose first entry is ``head`` (``size`` bytes): the header bytes after the nonce that every
    entry must share, those after the digest field (flags, lengths: the associated data's end), and the
    decrypting call; None where the batch is not one :func:`open_uniform` takes."""
    prefix, _, zeros, skel_len, tail_len, data_len = _SEALED.unpack_from(head, 0)
    data_start = (HEADER_SIZE + skel_len + tail_len + ALIGN - 1) & -ALIGN
    if prefix != SEAL_PREFIX or zeros != key_field(secret) or data_start + data_len + SEAL_TAG_SIZE != size:
        return None
    rest = bytes(head[DIGEST_OFFSET + NONCE_SIZE:HEADER_SIZE])  # the key id, zeros, flags and lengths
    clear = rest[DIGEST_SIZE - NONCE_SIZE:]
    if clear[0]:  # flags (a pickle): decode_sealed, which knows whether to unpickle
        return None
    into = raw_opener(secret)
    return None if into is None else (rest, clear, into)


def _open_in_place(keys: list[bytes], secret: bytes, run: Any, size: int) -> list[Any] | None:
    """:func:`open_uniform` for entries that lie evenly in one writable receive buffer (``run``, see
    :class:`~.resp.Replies`): each decrypted where it lies, so the batch is read without a copy, then decoded
    there. The bytes every entry must share are compared for the whole batch at once (numpy rows), and the
    loop is one AES-GCM call per entry. Where one does not open, it and those already opened are put back as
    they were received, and None is returned, for :func:`decode_sealed` to say which and why."""
    import numpy as np

    buf, first, stride, order = run
    n = len(order)
    if first + (n - 1) * stride + size > len(buf):
        return None
    flat = memoryview(buf)
    found = _batch_header(flat[first:first + size], size, secret)
    if found is None:
        return None
    rest, clear, into = found
    rows = np.ndarray((n, size), np.uint8, buf, first, (stride, 1))
    if (rows[:, :DIGEST_OFFSET].tobytes() != SEAL_PREFIX * n  # magic, version, kind, zeros
            or rows[:, DIGEST_OFFSET + NONCE_SIZE:HEADER_SIZE].tobytes() != rest * n):  # key id, flags, lengths
        return None
    nonces = rows[:, DIGEST_OFFSET:DIGEST_OFFSET + NONCE_SIZE].tobytes()
    ordered = list(map(keys.__getitem__, order))  # row r: key order[r]
    try:  # the length prefixes from the table, without a call per entry (keys under 512 bytes: all of them)
        aads = [_LENGTHS[len(k)] + k + clear for k in ordered]
    except IndexError:
        aads = [_aad_head(len(k)) + k + clear for k in ordered]
    start, ct, pt = first + HEADER_SIZE, size - HEADER_SIZE, size - HEADER_SIZE - SEAL_TAG_SIZE
    native = row_opener(seal_key(secret)) if worth_it(pt) else None
    if native is not None:  # small entries: every row in one call (.native_gcm)
        failed = native.open_rows(buf, first, stride, n, HEADER_SIZE, pt, nonces, aads)
        if failed is not None:
            _put_back(seal_cipher(secret), flat, start, stride, nonces, aads, failed.row, pt, failed.written)
            return None
    else:
        at = start  # the row being opened; those before it are open (no counter in the loop: one call each)
        try:
            for at, nb, aad in zip(range(start, start + n * stride, stride), range(0, n * NONCE_SIZE, NONCE_SIZE),
                                   aads, strict=True):
                into(nonces[nb:nb + NONCE_SIZE], flat[at:at + ct], aad, flat[at:at + pt])
        except Exception:
            _put_back(seal_cipher(secret), flat, start, stride, nonces, aads, (at - start) // stride, pt)
            return None
    rows[:, 4] = OPENED
    built = decode_opened_rows(buf, stride, size - SEAL_TAG_SIZE, n, first)
    out: list[Any] = [None] * n
    if built is None:  # not a batch numpy takes: grouped by decoder and built by column, where they lie
        _columns(flat, [(j, first + r * stride, size - SEAL_TAG_SIZE) for r, j in enumerate(order)], False, out)
        return out
    for j, sample in zip(order, built, strict=True):
        out[j] = sample
    return out


def _put_back(cipher: Any, flat: memoryview, start: int, stride: int, nonces: bytes, aads: list[bytes], done: int,
              pt: int, written: bool = True) -> None:
    """Seal again, as received, the ``done`` rows opened in place and row ``done``, which did not open: OpenSSL
    wrote its unauthenticated plaintext before it checked the tag (``written``; the native loop says when it
    failed before that, and the row is as received), and the keystream put back over it gives the ciphertext
    as received. GCM is deterministic under a nonce, so the opened rows get their tags back; the failed row's
    new tag goes to scratch, never into the entry (its own stays as received)."""
    scratch = bytearray(pt + SEAL_TAG_SIZE)
    for r in range(min(done + 1 if written else done, len(aads))):
        at, nonce = start + r * stride, nonces[r * NONCE_SIZE:(r + 1) * NONCE_SIZE]
        if r < done:
            cipher.encrypt_into(nonce, flat[at:at + pt], aads[r], flat[at:at + pt + SEAL_TAG_SIZE])
        else:
            cipher.encrypt_into(nonce, flat[at:at + pt], aads[r], scratch)
            flat[at:at + pt] = memoryview(scratch)[:pt]


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

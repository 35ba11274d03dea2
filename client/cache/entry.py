"""One cache entry: its header layout (see :mod:`.codec` for the whole format), and reading one entry.

The batch readers (:mod:`.batches`, :mod:`.batch_sealed`) share these constants and
fall back on :func:`decode` for any entry they do not take.

A sealed entry (``aes256-gcm``: everything after its header encrypted, the GCM tag at its end) is *opened*
before it is read: :func:`decode` decrypts it into a buffer of its own (:func:`open_entry`); :mod:`.batch_sealed`
opens a batch into one block, each opened entry a copy of the entry's header with the kind byte set to
:data:`OPENED` and the decrypted rest in place of the ciphertext, without the tag. :data:`OPENED` is an
internal marker, never written: every check of an entry from the wire refuses it (it is no digest kind), and
only :func:`decode_opened` (called by the opener on its own block) reads it, without a digest to verify.
"""

from __future__ import annotations

import hmac
import pickle
import struct
from typing import Any

from . import digests
from .digests import (
    DIGEST_GMAC,
    DIGEST_HMAC,
    DIGEST_NAMES,
    DIGEST_SEAL,
    DIGEST_SIZE,
    DIGEST_XXH3,
    KEYED_KINDS,
    NONCE_SIZE,
    SEAL_TAG_SIZE,
    SEALED_NO_KEY,
    check_key,
    opener,
)
from .digests import digest as _digest
from .skeletons import DECODERS, decoder_for
from .values import ALIGN, CorruptEntryError

MAGIC = b"BLC"
FORMAT_VERSION = 2
FLAG_PICKLE = 0x01
MAX_ENTRY_BYTES = 4 * 1024**3  # a larger value is refused before any work

HEADER = struct.Struct(f"<3sBB3x{DIGEST_SIZE}sB3xIIQ")
HEADER_SIZE = HEADER.size  # 52
HEADER_XXH = struct.Struct(f"<3sBB3xQ{DIGEST_SIZE - 8}sB3xIIQ")  # the same, an xxh3 digest read as its integer
DIGEST_OFFSET = 8
COVERED = DIGEST_OFFSET + DIGEST_SIZE  # the digest covers the entry from here on
U64 = struct.Struct("<Q")
PAD16 = bytes(16)

XXH_PREFIX = MAGIC + bytes((FORMAT_VERSION, DIGEST_XXH3, 0, 0, 0))
KEYED_PREFIXES = tuple(MAGIC + bytes((FORMAT_VERSION, kind, 0, 0, 0)) for kind in (DIGEST_GMAC, DIGEST_HMAC))
SEAL_PREFIX = MAGIC + bytes((FORMAT_VERSION, DIGEST_SEAL, 0, 0, 0))
OPENED = 0xF5  # the kind byte of an entry opened by this process (see the module's docstring); never on the wire

MISMATCH = "digest mismatch (corrupted, truncated, stored under another key)"
MISMATCH_KEYED = "digest mismatch (corrupted, truncated, stored under another key, or not written with this cache key)"


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
        magic, version, kind, digest, flags, skel_len, tail_len, data_len = HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise CorruptEntryError("not a bagua-lightning cache entry (bad magic)")
        if version != FORMAT_VERSION:
            raise CorruptEntryError(f"entry format version {version}, this reader understands {FORMAT_VERSION}")
        tail_start = HEADER_SIZE + skel_len
        data_start = (tail_start + tail_len + ALIGN - 1) & -ALIGN
        if kind == DIGEST_SEAL:
            if secret is None:
                raise CorruptEntryError(SEALED_NO_KEY)
            opened = open_entry(mv, key, secret, data_start, data_len)
            return _build(opened, flags, tail_start, tail_len, opened[data_start:], allow_pickle, OWN)
        if data_start + data_len != size:
            raise CorruptEntryError(f"entry length {size} does not match its header ({data_start + data_len})")
        if secret is not None and kind not in KEYED_KINDS:
            raise CorruptEntryError(f"entry carries a {DIGEST_NAMES.get(kind, kind)} digest; a cache key is "
                                    "configured, so only entries authenticated with it are accepted")
        xxhash = digests.xxhash
        if kind == DIGEST_XXH3 and xxhash is not None:  # the common case, without a call to _digest
            expected = U64.pack(xxhash.xxh3_64_intdigest(mv[COVERED:], xxhash.xxh3_64_intdigest(key))) + PAD16
        else:
            expected = _digest(kind, key, secret, mv[COVERED:], digest)
        if not hmac.compare_digest(expected, digest):
            raise CorruptEntryError(MISMATCH_KEYED if kind in KEYED_KINDS else MISMATCH)
        # tensors view the reply when the caller owns it
        return _build(mv, flags, tail_start, tail_len, mv[data_start:], allow_pickle,
                      SHARED if owned and type(value) is bytes else COPY)
    except CorruptEntryError:
        raise
    except Exception as exc:  # a damaged structure can fail anywhere in the decoder: always a miss
        raise CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})") from exc


COPY, SHARED, OWN = 0, 1, 2  # how _build may use an entry's data region (see there)


def _build(mv: memoryview, flags: int, tail_start: int, tail_len: int, data: Any, allow_pickle: bool,
           mode: int) -> Any:
    """The sample of an entry checked already, its data region ``data``. ``mode``: :data:`OWN` where ``data`` is
    writable and this sample's alone, or its batch's (opened: arrays and tensors view it); :data:`SHARED` where
    it is a reply the caller handed over (tensors view it, arrays a copy); :data:`COPY` else (both view one
    copy)."""
    if flags:
        if flags != FLAG_PICKLE:
            raise CorruptEntryError(f"unknown flags {flags:#x}")
        if not allow_pickle:
            raise CorruptEntryError('entry was written with serializer="pickle"; not unpickling it')
        return pickle.loads(data)
    skeleton = bytes(mv[HEADER_SIZE:tail_start])
    decoder = DECODERS.get(skeleton) or decoder_for(skeleton)
    if decoder.tail.size != tail_len:
        raise CorruptEntryError(f"tail of {tail_len} bytes, its skeleton says {decoder.tail.size}")
    tail = decoder.tail.unpack_from(mv, tail_start)
    if mode == OWN:
        return decoder.build(tail, data, data)
    # numpy arrays need a writable buffer
    writable = bytearray(data) if decoder.arrays or (decoder.tensors and mode == COPY) else None
    return decoder.build(tail, data if mode == SHARED or writable is None else writable, writable)


def check_sealed(mv: memoryview, size: int, data_start: int, data_len: int, secret: bytes) -> None:
    """The checks by value of a sealed entry of ``size`` bytes whose header says ``data_start``/``data_len``,
    to be opened with the cache key ``secret`` (the key it names, :mod:`.keyring`; whatever else it holds is
    authenticated when it is opened)."""
    if mv[:DIGEST_OFFSET] != SEAL_PREFIX:
        raise CorruptEntryError("sealed entry with a damaged header")
    check_key(mv, secret)
    if data_start + data_len + SEAL_TAG_SIZE != size:
        raise CorruptEntryError(f"sealed entry length {size} does not match its header "
                                f"({data_start + data_len + SEAL_TAG_SIZE})")


def open_entry(mv: memoryview, key: bytes, secret: bytes, data_start: int, data_len: int) -> memoryview:
    """The sealed entry ``mv`` stored under ``key``, opened into a new writable buffer: its header, then
    everything after it decrypted (skeleton, tail, pad, data), without the tag."""
    size = len(mv)
    check_sealed(mv, size, data_start, data_len, secret)
    opened = bytearray(size - SEAL_TAG_SIZE)
    out = memoryview(opened)
    out[:HEADER_SIZE] = mv[:HEADER_SIZE]
    opener(secret)(key, mv[DIGEST_OFFSET:DIGEST_OFFSET + NONCE_SIZE], mv[COVERED:HEADER_SIZE], mv[HEADER_SIZE:],
                   out[HEADER_SIZE:])
    opened[4] = OPENED
    return out


def decode_opened(view: memoryview, allow_pickle: bool = False) -> Any:
    """The sample of an entry that :mod:`.batch_sealed` opened into its own block (kind :data:`OPENED`): its tag
    was checked when it was opened, so no digest is. Only ever called on such a block, never on a value read.

    Raises:
        CorruptEntryError: as :func:`decode`.
    """
    try:
        _, _, kind, _, flags, skel_len, tail_len, data_len = HEADER.unpack_from(view, 0)
        if kind != OPENED:
            raise CorruptEntryError("not an opened entry")
        tail_start = HEADER_SIZE + skel_len
        data_start = (tail_start + tail_len + ALIGN - 1) & -ALIGN
        if data_start + data_len != len(view):
            raise CorruptEntryError(f"entry length {len(view)} does not match its header ({data_start + data_len})")
        return _build(view, flags, tail_start, tail_len, view[data_start:], allow_pickle, OWN)
    except CorruptEntryError:
        raise
    except Exception as exc:
        raise CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})") from exc


def whole_entry_reader(skeleton: bytes, tail: struct.Struct) -> tuple[Any, int, bytes, int]:
    """For entries of one skeleton: (unpack_from of header + skeleton + tail, its size, the fixed bytes after the
    digest (flags, lengths), where the data region starts). Fields: prefix, digest, digest padding, fixed,
    data length, skeleton, then the tail's."""
    whole = struct.Struct(f"<8sQ{DIGEST_SIZE - 8}s12sQ{len(skeleton)}s{tail.format[1:]}")
    fixed = struct.pack("<B3xII", 0, len(skeleton), tail.size)
    data_start = (HEADER_SIZE + len(skeleton) + tail.size + ALIGN - 1) & -ALIGN
    return whole.unpack_from, whole.size, fixed, data_start


class Bad:
    """Stands in :func:`.codec.decode_many`'s result for an entry that did not decode; ``error`` says why."""

    __slots__ = ("error",)

    def __init__(self, error: CorruptEntryError | None) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"Bad({self.error!r})" if self.error is not None else "MISSING"


MISSING = Bad(None)  # decode_many's result for a value that is None (a missing key)

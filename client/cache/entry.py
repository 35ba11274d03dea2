"""One cache entry: its header layout (see :mod:`.codec` for the whole format), and reading one entry.

The batch readers (:mod:`.batch_vector`, :mod:`.batch_column`) share these constants and fall back on
:func:`decode` for any entry they do not take.
"""

from __future__ import annotations

import hmac
import pickle
import struct
from typing import Any

from . import digests
from .digests import DIGEST_GMAC, DIGEST_HMAC, DIGEST_NAMES, DIGEST_SIZE, DIGEST_XXH3, KEYED_KINDS
from .digests import digest as _digest
from .plans import PLANS, plan_for
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

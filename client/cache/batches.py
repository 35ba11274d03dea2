"""Decoding a batch of entries of one skeleton and one length at once, numpy doing the per-entry work.

A dataset of fixed-size samples fetches batches of such entries. The batch is one ``(n, length)`` array: where
the entries lie, if the fetch says they lie evenly in one receive buffer (:class:`~.resp.Replies`), else a copy
of them side by side. Every byte the entries must share is compared at once, one digest per entry is computed
(xxh3, or with a cache key the keyed digest the entries carry) and all of them compared at once, the tail
numbers are read as columns, and each tensor leaf is split into per-sample views by one call (the plan's
:data:`~.plan_parts.Vector`). Anything else (a miss, another length, another kind of entry, shapes that
differ, a damaged entry) is not such a batch: :func:`decode_rows` returns None and
:func:`.codec.decode_many` goes on with :mod:`.batch_column`, which finds any culprit.

Sealed entries are opened first (:mod:`.batch_sealed`), into one block of this process's making where opened
entry ``i`` lies at ``i * stride``: :func:`decode_opened_rows` decodes that block the same way, where it lies,
with no digest to verify (GCM's tags were). It is the only way in to that: :func:`decode_rows` refuses the
opened entries' marker kind (:data:`~.entry.OPENED`), as every check of a value read does.
"""

from __future__ import annotations

import hmac
import struct
from typing import Any

from . import digests
from .digests import DIGEST_GMAC, DIGEST_XXH3, MAC_KINDS, NONCE_SIZE, gmac_tags, hmac_digest
from .entry import (
    COVERED,
    DIGEST_OFFSET,
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_XXH,
    MAGIC,
    OPENED,
    PAD16,
    whole_entry_reader,
)
from .plans import PLANS, Plan, Rows, Vector, plan_for
from .values import CorruptEntryError

UNIFORM_MIN = 8  # entries in a batch from which one of one skeleton and one length is decoded by numpy
_QS: dict[int, Any] = {}  # n -> struct of n u64, for digests compared at once


def _uniform_checks(plan: Any, tail_start: int, tail_len: int, start: int, np: Any) -> tuple[Any, Any]:
    """The byte columns that every entry of ``plan``'s skeleton has in common with the others of its length in a
    batch: all before the data region but the digest and the tail's numbers (ints and floats vary by sample;
    shapes, offsets and lengths may not, for the batch to be decoded together). Two sets: for xxh3 entries
    (whose digest is 8 bytes, then zeros that every entry shares) and for keyed entries (24 bytes of digest)."""
    cols = [*range(0, DIGEST_OFFSET), *range(DIGEST_OFFSET + 8, tail_start)]
    for j, code in enumerate(plan.tail.format[1:]):
        if code == "Q":
            cols += range(tail_start + 8 * j, tail_start + 8 * j + 8)
    cols += range(tail_start + tail_len, start)
    xxh3_cols = np.array(cols, np.intp)
    return xxh3_cols, xxh3_cols[(xxh3_cols < DIGEST_OFFSET) | (xxh3_cols >= COVERED)]


def _head_plan(head: memoryview, secret: bytes | None, np: Any,
               opened: bool = False) -> tuple[Plan, Vector, int, int, int] | None:
    """The plan of the batch's first entry, with its vector reader, its digest kind, where its tail starts and its tail's
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
        plan = PLANS.get(skeleton) or plan_for(skeleton)
    except CorruptEntryError:
        return None
    vector = plan.vector
    if vector is None or plan.tail.size != tail_len:
        return None
    if plan.fast is None:
        plan.fast = whole_entry_reader(plan.skeleton, plan.tail)
    start = plan.fast[3]
    if start + data_len != length:
        return None
    if plan.uniform is None:
        plan.uniform = _uniform_checks(plan, tail_start, tail_len, start, np)
    return plan, vector, kind, tail_start, tail_len


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
    plan, vector, kind, tail_start, tail_len = found
    length, start = len(head), plan.fast[3]
    if buf is not None:
        rows = np.ndarray((n, length), np.uint8, buf, first, (stride, 1))
    else:
        assert values is not None
        buf = bytearray().join(values)
        first, stride = 0, length
        rows = np.frombuffer(buf, np.uint8).reshape(n, length)
    # The bytes every entry shares, equal to the first's; then the digests, all at once.
    same = rows[:, plan.uniform[secret is not None or opened]]
    if same.tobytes() != same[0].tobytes() * n:
        return None
    if not opened and not _digests_match(rows, buf, first, stride, length, keys, kind, secret):
        return None
    tail = np.ascontiguousarray(rows[:, tail_start:tail_start + tail_len]) if tail_len else None
    align = (first | stride | 16) & -(first | stride | 16)  # receive buffers start on 16-byte boundaries
    try:
        return vector(Rows(rows, tail, start, plan.tail.unpack_from(head, tail_start), align))
    except Exception:  # shapes that numpy will not split, say: entry by entry
        return None

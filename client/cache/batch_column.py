"""Decoding a batch of entries by column: entries that share a skeleton are built together.

A dataset's samples share their skeleton. The batch is read entry by entry, the common cases checked inline
(unkeyed xxh3 entries; keyed entries, their MACs computed for the whole batch first) and grouped by plan; an
entry of the skeleton seen last is read with one ``struct`` unpack of its header, skeleton and tail. Each
group is then built by its plan's :data:`~.plan_parts.Column`: the tensors and arrays of one leaf across the
group are copied into one block and split into per-sample views in one call, so nothing refers to the values
afterwards. Any other entry, and every entry of a group that fails to build, goes through
:func:`.entry.decode` on its own, so only a damaged entry is a miss.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from . import digests
from .digests import DIGEST_XXH3, MAC_KINDS
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
    PAD16,
    XXH_PREFIX,
    Bad,
    decode,
    whole_entry_reader,
)
from .plans import PLANS, Plan, plan_for
from .values import ALIGN, CorruptEntryError

# plan id -> (plan, entry indices, their tail values, their data regions)
Groups = dict[int, tuple[Plan, list[int], list[tuple[Any, ...]], list[Any]]]


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
    their own, and return the entries of the common cases grouped by plan (still to be built)."""
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
                    plan = group[0]
                    if plan.fast is None:
                        plan.fast = whole_entry_reader(plan.skeleton, plan.tail)
                    l_unpack, l_size, l_fixed, l_start = plan.fast
                    l_skeleton, l_idx, l_tails, l_datas = plan.skeleton, group[1], group[2], group[3]
                    continue
            out[j] = decode(value, keys[j], allow_pickle, secret)  # any other entry, on its own
        except CorruptEntryError as exc:
            out[j] = Bad(exc)
        except Exception as exc:
            out[j] = Bad(CorruptEntryError(f"malformed entry ({type(exc).__name__}: {exc})"))
    return groups


def join_group(groups: Groups, j: int, mv: memoryview, tail_start: int, tail_len: int, data: Any
               ) -> tuple[Plan, list[int], list[tuple[Any, ...]], list[Any]]:
    """Put entry ``j`` (``mv``, checked already; its data region ``data``) in the group of its skeleton's plan;
    the group. Raises :class:`CorruptEntryError` where its tail is not the plan's."""
    skeleton = bytes(mv[HEADER_SIZE:tail_start])
    plan = PLANS.get(skeleton) or plan_for(skeleton)
    if plan.tail.size != tail_len:
        raise CorruptEntryError(f"tail of {tail_len} bytes, its skeleton says {plan.tail.size}")
    group = groups.get(id(plan))
    if group is None:
        group = groups[id(plan)] = (plan, [], [], [])
    group[1].append(j)
    group[2].append(plan.tail.unpack_from(mv, tail_start))
    group[3].append(data)
    return group


def build_groups(groups: Groups, one: Callable[[int], Any], out: list[Any]) -> None:
    """Build each group by its plan's column into ``out``; a group that fails, entry by entry: ``one(j)``."""
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
                out[j] = one(j)
            except CorruptEntryError as exc:
                out[j] = Bad(exc)

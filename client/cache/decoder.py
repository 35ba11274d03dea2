"""What a skeleton compiles into: a :class:`Decoder` and the pieces it is made of (:mod:`.skeletons` puts them
together and caches the decoders).

A :class:`Decoder` holds three readers of one skeleton: ``build`` makes one sample from its tail values and data
region, a :data:`Column` makes the samples of many entries at once, and a :data:`Vector` makes them from
:class:`Rows` (entries of one length side by side), letting numpy do the per-row work. Here too are the
bounds-checked helpers those readers share, and the lazily imported torch/numpy environment.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Callable
from typing import Any

from .values import TORCH_DTYPES, CorruptEntryError

Build = Callable[[tuple[Any, ...], Any, Any], Any]  # (tail values, tensor buffer, writable buffer) -> value
# (tails, data regions) of many entries with the same skeleton -> their values; data regions may be views of
# shared receive buffers, so a column copies whatever it keeps (tensors and arrays into one block per column)
Column = Callable[[list[tuple[Any, ...]], list[Any]], list[Any]]


class Rows:
    """Many entries of one skeleton and one length: what a :data:`Vector` builds from.

    ``rows``: an ``(m, length)`` uint8 array of the entries (writable; rows may lie apart, e.g. where they were
    received; the built tensors may view it); ``tail``: the tail fields of every row as an ``(m, tail bytes)``
    uint8 array (read as columns through :attr:`i`/:attr:`f`); ``first``: the first row's tail
    fields, unpacked; ``start``: where the data region begins in a row; ``align``: a power of two that divides
    the address of every row. Whoever makes a ``Rows`` has checked that the rows agree on every tail field but
    numbers (shapes, offsets and lengths), so that the first row's stand for all.
    """

    __slots__ = ("align", "first", "m", "rows", "start", "tail")

    def __init__(self, rows: Any, tail: Any, start: int, first: tuple[Any, ...], align: int = 1) -> None:
        self.rows = rows
        self.m = len(rows)
        self.tail = tail
        self.start = start
        self.first = first
        self.align = align

    @property
    def i(self) -> Any:
        return self.tail.view("<i8")

    @property
    def f(self) -> Any:
        return self.tail.view("<f8")


class NotUniform(Exception):
    """The rows differ where a :data:`Vector` needs them equal (array shapes): build them one by one."""


# Rows -> the values of one node for every row, with numpy doing the per-row work; None where a node has none.
Vector = Callable[[Rows], list[Any]]


class Decoder:
    """A compiled skeleton: the tail's layout and the function that builds the sample.

    ``tensors``: the sample holds tensors (they view the reply when the caller owns it, else a copy);
    ``arrays``: it holds numpy arrays (always a writable copy of the data region); ``column``: builds the
    samples of many entries at once (:data:`Column`).
    """

    __slots__ = ("arrays", "build", "column", "fast", "skeleton", "tail", "tensors", "uniform", "vector")

    def __init__(self, tail: struct.Struct, build: Build, tensors: bool, arrays: bool) -> None:
        self.skeleton = b""
        self.fast: Any = None  # the codec's whole-entry reader for this skeleton, made on first use
        self.uniform: Any = None  # the codec's checks of a batch of this skeleton, made on first use
        self.tail = tail
        self.build = build
        self.column = column_of(build)
        self.vector = vector_of(build)
        self.tensors = tensors
        self.arrays = arrays


def with_column(build: Build, column: Column, vector: Vector | None = None) -> Build:
    """``build``, marked with the :data:`Column` (and :data:`Vector`) that build many values of its node."""
    build.column = column  # type: ignore[attr-defined]
    if vector is not None:
        build.vector = vector  # type: ignore[attr-defined]
    return build


def vector_of(build: Build) -> Vector | None:
    return getattr(build, "vector", None)


def _vectors(builds: list[Build]) -> list[Vector] | None:
    found = [vector_of(b) for b in builds]
    return None if any(v is None for v in found) else found  # type: ignore[return-value]


def _private_copies(build: Build) -> Build:
    """Mark ``build`` as one whose values may view its buffers: its column gives each row its own copy."""
    build.private = True  # type: ignore[attr-defined]
    return build


def column_of(build: Build) -> Column:
    column = getattr(build, "column", None)
    if column is not None:
        return column
    if getattr(build, "private", False):
        def private(tails: list[tuple[Any, ...]], datas: list[Any]) -> list[Any]:
            out = []
            for v, d in zip(tails, datas, strict=True):
                w = bytearray(d)
                out.append(build(v, w, w))
            return out

        return private
    return lambda tails, datas: [build(v, d, None) for v, d in zip(tails, datas, strict=True)]

def _rows_block(tails: list[tuple[Any, ...]], datas: list[Any], s: int, e: int, np: Any) -> Any:
    """The bytes of one array leaf of every row, copied into one ``(rows, nbytes)`` block; None when the rows
    differ in shape or the leaf is empty (then every row gets its own buffer). The shape is ``v[s:e]``, the
    offset and length of the bytes ``v[e]`` and ``v[e + 1]``; a range past a row's data raises ``ValueError``.
    """
    first = tails[0]
    off, nb = first[e], first[e + 1]
    if not nb:
        return None
    same = first[s:e + 2]  # shape, offset and length of the first row
    if [v[s:e + 2] for v in tails].count(same) == len(tails):  # the usual batch: one copy loop in C
        block = bytearray().join([d[off:off + nb] for d in datas])
        if len(block) != nb * len(tails):
            raise ValueError("an array runs past the end of its entry")
        return np.frombuffer(block, np.uint8).reshape(len(tails), nb)
    shape = first[s:e]
    block = np.empty((len(tails), nb), np.uint8)
    flat = memoryview(block).cast("B")
    k = 0
    for v, d in zip(tails, datas, strict=True):
        if v[e + 1] != nb or v[s:e] != shape:  # another offset is fine, another shape or length is not
            return None
        flat[k:k + nb] = d[v[e]:v[e] + nb]
        k += nb
    return block


def _uniform_leaf(r: Rows, s: int, e: int) -> tuple[tuple[int, ...], int, int]:
    """Shape, start in the row and length of an array leaf (tail fields ``s:e``, then offset and length): the
    first row's, which every row shares (see :class:`Rows`)."""
    values = r.first[s:e + 2]
    c0, nb = r.start + values[-2], values[-1]
    if c0 + nb > r.rows.shape[1]:
        raise CorruptEntryError(f"{nb} bytes at {c0} run past the {r.rows.shape[1]}-byte entry")
    return tuple(values[:-2]), c0, nb


def _at(buf: Any, off: int, n: int) -> Any:
    """``buf[off:off+n]``, refusing a range past the end (slicing would silently shorten it)."""
    if off + n > len(buf):
        raise CorruptEntryError(f"{n} bytes at {off} run past the {len(buf)}-byte data region")
    return buf[off:off + n]


_ENV: dict[str, Any] = {}


def _env() -> dict[str, Any]:
    """torch, numpy and the dtype table, imported on the first tensor or array."""
    if not _ENV:
        import numpy as np
        import torch

        table = {}
        for name in TORCH_DTYPES:
            dtype = getattr(torch, name)
            np_dtype = np.dtype(name).newbyteorder("<") if hasattr(np, name) else None
            table[name.encode()] = (dtype, dtype.itemsize, np_dtype)
        # torch warns once per process that a tensor over a read-only buffer could write to it. A reply
        # buffer is owned by the tensors decoded from it and nobody else reads it: the warning would only
        # alarm, so it is used up here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(b"\0", dtype=torch.uint8)
            torch.from_numpy(np.frombuffer(b"\0", np.uint8))
        _ENV.update(torch=torch, np=np, dtypes=table)
    return _ENV

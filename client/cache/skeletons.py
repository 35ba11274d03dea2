"""Reading cache entries: a skeleton (see :mod:`.values`) is compiled once into a :class:`~.decoder.Decoder`,
then every entry with it decodes with one ``struct`` unpack of its tail and a prebuilt function.

Samples of a dataset almost always share their skeleton (types, dtypes, numbers of dimensions, container
lengths), so after the first entry a read costs a dict lookup, an unpack and the construction of the values
themselves. Decoders are cached per process (:func:`decoder_for`), at most :data:`MAX_DECODERS` of them (the
cache is emptied when full, so hostile entries cannot grow it).

Compiling is one walk that gives every leaf its place in the tail and nests the readers of its nodes (made of
:mod:`.decoder`'s parts). Every check that keeps a damaged or hostile entry from costing more than its own size
is made here, before anything is built: the skeleton nests at most :data:`~.values.MAX_DEPTH` levels, every
count is checked against the bytes left, only dtypes the codec writes, the tail must be exactly as long as
the skeleton says, contents are read through bounds-checked views, and classes of namedtuples and dataclasses
are looked up among modules already imported (nothing is ever imported because of an entry).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from .decoder import (
    Build,
    Decoder,
    NotUniform,
    Rows,
    _at,
    _env,
    _private_copies,
    _rows_block,
    _uniform_leaf,
    _vectors,
    column_of,
    with_column,
)
from .values import (
    MAX_DEPTH,
    MAX_NDIM,
    T_BIGINT,
    T_BYTEARRAY,
    T_BYTES,
    T_COMPLEX,
    T_DATACLASS,
    T_DICT,
    T_FALSE,
    T_FLOAT,
    T_IMAGE,
    T_INT,
    T_LIST,
    T_NAMEDTUPLE,
    T_NDARRAY,
    T_NONE,
    T_NPSCALAR,
    T_STR,
    T_TENSOR,
    T_TRUE,
    T_TUPLE,
    CorruptEntryError,
    _find_class,
)

_U32 = struct.Struct("<I")
MAX_DECODERS = 1024
DECODERS: dict[bytes, Decoder] = {}


def decoder_for(skeleton: bytes) -> Decoder:
    """The decoder of ``skeleton``, compiled on first use."""
    found = DECODERS.get(skeleton)
    if found is None:
        found = _Compiler(skeleton).decoder()
        found.skeleton = skeleton
        if len(DECODERS) >= MAX_DECODERS:
            DECODERS.clear()
        DECODERS[skeleton] = found
    return found


class _Compiler:
    """Walks a skeleton once, assigning each leaf its position in the tail."""

    def __init__(self, skeleton: bytes) -> None:
        self.skel = skeleton
        self.pos = 0
        self.fmt: list[str] = []
        self.tensors = False
        self.arrays = False

    def decoder(self) -> Decoder:
        build = self.node(0)
        if self.pos != len(self.skel):
            raise CorruptEntryError("trailing bytes after the sample structure")
        return Decoder(struct.Struct("<" + "".join(self.fmt)), build, self.tensors, self.arrays)

    def _fields(self, code: str, n: int = 1) -> int:
        """Reserve ``n`` tail fields; return the index of the first."""
        i = len(self.fmt)
        self.fmt.extend(code * n)
        return i

    def _byte(self) -> int:
        b = self.skel[self.pos]
        self.pos += 1
        return b

    def _name(self) -> bytes:
        n = self._byte()
        if self.pos + n > len(self.skel):
            raise CorruptEntryError("entry structure runs past its skeleton")
        self.pos += n
        return self.skel[self.pos - n:self.pos]

    def _count(self) -> int:
        (n,) = _U32.unpack_from(self.skel, self.pos)
        self.pos += 4
        # Every item takes at least one byte of skeleton: a larger count is a lie, refused before building.
        if n > len(self.skel) - self.pos:
            raise CorruptEntryError(f"a container of {n} items in {len(self.skel) - self.pos} bytes of structure")
        return int(n)

    def node(self, depth: int) -> Build:
        tag = self._byte()
        if tag == T_TENSOR:
            return self._tensor()
        if tag in (T_INT, T_FLOAT):
            i = self._fields("q" if tag == T_INT else "d")
            if tag == T_INT:
                return with_column(lambda v, d, w: v[i], lambda tails, datas: [v[i] for v in tails],
                                   lambda r: r.i[:, i].tolist())
            return with_column(lambda v, d, w: v[i], lambda tails, datas: [v[i] for v in tails],
                               lambda r: r.f[:, i].tolist())
        if tag in (T_NONE, T_TRUE, T_FALSE):
            const = None if tag == T_NONE else tag == T_TRUE
            return with_column(lambda v, d, w: const, lambda tails, datas: [const] * len(tails),
                               lambda r: [const] * r.m)
        if tag in (T_STR, T_BYTES, T_BYTEARRAY, T_BIGINT):
            return self._blob(tag)
        if tag == T_COMPLEX:
            i = self._fields("d", 2)
            return lambda v, d, w: complex(v[i], v[i + 1])
        if tag == T_NDARRAY:
            return self._ndarray()
        if tag == T_NPSCALAR:
            return self._npscalar()
        if depth >= MAX_DEPTH:
            raise CorruptEntryError(f"structure nested deeper than {MAX_DEPTH} levels")
        if tag in (T_TUPLE, T_LIST):
            return self._sequence(tag, depth + 1)
        if tag == T_DICT:
            return self._dict(depth + 1)
        if tag == T_IMAGE:
            return self._image(depth + 1)
        if tag in (T_NAMEDTUPLE, T_DATACLASS):
            return self._record(tag, depth + 1)
        raise CorruptEntryError(f"unknown tag {tag:#x}")

    def _sequence(self, tag: int, depth: int) -> Build:
        items = [self.node(depth) for _ in range(self._count())]
        cols = [column_of(f) for f in items]

        def rows(tails: list[tuple[Any, ...]], datas: list[Any]) -> Any:
            if not cols:
                return [()] * len(tails)
            return zip(*[c(tails, datas) for c in cols], strict=True)

        vecs = _vectors(items)

        def vector_rows(r: Rows) -> Any:
            if not vecs:
                return [()] * r.m
            return zip(*[vec(r) for vec in vecs], strict=True)

        if tag == T_LIST:
            return with_column(lambda v, d, w: [f(v, d, w) for f in items],
                               lambda tails, datas: [list(r) for r in rows(tails, datas)],
                               None if vecs is None else lambda r: [list(x) for x in vector_rows(r)])
        if len(items) == 2:  # (input, target): the most common sample
            a, b = items
            return with_column(lambda v, d, w: (a(v, d, w), b(v, d, w)),
                               lambda tails, datas: list(rows(tails, datas)),
                               None if vecs is None else lambda r: list(vector_rows(r)))
        return with_column(lambda v, d, w: tuple([f(v, d, w) for f in items]),
                           lambda tails, datas: list(rows(tails, datas)),
                           None if vecs is None else lambda r: list(vector_rows(r)))

    def _dict(self, depth: int) -> Build:
        n = self._count()
        pairs = [(self.node(depth), self.node(depth)) for _ in range(n)]

        def build(v: tuple[Any, ...], d: Any, w: Any) -> Any:
            out = {k(v, d, w): x(v, d, w) for k, x in pairs}
            if len(out) != n:
                raise CorruptEntryError("duplicate dict keys")
            return out

        key_cols = [column_of(k) for k, _ in pairs]
        value_cols = [column_of(x) for _, x in pairs]

        def column(tails: list[tuple[Any, ...]], datas: list[Any]) -> list[Any]:
            if not pairs:
                return [{} for _ in tails]
            keys = zip(*[c(tails, datas) for c in key_cols], strict=True)
            values = zip(*[c(tails, datas) for c in value_cols], strict=True)
            out = [dict(zip(k, x, strict=True)) for k, x in zip(keys, values, strict=True)]
            if any(len(o) != n for o in out):
                raise CorruptEntryError("duplicate dict keys")
            return out

        key_vecs = _vectors([k for k, _ in pairs])
        value_vecs = _vectors([x for _, x in pairs])
        if key_vecs is None or value_vecs is None or not pairs:
            return with_column(build, column)
        kv, vv = key_vecs, value_vecs

        def vector(r: Rows) -> list[Any]:
            keys = zip(*[c(r) for c in kv], strict=True)
            values = zip(*[c(r) for c in vv], strict=True)
            out = [dict(zip(k, x, strict=True)) for k, x in zip(keys, values, strict=True)]
            if any(len(o) != n for o in out):
                raise CorruptEntryError("duplicate dict keys")
            return out

        return with_column(build, column, vector)

    def _record(self, tag: int, depth: int) -> Build:
        name = self._name().decode("utf-8")
        cls = _find_class(name)
        n = self._count()
        if tag == T_NAMEDTUPLE:
            if not (isinstance(cls, type) and issubclass(cls, tuple) and len(getattr(cls, "_fields", ())) == n):
                raise CorruptEntryError(f"{name} is not a namedtuple of {n} fields")
            items = [self.node(depth) for _ in range(n)]
            make = cls._make  # type: ignore[attr-defined]
            cols = [column_of(f) for f in items]
            vecs = _vectors(items) or []  # (none for a namedtuple without fields: it is rare)
            return with_column(
                lambda v, d, w: make([f(v, d, w) for f in items]),
                lambda tails, datas: [make(r) for r in zip(*[c(tails, datas) for c in cols], strict=True)]
                if cols else [make(()) for _ in tails],
                None if not vecs else lambda r: [make(x) for x in zip(*[c(r) for c in vecs], strict=True)])
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise CorruptEntryError(f"{name} is not a dataclass")
        fields = [(self._name().decode("utf-8"), self.node(depth)) for _ in range(n)]
        expected = [f.name for f in dataclasses.fields(cls)]
        if [f for f, _ in fields] != expected:
            raise CorruptEntryError(f"fields {[f for f, _ in fields]} do not match {name}'s {expected}")
        new, setattr_ = object.__new__, object.__setattr__

        def build(v: tuple[Any, ...], d: Any, w: Any) -> Any:
            # As pickle does: no __init__ (fields with init=False exist too), every field set directly.
            obj = new(cls)
            for field, f in fields:
                setattr_(obj, field, f(v, d, w))
            return obj

        named_cols = [(field, column_of(f)) for field, f in fields]

        def column(tails: list[tuple[Any, ...]], datas: list[Any]) -> list[Any]:
            out = [new(cls) for _ in tails]
            for field, c in named_cols:
                for obj, value in zip(out, c(tails, datas), strict=True):
                    setattr_(obj, field, value)
            return out

        dataclass_vecs = _vectors([f for _, f in fields])
        if dataclass_vecs is None:
            return with_column(build, column)
        named_vecs = list(zip([field for field, _ in fields], dataclass_vecs, strict=True))

        def vector(r: Rows) -> list[Any]:
            out = [new(cls) for _ in range(r.m)]
            for field, c in named_vecs:
                for obj, value in zip(out, c(r), strict=True):
                    setattr_(obj, field, value)
            return out

        return with_column(build, column, vector)

    def _blob(self, tag: int) -> Build:
        i = self._fields("Q", 2)
        if tag == T_STR:
            return lambda v, d, w: str(_at(d, v[i], v[i + 1]), "utf-8", "surrogatepass")
        if tag == T_BYTES:
            return lambda v, d, w: bytes(_at(d, v[i], v[i + 1]))
        if tag == T_BYTEARRAY:
            return lambda v, d, w: bytearray(_at(d, v[i], v[i + 1]))
        return lambda v, d, w: int.from_bytes(_at(d, v[i], v[i + 1]), "little", signed=True)

    def _dims(self) -> tuple[int, int]:
        ndim = self._byte()
        if ndim > MAX_NDIM:
            raise CorruptEntryError(f"array with {ndim} dimensions")
        return ndim, self._fields("Q", ndim)

    def _tensor(self) -> Build:
        env = _env()
        spec = env["dtypes"].get(self._name())
        if spec is None:
            raise CorruptEntryError("tensor of a dtype the codec does not write")
        dtype, itemsize, np_dtype = spec
        ndim, s = self._dims()
        e = s + ndim  # shape is v[s:e]; offset and length of the bytes follow
        self._fields("Q", 2)
        self.tensors = True
        torch, np = env["torch"], env["np"]
        from_numpy, frombuffer, empty = torch.from_numpy, np.frombuffer, torch.empty

        def one(v: tuple[Any, ...], d: Any) -> Any:  # a tensor on its own copy of the bytes
            nb = v[e + 1]
            if nb == 0:
                return empty(v[s:e], dtype=dtype)
            raw = np.empty(nb, np.uint8)
            memoryview(raw)[:] = _at(d, v[e], nb)
            return from_numpy(raw).view(dtype).view(v[s:e])

        def column(tails: list[tuple[Any, ...]], datas: list[Any]) -> list[Any]:
            # Same shape in every row (the usual case): one block, one copy per row, one call for all views.
            block = _rows_block(tails, datas, s, e, np)
            if block is None:
                return [one(v, d) for v, d in zip(tails, datas, strict=True)]
            return split(block, (len(tails), *tails[0][s:e]))

        def split(raw: Any, shape: tuple[int, ...]) -> list[Any]:
            """Per-row tensors of ``raw`` (rows of bytes). Typed and shaped by numpy where it can, so that the
            rows are views of a plain tensor: unbinding a view of a view costs torch about twice as much."""
            if np_dtype is not None:
                return list(from_numpy(raw.view(np_dtype).reshape(shape)).unbind(0))
            return list(from_numpy(raw).view(dtype).view(shape).unbind(0))

        def vector(r: Rows) -> list[Any]:
            shape, c0, nb = _uniform_leaf(r, s, e)
            if nb == 0:
                return [empty(shape, dtype=dtype) for _ in range(r.m)]
            raw = r.rows[:, c0:c0 + nb]
            if r.align % itemsize or c0 % itemsize:  # the rows would be misaligned: a copy
                raw = np.ascontiguousarray(raw)
            return split(raw, (r.m, *shape))

        if np_dtype is not None:  # numpy builds a shaped view faster than torch.frombuffer(...).view(shape)
            def build(v: tuple[Any, ...], d: Any, w: Any) -> Any:
                n = v[e + 1] // itemsize
                if n == 0:
                    return empty(v[s:e], dtype=dtype)
                return from_numpy(frombuffer(d, np_dtype, n, v[e]).reshape(v[s:e]))

            return with_column(build, column, vector)

        def build_torch(v: tuple[Any, ...], d: Any, w: Any) -> Any:
            n = v[e + 1] // itemsize
            if n == 0:
                return empty(v[s:e], dtype=dtype)
            return torch.frombuffer(d, dtype=dtype, count=n, offset=v[e]).view(v[s:e])

        return with_column(build_torch, column, vector)

    def _ndarray(self) -> Build:
        np = _env()["np"]
        dt = np.dtype(self._name().decode("ascii"))
        if dt.hasobject:
            raise CorruptEntryError("object arrays are never decoded")
        ndim, s = self._dims()
        e = s + ndim
        self._fields("Q", 2)
        self.arrays = True
        frombuffer, empty = np.frombuffer, np.empty

        def build(v: tuple[Any, ...], d: Any, w: Any) -> Any:
            n = v[e + 1] // dt.itemsize
            if n == 0:
                return empty(v[s:e], dtype=dt)
            return frombuffer(w, dt, n, v[e]).reshape(v[s:e])

        def column(tails: list[tuple[Any, ...]], datas: list[Any]) -> list[Any]:
            block = _rows_block(tails, datas, s, e, np) if ndim else None
            if block is None:
                out = []
                for v, d in zip(tails, datas, strict=True):
                    w = bytearray(d)
                    out.append(build(v, w, w))
                return out
            return list(block.view(dt).reshape((len(tails), *tails[0][s:e])))

        def vector(r: Rows) -> list[Any]:
            if not ndim:
                raise NotUniform  # rows of a (m,) array would be numpy scalars, not 0-d arrays
            shape, c0, nb = _uniform_leaf(r, s, e)
            if nb == 0:
                return [empty(shape, dtype=dt) for _ in range(r.m)]
            return list(np.ascontiguousarray(r.rows[:, c0:c0 + nb]).view(dt).reshape((r.m, *shape)))

        return with_column(build, column, vector)

    def _npscalar(self) -> Build:
        np = _env()["np"]
        dt = np.dtype(self._name().decode("ascii"))
        if dt.hasobject:
            raise CorruptEntryError("object scalars are never decoded")
        i = self._fields("Q", 2)
        return lambda v, d, w: np.frombuffer(_at(d, v[i], v[i + 1]), dtype=dt, count=1)[0].copy()

    def _image(self, depth: int) -> Build:
        from PIL import Image

        mode = self._name().decode("ascii")
        size = self._fields("Q", 2)
        palette_mode = self._name().decode("ascii")
        palette = self._fields("Q", 2) if palette_mode else -1
        if self.skel[self.pos] != T_DICT:
            raise CorruptEntryError("image info is not a dict")
        info = self.node(depth)
        pixels = self._fields("Q", 2)

        def build(v: tuple[Any, ...], d: Any, w: Any) -> Any:
            image = Image.frombytes(mode, (v[size], v[size + 1]), _at(d, v[pixels], v[pixels + 1]))
            if palette >= 0:
                image.putpalette(bytes(_at(d, v[palette], v[palette + 1])), palette_mode)
            image.info.update(info(v, d, w))
            return image

        return _private_copies(build)

"""The structure section of a cache entry: how each supported value is written and read back.

The structure (``meta``) is one tag byte per value followed by its fields; array contents live in a separate
data region (see :mod:`.codec`) and are referenced by ``(offset, nbytes)``. Supported values: ``None``,
``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``, ``tuple``/``list``/``dict`` of
supported values, ``torch.Tensor`` (CPU, strided, no grad), ``numpy.ndarray`` and numpy scalars of plain
dtypes, ``PIL.Image.Image``, namedtuples and dataclasses defined at module level. Types are exact: an
``OrderedDict`` or a tensor subclass would come back as something else, so they are refused.

Budgets keep a hostile or damaged entry from costing more than its own size: containers nest at most
:data:`MAX_DEPTH` levels (on write and on read, so neither side can hit Python's recursion limit), and every
count read from an entry is checked against the bytes left before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from typing import Any

from bagua_lightning.errors import CacheError

MAX_DEPTH = 32  # nesting levels of containers, images, namedtuples and dataclasses
ALIGN = 64  # bytes; every array starts on this boundary of the data region
PICKLE_HINT = (
    'or pass serializer="pickle" to CachedDataset/CacheLoader if you trust everyone who can write to this '
    "Redis (unpickling runs code from the cache)"
)

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_ARR = struct.Struct("<QQ")  # offset in the data region, nbytes
_SIZE = struct.Struct("<II")  # PIL image width, height
_MAX_NDIM = 64


class CorruptEntryError(CacheError):
    """A cached value is not a valid entry for its key (digest, length, version, budget or format mismatch)."""


# Tag bytes of the structure section.
T_NONE, T_TRUE, T_FALSE = b"N"[0], b"T"[0], b"F"[0]
T_INT, T_BIGINT, T_FLOAT, T_COMPLEX = b"i"[0], b"I"[0], b"f"[0], b"c"[0]
T_STR, T_BYTES, T_BYTEARRAY = b"s"[0], b"b"[0], b"B"[0]
T_TUPLE, T_LIST, T_DICT = b"("[0], b"["[0], b"{"[0]
T_TENSOR, T_NDARRAY, T_NPSCALAR = b"X"[0], b"A"[0], b"a"[0]
T_IMAGE, T_NAMEDTUPLE, T_DATACLASS = b"P"[0], b"n"[0], b"D"[0]

TORCH_DTYPES = frozenset((
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2",
))


def pad(n: int) -> int:
    return (-n) % ALIGN


def _unsupported(path: str, t: type) -> TypeError:
    return TypeError(
        f"the safe cache codec cannot store {path} of type {t.__module__}.{t.__qualname__}: it stores "
        "torch.Tensor, numpy.ndarray, numpy scalars, PIL images, int, float, complex, bool, None, str, bytes, "
        "tuple/list/dict and module-level namedtuples and dataclasses of them (exact types). Convert the "
        "sample in your dataset, " + PICKLE_HINT + "."
    )


def _class_name(cls: type, path: str) -> bytes:
    name = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = _find_class(name)
    except CorruptEntryError:
        found = None
    if found is not cls:
        raise TypeError(f"the safe cache codec cannot store {path}: its class {cls.__qualname__} cannot be found "
                        f"as {name} (defined inside a function?); define it at module level so a reader can "
                        "find it, " + PICKLE_HINT + ".")
    return name.encode()


class Encoder:
    """Walks a sample once: structure bytes go to ``self.meta``, array sources to ``self.arrays``."""

    __slots__ = ("arrays", "data_len", "meta")

    def __init__(self) -> None:
        self.meta = bytearray()
        self.arrays: list[tuple[int, memoryview]] = []  # (offset in data, bytes view)
        self.data_len = 0

    def _add_array(self, view: memoryview) -> None:
        self.data_len += pad(self.data_len)
        self.meta += _ARR.pack(self.data_len, view.nbytes)
        self.arrays.append((self.data_len, view))
        self.data_len += view.nbytes

    def _blob(self, tag: int, raw: bytes | bytearray) -> None:
        self.meta.append(tag)
        self.meta += _U32.pack(len(raw))
        self.meta += raw

    def _name(self, raw: bytes) -> None:
        self.meta.append(len(raw))
        self.meta += raw

    def _shape(self, shape: tuple[int, ...]) -> None:
        self.meta.append(len(shape))
        for d in shape:
            self.meta += _I64.pack(d)

    def add(self, obj: Any, path: str, depth: int = 0) -> None:
        t = type(obj)
        m = self.meta
        if obj is None:
            m.append(T_NONE)
        elif t is bool:
            m.append(T_TRUE if obj else T_FALSE)
        elif t is int:
            if -(2**63) <= obj < 2**63:
                m.append(T_INT)
                m += _I64.pack(obj)
            else:
                self._blob(T_BIGINT, obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True))
        elif t is float:
            m.append(T_FLOAT)
            m += _F64.pack(obj)
        elif t is complex:
            m.append(T_COMPLEX)
            m += _C128.pack(obj.real, obj.imag)
        elif t is str:
            self._blob(T_STR, obj.encode("utf-8", "surrogatepass"))
        elif t is bytes or t is bytearray:
            self._blob(T_BYTES if t is bytes else T_BYTEARRAY, obj)
        elif t is tuple or t is list or t is dict:
            self._container(obj, t, path, depth)
        elif _is_tensor(obj):
            self._tensor(obj, path)
        elif _is_numpy(obj, "ndarray"):
            self._ndarray(obj, path)
        elif _is_numpy(obj, "generic"):
            self._npscalar(obj, path)
        elif _is_image(obj):
            self._image(obj, path, depth)
        elif isinstance(obj, tuple) and isinstance(getattr(t, "_fields", None), tuple) and t.__bases__ == (tuple,):
            self._deeper(path, depth)
            m.append(T_NAMEDTUPLE)
            self._name(_class_name(t, path))
            m += _U32.pack(len(obj))
            for name, item in zip(t._fields, obj, strict=True):
                self.add(item, f"{path}.{name}", depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            self._dataclass(obj, path, depth)
        else:
            raise _unsupported(path, t)

    def _deeper(self, path: str, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise TypeError(f"the safe cache codec cannot store {path}: containers nested deeper than {MAX_DEPTH} "
                            "levels (or a container that holds itself); flatten the sample, " + PICKLE_HINT + ".")

    def _container(self, obj: Any, t: type, path: str, depth: int) -> None:
        self._deeper(path, depth)
        if t is dict:
            self.meta.append(T_DICT)
            self.meta += _U32.pack(len(obj))
            for k, v in obj.items():
                self.add(k, f"{path} key {k!r}", depth + 1)
                self.add(v, f"{path}[{k!r}]", depth + 1)
            return
        self.meta.append(T_TUPLE if t is tuple else T_LIST)
        self.meta += _U32.pack(len(obj))
        for i, item in enumerate(obj):
            self.add(item, f"{path}[{i}]", depth + 1)

    def _dataclass(self, obj: Any, path: str, depth: int) -> None:
        self._deeper(path, depth)
        t = type(obj)
        fields = dataclasses.fields(obj)
        self.meta.append(T_DATACLASS)
        self._name(_class_name(t, path))
        self.meta += _U32.pack(len(fields))
        for f in fields:
            self._blob(T_STR, f.name.encode())
            self.add(getattr(obj, f.name), f"{path}.{f.name}", depth + 1)

    def _tensor(self, obj: Any, path: str) -> None:
        import torch

        name = str(obj.dtype).removeprefix("torch.")
        problem = None
        if type(obj) is not torch.Tensor:
            problem = f"a {type(obj).__qualname__} (tensor subclass)"
        elif obj.layout != torch.strided:
            problem = f"a {obj.layout} tensor"
        elif obj.device.type != "cpu":
            problem = f"a tensor on {obj.device} (move samples to the device after loading)"
        elif obj.is_quantized or name not in TORCH_DTYPES:
            problem = f"a tensor of dtype {obj.dtype}"
        elif obj.requires_grad:
            problem = "a tensor that requires grad (detach it in the dataset)"
        if problem is not None:
            raise TypeError(f"the safe cache codec cannot store {path}: {problem}; " + PICKLE_HINT + ".")
        self.meta.append(T_TENSOR)
        self._name(name.encode())
        self._shape(tuple(obj.shape))
        flat = obj.contiguous().reshape(-1)
        if flat.numel() == 0:
            self._add_array(memoryview(b""))
        else:
            self._add_array(memoryview(flat.view(torch.uint8).numpy()).cast("B"))

    def _ndarray(self, obj: Any, path: str) -> None:
        import numpy as np

        dt = obj.dtype
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.kind == "V":
            raise TypeError(f"the safe cache codec cannot store {path}: a numpy array of dtype {dt}; "
                            + PICKLE_HINT + ".")
        self.meta.append(T_NDARRAY)
        self._name(dt.str.encode())
        self._shape(tuple(obj.shape))
        arr = np.ascontiguousarray(obj)
        flat: Any = arr.reshape(-1).view(np.uint8)
        self._add_array(memoryview(flat).cast("B") if arr.size else memoryview(b""))

    def _npscalar(self, obj: Any, path: str) -> None:
        dt = obj.dtype
        if dt.hasobject or dt.fields is not None or dt.kind == "V":
            raise TypeError(f"the safe cache codec cannot store {path}: a numpy scalar of dtype {dt}; "
                            + PICKLE_HINT + ".")
        self.meta.append(T_NPSCALAR)
        self._name(dt.str.encode())
        data = obj.tobytes()
        self.meta += _U32.pack(len(data)) + data

    def _image(self, obj: Any, path: str, depth: int) -> None:
        self._deeper(path, depth)
        self.meta.append(T_IMAGE)
        self._name(obj.mode.encode())
        self.meta += _SIZE.pack(*obj.size)
        palette = obj.palette
        if obj.mode in ("P", "PA") and palette is not None:
            self._name(palette.mode.encode())
            self._blob(T_BYTES, bytes(obj.getpalette(palette.mode) or b""))
        else:
            self._name(b"")
        # Image metadata (dpi, gamma, ...) is kept where the codec can store it; other entries are dropped.
        info = {}
        for k, v in obj.info.items():
            try:
                Encoder().add((k, v), path, depth + 1)
            except TypeError:
                continue
            info[k] = v
        self.add(info, f"{path}.info", depth + 1)
        self._add_array(memoryview(obj.tobytes()))


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist unless torch was imported
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_numpy(obj: Any, kind: str) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, getattr(np, kind))


def _is_image(obj: Any) -> bool:
    image = sys.modules.get("PIL.Image")
    return image is not None and isinstance(obj, image.Image)


class Decoder:
    """Reads the structure with ``unpack_from`` at a moving offset.

    ``data`` is the entry's data region. When ``shared`` is True the decoder owns it (a reply buffer nobody
    else holds) and tensors view it directly; otherwise tensors and arrays view one writable copy of it,
    made on the first array. numpy arrays always view a writable copy (numpy refuses a read-only base).
    """

    __slots__ = ("copy", "data", "end", "meta", "pos", "shared")

    def __init__(self, meta: bytes, data: memoryview, shared: bool) -> None:
        self.meta = meta
        self.end = len(meta)
        self.data = data
        self.shared = shared
        self.copy: bytearray | None = None
        self.pos = 0

    def _take(self, n: int) -> bytes:
        pos = self.pos
        if pos + n > self.end:
            raise CorruptEntryError("entry structure runs past its meta section")
        self.pos = pos + n
        return self.meta[pos:pos + n]

    def _u32(self) -> int:
        (n,) = _U32.unpack_from(self.meta, self.pos)
        self.pos += 4
        return int(n)

    def _count(self) -> int:
        # Every item takes at least one byte of structure: a larger count is a lie, refused before allocating.
        n = self._u32()
        if n > self.end - self.pos:
            raise CorruptEntryError(f"a container of {n} items in {self.end - self.pos} bytes of structure")
        return n

    def _name(self) -> str:
        n = self.meta[self.pos]
        self.pos += 1
        return str(self._take(n), "ascii")

    def _writable(self) -> bytearray:
        if self.copy is None:
            self.copy = bytearray(self.data)
        return self.copy

    def _shape_and_bytes(self) -> tuple[tuple[int, ...], int, int, int]:
        ndim = self.meta[self.pos]
        if ndim > _MAX_NDIM:
            raise CorruptEntryError(f"array with {ndim} dimensions")
        shape = struct.unpack_from(f"<{ndim}q", self.meta, self.pos + 1)
        self.pos += 1 + 8 * ndim
        off, nbytes = _ARR.unpack_from(self.meta, self.pos)
        self.pos += _ARR.size
        if off + nbytes > self.data.nbytes:
            raise CorruptEntryError("array data runs past the entry")
        numel = 1
        for d in shape:
            if d < 0:
                raise CorruptEntryError(f"negative dimension in shape {shape}")
            numel *= d
        return shape, numel, off, nbytes

    def read(self, depth: int = 0) -> Any:
        meta = self.meta
        pos = self.pos
        tag = meta[pos]
        self.pos = pos + 1
        if tag == T_TENSOR:
            return self._read_tensor()
        if tag == T_INT:
            self.pos = pos + 9
            return _I64.unpack_from(meta, pos + 1)[0]
        if depth >= MAX_DEPTH and tag in _NESTED:
            raise CorruptEntryError(f"structure nested deeper than {MAX_DEPTH} levels")
        if tag == T_TUPLE:
            (n,) = _U32.unpack_from(meta, pos + 1)
            self.pos = pos + 5
            if n > self.end - pos:
                raise CorruptEntryError(f"a container of {n} items in {self.end - pos} bytes of structure")
            read = self.read
            depth += 1
            return tuple([read(depth) for _ in range(n)])
        if tag in _NESTED:
            return self._read_nested(tag, depth + 1)
        if tag == T_FLOAT:
            (f,) = _F64.unpack_from(meta, self.pos)
            self.pos += 8
            return f
        if tag == T_NDARRAY:
            return self._read_ndarray()
        if tag == T_STR:
            return str(self._take(self._u32()), "utf-8", "surrogatepass")
        if tag == T_BYTES:
            return self._take(self._u32())
        if tag == T_NONE:
            return None
        if tag == T_TRUE:
            return True
        if tag == T_FALSE:
            return False
        if tag == T_BIGINT:
            return int.from_bytes(self._take(self._u32()), "little", signed=True)
        if tag == T_COMPLEX:
            re, im = _C128.unpack_from(meta, self.pos)
            self.pos += 16
            return complex(re, im)
        if tag == T_BYTEARRAY:
            return bytearray(self._take(self._u32()))
        if tag == T_NPSCALAR:
            import numpy as np

            dt = np.dtype(self._name())
            if dt.hasobject:
                raise CorruptEntryError("object scalars are never decoded")
            raw = self._take(self._u32())
            return np.frombuffer(raw, dtype=dt, count=1)[0].copy()
        raise CorruptEntryError(f"unknown tag {tag:#x}")

    def _read_nested(self, tag: int, depth: int) -> Any:
        if tag == T_LIST:
            return [self.read(depth) for _ in range(self._count())]
        if tag == T_DICT:
            n = self._count()
            out = {}
            for _ in range(n):
                k = self.read(depth)
                out[k] = self.read(depth)
            if len(out) != n:
                raise CorruptEntryError("duplicate dict keys")
            return out
        if tag == T_IMAGE:
            return self._read_image(depth)
        cls = _find_class(self._name())
        n = self._count()
        if tag == T_NAMEDTUPLE:
            if not (isinstance(cls, type) and issubclass(cls, tuple) and len(getattr(cls, "_fields", ())) == n):
                raise CorruptEntryError(f"{cls!r} is not a namedtuple of {n} fields")
            return cls._make([self.read(depth) for _ in range(n)])  # type: ignore[attr-defined]
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise CorruptEntryError(f"{cls!r} is not a dataclass")
        names = [f.name for f in dataclasses.fields(cls)]
        values = {}
        for _ in range(n):
            if self.meta[self.pos] != T_STR:
                raise CorruptEntryError("dataclass field without a name")
            self.pos += 1
            name = str(self._take(self._u32()), "utf-8")
            values[name] = self.read(depth)
        if list(values) != names:
            raise CorruptEntryError(f"fields {list(values)} do not match {cls.__qualname__}'s {names}")
        # As pickle does: no __init__ (fields with init=False exist too), set every field directly.
        obj = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        return obj

    def _read_image(self, depth: int) -> Any:
        from PIL import Image

        mode = self._name()
        size = _SIZE.unpack_from(self.meta, self.pos)
        self.pos += _SIZE.size
        palette_mode = self._name()
        palette = None
        if palette_mode:
            if self.meta[self.pos] != T_BYTES:
                raise CorruptEntryError("image palette is not bytes")
            self.pos += 1
            palette = self._take(self._u32())
        if self.meta[self.pos] != T_DICT:
            raise CorruptEntryError("image info is not a dict")
        info = self.read(depth)
        off, nbytes = _ARR.unpack_from(self.meta, self.pos)
        self.pos += _ARR.size
        if off + nbytes > self.data.nbytes:
            raise CorruptEntryError("image data runs past the entry")
        image = Image.frombytes(mode, size, self.data[off:off + nbytes])
        if palette is not None:
            image.putpalette(palette, palette_mode)
        image.info.update(info)
        return image

    def _read_tensor(self) -> Any:
        meta = self.meta
        pos = self.pos
        n = meta[pos]
        spec = _TENSOR_TYPES.get(meta[pos + 1:pos + 1 + n]) or _tensor_spec(meta[pos + 1:pos + 1 + n])
        dtype, itemsize, np_dtype, torch, np_frombuffer = spec
        pos += 1 + n
        ndim = meta[pos]
        shape = (_SHAPES.get(ndim) or _shape_struct(ndim)).unpack_from(meta, pos + 1)
        pos += 1 + 8 * ndim
        off, nbytes = _ARR.unpack_from(meta, pos)
        self.pos = pos + 16
        numel = math.prod(shape)  # dims are read unsigned: nothing negative to check
        if numel * itemsize != nbytes or off + nbytes > self.data.nbytes:
            raise CorruptEntryError(f"tensor of shape {shape} and dtype {dtype} does not fit {nbytes} bytes "
                                    f"at {off} of {self.data.nbytes}")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        buf = self.data if self.shared else self._writable()
        if np_dtype is not None:  # numpy builds a shaped view faster than torch.frombuffer(...).view(shape)
            return torch.from_numpy(np_frombuffer(buf, np_dtype, numel, off).reshape(shape))
        t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=off)
        return t if ndim == 1 else t.view(shape)

    def _read_ndarray(self) -> Any:
        import numpy as np

        dt = np.dtype(self._name())
        if dt.hasobject:
            raise CorruptEntryError("object arrays are never decoded")
        shape, numel, off, nbytes = self._shape_and_bytes()
        if numel * dt.itemsize != nbytes:
            raise CorruptEntryError(f"array of shape {shape} and dtype {dt} does not fit {nbytes} bytes")
        if numel == 0:
            return np.empty(shape, dtype=dt)
        return np.frombuffer(self._writable(), dtype=dt, count=numel, offset=off).reshape(shape)


_NESTED = frozenset((T_TUPLE, T_LIST, T_DICT, T_IMAGE, T_NAMEDTUPLE, T_DATACLASS))
_SHAPES: dict[int, struct.Struct] = {}
# dtype name as written -> (torch dtype, item size, numpy dtype or None, torch, numpy.frombuffer); filled on
# first use, so that the hot path is one dict lookup.
_TENSOR_TYPES: dict[bytes, tuple[Any, int, Any, Any, Any]] = {}


def _np() -> Any:
    import numpy

    return numpy


def _tensor_spec(name: bytes) -> tuple[Any, int, Any, Any, Any]:
    if not _TENSOR_TYPES:
        import warnings

        import torch

        try:
            np: Any = _np()
        except ImportError:  # torch runs without numpy: tensors then go through torch.frombuffer only
            np = None
        for dtype_name in TORCH_DTYPES:
            dtype = getattr(torch, dtype_name)
            np_dtype = np.dtype(dtype_name).newbyteorder("<") if np is not None and hasattr(np, dtype_name) else None
            _TENSOR_TYPES[dtype_name.encode()] = (dtype, dtype.itemsize, np_dtype, torch,
                                                  np.frombuffer if np is not None else None)
        # torch warns once per process that a tensor over a read-only buffer could write to it. A reply
        # buffer is owned by the tensors decoded from it and nobody else reads it: the warning would only
        # alarm, so it is used up here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(b"\0", dtype=torch.uint8)
            if np is not None:
                torch.from_numpy(np.frombuffer(b"\0", np.uint8))
    spec = _TENSOR_TYPES.get(name)
    if spec is None:
        raise CorruptEntryError(f"tensor dtype {name!r} is not one the codec writes")
    return spec


def _shape_struct(ndim: int) -> struct.Struct:
    if ndim > _MAX_NDIM:
        raise CorruptEntryError(f"array with {ndim} dimensions")
    st = _SHAPES[ndim] = struct.Struct(f"<{ndim}Q")
    return st


def _find_class(name: str) -> Any:
    """The class ``module:qualname`` among modules already imported; a cache entry never imports code."""
    module_name, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        raise CorruptEntryError(f"module {module_name!r} of a cached namedtuple/dataclass is not imported")
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise CorruptEntryError(f"{name} not found")
    return obj

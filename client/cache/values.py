"""How each supported value is written into a cache entry (reading is :mod:`.skeletons`).

A sample becomes three parts (see :mod:`.codec` for the entry layout): the skeleton (one tag byte per value,
plus dtype names, numbers of dimensions, container lengths, class and field names), the tail (the
fixed-size fields that vary from sample to sample: numbers, shapes, offsets and lengths, 8 bytes each), and
the data region (array, image, string and bytes contents). Supported values: ``None``,
``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``, ``tuple``/``list``/``dict`` of
supported values, ``torch.Tensor`` (CPU, strided, no grad), ``numpy.ndarray`` and numpy scalars of plain
dtypes, ``PIL.Image.Image``, namedtuples and dataclasses defined at module level. Types are exact: an
``OrderedDict`` or a tensor subclass would come back as something else, so they are refused.

Containers nest at most :data:`MAX_DEPTH` levels, on write and on read (:mod:`.skeletons`), so neither side can
hit Python's recursion limit.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from typing import Any

from ...core.errors import CacheError

MAX_DEPTH = 32  # nesting levels of containers, images, namedtuples and dataclasses
ALIGN = 64  # bytes; every array starts on this boundary of the data region
PICKLE_HINT = (
    'or pass serializer="pickle" to CachedDataset/CacheLoader if you trust everyone who can write to this '
    "Redis (unpickling runs code from the cache)"
)

_U32 = struct.Struct("<I")
MAX_NDIM = 64


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


# A GET reply is "$<size>\r\n<entry>\r\n". Entries are padded (at the end of their data region) so that a
# reply spans a multiple of this many bytes: back to back in a receive buffer, a batch's entries of one size
# then all start on this boundary, and their arrays can be used where they lie (see resp.Receiver).
REPLY_ALIGN = 16


def reply_pad(size: int) -> int:
    """Bytes to add to an entry of ``size`` bytes so that its ``GET`` reply spans a multiple of REPLY_ALIGN."""
    for extra in range(2 * REPLY_ALIGN):
        total = size + extra
        if (total + len(str(total)) + 5) % REPLY_ALIGN == 0:
            return extra
    raise AssertionError("unreachable: the reply length takes every residue within 2 * REPLY_ALIGN")


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
    """Walks a sample once: the skeleton to ``meta``, fixed-size fields to the tail, bytes to the data region.

    The skeleton holds what is usually the same for every sample of a dataset (types, dtypes, numbers of
    dimensions, container lengths, class and field names); the tail holds what varies (numbers, shapes,
    offsets and lengths in the data region), all 8-byte fields. A reader compiles a skeleton once and
    decodes every later entry with the same skeleton by one ``struct`` unpack and a prebuilt function.
    """

    __slots__ = ("arrays", "data_len", "fmt", "meta", "vals")

    def __init__(self) -> None:
        self.meta = bytearray()
        self.fmt: list[str] = []
        self.vals: list[Any] = []
        self.arrays: list[tuple[int, memoryview]] = []  # (offset in data, bytes view)
        self.data_len = 0

    def tail(self) -> bytes:
        return struct.pack("<" + "".join(self.fmt), *self.vals)

    def _field(self, code: str, value: Any) -> None:
        self.fmt.append(code)
        self.vals.append(value)

    def _add_array(self, view: memoryview) -> None:
        self.data_len += pad(self.data_len)  # arrays start aligned
        self._add_bytes(view)

    def _add_bytes(self, view: memoryview | bytes | bytearray) -> None:
        view = memoryview(view)
        self._field("Q", self.data_len)
        self._field("Q", view.nbytes)
        self.arrays.append((self.data_len, view))
        self.data_len += view.nbytes

    def _blob(self, tag: int, raw: bytes | bytearray) -> None:
        self.meta.append(tag)
        self._add_bytes(raw)

    def _name(self, raw: bytes) -> None:
        self.meta.append(len(raw))
        self.meta += raw

    def _shape(self, shape: tuple[int, ...]) -> None:
        self.meta.append(len(shape))
        for d in shape:
            self._field("Q", d)

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
                self._field("q", obj)
            else:
                self._blob(T_BIGINT, obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True))
        elif t is float:
            m.append(T_FLOAT)
            self._field("d", obj)
        elif t is complex:
            m.append(T_COMPLEX)
            self._field("d", obj.real)
            self._field("d", obj.imag)
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
            self._name(f.name.encode())
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
        self._add_bytes(obj.tobytes())

    def _image(self, obj: Any, path: str, depth: int) -> None:
        self._deeper(path, depth)
        self.meta.append(T_IMAGE)
        self._name(obj.mode.encode())
        self._field("Q", obj.size[0])
        self._field("Q", obj.size[1])
        palette = obj.palette
        if obj.mode in ("P", "PA") and palette is not None:
            self._name(palette.mode.encode())
            self._add_bytes(bytes(obj.getpalette(palette.mode) or b""))
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
        self._add_bytes(obj.tobytes())


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist unless torch was imported
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_numpy(obj: Any, kind: str) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, getattr(np, kind))


def _is_image(obj: Any) -> bool:
    image = sys.modules.get("PIL.Image")
    return image is not None and isinstance(obj, image.Image)


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

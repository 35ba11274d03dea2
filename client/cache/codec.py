"""The safe sample codec: tensors, numpy arrays, numbers, strings, bytes and containers, without pickle.

Entry layout (little endian)::

    header (24 bytes): b"BLC" | format version u8 | flags u8 | 3 zero bytes | meta_len u32 | data_len u64 | crc32 u32
    meta   (meta_len):  the structure, one tag byte per value (see ``_Tag``), array descriptors, small scalars
    pad               : zeros up to a multiple of 64 bytes
    data   (data_len) : raw array bytes, each array starting on a 64-byte boundary

The CRC-32 covers the key the entry was written under, the header up to the CRC, the meta and the data: a
flipped bit, a truncated value or a valid entry copied under another key all fail :func:`decode` with
:class:`CorruptEntryError`, which the loader counts and treats as a miss. Array bytes are copied once on
write (straight from the tensor's memory into the value) and once on read (into one writable buffer that
every decoded tensor and array of the entry views, with no per-array copy).

Only exact types are accepted (a ``namedtuple`` or an ``OrderedDict`` would come back as a plain tuple or
dict, i.e. a different sample), so anything else raises ``TypeError`` naming the type, where it sits in the
sample and how to opt in to pickle. Pickle (flag bit 0) is written and read only with ``allow_pickle``; an
entry written with pickle is a miss for a reader that did not opt in, never unpickled.
"""

from __future__ import annotations

import pickle
import struct
import sys
import zlib
from typing import Any

from bagua_lightning.errors import CacheError

MAGIC = b"BLC"
FORMAT_VERSION = 1
FLAG_PICKLE = 0x01
ALIGN = 64  # bytes; keeps every array aligned for vectorised kernels after a zero-copy view

_HEADER = struct.Struct("<3sBB3xIQI")
HEADER_SIZE = _HEADER.size  # 24
_CRC_OFFSET = HEADER_SIZE - 4
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_ARR = struct.Struct("<QQ")  # offset in the data region, nbytes
_MAX_NDIM = 64

PICKLE_HINT = (
    'or pass serializer="pickle" to CachedDataset/CacheLoader if you trust everyone who can write to this '
    "Redis (unpickling runs code from the cache)"
)


class CorruptEntryError(CacheError):
    """A cached value is not a valid entry for its key (checksum, length, version or format mismatch)."""


# Tag bytes of the meta section.
T_NONE, T_TRUE, T_FALSE = b"N"[0], b"T"[0], b"F"[0]
T_INT, T_BIGINT, T_FLOAT, T_COMPLEX = b"i"[0], b"I"[0], b"f"[0], b"c"[0]
T_STR, T_BYTES, T_BYTEARRAY = b"s"[0], b"b"[0], b"B"[0]
T_TUPLE, T_LIST, T_DICT = b"("[0], b"["[0], b"{"[0]
T_TENSOR, T_NDARRAY, T_NPSCALAR = b"X"[0], b"A"[0], b"a"[0]

_TORCH_DTYPES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2",
)


def _pad(n: int) -> int:
    return (-n) % ALIGN


class _Encoder:
    """Walks a sample once: meta bytes go to ``self.meta``, array sources to ``self.arrays``."""

    __slots__ = ("arrays", "data_len", "meta")

    def __init__(self) -> None:
        self.meta = bytearray()
        self.arrays: list[tuple[int, memoryview]] = []  # (offset in data, bytes view)
        self.data_len = 0

    def _add_array(self, view: memoryview) -> None:
        self.data_len += _pad(self.data_len)
        self.meta += _ARR.pack(self.data_len, view.nbytes)
        self.arrays.append((self.data_len, view))
        self.data_len += view.nbytes

    def _shape(self, shape: tuple[int, ...]) -> None:
        self.meta.append(len(shape))
        for d in shape:
            self.meta += _I64.pack(d)

    def add(self, obj: Any, path: str) -> None:
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
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                m.append(T_BIGINT)
                m += _U32.pack(len(raw)) + raw
        elif t is float:
            m.append(T_FLOAT)
            m += _F64.pack(obj)
        elif t is complex:
            m.append(T_COMPLEX)
            m += _C128.pack(obj.real, obj.imag)
        elif t is str:
            raw = obj.encode("utf-8", "surrogatepass")
            m.append(T_STR)
            m += _U32.pack(len(raw)) + raw
        elif t is bytes or t is bytearray:
            m.append(T_BYTES if t is bytes else T_BYTEARRAY)
            m += _U32.pack(len(obj)) + obj
        elif t is tuple or t is list:
            m.append(T_TUPLE if t is tuple else T_LIST)
            m += _U32.pack(len(obj))
            for i, item in enumerate(obj):
                self.add(item, f"{path}[{i}]")
        elif t is dict:
            m.append(T_DICT)
            m += _U32.pack(len(obj))
            for k, v in obj.items():
                self.add(k, f"{path} key {k!r}")
                self.add(v, f"{path}[{k!r}]")
        elif _is_tensor(obj):
            self._tensor(obj, path)
        elif _is_numpy(obj, "ndarray"):
            self._ndarray(obj, path)
        elif _is_numpy(obj, "generic"):
            self._npscalar(obj, path)
        else:
            raise TypeError(
                f"the safe cache codec cannot store {path} of type {t.__module__}.{t.__qualname__}: it stores "
                "torch.Tensor, numpy.ndarray, numpy scalars, int, float, complex, bool, None, str, bytes and "
                "tuple/list/dict of them (exact types). Convert the sample in your dataset, " + PICKLE_HINT + "."
            )

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
        elif obj.is_quantized or name not in _TORCH_DTYPES:
            problem = f"a tensor of dtype {obj.dtype}"
        elif obj.requires_grad:
            problem = "a tensor that requires grad (detach it in the dataset)"
        if problem is not None:
            raise TypeError(f"the safe cache codec cannot store {path}: {problem}; " + PICKLE_HINT + ".")
        raw = name.encode()
        self.meta.append(T_TENSOR)
        self.meta.append(len(raw))
        self.meta += raw
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
        raw = dt.str.encode()
        self.meta.append(T_NDARRAY)
        self.meta.append(len(raw))
        self.meta += raw
        self._shape(tuple(obj.shape))
        arr = np.ascontiguousarray(obj)
        flat: Any = arr.reshape(-1).view(np.uint8)
        self._add_array(memoryview(flat).cast("B") if arr.size else memoryview(b""))

    def _npscalar(self, obj: Any, path: str) -> None:
        dt = obj.dtype
        if dt.hasobject or dt.fields is not None or dt.kind == "V":
            raise TypeError(f"the safe cache codec cannot store {path}: a numpy scalar of dtype {dt}; "
                            + PICKLE_HINT + ".")
        raw = dt.str.encode()
        data = obj.tobytes()
        self.meta.append(T_NPSCALAR)
        self.meta.append(len(raw))
        self.meta += raw
        self.meta += _U32.pack(len(data)) + data


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist unless torch was imported
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_numpy(obj: Any, kind: str) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, getattr(np, kind))


def _crc(key: bytes, header: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(body, zlib.crc32(header[:_CRC_OFFSET], zlib.crc32(key))) & 0xFFFFFFFF


def encode(obj: Any, key: bytes = b"", *, allow_pickle: bool = False) -> memoryview:
    """Serialize ``obj`` into one entry for ``key``.

    Args:
        obj: the sample.
        key: the Redis key it is stored under (bound into the checksum).
        allow_pickle: store with pickle (protocol 5) instead of the safe codec.

    Returns:
        A view of the entry's bytes, accepted by redis-py as a value without another copy.

    Raises:
        TypeError: a value the safe codec does not store (message names it and where it is).
    """
    if allow_pickle:
        data = pickle.dumps(obj, protocol=5)
        return _assemble(key, FLAG_PICKLE, b"", [(0, memoryview(data))], len(data))
    enc = _Encoder()
    enc.add(obj, "the sample")
    return _assemble(key, 0, enc.meta, enc.arrays, enc.data_len)


def _assemble(key: bytes, flags: int, meta: bytes | bytearray, arrays: list[tuple[int, memoryview]],
              data_len: int) -> memoryview:
    data_start = HEADER_SIZE + len(meta)
    data_start += _pad(data_start)
    out = bytearray(data_start + data_len)
    out[HEADER_SIZE:HEADER_SIZE + len(meta)] = meta
    for off, view in arrays:
        out[data_start + off:data_start + off + view.nbytes] = view
    _HEADER.pack_into(out, 0, MAGIC, FORMAT_VERSION, flags, len(meta), data_len, 0)
    mv = memoryview(out)
    _U32.pack_into(out, _CRC_OFFSET, _crc(key, mv[:HEADER_SIZE], mv[HEADER_SIZE:]))
    return mv


def is_pickled(value: bytes | memoryview) -> bool:
    """True when ``value`` looks like an entry written with ``serializer="pickle"``."""
    return len(value) >= HEADER_SIZE and bytes(value[:3]) == MAGIC and bool(value[4] & FLAG_PICKLE)


def decode(value: bytes | bytearray | memoryview, key: bytes = b"", *, allow_pickle: bool = False) -> Any:
    """Rebuild the sample from an entry read under ``key``.

    Raises:
        CorruptEntryError: not an entry of this format/version for this key, a checksum mismatch, or a
            pickled entry while ``allow_pickle`` is False.
    """
    mv = memoryview(value).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise CorruptEntryError(f"entry of {mv.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, meta_len, data_len, crc = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptEntryError("not a bagua-lightning cache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"entry format version {version}, this reader understands {FORMAT_VERSION}")
    data_start = HEADER_SIZE + meta_len
    data_start += _pad(data_start)
    if data_start + data_len != mv.nbytes:
        raise CorruptEntryError(f"entry length {mv.nbytes} does not match its header ({data_start + data_len})")
    if zlib.crc32(mv[HEADER_SIZE:], zlib.crc32(mv[:_CRC_OFFSET], zlib.crc32(key))) != crc:
        raise CorruptEntryError("checksum mismatch (corrupted, truncated or stored under another key)")
    if flags & FLAG_PICKLE:
        if not allow_pickle:
            raise CorruptEntryError('entry was written with serializer="pickle"; not unpickling it')
        return pickle.loads(mv[data_start:])
    if flags:
        raise CorruptEntryError(f"unknown flags {flags:#x}")
    try:
        dec = _Decoder(bytes(mv[HEADER_SIZE:HEADER_SIZE + meta_len]), mv[data_start:])
        obj = dec.read()
        if dec.pos != meta_len:
            raise CorruptEntryError("trailing bytes after the sample structure")
    except CorruptEntryError:
        raise
    except (ValueError, TypeError, IndexError, struct.error, UnicodeDecodeError, AttributeError) as exc:
        raise CorruptEntryError(f"malformed entry structure: {exc}") from exc
    return obj


class _Decoder:
    """Reads the meta section with ``unpack_from`` at a moving offset (no per-field slicing)."""

    __slots__ = ("buf", "data", "end", "meta", "pos")

    def __init__(self, meta: bytes, data: memoryview) -> None:
        self.meta = meta
        self.end = len(meta)
        self.data = data
        self.buf: bytearray | None = None  # the one writable copy of the data region, made on first array
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

    def _name(self) -> str:
        n = self.meta[self.pos]
        self.pos += 1
        return str(self._take(n), "ascii")

    def _shape_and_bytes(self) -> tuple[tuple[int, ...], int, bytearray, int, int]:
        ndim = self.meta[self.pos]
        if ndim > _MAX_NDIM:
            raise CorruptEntryError(f"array with {ndim} dimensions")
        shape = struct.unpack_from(f"<{ndim}q", self.meta, self.pos + 1)
        self.pos += 1 + 8 * ndim
        off, nbytes = _ARR.unpack_from(self.meta, self.pos)
        self.pos += _ARR.size
        if off + nbytes > self.data.nbytes:
            raise CorruptEntryError("array data runs past the entry")
        if self.buf is None:
            self.buf = bytearray(self.data)
        numel = 1
        for d in shape:
            if d < 0:
                raise CorruptEntryError(f"negative dimension in shape {shape}")
            numel *= d
        return shape, numel, self.buf, off, nbytes

    def read(self) -> Any:
        meta = self.meta
        tag = meta[self.pos]
        self.pos += 1
        if tag == T_TENSOR:
            return self._read_tensor()
        if tag == T_INT:
            (v,) = _I64.unpack_from(meta, self.pos)
            self.pos += 8
            return v
        if tag in (T_TUPLE, T_LIST):
            items = [self.read() for _ in range(self._u32())]
            return tuple(items) if tag == T_TUPLE else items
        if tag == T_DICT:
            n = self._u32()
            out = {}
            for _ in range(n):
                k = self.read()
                out[k] = self.read()
            if len(out) != n:
                raise CorruptEntryError("duplicate dict keys")
            return out
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
            raw = self._take(self._u32())
            return np.frombuffer(raw, dtype=dt, count=1)[0].copy()
        raise CorruptEntryError(f"unknown tag {tag:#x}")

    def _read_tensor(self) -> Any:
        import torch

        name = self._name()
        if name not in _TORCH_DTYPES:
            raise CorruptEntryError(f"tensor dtype {name!r} is not one the codec writes")
        dtype = getattr(torch, name)
        shape, numel, buf, off, nbytes = self._shape_and_bytes()
        if numel * dtype.itemsize != nbytes:
            raise CorruptEntryError(f"tensor of shape {shape} and dtype {name} does not fit {nbytes} bytes")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype, count=numel, offset=off).view(shape)

    def _read_ndarray(self) -> Any:
        import numpy as np

        dt = np.dtype(self._name())
        if dt.hasobject:
            raise CorruptEntryError("object arrays are never decoded")
        shape, numel, buf, off, nbytes = self._shape_and_bytes()
        if numel * dt.itemsize != nbytes:
            raise CorruptEntryError(f"array of shape {shape} and dtype {dt} does not fit {nbytes} bytes")
        if numel == 0:
            return np.empty(shape, dtype=dt)
        return np.frombuffer(buf, dtype=dt, count=numel, offset=off).reshape(shape)

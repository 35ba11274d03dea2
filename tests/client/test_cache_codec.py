"""The safe codec: exact round trips, integrity checks, and clear errors for what it does not store."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import pickle
import sys
import typing

import numpy as np
import pytest
import torch
from PIL import Image

from bagua_lightning.client.cache import codec, digests
from bagua_lightning.client.cache.codec import CorruptEntryError, decode, encode

KEY = b"ds:1:7"


def assert_same(a: object, b: object) -> None:
    """Equal values of identical types, dtypes and shapes, recursively."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.contiguous().numpy(force=True).tobytes() == b.contiguous().numpy(force=True).tobytes() \
            if a.dtype != torch.bfloat16 else torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


SAMPLES = {
    "image_label": (torch.randn(3, 32, 32), 7),
    "dtypes": [torch.arange(10, dtype=dt) for dt in (torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                                      torch.int16, torch.int32, torch.int64, torch.uint8)]
    + [torch.tensor([True, False]), torch.randn(4, dtype=torch.complex64)],
    "scalar_and_empty": {"scalar": torch.tensor(3.5), "empty": torch.empty(0, 5), "zero_d_int": torch.tensor(2)},
    "non_contiguous": torch.arange(24.0).reshape(4, 6).t(),
    "numpy": {"f": np.random.rand(5, 3).astype(np.float32), "fortran": np.asfortranarray(np.ones((3, 4))),
              "u16": np.arange(7, dtype=np.uint16), "str": np.array(["ab", "c"]), "empty": np.zeros((0,)),
              "scalar": np.float32(2.5), "bool": np.bool_(True), "i64": np.int64(-3)},
    "python": (None, True, False, 0, -(2**63), 2**63, -(10**40), 1.25, float("nan"), float("inf"), 1 - 2j,
               "", "héllo \u2603", b"", b"\x00raw", bytearray(b"ba"), [], (), {}),
    "nested": {"a": [1, (2, [3, {"b": torch.ones(2)}])], 5: "int key", (1, 2): "tuple key", None: 1.0},
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_round_trip_is_exact(name: str) -> None:
    sample = SAMPLES[name]
    assert_same(decode(bytes(encode(sample, KEY)), KEY), sample)


def test_decoded_tensors_are_writable_and_do_not_alias_the_input() -> None:
    x = torch.zeros(4)
    out = decode(bytes(encode((x, np.zeros(3)), KEY)), KEY)
    out[0].add_(1)
    out[1][:] += 1
    assert torch.equal(x, torch.zeros(4))
    assert out[0].sum().item() == 4.0 and out[1].sum() == 3.0


def test_arrays_are_aligned_in_the_entry() -> None:
    value = bytes(encode((torch.ones(3), torch.ones(5, dtype=torch.float64)), KEY))
    out = decode(value, KEY)
    assert all(t.data_ptr() % 8 == 0 for t in out)


@pytest.mark.parametrize("mutate", [
    lambda b: b.__setitem__(len(b) - 1, b[-1] ^ 0x01),          # bit flip in the data
    lambda b: b.__setitem__(30, b[30] ^ 0x80),                  # bit flip in the structure
    lambda b: b.__setitem__(3, 99),                              # another format version
    lambda b: b.__delitem__(slice(len(b) - 10, None)),           # truncated
    lambda b: b.__setitem__(slice(0, 3), b"XYZ"),                # not our magic
])
def test_corruption_is_detected(mutate: object) -> None:
    entry = bytearray(encode((torch.arange(100.0), "label"), KEY))
    mutate(entry)  # type: ignore[operator]
    with pytest.raises(CorruptEntryError):
        decode(bytes(entry), KEY)


def test_entry_under_another_key_is_rejected() -> None:
    with pytest.raises(CorruptEntryError, match="another key"):
        decode(bytes(encode(torch.ones(3), KEY)), b"ds:1:8")


@pytest.mark.parametrize("garbage", [b"", b"hello", pickle.dumps(torch.ones(2)), b"\x00" * 100])
def test_foreign_values_are_rejected(garbage: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode(garbage, KEY)


Point = collections.namedtuple("Point", "x y")


def _local_point() -> type:
    return collections.namedtuple("LocalPoint", "x y")


_LOCAL_POINT = _local_point()  # its name LocalPoint is not reachable in this module


@pytest.mark.parametrize(("sample", "names"), [
    (object(), "builtins.object"),
    ({"img": [1, {"x": object()}]}, "the sample['img'][1]['x']"),
    (_LOCAL_POINT(1, 2), "defined inside a function"),
    (collections.OrderedDict(a=1), "OrderedDict"),
    (torch.nn.Parameter(torch.ones(2)), "tensor subclass"),
    (torch.ones(2, requires_grad=True), "requires grad"),
    (torch.ones(2).to_sparse(), "sparse"),
    (np.array([object()]), "dtype object"),
    ({1, 2}, "builtins.set"),
])
def test_unsupported_values_raise_a_clear_type_error(sample: object, names: str) -> None:
    with pytest.raises(TypeError) as info:
        encode(sample, KEY)
    message = str(info.value)
    assert names in message
    assert 'serializer="pickle"' in message


def test_pickle_needs_opt_in_on_both_sides() -> None:
    sample = {"p": Point(1, 2), "s": {1, 2}}
    entry = bytes(encode(sample, KEY, allow_pickle=True))
    assert codec.is_pickled(entry)
    assert decode(entry, KEY, allow_pickle=True) == sample
    with pytest.raises(CorruptEntryError, match="not unpickling"):
        decode(entry, KEY)


class Labeled(typing.NamedTuple):
    image: torch.Tensor
    label: int


@dataclasses.dataclass(frozen=True)
class Record:
    features: np.ndarray
    name: str
    weight: float = 1.0
    extra: list[int] = dataclasses.field(default_factory=list, init=False)


def _images() -> list[Image.Image]:
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (7, 5, 3), dtype=np.uint8))
    rgb.info["dpi"] = (72, 72)
    rgb.info["handle"] = object()  # not storable: dropped, the image itself still round-trips
    return [rgb, rgb.convert("L"), rgb.convert("RGBA"), rgb.convert("P"), rgb.convert("I;16"),
            rgb.convert("F"), Image.new("1", (9, 3), 1)]


@pytest.mark.parametrize("index", range(7))
def test_pil_images_round_trip_natively(index: int) -> None:
    image = _images()[index]
    entry = bytes(encode((image, 3), KEY))
    assert not codec.is_pickled(entry)
    out, label = decode(entry, KEY)
    assert label == 3 and type(out) is Image.Image
    assert (out.mode, out.size, out.tobytes(), out.getpalette()) == (image.mode, image.size, image.tobytes(),
                                                                      image.getpalette())
    assert out.info.get("dpi") == image.info.get("dpi") and "handle" not in out.info
    if "handle" not in image.info:
        assert out == image


def test_namedtuples_dataclasses_none_bool_and_numpy_scalars_round_trip() -> None:
    rec = Record(np.arange(3.0), "r")
    object.__setattr__(rec, "extra", [4])
    sample = [Labeled(torch.ones(2), 5), Point(None, True), rec, np.int16(-2), np.bool_(False), np.float64(0.5)]
    out = decode(bytes(encode(sample, KEY)), KEY)
    assert type(out[0]) is Labeled and torch.equal(out[0].image, torch.ones(2)) and out[0].label == 5
    assert out[1] == Point(None, True) and type(out[1]) is Point
    assert type(out[2]) is Record and out[2].name == "r" and out[2].extra == [4]
    assert np.array_equal(out[2].features, rec.features)
    assert [(type(x), x) for x in out[3:]] == [(type(x), x) for x in sample[3:]]


def _nested(depth: int) -> list[object]:
    root: list[object] = []
    node = root
    for _ in range(depth):
        child: list[object] = []
        node.append(child)
        node = child
    return root


def test_deep_nesting_is_refused_on_write_and_a_miss_on_read() -> None:
    with pytest.raises(TypeError, match="nested deeper"):
        encode(_nested(2000), KEY)
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(TypeError, match="holds itself"):
        encode(cyclic, KEY)
    # A crafted entry: 2,000 nested lists with a valid digest. Decoding is a clean CorruptEntryError.
    meta = b"[\x01\x00\x00\x00" * 2000 + b"[\x00\x00\x00\x00"
    entry = codec._assemble(KEY, None, codec.default_digest_kind(), 0, meta, b"", [], 0)
    with pytest.raises(CorruptEntryError, match="nested deeper"):
        decode(bytes(entry), KEY)


def test_counts_larger_than_the_entry_are_refused_before_allocating() -> None:
    meta = b"[\xff\xff\xff\x7f"  # a list claiming 2**31-1 items in 5 bytes
    entry = codec._assemble(KEY, None, codec.default_digest_kind(), 0, meta, b"", [], 0)
    with pytest.raises(CorruptEntryError, match="items in"):
        decode(bytes(entry), KEY)


def test_a_class_that_is_not_imported_is_a_miss_not_an_import() -> None:
    meta = b"n" + bytes([len(b"antigravity:x")]) + b"antigravity:x" + b"\x00\x00\x00\x00"
    entry = codec._assemble(KEY, None, codec.default_digest_kind(), 0, meta, b"", [], 0)
    with pytest.raises(CorruptEntryError, match="not imported"):
        decode(bytes(entry), KEY)
    assert "antigravity" not in sys.modules


def test_both_unkeyed_digests_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digests, "xxhash", None)
    crc_entry = bytes(encode(torch.ones(3), KEY))
    assert crc_entry[4] == codec.DIGEST_CRC32
    monkeypatch.undo()
    assert_same(decode(crc_entry, KEY), torch.ones(3))


def test_owned_reply_buffers_are_viewed_without_a_copy() -> None:
    value = bytes(encode((torch.arange(4.0), np.arange(2)), KEY))
    t, a = decode(value, KEY, owned=True)
    base = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value or 0
    assert base <= t.data_ptr() < base + len(value)  # the tensor views the reply itself
    a[:] += 1  # numpy arrays still get a writable copy
    assert a.tolist() == [1, 2]


def test_format_version_1_entries_are_misses() -> None:
    entry = bytearray(encode(1, KEY))
    entry[3] = 1
    with pytest.raises(CorruptEntryError, match="version 1"):
        decode(bytes(entry), KEY)

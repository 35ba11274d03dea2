"""The safe codec: exact round trips, integrity checks, and clear errors for what it does not store."""

from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest
import torch

from bagua_lightning.client.cache import codec
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


@pytest.mark.parametrize(("sample", "names"), [
    (object(), "builtins.object"),
    ({"img": [1, {"x": object()}]}, "the sample['img'][1]['x']"),
    (Point(1, 2), "Point"),
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

"""Batched reads: GET replies received as views (``read_bulk_replies``), receive buffers reused
(``BufferPool``), batches decoded by column and by numpy (``decode_many``): always equal to one-by-one
``decode``, a damaged entry a miss on its own."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import redis
import torch

from bagua_lightning.client.cache import codec
from bagua_lightning.client.cache.backends import BufferPool, pack_gets, read_bulk_replies

from .test_cache_codec import SAMPLES, assert_same


class Pair(NamedTuple):
    image: Any
    label: int


def keys_for(n: int) -> list[bytes]:
    return [b"ds:1:%d" % i for i in range(n)]


def stream_reader(stream: bytes, chunk: int) -> Iterator[socket.socket]:
    """A connected socket on which ``stream`` arrives in ``chunk``-byte writes, from a thread."""
    a, b = socket.socketpair()
    a.settimeout(10)

    def feed() -> None:
        for i in range(0, len(stream), chunk):
            b.sendall(stream[i:i + chunk])

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield a
    finally:
        writer.join(10)
        a.close()
        b.close()


def bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%b\r\n" % (len(value), value)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_replies_are_read_whole_across_any_split(chunk: int) -> None:
    values = [bytes(range(256)) * 40, b"", None, b"\r\n$3\r\nabc", b"x" * 70000, b"y" * 70000]
    stream = b"".join(bulk(v) for v in values) + b"-MOVED 3999 127.0.0.1:6381\r\n" + b"_\r\n"
    for sock in stream_reader(stream, chunk):
        got = read_bulk_replies(sock, len(values) + 2, 1024)
    assert [None if v is None else bytes(v) for v in got[:-2]] == values
    assert isinstance(got[-2], redis.ResponseError) and "MOVED" in str(got[-2])
    assert got[-1] is None


def test_a_malformed_or_closed_stream_is_a_connection_error() -> None:
    for sock in stream_reader(b"$12x\r\n", 64):
        with pytest.raises(redis.ConnectionError, match="malformed reply header"):
            read_bulk_replies(sock, 1, 64)
    for sock in stream_reader(b"+OK\r\n", 64):
        with pytest.raises(redis.ConnectionError, match="unexpected reply type"):
            read_bulk_replies(sock, 1, 64)
    a, b = socket.socketpair()
    b.sendall(bulk(b"abc")[:5])
    b.close()
    with pytest.raises(redis.ConnectionError, match="closed"):
        read_bulk_replies(a, 1, 64)
    a.close()


def test_pool_reuses_a_buffer_only_once_no_view_of_it_is_left() -> None:
    pool = BufferPool()
    assert len(pool.take(1000)) == 1024  # rounded up to a power of two
    pool.give([pool.take(1000)])
    free_id = id(pool._free[-1])
    assert id(pool.take(1000)) == free_id  # nobody holds it: reused
    held = pool.take(1000)
    view = memoryview(held)[10:20]
    held_id = id(held)
    pool.give([held])
    del held
    assert id(pool.take(1000)) != held_id  # a view still holds it: forgotten, never handed out twice
    assert pool._free == []
    del view
    pool.give([pool.take(1000)])
    assert len(pool.take(2000)) == 2048  # the pooled one is too small


def test_pack_gets_is_resp_for_any_key_length() -> None:
    keys = [b"a", b"k" * 600, "é".encode()]
    assert pack_gets(keys) == b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(k), k) for k in keys)


def as_views(entries: list[bytes]) -> list[memoryview]:
    """The entries as views of one receive buffer, as read_bulk_replies returns them."""
    buf = bytearray(b"".join(bulk(e) for e in entries))
    mv, out, pos = memoryview(buf), [], 0
    for e in entries:
        head = len(b"$%d\r\n" % len(e))
        out.append(mv[pos + head:pos + head + len(e)])
        pos += head + len(e) + 2
    return out


BATCHES = {
    "cifar": [(torch.randn(3, 8, 8), i) for i in range(16)],
    "dtypes": [{"x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + i, "m": torch.tensor([True, False]),
                "f": float(i), "n": None} for i in range(12)],
    "numpy": [[np.full((2, 3), i, np.float64), np.arange(i, i + 4, dtype=np.int16)] for i in range(10)],
    "namedtuple": [Pair(torch.ones(4) * i, -i) for i in range(9)],
    "shapes_differ": [(torch.randn(3, 8 if i % 2 else 4, 2), i) for i in range(10)],
    "misaligned_rows": [(torch.arange(5, dtype=torch.float64) * i, "abc"[: i % 3]) for i in range(10)],
    "mixed": list(SAMPLES.values()) * 2,
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_decode_many_equals_decode_one_by_one(name: str) -> None:
    samples = BATCHES[name]
    keys = keys_for(len(samples))
    entries = [bytes(codec.encode(s, k)) for s, k in zip(samples, keys, strict=True)]
    got = codec.decode_many(as_views(entries), keys)
    for sample, value in zip(samples, got, strict=True):
        assert_same(value, sample)


def test_decoded_batch_outlives_its_receive_buffer() -> None:
    samples = BATCHES["cifar"]
    keys = keys_for(len(samples))
    entries = [bytes(codec.encode(s, k)) for s, k in zip(samples, keys, strict=True)]
    views = as_views(entries)
    got = codec.decode_many(views, keys)
    views[0].obj[:] = bytes(len(views[0].obj))  # the receive buffer is reused for the next batch
    for sample, value in zip(samples, got, strict=True):
        assert torch.equal(value[0], sample[0]) and value[1] == sample[1]


@pytest.mark.parametrize("damage", ["digest", "key", "header", "short", "shape"])
def test_a_damaged_entry_in_a_batch_is_a_miss_on_its_own(damage: str) -> None:
    samples = BATCHES["cifar"]
    keys = keys_for(len(samples))
    entries = [bytearray(codec.encode(s, k)) for s, k in zip(samples, keys, strict=True)]
    if damage == "digest":
        entries[5][-1] ^= 1
    elif damage == "key":
        keys[5] = b"ds:1:other"
    elif damage == "header":
        entries[5][40] ^= 1  # a zero padding byte of the digest
    elif damage == "short":
        entries[5] = entries[5][:-8]
    else:  # a shape forged with a valid digest: 8x8 -> 4x16, the same bytes
        forged = bytes(codec.encode((torch.randn(3, 4, 16), 5), keys[5]))
        entries[5] = bytearray(forged)
    got = codec.decode_many([bytes(e) for e in entries], keys)
    for j, (sample, value) in enumerate(zip(samples, got, strict=True)):
        if j == 5 and damage != "shape":
            assert type(value) is codec.Bad and isinstance(value.error, codec.CorruptEntryError)
        elif j == 5:
            assert value[0].shape == (3, 4, 16)  # authentic under its key: decoded as written
        else:
            assert torch.equal(value[0], sample[0]) and value[1] == sample[1]


def test_missing_values_and_keyed_entries() -> None:
    samples = BATCHES["cifar"][:10]
    keys = keys_for(len(samples))
    secret = b"job key"
    entries: list[Any] = [bytes(codec.encode(s, k, secret=secret)) for s, k in zip(samples, keys, strict=True)]
    entries[2] = None
    got = codec.decode_many(entries, keys, secret=secret)
    assert got[2] is codec.MISSING
    assert all(torch.equal(got[j][0], samples[j][0]) for j in range(10) if j != 2)
    unkeyed = codec.decode_many(entries, keys)  # keyed entries without the key: misses
    assert all(type(v) is codec.Bad for v in unkeyed)

"""Batched reads: GET replies received as views (``Receiver``), receive buffers reused
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
from bagua_lightning.client.cache.resp import BufferPool, Receiver, Replies, pack_gets
from bagua_lightning.client.cache.values import REPLY_ALIGN, reply_pad

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


def read_bulk_replies(sock: socket.socket, n: int, size_hint: int) -> list[Any]:
    """The next ``n`` GET replies on ``sock``, in a receive area of their own."""
    return Receiver(size_hint, 0, BufferPool(), n).read(sock, n)


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
    assert len(pool.take(1000)) == 1125  # an eighth more, for batches a little larger
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
    assert len(pool.take(2000)) == 2250  # the pooled one is too small


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


# --- Batches decoded where they lie: entries padded to a reply boundary, replies back to back ----------------

def test_padded_entries_make_every_reply_span_a_multiple_of_the_boundary() -> None:
    # around every change of the header's width too ($9 -> $10, ...)
    for size in [*range(0, 300), *range(9_950, 10_050), *range(99_950, 100_050), 999_990]:
        extra = reply_pad(size)
        assert 0 <= extra < 2 * REPLY_ALIGN, size
        assert len(bulk(bytes(size + extra))) % REPLY_ALIGN == 0, size


@pytest.mark.parametrize("name", list(BATCHES))
def test_every_safe_codec_entry_is_padded_and_still_decodes(name: str) -> None:
    for j, sample in enumerate(BATCHES[name]):
        entry = bytes(codec.encode(sample, b"k:%d" % j))
        assert len(bulk(entry)) % REPLY_ALIGN == 0
        assert_same(codec.decode(entry, b"k:%d" % j), sample)


def connection_with(replies: bytes) -> tuple[socket.socket, socket.socket]:
    """A connected socket on which ``replies`` are already waiting (they fit the socket buffers)."""
    a, b = socket.socketpair()
    a.settimeout(10)
    b.sendall(replies)
    return a, b


def receive(groups: list[list[bytes | None]], value_hint: int, size_hint: int,
            pool: BufferPool | None = None) -> tuple[Receiver, list[list[Any]]]:
    """Read each group's GET replies from its own connection into one receive area, as a fetch does."""
    receiver = Receiver(size_hint, value_hint, pool or BufferPool(), sum(map(len, groups)))
    got = []
    for group in groups:
        a, b = connection_with(b"".join(bulk(v) for v in group))
        try:
            got.append(receiver.read(a, len(group)))
        finally:
            a.close()
            b.close()
    return receiver, got


def batch_of(n: int) -> tuple[list[Any], list[bytes], list[bytes]]:
    samples = [(torch.randn(3, 8, 8), i) for i in range(n)]
    keys = keys_for(n)
    return samples, keys, [bytes(codec.encode(s, k)) for s, k in zip(samples, keys, strict=True)]


def address_range(buf: bytearray) -> range:
    start = np.frombuffer(buf, np.uint8).ctypes.data
    return range(start, start + len(buf))


def test_replies_of_several_connections_lie_evenly_in_one_buffer_and_decode_where_they_lie() -> None:
    samples, keys, entries = batch_of(30)
    # three nodes, keys interleaved among them as a cluster places them
    idx = [list(range(0, 30, 3)), list(range(1, 30, 3)), list(range(2, 30, 3))]
    receiver, got = receive([[entries[j] for j in g] for g in idx], len(entries[0]), 30 * len(bulk(entries[0])))
    order = [j for g in idx for j in g]
    run = receiver.run(order)
    assert run is not None
    buf, first, stride, _ = run
    assert first % REPLY_ALIGN == 0 and stride == len(bulk(entries[0])) and stride % REPLY_ALIGN == 0
    for r, j in enumerate(order):
        assert bytes(buf[first + r * stride:first + r * stride + len(entries[j])]) == entries[j]
    values: list[Any] = [None] * 30
    for g, replies in zip(idx, got, strict=True):
        for j, v in zip(g, replies, strict=True):
            values[j] = v
    decoded = codec.decode_many(Replies(values, run), keys)
    where = address_range(buf)
    for sample, value in zip(samples, decoded, strict=True):
        assert torch.equal(value[0], sample[0]) and value[1] == sample[1]
        assert value[0].data_ptr() in where and value[0].data_ptr() % 4 == 0  # no copy, aligned
        assert value[0].is_contiguous()


@pytest.mark.parametrize("case", ["nil", "other length", "small buffer", "no size hint", "large buffer"])
def test_an_uneven_fetch_is_no_run_and_its_values_are_still_right(case: str) -> None:
    _, keys, entries = batch_of(12)
    values: list[bytes | None] = list(entries)
    size_hint, value_hint = 12 * len(bulk(entries[0])), len(entries[0])
    if case == "nil":
        values[4] = None
    elif case == "other length":
        values[4] = bytes(codec.encode((torch.randn(3, 8, 9), 4), keys[4]))
    elif case == "small buffer":
        size_hint = 1000  # the replies overflow the first buffer (MIN_CHUNK) into a second
        values = [bytes(codec.encode((torch.randn(64, 64), i), k)) for i, k in enumerate(keys)]
        value_hint = len(values[0])
    elif case == "no size hint":
        value_hint = 0  # the first fetch: nothing is known about the values yet (a chunk, mostly empty)
    else:
        size_hint *= 2  # a buffer mostly empty: samples would keep it all alive, so they get copies
    receiver, got = receive([values[:5], values[5:]], value_hint, size_hint)
    run = receiver.run(list(range(12)))
    assert [None if v is None else bytes(v) for v in got[0] + got[1]] == values
    assert run is None
    decoded = codec.decode_many(Replies(got[0] + got[1], run), keys)
    for j, value in enumerate(decoded):
        if values[j] is None:
            assert value is codec.MISSING
        else:
            assert_same(value, codec.decode(values[j], keys[j]))


def test_bytes_after_the_replies_asked_for_are_a_connection_error() -> None:
    a, b = connection_with(bulk(b"one") + bulk(b"two"))
    try:
        receiver = Receiver(1024, 3, BufferPool(), 1)
        with pytest.raises(redis.ConnectionError, match="unexpected bytes after 1 GET replies"):
            receiver.read(a, 1)
        assert receiver.run([0]) is None
    finally:
        a.close()
        b.close()


def test_a_damaged_entry_in_an_even_run_is_a_miss_on_its_own() -> None:
    samples, keys, entries = batch_of(16)
    damaged = bytearray(entries[7])
    damaged[-20] ^= 1  # an image byte: the digest no longer matches
    values = [*entries[:7], bytes(damaged), *entries[8:]]
    receiver, got = receive([values], len(entries[0]), 16 * len(bulk(entries[0])))
    run = receiver.run(list(range(16)))
    assert run is not None
    decoded = codec.decode_many(Replies(got[0], run), keys)
    assert type(decoded[7]) is codec.Bad
    assert all(torch.equal(decoded[j][0], samples[j][0]) for j in range(16) if j != 7)


def test_a_buffer_that_samples_view_is_never_received_into_again() -> None:
    pool = BufferPool()
    samples, keys, entries = batch_of(10)
    receiver, got = receive([entries], len(entries[0]), 10 * len(bulk(entries[0])), pool)
    run = receiver.run(list(range(10)))
    assert run is not None
    pool.give(receiver.used)
    kept = codec.decode_many(Replies(got[0], run), keys)[3]
    del got, run, receiver
    # the next fetch, of other entries of the same size, must not receive into the buffer the sample views
    _, _, other = batch_of(10)
    second, _ = receive([[bytes(e) for e in other]], len(entries[0]), 10 * len(bulk(entries[0])), pool)
    assert all(kept[0].data_ptr() not in address_range(buf) for buf in second.used)
    assert torch.equal(kept[0], samples[3][0]) and kept[1] == 3
    kept[0].zero_()  # the sample is the caller's own: writable
    assert not kept[0].any()


def test_batches_read_from_real_servers_lie_evenly_and_samples_kept_stay_intact(
        any_deployment: tuple[str, Any, dict[str, object]]) -> None:
    from bagua_lightning.client import CachedDataset

    from .cache_datasets import Source

    name, info, options = any_deployment

    class Images(Source):  # fixed-size samples: (image, label)
        def __getitem__(self, i: int) -> Any:
            return torch.full((3, 16, 16), float(i)), i

    ds = CachedDataset(Images(96), dataset_name="even", hosts=info.hosts, writer_buffer_size=16, **options)
    batches = [list(range(j, 96, 6)) for j in range(6)]
    for b in batches:
        ds.__getitems__(b)
    ds.flush()
    loader = ds.cache_loader
    for _ in range(2):  # the first read learns the size of the values, the second lies evenly
        values, error = loader.store.fetch([loader.redis_key(i).encode() for i in batches[0]])
        assert error is None
    assert getattr(values, "run", None) is not None, name
    del values
    kept = [ds.__getitems__(b) for b in batches for _ in range(2)]  # every batch's samples held at once
    for b, got in zip([b for b in batches for _ in range(2)], kept, strict=True):
        for i, (image, label) in zip(b, got, strict=True):
            assert label == i and torch.equal(image, torch.full((3, 16, 16), float(i)))
    kept[0][0][0].add_(1000)  # a sample changed in place changes no other and no later read
    assert torch.equal(kept[1][0][0], torch.full((3, 16, 16), 0.0))
    assert torch.equal(ds.__getitems__([0])[0][0], torch.full((3, 16, 16), 0.0))
    assert ds.stats.corrupt == 0 and ds.stats.misses == 96

"""Sealed entries (``aes256-gcm``): the data region encrypted with a key derived from the cache key, the entry
and the redis key it is stored under authenticated. Round trips, batches (all sealed, mixed with other kinds),
the layout docs/cache.md defines, confidentiality, and every kind of tampering a miss."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from bagua_lightning.client.cache import batch_sealed, codec, digests, native_gcm
from bagua_lightning.client.cache.codec import CorruptEntryError, decode, decode_many, encode
from bagua_lightning.client.cache.entry import HEADER, HEADER_SIZE, OPENED
from bagua_lightning.client.cache.resp import Replies
from tests.client.conftest import cryptography_missing

from .test_cache_codec import SAMPLES, assert_same

KEY = b"ds:1:7"
SECRET = b"a cache key shared by the job"
PATTERN = b"SEALED-SAMPLE-PATTERN:0123456789"  # 32 bytes, recognisable in an entry
N = 64


def sealed(sample: Any, key: bytes = KEY, secret: bytes = SECRET, **kw: Any) -> bytes:
    entry = bytes(encode(sample, key, secret=secret, **kw))
    assert entry[4] == codec.DIGEST_SEAL
    return entry


def layout(entry: bytes) -> tuple[int, int, int]:
    """(where the tail starts, where the data region starts, data_len) from an entry's header."""
    *_, skel_len, tail_len, data_len = HEADER.unpack_from(entry, 0)
    tail_start = 52 + skel_len
    return tail_start, (tail_start + tail_len + 63) & -64, data_len


def batch(n: int = N, secret: bytes | None = SECRET, **kw: Any) -> tuple[list[bytes], list[bytes], list[Any]]:
    """``n`` CIFAR-like ``(3x32x32 float32 tensor, label)`` entries (12 KB each), their keys and samples."""
    g = torch.Generator().manual_seed(n)
    samples = [(torch.randn(3, 32, 32, generator=g), i) for i in range(n)]
    keys = [b"ds:1:%d" % i for i in range(n)]
    return [bytes(encode(s, k, secret=secret, **kw)) for s, k in zip(samples, keys, strict=True)], keys, samples


def assert_pairs(got: list[Any], samples: list[Any], skip: frozenset[int] = frozenset()) -> None:
    for j, (value, sample) in enumerate(zip(got, samples, strict=True)):
        if j not in skip:
            assert type(value) is not codec.Bad, (j, value)
            assert torch.equal(value[0], sample[0]) and value[1] == sample[1], j


# Writing: what a cache key gives, and the layout.

def test_a_cache_key_seals_by_default_gmac_on_request_and_nothing_without_a_key() -> None:
    sample = (torch.arange(5), "x")
    assert encode(sample, KEY, secret=SECRET)[4] == codec.DIGEST_SEAL
    assert encode(sample, KEY, secret=SECRET, seal=True)[4] == codec.DIGEST_SEAL
    assert encode(sample, KEY, secret=SECRET, seal=False)[4] == codec.DIGEST_GMAC
    assert encode(sample, KEY)[4] == codec.default_digest_kind()
    assert encode(sample, KEY, seal=False)[4] == codec.default_digest_kind()
    with pytest.raises(ValueError, match="needs a cache key"):
        encode(sample, KEY, seal=True)
    assert codec.DIGEST_NAMES[codec.DIGEST_SEAL] == "aes256-gcm"


def test_sealed_layout_is_aes_gcm_as_documented() -> None:
    # Opened here with cryptography's own HKDF and AESGCM, from docs/cache.md: a change cannot go unnoticed.
    sample = (torch.arange(6.0), "x", {"n": np.arange(3)})
    entry = sealed(sample)
    _, data_start, data_len = layout(entry)
    assert entry[:8] == b"BLC\x02\x05\x00\x00\x00"
    # the nonce, then the id of the key that sealed it (HKDF, its own info) and 4 zero bytes
    assert entry[20:28] == HKDF(hashes.SHA256(), 8, None, b"bagua-lightning cache key id v1").derive(SECRET)
    assert entry[28:32] == bytes(4)
    assert len(entry) == data_start + data_len + 16  # the whole tag at the very end
    aes_key = HKDF(hashes.SHA256(), 32, None, digests.SEAL_KEY_INFO).derive(SECRET)
    assert aes_key != HKDF(hashes.SHA256(), 32, None, digests.GMAC_KEY_INFO).derive(SECRET)
    aad = struct.pack("<Q", len(KEY)) + KEY + entry[32:52]  # the key, the flags and the lengths
    plain = AESGCM(aes_key).decrypt(entry[8:20], entry[52:], aad)  # all after the 52-byte header
    assert len(plain) == data_start - 52 + data_len
    gmac = bytes(encode(sample, KEY, secret=SECRET, seal=False))
    gmac_start = layout(gmac)[1]
    # The flags and lengths are the unsealed entry's; the rest decrypts to its skeleton, tail, pad and data
    # region (padding included).
    assert entry[32:52] == gmac[32:52] and data_start == gmac_start
    assert plain == gmac[52:gmac_start + data_len]
    assert_same(decode(entry, KEY, secret=SECRET), sample)


def test_the_numbers_and_the_structure_are_sealed_too() -> None:
    # A label, a float, a string key and a shape live in the skeleton and the tail: sealed with the data.
    label, score = 0x1234567890ABCDEF, 2.718281828459045
    sample = {"label_name_in_the_skeleton": torch.zeros(7, 11), "label": label, "score": score}
    gmac = bytes(encode(sample, KEY, secret=SECRET, seal=False))
    entry = sealed(sample)
    for clear in (struct.pack("<q", label), struct.pack("<d", score), b"label_name_in_the_skeleton"):
        assert clear in gmac and clear not in entry
    assert_same(decode(entry, KEY, secret=SECRET), sample)


def test_nonces_are_random_and_the_replies_stay_aligned() -> None:
    entries = [sealed(torch.ones(3, 32, 32)) for _ in range(200)]
    assert len({e[8:20] for e in entries}) == 200
    assert len({e[-16:] for e in entries}) == 200
    for e in entries[:3]:
        assert (len(e) + len(str(len(e))) + 5) % 16 == 0  # a GET reply spans a multiple of 16 bytes


def test_the_entry_does_not_reveal_the_sample() -> None:
    raw = np.frombuffer(PATTERN * 64, np.uint8).copy()
    sample = {"t": torch.from_numpy(raw.copy()), "a": raw, "s": PATTERN.decode() * 4, "b": PATTERN * 4}
    plain = bytes(encode(sample, KEY))
    assert PATTERN in plain  # the unkeyed entry holds it in clear, as does gmac
    assert PATTERN in bytes(encode(sample, KEY, secret=SECRET, seal=False))
    entry = sealed(sample)
    for piece in (PATTERN[:8], PATTERN[8:16], PATTERN[16:24], PATTERN[24:]):
        assert piece not in entry
    assert_same(decode(entry, KEY, secret=SECRET), sample)
    pickled = sealed(sample["s"], allow_pickle=True)
    assert PATTERN[:8] not in pickled and PATTERN[:8] in bytes(encode(sample["s"], KEY, allow_pickle=True))


# Reading: one entry, and batches.

@pytest.mark.parametrize("name", list(SAMPLES))
def test_round_trip_is_exact(name: str) -> None:
    sample = SAMPLES[name]
    entry = sealed(sample)
    assert_same(decode(entry, KEY, secret=SECRET), sample)
    assert_same(decode(memoryview(bytearray(entry)), KEY, secret=SECRET), sample)
    assert_same(decode(entry, KEY, secret=SECRET, owned=True), sample)
    for n in (1, 3, 9):  # the batch readers: opened into one block, then by column or by numpy rows
        for got in decode_many([entry] * n, [KEY] * n, secret=SECRET):
            assert_same(got, sample)


def test_decoded_tensors_and_arrays_are_writable_and_their_own() -> None:
    sample = (torch.zeros(4), np.zeros(3))
    entry = sealed(sample)
    a, b = decode(entry, KEY, secret=SECRET), decode(entry, KEY, secret=SECRET)
    a[0].add_(1)
    a[1][:] += 1
    assert float(b[0].sum()) == 0 and float(b[1].sum()) == 0


@pytest.mark.parametrize("n", [4, N])  # below and above the numpy rows' threshold
def test_uniform_batches_decode_in_one_opened_block(n: int) -> None:
    entries, keys, samples = batch(n)
    for values in (entries, [memoryview(bytearray(e)) for e in entries]):
        got = decode_many(values, keys, secret=SECRET)
        assert_pairs(got, samples)
        # The tensors view one block of the reader's, not the values: none of them refers to an entry.
        assert all(got[j][0].data_ptr() != got[j + 1][0].data_ptr() for j in range(n - 1))
        if n >= 8:  # numpy rows: every tensor is a view of the opened block, one storage for all
            assert len({g[0].untyped_storage().data_ptr() for g in got}) == 1
        got[0][0].add_(1)  # writable, and the others are not touched
        assert torch.equal(got[1][0], samples[1][0])


def test_a_fetch_that_says_where_sealed_entries_lie_is_read_the_same() -> None:
    entries, keys, samples = batch()
    length = len(entries[0])
    stride = (length + 15) & -16
    order = list(range(N))[::-1]  # row r holds the value of key order[r]
    buf = bytearray(stride * N)
    for r, j in enumerate(order):
        buf[r * stride:r * stride + length] = entries[j]
    views = [memoryview(buf)[r * stride:r * stride + length] for r in range(N)]
    values = Replies([views[order.index(j)] for j in range(N)], (buf, 0, stride, order))
    assert_pairs(decode_many(values, keys, secret=SECRET), samples)


def test_non_uniform_batches_are_read_by_column_and_one_by_one() -> None:
    samples: list[Any] = [(torch.randn(3, 4 + i % 3, 5), f"id{'x' * i}", {"np": np.arange(i)}) for i in range(20)]
    samples += [("pickled?", i) for i in range(3)] + [torch.ones(i) for i in range(4)]
    keys = [b"ds:1:%d" % i for i in range(len(samples))]
    entries = [sealed(s, k) for s, k in zip(samples, keys, strict=True)]
    for got, want in zip(decode_many(entries, keys, secret=SECRET), samples, strict=True):
        assert_same(got, want)


@pytest.mark.parametrize("n", [5, N])
def test_mixed_batches_merge_sealed_and_other_entries_by_index(n: int) -> None:
    entries, keys, samples = batch(n)
    gmac = batch(n, seal=False)[0]
    with cryptography_missing():  # an earlier release, or one without cryptography: hmac-sha256
        hmac_entries = batch(n)[0]
    assert {e[4] for e in hmac_entries} == {codec.DIGEST_HMAC}
    unkeyed = batch(n, secret=None)[0]
    values: list[Any] = []
    kinds = [entries, gmac, hmac_entries, None, unkeyed]
    for j in range(n):
        source = kinds[j % len(kinds)]
        values.append(None if source is None else source[j])
    got = decode_many(values, keys, secret=SECRET)
    for j, value in enumerate(got):
        if values[j] is None:
            assert value is codec.MISSING
        elif kinds[j % len(kinds)] is unkeyed:  # a valid checksum, no cache key: refused where one is set
            assert type(value) is codec.Bad and "only entries authenticated" in str(value.error)
        else:
            assert torch.equal(value[0], samples[j][0]) and value[1] == samples[j][1], j
    # Half sealed, half gmac, each in a run of its own.
    half = entries[:n // 2] + gmac[n // 2:]
    assert_pairs(decode_many(half, keys, secret=SECRET), samples)


# Every change is a miss.

def _flip(entry: bytes, at: int, bit: int = 0x01) -> bytes:
    return entry[:at] + bytes([entry[at] ^ bit]) + entry[at + 1:]


def _positions(entry: bytes) -> dict[str, int]:
    tail_start, data_start, data_len = layout(entry)
    end = data_start + data_len
    return {"magic": 0, "version": 3, "kind": 4, "zero_after_kind": 6, "nonce": 8, "nonce_end": 19,
            "field_zeros": 20, "field_zeros_end": 31, "flags": 32, "flags_pad": 34, "skeleton_len": 36,
            "tail_len": 40, "data_len": 44, "data_len_high": 51, "skeleton": 52, "tail": tail_start,
            "tail_label": data_start - 8 if tail_start == data_start - 8 else tail_start + 8,
            "ciphertext": data_start, "ciphertext_mid": data_start + data_len // 2, "ciphertext_end": end - 1,
            "tag": end, "tag_end": end + 15}


TAMPERS = [*_positions(sealed((torch.randn(3, 32, 32), 1))), "truncated_1", "truncated_tag", "truncated_16",
           "extended_1", "extended_16", "moved", "other_cache_key", "as_gmac", "as_hmac", "as_xxh3", "as_opened",
           "as_unsealed", "field_nonzero"]


def _tamper(how: str, entries: list[bytes], keys: list[bytes], samples: list[Any], bad: int) -> bytes:
    e = entries[bad]
    positions = _positions(e)
    if how in positions:
        return _flip(e, positions[how], 0x80 if how == "kind" else 0x01)
    data_len = layout(e)[2]
    if how.startswith("truncated"):
        return e[:-{"truncated_1": 1, "truncated_tag": 16, "truncated_16": 17}[how]]
    if how == "extended_1":
        return e + b"\0"
    if how == "extended_16":  # what a longer data_len would want: refused by length, and the tag fails
        return e[:44] + struct.pack("<Q", data_len + 16) + e[52:] + bytes(16)
    if how == "moved":  # another key's authentic entry, copied under this key
        return entries[bad - 1]
    if how == "other_cache_key":
        return bytes(encode(samples[bad], keys[bad], secret=b"another job's key"))
    if how.startswith("as_") and how != "as_unsealed":  # the kind byte relabelled
        kind = {"as_gmac": codec.DIGEST_GMAC, "as_hmac": codec.DIGEST_HMAC, "as_xxh3": codec.DIGEST_XXH3,
                "as_opened": OPENED}[how]
        return e[:4] + bytes([kind]) + e[5:]
    if how == "as_unsealed":  # the plaintext put back, the tag dropped, relabelled as an opened entry would be
        aad = digests.seal_aad(keys[bad], e[32:52])
        plain: bytes = digests.seal_cipher(SECRET).decrypt(e[8:20], e[52:], aad)
        return e[:4] + bytes([OPENED]) + e[5:52] + plain
    assert how == "field_nonzero"
    return e[:25] + b"\x01" + e[26:]


def test_every_byte_flipped_is_a_miss() -> None:
    sample = ((torch.arange(12.0) * 3).reshape(3, 4), 7, "label", b"raw")
    entry = sealed(sample)
    for at in range(len(entry)):
        for bit in (0x01, 0x80):
            with pytest.raises(CorruptEntryError):
                decode(_flip(entry, at, bit), KEY, secret=SECRET)
    assert_same(decode(entry, KEY, secret=SECRET), sample)


@pytest.mark.parametrize("n", [4, N])  # below and above the numpy rows' threshold
@pytest.mark.parametrize("how", TAMPERS)
def test_every_tampering_is_a_miss_alone_and_in_a_batch(n: int, how: str) -> None:
    entries, keys, samples = batch(n)
    bad = n // 2
    entries[bad] = forged = _tamper(how, entries, keys, samples, bad)
    with pytest.raises(CorruptEntryError):
        decode(forged, keys[bad], secret=SECRET)
    with pytest.raises(CorruptEntryError):
        decode(forged, keys[bad])
    got = decode_many(entries, keys, secret=SECRET)
    assert type(got[bad]) is codec.Bad and isinstance(got[bad].error, CorruptEntryError), got[bad]
    assert_pairs(got, samples, skip=frozenset((bad,)))
    # In a fetch that says where the entries lie (the numpy path's way in): the same.
    length = len(entries[0])
    if all(len(e) == length for e in entries):
        buf = bytearray().join(entries)
        run = Replies([memoryview(buf)[i * length:(i + 1) * length] for i in range(n)],
                      (buf, 0, length, list(range(n))))
        got = decode_many(run, keys, secret=SECRET)
        assert type(got[bad]) is codec.Bad
        assert_pairs(got, samples, skip=frozenset((bad,)))


@pytest.mark.parametrize("n", [4, N])
def test_opened_entries_from_the_wire_are_misses(n: int) -> None:
    # What the opener makes in its own block, made by someone who can write to Redis: never read unverified.
    entries, keys, samples = batch(n)
    forged = []
    for e, k in zip(entries, keys, strict=True):
        aad = digests.seal_aad(k, e[32:52])
        forged.append(e[:4] + bytes([OPENED]) + e[5:52] + digests.seal_cipher(SECRET).decrypt(e[8:20], e[52:], aad))
    unkeyed = [bytes(encode(s, k)) for s, k in zip(samples, keys, strict=True)]
    forged += [e[:4] + bytes([OPENED]) + e[5:] for e in unkeyed]
    keys2 = keys + keys
    for secret in (SECRET, None):
        assert all(type(v) is codec.Bad for v in decode_many(forged, keys2, secret=secret))
        assert all(type(v) is codec.Bad for v in decode_many(forged[:n], keys, secret=secret))
        assert all(type(v) is codec.Bad for v in decode_many(forged[n:], keys, secret=secret))
        for e, k in zip(forged, keys2, strict=True):
            with pytest.raises(CorruptEntryError):
                decode(e, k, secret=secret)


def test_without_the_cache_key_a_sealed_entry_is_a_miss_that_says_why() -> None:
    entries, keys, _ = batch(N)
    with pytest.raises(CorruptEntryError, match=r"sealed .* none is configured here: configure the job's cache key"):
        decode(entries[0], keys[0])
    for n in (3, N):
        got = decode_many(entries[:n], keys[:n])
        assert all(type(v) is codec.Bad and "cache key" in str(v.error) for v in got)
    got = decode_many(entries, keys, secret=b"another job's key")  # refused by the key id they name
    assert all(type(v) is codec.Bad and "names cache key" in str(v.error) for v in got)


def test_pickled_entries_are_sealed_too() -> None:
    sample = {"set": {1, 2}, "pattern": PATTERN}
    entry = sealed(sample, allow_pickle=True)
    assert codec.is_pickled(entry)
    assert decode(entry, KEY, secret=SECRET, allow_pickle=True) == sample
    with pytest.raises(CorruptEntryError, match="not unpickling"):
        decode(entry, KEY, secret=SECRET)
    with pytest.raises(CorruptEntryError, match="cache key"):
        decode(entry, KEY, allow_pickle=True)
    with pytest.raises(CorruptEntryError, match="does not open"):  # the pickle is not even looked at
        decode(_flip(entry, len(entry) - 20), KEY, secret=SECRET, allow_pickle=True)
    _, data_start, _ = layout(entry)
    with pytest.raises(CorruptEntryError, match="does not open"):
        decode(_flip(entry, data_start), KEY, secret=SECRET, allow_pickle=True)
    values = [entry, sealed(("a", 1)), None, _flip(entry, 40)] + [entry] * 8
    keys = [KEY] * len(values)
    got = decode_many(values, keys, secret=SECRET, allow_pickle=True)
    assert got[0] == sample and got[1] == ("a", 1) and got[2] is codec.MISSING and type(got[3]) is codec.Bad
    assert all(g == sample for g in got[4:])
    got = decode_many(values, keys, secret=SECRET)
    assert all(type(got[j]) is codec.Bad and "not unpickling" in str(got[j].error) for j in (0, 4, 11))
    assert got[1] == ("a", 1)


def _in_one_buffer(entries: list[bytes]) -> Replies:
    """``entries`` as a fetch leaves them: views of one writable receive buffer, evenly spaced, in reverse order."""
    length = len(entries[0])
    n = len(entries)
    buf = bytearray(16) + bytearray().join(reversed(entries))
    order = list(reversed(range(n)))
    return Replies([memoryview(buf)[16 + (n - 1 - j) * length:16 + (n - j) * length] for j in range(n)],
                   (buf, 16, length, order))


@pytest.fixture(params=["native", "per-entry"])
def in_place_opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The batch opened in place by the native loop in one call (.native_gcm; taken for small entries, made to
    here whatever their size), or by cryptography's call per entry."""
    calls: list[int] = []
    if request.param == "native":
        if not native_gcm.available():
            pytest.skip("the native loop is not available here (no C compiler or libcrypto)")
        real = native_gcm.RowOpener.open_rows

        def counted(self: Any, *args: Any) -> Any:
            calls.append(args[3])  # n
            return real(self, *args)

        monkeypatch.setattr(native_gcm.RowOpener, "open_rows", counted)
        monkeypatch.setattr(batch_sealed, "worth_it", lambda size: True)
    else:
        monkeypatch.setattr(batch_sealed, "row_opener", lambda key: None)
    yield request.param
    if request.param == "native":
        assert calls, "no batch was opened by the native loop"


def test_a_batch_in_one_receive_buffer_is_opened_where_it_lies(in_place_opener: str) -> None:
    entries, keys, samples = batch(N)
    run = _in_one_buffer(entries)
    got = decode_many(run, keys, secret=SECRET)
    assert_pairs(got, samples)
    assert all(v[4] == OPENED for v in run)  # decrypted in place, marked opened
    # a batch with one entry that does not open: every other entry is as it was, and said which
    entries[N // 3] = _flip(entries[N // 3], len(entries[N // 3]) - 3)
    run = _in_one_buffer(entries)
    got = decode_many(run, keys, secret=SECRET)
    assert type(got[N // 3]) is codec.Bad and "does not open" in str(got[N // 3].error)
    assert_pairs(got, samples, skip=frozenset((N // 3,)))
    # pickled, in one buffer: unpickled only when asked
    pickled = [sealed(("p", i), key=k, allow_pickle=True) for i, k in enumerate(keys)]
    assert {len(p) for p in pickled} == {len(pickled[0])}
    assert decode_many(_in_one_buffer(pickled), keys, secret=SECRET, allow_pickle=True) == [("p", i) for i in range(N)]
    assert all(type(v) is codec.Bad for v in decode_many(_in_one_buffer(pickled), keys, secret=SECRET))


def test_without_cryptography_sealed_entries_are_misses_and_keyed_writes_hmac(without_cryptography: None) -> None:
    entry = bytes(encode(torch.ones(2), KEY, secret=SECRET))
    assert entry[4] == codec.DIGEST_HMAC
    with pytest.raises(RuntimeError, match="cryptography"):
        encode(torch.ones(2), KEY, secret=SECRET, seal=True)


def test_a_sealed_entry_is_a_miss_where_cryptography_is_missing() -> None:
    entry = sealed(torch.ones(2))
    with cryptography_missing():
        with pytest.raises(CorruptEntryError, match="install the cryptography package"):
            decode(entry, KEY, secret=SECRET)
        got = decode_many([entry] * 8, [KEY] * 8, secret=SECRET)
        assert all(type(v) is codec.Bad and "cryptography" in str(v.error) for v in got)
    assert torch.equal(decode(entry, KEY, secret=SECRET), torch.ones(2))


class OneShotAESGCM:
    """cryptography's AESGCM as releases before 45 had it: ``encrypt``/``decrypt`` only, no ``*_into``."""

    def __init__(self, key: bytes) -> None:
        self._aes = AESGCM(key)

    def encrypt(self, nonce: Any, data: Any, aad: Any) -> bytes:
        return self._aes.encrypt(nonce, data, aad)

    def decrypt(self, nonce: Any, data: Any, aad: Any) -> bytes:
        return self._aes.decrypt(nonce, data, aad)


def test_without_the_into_methods_sealing_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    entries, keys, samples = batch(N)
    monkeypatch.setattr(digests, "_aesgcm_class", lambda: OneShotAESGCM)
    digests.seal_cipher.cache_clear()
    try:
        assert not hasattr(digests.seal_cipher(SECRET), "decrypt_into")
        assert_pairs(decode_many(entries, keys, secret=SECRET), samples)
        again = [bytes(encode(s, k, secret=SECRET)) for s, k in zip(samples, keys, strict=True)]
        assert_pairs(decode_many(again, keys, secret=SECRET), samples)
        broken = list(again)
        broken[3] = _flip(broken[3], len(broken[3]) - 1)
        got = decode_many(broken, keys, secret=SECRET)
        assert type(got[3]) is codec.Bad and "does not open" in str(got[3].error)
    finally:
        monkeypatch.undo()  # the real cipher from here on, for this test's last read and every later test
        digests.seal_cipher.cache_clear()
    assert_pairs(decode_many(again, keys, secret=SECRET), samples)  # the real one reads what the other wrote


def test_sealed_indices_only_look_at_the_kind_byte() -> None:
    entries = batch(4)[0]
    values: list[Any] = [entries[0], None, b"", b"BLC", bytes(encode(1, KEY)), memoryview(bytearray(entries[1]))]
    assert batch_sealed.sealed_indices(values) == [0, 5]


@pytest.mark.parametrize("bad", [0, N // 2, N - 1])  # the first row, one in the middle, the last
def test_a_batch_that_does_not_open_in_place_is_left_as_received(bad: int, in_place_opener: str) -> None:
    entries, keys, samples = batch(N)
    entries[bad] = _flip(entries[bad], len(entries[bad]) - 3)  # its tag: the rows before it open, it does not
    run = _in_one_buffer(entries)
    as_received = bytes(run.run[0])  # type: ignore[attr-defined]
    got = decode_many(run, keys, secret=SECRET)
    assert type(got[bad]) is codec.Bad and "does not open" in str(got[bad].error)
    assert_pairs(got, samples, skip=frozenset((bad,)))
    # Every row opened in place was sealed again, and the one that failed holds its ciphertext again, not the
    # plaintext OpenSSL wrote before it checked the tag; no row carries a tag of this reader's making.
    assert bytes(run.run[0]) == as_received  # type: ignore[attr-defined]
    entries[bad] = _flip(entries[bad], HEADER_SIZE + 5)  # a flipped ciphertext byte as well: the same
    run = _in_one_buffer(entries)
    as_received = bytes(run.run[0])  # type: ignore[attr-defined]
    assert type(decode_many(run, keys, secret=SECRET)[bad]) is codec.Bad
    assert bytes(run.run[0]) == as_received  # type: ignore[attr-defined]

"""Entries authenticated with the cache key: sealed (AES-256-GCM) written by default, AES-GMAC written on request
(``seal=False``) and read, HMAC-SHA256 of earlier releases still read, and every entry that was not written with
the key under its own redis key a miss (in the codec and in a real Redis). Sealing itself: test_cache_sealed.py."""

from __future__ import annotations

import hmac
import logging

import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch.utils.data import DataLoader

from bagua_lightning.client import CachedDataset, RedisStore
from bagua_lightning.client.cache import codec, digests
from bagua_lightning.client.cache.codec import CorruptEntryError, decode, encode
from bagua_lightning.services.redis_cluster import ClusterInfo
from tests.client.cache_datasets import Source
from tests.client.conftest import cryptography_missing

KEY = b"ds:1:7"
SECRET = b"a cache key shared by the job"
FIELD = slice(8, 32)  # the digest field: nonce (12 bytes), then the truncated tag (12 bytes)


def test_keyed_entries_are_sealed_by_default_gmac_on_request_and_need_the_key() -> None:
    sample = (torch.arange(5), "x")
    assert encode(sample, KEY, secret=SECRET)[4] == codec.DIGEST_SEAL
    keyed = bytes(encode(sample, KEY, secret=SECRET, seal=False))
    assert keyed[4] == codec.DIGEST_GMAC
    assert_same_sample(decode(keyed, KEY, secret=SECRET), sample)
    with pytest.raises(CorruptEntryError, match="not written with this cache key"):
        decode(keyed, KEY, secret=b"another key")
    with pytest.raises(CorruptEntryError, match="none is configured"):  # an unkeyed reader misses
        decode(keyed, KEY)
    with pytest.raises(CorruptEntryError, match="another key"):
        decode(keyed, b"ds:1:8", secret=SECRET)
    # A forgery by someone who can write to Redis but has no key: a valid unkeyed digest is refused.
    forged = bytes(encode(sample, KEY))
    assert_same_sample(decode(forged, KEY), sample)
    with pytest.raises(CorruptEntryError, match="only entries authenticated"):
        decode(forged, KEY, secret=SECRET)


def assert_same_sample(got: tuple[torch.Tensor, str], want: tuple[torch.Tensor, str]) -> None:
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_gmac_digest_is_aes_gcm_of_the_key_with_the_entry_as_associated_data() -> None:
    # The digest docs/cache.md defines, computed here with cryptography's own HKDF: a change cannot go unnoticed.
    aes_key = HKDF(hashes.SHA256(), 32, None, digests.GMAC_KEY_INFO).derive(SECRET)
    assert digests._hkdf_sha256(SECRET, digests.GMAC_KEY_INFO) == aes_key
    entry = bytes(encode((torch.arange(6.0), "x"), KEY, secret=SECRET, seal=False))
    nonce = entry[8:20]
    assert entry[20:32] == AESGCM(aes_key).encrypt(nonce, KEY, entry[32:])[-16:-4]
    # Not the HMAC key used as it is: the AES key is derived for this use alone.
    assert aes_key != SECRET.ljust(32, b"\0")[:32]


def test_nonces_differ_across_writes_of_the_same_sample() -> None:
    sample = torch.ones(3, 32, 32)
    entries = [bytes(encode(sample, KEY, secret=SECRET, seal=False)) for _ in range(200)]
    assert len({e[8:20] for e in entries}) == 200
    assert len({e[32:] for e in entries}) == 1  # everything but the digest field is the same
    for e in entries[:5]:
        assert torch.equal(decode(e, KEY, secret=SECRET), sample)


def _flip(entry: bytes, at: int) -> bytes:
    return entry[:at] + bytes([entry[at] ^ 0x01]) + entry[at + 1:]


def _batch(n: int) -> tuple[list[bytes], list[bytes], list[tuple[torch.Tensor, int]]]:
    samples = [(torch.randn(3, 32, 32), i) for i in range(n)]  # 12 KB entries, as in CIFAR
    keys = [f"ds:1:{i}".encode() for i in range(n)]
    return [bytes(encode(s, k, secret=SECRET, seal=False)) for s, k in zip(samples, keys, strict=True)], keys, samples


FORGERIES = ["none", "data_bit", "tag_bit", "tag_last_bit", "nonce_bit", "tag_zeroed", "nonce_reused",
             "other_key", "unkeyed", "moved", "short", "as_hmac"]


@pytest.mark.parametrize("n", [4, 32])  # below and above the numpy batch path's threshold
@pytest.mark.parametrize("forgery", FORGERIES)
def test_keyed_batches_verify_every_entry(n: int, forgery: str) -> None:
    entries, keys, samples = _batch(n)
    bad = n // 2
    e = entries[bad]
    if forgery == "data_bit":
        entries[bad] = _flip(e, len(e) - 40)
    elif forgery == "tag_bit":
        entries[bad] = _flip(e, 20)
    elif forgery == "tag_last_bit":
        entries[bad] = _flip(e, 31)
    elif forgery == "nonce_bit":
        entries[bad] = _flip(e, 8)
    elif forgery == "tag_zeroed":  # a shorter tag, padded out: only the first 8 bytes kept
        entries[bad] = e[:28] + bytes(4) + e[32:]
    elif forgery == "nonce_reused":  # another entry's nonce with this entry's tag
        entries[bad] = e[:8] + entries[bad - 1][8:20] + e[20:]
    elif forgery == "other_key":  # the same sample, authenticated with a key the reader does not hold
        entries[bad] = bytes(encode(samples[bad], keys[bad], secret=b"another job's key"))
    elif forgery == "unkeyed":  # a valid unkeyed checksum, as anyone who can write to Redis can make
        entries[bad] = bytes(encode(samples[bad], keys[bad]))
    elif forgery == "moved":  # another key's authentic entry, copied under this key
        entries[bad] = entries[bad - 1]
    elif forgery == "short":
        entries[bad] = e[:-64]
    elif forgery == "as_hmac":  # the kind byte changed: a GMAC field is no HMAC of the entry
        entries[bad] = e[:4] + bytes([codec.DIGEST_HMAC]) + e[5:]
    got = codec.decode_many(entries, keys, secret=SECRET)
    for j, (value, sample) in enumerate(zip(got, samples, strict=True)):
        if j == bad and forgery != "none":
            assert type(value) is codec.Bad and isinstance(value.error, CorruptEntryError), (j, value)
        else:
            assert torch.equal(value[0], sample[0]) and value[1] == sample[1], j
    others = codec.decode_many(entries, keys, secret=b"another job's key")
    assert all(type(v) is codec.Bad for j, v in enumerate(others) if not (j == bad and forgery == "other_key"))
    unkeyed = codec.decode_many(entries, keys)
    assert all(type(v) is codec.Bad for j, v in enumerate(unkeyed) if not (j == bad and forgery == "unkeyed"))


def test_without_cryptography_keyed_entries_are_hmac_written_with_one_log_line(
        without_cryptography: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bagua_lightning.client.cache"):
        entries = [bytearray(encode((torch.arange(6.0), "x"), KEY, secret=SECRET)) for _ in range(3)]
    assert [r.getMessage() for r in caplog.records if "cryptography" in r.getMessage()] == [
        caplog.records[0].getMessage()]
    assert "pip install -U cryptography" in caplog.records[0].getMessage()
    entry = entries[0]
    assert entry[4] == codec.DIGEST_HMAC
    # The digest earlier releases wrote, computed independently: their entries keep verifying.
    mac = hmac.new(SECRET, len(KEY).to_bytes(8, "little") + KEY + bytes(entry[32:]), "sha256").digest()
    assert bytes(entry[FIELD]) == mac[:24]
    assert decode(bytes(entry), KEY, secret=SECRET)[1] == "x"


def test_a_gmac_entry_is_a_miss_where_cryptography_is_missing() -> None:
    entry = bytes(encode(torch.ones(2), KEY, secret=SECRET, seal=False))
    with cryptography_missing():
        with pytest.raises(CorruptEntryError, match="install the cryptography package"):
            decode(entry, KEY, secret=SECRET)
        got = codec.decode_many([entry] * 8, [KEY] * 8, secret=SECRET)
        assert all(type(v) is codec.Bad for v in got)
    assert torch.equal(decode(entry, KEY, secret=SECRET), torch.ones(2))


@pytest.mark.parametrize("n", [4, 32])
def test_hmac_entries_of_earlier_releases_are_read_among_gmac_ones(n: int) -> None:
    samples = [(torch.randn(3, 32, 32), i) for i in range(n)]
    keys = [f"ds:1:{i}".encode() for i in range(n)]
    with cryptography_missing():
        old = [bytes(encode(s, k, secret=SECRET)) for s, k in zip(samples, keys, strict=True)]
    assert {e[4] for e in old} == {codec.DIGEST_HMAC}
    new = [bytes(encode(s, k, secret=SECRET, seal=False)) for s, k in zip(samples, keys, strict=True)]
    for entries in (old, [o if j % 2 else e for j, (o, e) in enumerate(zip(old, new, strict=True))]):
        got = codec.decode_many(entries, keys, secret=SECRET)
        for value, sample in zip(got, samples, strict=True):
            assert torch.equal(value[0], sample[0]) and value[1] == sample[1]
    moved = list(old)
    moved[1] = old[0]  # an HMAC entry copied under another key is still a miss
    assert type(codec.decode_many(moved, keys, secret=SECRET)[1]) is codec.Bad


# In a real Redis: what a job with the cache key reads.

def _keyed(redis_cluster3: ClusterInfo, n: int, secret: bytes = SECRET) -> CachedDataset:
    return CachedDataset(Source(n), dataset_name="keyed", hosts=redis_cluster3.hosts, cache_key=secret,
                         writer_buffer_size=1)


def test_entry_copied_to_another_key_in_redis_is_a_miss(store: RedisStore, redis_cluster3: ClusterInfo) -> None:
    ds = _keyed(redis_cluster3, 4)
    ds.__getitems__([0, 1, 2, 3])
    a, b = ds.cache_loader.redis_key(1), ds.cache_loader.redis_key(2)
    store.set(b, store.get(a) or b"")  # sample 1's authentic entry, stored as sample 2
    for _ in range(2):  # the second pass reads the rewritten entry
        out = ds.__getitems__([0, 1, 2, 3])
        assert [o[1] for o in out] == [0, 1, 2, 3] and torch.equal(out[2][0], Source(4)[2][0])
    assert ds.stats.corrupt == 1
    assert (store.get(b) or b"")[4] == codec.DIGEST_SEAL


def test_entry_forged_with_another_cache_key_in_redis_is_a_miss(store: RedisStore,
                                                                redis_cluster3: ClusterInfo) -> None:
    ds = _keyed(redis_cluster3, 4)
    ds.__getitems__([0, 1, 2, 3])
    key = ds.cache_loader.redis_key(3)
    forged = (torch.full((3, 8, 8), 666.0), 3, {"np": torch.zeros(1).numpy(), "id": "forged"})
    store.set(key, bytes(encode(forged, key.encode(), secret=b"not the job's key")))  # right format, wrong key
    out = ds.__getitems__([0, 1, 2, 3])
    assert out[3][2]["id"] == "s0-3"
    assert ds.stats.corrupt == 1
    unkeyed = CachedDataset(Source(4), dataset_name="keyed", hosts=redis_cluster3.hosts, cache_key=b"")
    unkeyed.__getitems__([0, 1])
    assert unkeyed.stats.hits == 0  # a job without the key never reads sealed entries (they live apart)


def test_hmac_entries_in_redis_live_apart_from_sealed_ones(store: RedisStore, redis_cluster3: ClusterInfo) -> None:
    # Entries in clear (hmac: an earlier release, or a process without cryptography) are never where the read
    # ports read: a sealing writer neither serves nor overwrites them, it keeps its own under "!sealed:".
    with cryptography_missing():
        hmac = _keyed(redis_cluster3, 16)
        hmac.__getitems__(list(range(16)))
        hmac_key = hmac.cache_loader.redis_key(0)
    ds = _keyed(redis_cluster3, 16)
    assert ds.cache_loader.redis_key(0) == "!sealed:" + hmac_key
    source = ds.dataset
    for _ in range(2):
        out = ds.__getitems__(list(range(16)))
        assert [o[1] for o in out] == list(range(16))
    assert ds.stats.corrupt == 0 and ds.stats.hits == 16 and source.loads == 16
    assert (store.get(hmac_key) or b"")[4] == codec.DIGEST_HMAC
    assert (store.get(ds.cache_loader.redis_key(0)) or b"")[4] == codec.DIGEST_SEAL


def test_forked_dataloader_workers_write_and_verify_keyed_entries(store: RedisStore,
                                                                 redis_cluster3: ClusterInfo) -> None:
    ds = _keyed(redis_cluster3, 48)
    ds.__getitems__([0, 1])  # the parent's cipher is set up before the workers fork
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    for _ in range(2):
        labels = [int(i) for _, batch_labels, _ in loader for i in batch_labels]
        assert labels == list(range(48))
    stats = ds.stats  # summed over the workers
    assert stats.corrupt == 0 and stats.hits >= 48
    assert {(store.get(ds.cache_loader.redis_key(i)) or b"")[4] for i in range(48)} == {codec.DIGEST_SEAL}


def test_an_entry_over_the_aead_limit_is_written_hmac(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digests, "GMAC_MAX_BYTES", 1000)  # stands for cryptography's 2 GiB
    small, large = torch.ones(10), torch.ones(1000)
    assert encode(small, KEY, secret=SECRET)[4] == codec.DIGEST_SEAL
    assert encode(small, KEY, secret=SECRET, seal=False)[4] == codec.DIGEST_GMAC
    for seal in (None, False):
        entry = bytes(encode(large, KEY, secret=SECRET, seal=seal))
        assert entry[4] == codec.DIGEST_HMAC
        assert torch.equal(decode(entry, KEY, secret=SECRET), large)

"""client/cache/native_gcm.py: a batch's sealed entries opened in one call, built and loaded only when trusted."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from bagua_lightning.client.cache import native_gcm

needs_cc = pytest.mark.skipif(native_gcm._compiler() is None, reason="needs a C compiler (gcc)")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that has not tried the native loop yet, with its own cache folder."""
    monkeypatch.setattr(native_gcm, "_loaded", [])
    monkeypatch.setattr(native_gcm, "_openers", {})
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv(native_gcm.ENV_NATIVE, raising=False)
    return cache


def _rows(n: int, text_len: int, header: int, stride: int, key: bytes, seed: int = 0) -> tuple[
        bytearray, bytes, list[bytes], list[bytes]]:
    rng = random.Random(seed)
    aes = AESGCM(key)
    first = 24
    buf = bytearray(rng.randbytes(first + n * stride))
    nonces, aads, plains = b"", [], []
    for r in range(n):
        nonce, aad = rng.randbytes(12), rng.randbytes(rng.randrange(0, 80))
        plain = rng.randbytes(text_len)
        at = first + r * stride + header
        buf[at:at + text_len + 16] = aes.encrypt(nonce, plain, aad)
        nonces += nonce
        aads.append(aad)
        plains.append(plain)
    return buf, nonces, aads, plains


@needs_cc
@pytest.mark.parametrize("text_len", [0, 1, 15, 16, 17, 4096, 12_345])
def test_rows_open_to_cryptographys_plaintext(fresh: Path, text_len: int) -> None:
    key = os.urandom(32)
    opener = native_gcm.row_opener(key)
    assert opener is not None
    header, n = 52, 9
    stride = (header + text_len + 16 + 63) & -64
    buf, nonces, aads, plains = _rows(n, text_len, header, stride, key, seed=text_len)
    before = bytes(buf)
    assert opener.open_rows(buf, 24, stride, n, header, text_len, nonces, aads) is None
    for r, plain in enumerate(plains):
        at = 24 + r * stride
        assert bytes(buf[at + header:at + header + text_len]) == plain
        # the header and everything around the ciphertext is left as it was (the tag included)
        assert buf[at:at + header] == before[at:at + header]
        assert buf[at + header + text_len:at + stride] == before[at + header + text_len:at + stride]
    assert buf[:24] == before[:24]


def test_only_small_entries_take_the_native_loop() -> None:
    assert native_gcm.worth_it(16) and native_gcm.worth_it(native_gcm.ONE_RUN_MAX_ENTRY)
    assert not native_gcm.worth_it(12_400)  # a CIFAR sample: cryptography's own AES-GCM build is faster


@needs_cc
@pytest.mark.parametrize("where", ["tag", "ciphertext", "aad", "nonce"])
@pytest.mark.parametrize("bad", [0, 4, 8])
def test_a_row_that_does_not_open_is_named_and_the_rows_before_it_are_open(fresh: Path, where: str, bad: int) -> None:
    key = os.urandom(32)
    opener = native_gcm.row_opener(key)
    assert opener is not None
    header, text_len, n = 52, 1000, 9
    stride = 1088
    buf, nonces, aads, plains = _rows(n, text_len, header, stride, key, seed=bad)
    at = 24 + bad * stride + header
    if where == "tag":
        buf[at + text_len + 3] ^= 0x40
    elif where == "ciphertext":
        buf[at + 7] ^= 1
    elif where == "aad":
        aads[bad] = aads[bad] + b"x"
    else:
        nonces = nonces[:12 * bad] + bytes([nonces[12 * bad] ^ 1]) + nonces[12 * bad + 1:]
    failed = opener.open_rows(buf, 24, stride, n, header, text_len, nonces, aads)
    assert failed is not None and (failed.row, failed.written) == (bad, True)  # the rows before it: checked next
    for r in range(bad):
        assert bytes(buf[24 + r * stride + header:24 + r * stride + header + text_len]) == plains[r]
    # another key opens nothing
    other = native_gcm.row_opener(os.urandom(32))
    assert other is not None
    fresh_buf, nonces2, aads2, _ = _rows(n, text_len, header, stride, key, seed=99)
    failed = other.open_rows(fresh_buf, 24, stride, n, header, text_len, nonces2, aads2)
    assert failed is not None and (failed.row, failed.written) == (0, True)


@needs_cc
def test_rows_outside_the_buffer_or_mismatched_lists_are_refused(fresh: Path) -> None:
    opener = native_gcm.row_opener(bytes(32))
    assert opener is not None
    buf = bytearray(1000)
    with pytest.raises(ValueError, match="do not lie in a buffer of 1000 bytes"):
        opener.open_rows(buf, 0, 200, 5, 52, 140, bytes(60), [b""] * 5)  # the last row ends at 1008
    with pytest.raises(ValueError, match="need 48 bytes of nonces and 4 associated data"):
        opener.open_rows(buf, 0, 200, 4, 52, 100, bytes(47), [b""] * 4)
    assert opener.open_rows(buf, 0, 200, 0, 52, 100, b"", []) is None


@needs_cc
def test_the_built_loop_is_cached_private_and_reused(fresh: Path) -> None:
    assert native_gcm.available()
    built = list((fresh / "bagua-lightning" / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    assert (built[0].stat().st_mode & 0o077) == 0 and (built[0].parent.stat().st_mode & 0o077) == 0
    stamp = built[0].stat().st_mtime_ns
    native_gcm._loaded.clear()
    assert native_gcm.available()
    assert built[0].stat().st_mtime_ns == stamp  # loaded again, not rebuilt


@needs_cc
def test_a_loop_others_could_have_planted_is_never_loaded(fresh: Path) -> None:
    assert native_gcm.available()
    built = next((fresh / "bagua-lightning" / "native").iterdir())
    built.chmod(0o777)  # writable by every user: anyone could have put their code there
    native_gcm._loaded.clear()
    assert not native_gcm.available()
    assert native_gcm.row_opener(bytes(32)) is None
    built.chmod(0o700)
    (fresh / "bagua-lightning" / "native").chmod(0o777)  # the folder: anyone could replace the file
    native_gcm._loaded.clear()
    assert not native_gcm.available()


def test_without_a_compiler_or_when_turned_off_entries_open_one_call_each(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_gcm.ENV_NATIVE, "0")
    assert not native_gcm.available() and native_gcm.row_opener(bytes(32)) is None
    assert not (fresh / "bagua-lightning").exists()  # nothing built
    native_gcm._loaded.clear()
    monkeypatch.delenv(native_gcm.ENV_NATIVE)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(fresh))  # neither cc nor gcc
    assert not native_gcm.available()


@needs_cc
def test_a_compiler_that_fails_leaves_the_per_entry_call(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'cc: broken on purpose' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert not native_gcm.available()
    assert not list((fresh / "bagua-lightning" / "native").iterdir())  # no scratch file left behind


def _child_opens(key: bytes) -> None:
    os._exit(0 if native_gcm.row_opener(key) is None and not native_gcm.available() else 3)


@needs_cc
def test_a_forked_worker_opens_through_cryptography_and_never_waits(fresh: Path) -> None:
    """A fork child never calls the system's OpenSSL through the loop (a parent thread inside it at the fork
    would leave its locks held there), nor waits on the loop's lock that another parent thread held."""
    import multiprocessing

    assert native_gcm.available()  # loaded in the parent
    native_gcm._lock.acquire()  # another thread of this process is in the loop's set-up at the fork
    try:
        child = multiprocessing.get_context("fork").Process(target=_child_opens, args=(bytes(32),))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join(10)
    finally:
        native_gcm._lock.release()
    assert not alive, "the forked worker waited on a lock its parent held"
    assert child.exitcode == 0, "the forked worker used the native loop"
    assert native_gcm.row_opener(bytes(32)) is not None  # the parent still does

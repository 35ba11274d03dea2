"""A batch's sealed entries opened in one call: AES-256-GCM through the system's OpenSSL, without a Python loop.

``cryptography`` opens one entry per call, and a sealed read's cost over an unkeyed one is that call plus the
Python around it (docs/benchmarks.md, "Sealed reads on the 16-core host"). :class:`RowOpener` opens every row
of a receive buffer in one call of a small C loop (``native_gcm.c``) over OpenSSL's EVP functions: one cipher
context per thread and key, keyed once; per entry only its nonce, its associated data, the decryption where it
lies and the tag check. ctypes releases the GIL for the call.

The loop is freestanding C (no header, no library), built on first use with the machine's C compiler
(``$CC``, else ``cc`` or ``gcc``) into the user's cache folder, and loaded only from a file and folders that
the file-trust rules accept (:mod:`bagua_lightning.core.file_trust`: this user's, writable by nobody else).
OpenSSL's functions are looked up in the system's ``libcrypto`` by ctypes. Before first use the loop opens an
entry sealed by ``cryptography`` and must refuse the same entry with one bit changed; anything missing or
different (no compiler, no libcrypto, a failed build or check) leaves :func:`row_opener` returning None, and
the reader keeps ``cryptography``'s call per entry; so does every forked child (see
:func:`_after_fork_in_child`). ``BAGUA_LIGHTNING_NATIVE_GCM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_NATIVE = "BAGUA_LIGHTNING_NATIVE_GCM"
SOURCE = Path(__file__).with_name("native_gcm.c")
_TAG = 16
_NONCE = 12
_CRYPTO_NAMES = ("libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so")


class _Evp(ctypes.Structure):
    _fields_ = [("decrypt_init", ctypes.c_void_p), ("decrypt_update", ctypes.c_void_p),
                ("decrypt_final", ctypes.c_void_p), ("ctrl", ctypes.c_void_p)]


class _Native:
    """The loaded loop and the libcrypto functions it calls."""

    def __init__(self, loop: Any, crypto: Any) -> None:
        self.crypto = crypto
        vp = ctypes.c_void_p
        crypto.EVP_CIPHER_CTX_new.restype = vp
        crypto.EVP_CIPHER_CTX_new.argtypes = []
        crypto.EVP_CIPHER_CTX_free.restype = None
        crypto.EVP_CIPHER_CTX_free.argtypes = [vp]
        crypto.EVP_aes_256_gcm.restype = vp
        crypto.EVP_aes_256_gcm.argtypes = []
        crypto.EVP_DecryptInit_ex.restype = ctypes.c_int
        crypto.EVP_DecryptInit_ex.argtypes = [vp, vp, vp, ctypes.c_char_p, ctypes.c_char_p]
        self.cipher = crypto.EVP_aes_256_gcm()
        if not self.cipher:
            raise OSError("libcrypto has no AES-256-GCM")
        self.evp = _Evp(*(ctypes.cast(getattr(crypto, name), vp).value for name in (
            "EVP_DecryptInit_ex", "EVP_DecryptUpdate", "EVP_DecryptFinal_ex", "EVP_CIPHER_CTX_ctrl")))
        self.open_rows = loop.bl_gcm_open_rows
        self.open_rows.restype = ctypes.c_long
        self.open_rows.argtypes = [ctypes.POINTER(_Evp), vp, vp, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                   ctypes.c_long, ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p, vp]


class _Context:
    """One EVP cipher context keyed for AES-256-GCM (freed with the object; one per thread and key)."""

    def __init__(self, native: _Native, key: bytes) -> None:
        self._free = native.crypto.EVP_CIPHER_CTX_free
        self.ctx = native.crypto.EVP_CIPHER_CTX_new()
        if not self.ctx:
            raise MemoryError("EVP_CIPHER_CTX_new failed")
        if native.crypto.EVP_DecryptInit_ex(self.ctx, native.cipher, None, key, None) != 1:
            self._free(self.ctx)
            self.ctx = None
            raise OSError("EVP_DecryptInit_ex refused the key")

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self._free(self.ctx)
            self.ctx = None


class RowOpener:
    """Opens rows of a writable buffer sealed under one AES-256 key (see :meth:`open_rows`)."""

    def __init__(self, native: _Native, key: bytes) -> None:
        self._native, self._key = native, key
        self._local = threading.local()  # a context per thread: EVP contexts are not shared between threads

    def _context(self) -> _Context:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = _Context(self._native, self._key)
        return ctx

    def open_rows(self, buf: bytearray, first: int, stride: int, n: int, header: int, text_len: int, nonces: bytes,
                  aads: list[bytes]) -> Failed | None:
        """Open ``n`` rows of ``buf`` in place: row ``r`` at ``first + r * stride``, its ciphertext the
        ``text_len`` bytes ``header`` bytes in, then its 16-byte tag; its nonce ``nonces[12 r:12 r + 12]``, its
        associated data ``aads[r]``.

        Returns None when every row opened; else a :class:`Failed`: the first row that did not (those before it
        are open, those after it as received).

        Raises:
            ValueError: the rows do not lie inside ``buf``, or the nonces or associated data do not match ``n``.
        """
        if n <= 0:
            return None
        if first < 0 or header < 0 or text_len < 0 or stride < header + text_len + _TAG \
                or first + (n - 1) * stride + header + text_len + _TAG > len(buf):
            raise ValueError(f"{n} rows of stride {stride} at {first} do not lie in a buffer of {len(buf)} bytes")
        if len(nonces) != n * _NONCE or len(aads) != n:
            raise ValueError(f"{n} rows need {n * _NONCE} bytes of nonces and {n} associated data, "
                             f"got {len(nonces)} and {len(aads)}")
        ends = (ctypes.c_long * n)(*accumulate(map(len, aads)))
        holder = (ctypes.c_char * len(buf)).from_buffer(buf)
        try:
            done = int(self._native.open_rows(ctypes.byref(self._native.evp), self._context().ctx,
                                              ctypes.addressof(holder), first, stride, n, header, text_len, nonces,
                                              b"".join(aads), ctypes.addressof(ends)))
        finally:
            del holder
        if done == n:
            return None
        if done == -1:
            raise ValueError("the native opener refused its arguments")
        return Failed(-2 - done, False) if done < -1 else Failed(done, True)


@dataclass
class Failed:
    """The first ``row`` that did not open, and whether unauthenticated output was ``written`` over it; the rows
    before it are open (plaintext now), those after it as received."""

    row: int
    written: bool


ONE_RUN_MAX_ENTRY = 6 * 1024


def worth_it(text_len: int) -> bool:
    """Whether a batch of entries of ``text_len`` bytes opens faster in one native run than through
    cryptography's call per entry: only small entries do. The loop saves the ~1 us fixed cost of each call and the
    Python around it, but the system's OpenSSL 3.0 decrypts at about 3.7 GB/s where cryptography's own build
    (wide-vector AES-GCM) reaches about 9: from about 8 KB on the per-entry call wins (docs/benchmarks.md,
    "The native loop")."""
    return text_len <= ONE_RUN_MAX_ENTRY


_lock = threading.Lock()
_loaded: list[_Native | None] = []  # [] not tried yet; [None] not available in this process
_openers: dict[bytes, RowOpener] = {}


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker under ``fork``) never uses the loop: a thread of the parent that was
    inside the system's OpenSSL at the fork (the cache writer's TLS, say) leaves its locks held forever in the
    child, and the loop's first EVP call there would wait on them. The child opens entries through
    ``cryptography``'s own OpenSSL instead, as without the loop; its lock is fresh too (another thread may have
    held it, building the loop, at the fork)."""
    global _lock
    _lock = threading.Lock()
    _loaded[:] = [None]
    _openers.clear()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bagua-lightning" / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build(source: bytes) -> Path:
    """The built loop for ``source`` in the cache folder, built there first when missing."""
    from bagua_lightning.core.file_trust import check_own_folder, check_trusted

    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_own_folder(folder, "native-code cache folder")
    target = folder / f"native_gcm-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not target.exists():
        cc = _compiler()
        if cc is None:
            raise OSError("no C compiler (set $CC, or install gcc)")
        scratch = folder / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
        src = folder / f".native_gcm.{os.getpid()}.{threading.get_ident()}.c"
        try:
            src.write_bytes(source)
            result = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-nostdlib", "-fno-stack-protector",
                                     "-o", str(scratch), str(src)], capture_output=True, text=True, timeout=120,
                                    check=False)
            if result.returncode != 0:
                raise OSError(f"{cc} failed: {result.stderr.strip()[-300:]}")
            scratch.chmod(0o700)
            os.replace(scratch, target)  # atomic: another process building the same source gets one whole file
        finally:
            for leftover in (scratch, src):
                leftover.unlink(missing_ok=True)
    check_trusted(target, "native helper")
    return target


def _load_crypto() -> Any:
    names = list(_CRYPTO_NAMES)
    found = ctypes.util.find_library("crypto")
    if found and found not in names:
        names.append(found)
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise OSError(f"no libcrypto ({'; '.join(errors)})")


def _self_check(native: _Native) -> None:
    """Open an entry ``cryptography`` sealed, and refuse it with one bit changed; OSError otherwise."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key, nonce, aad = bytes(range(32)), bytes(range(12)), b"\x05\x00\x00\x00\x00\x00\x00\x00check"
    plain = bytes(range(256)) * 3
    sealed = AESGCM(key).encrypt(nonce, plain, aad)
    opener = RowOpener(native, key)
    for flip in (False, True):
        buf = bytearray(b"\x00" * 8 + sealed + b"\x00" * 8)
        if flip:
            buf[8 + 100] ^= 1
        failed = opener.open_rows(buf, 0, len(buf), 1, 8, len(plain), nonce, [aad])
        if flip and failed is None:
            raise OSError("the native opener accepted a changed entry")
        if not flip and (failed is not None or bytes(buf[8:8 + len(plain)]) != plain):
            raise OSError("the native opener does not give cryptography's plaintext")


def _native() -> _Native | None:
    if _loaded:  # tried already: no lock on the read path of every batch
        return _loaded[0]
    with _lock:
        if not _loaded:
            native = None
            if os.environ.get(ENV_NATIVE, "1") != "0":
                try:
                    path = _build(SOURCE.read_bytes())
                    native = _Native(ctypes.CDLL(str(path)), _load_crypto())
                    _self_check(native)
                except Exception as exc:  # any failure: cryptography's per-entry call instead
                    log.debug("sealed entries open one call per entry: %s", exc)
                    native = None
            _loaded.append(native)
        return _loaded[0]


def row_opener(key: bytes) -> RowOpener | None:
    """The opener for the AES-256 ``key`` (32 bytes), or None where the native loop is not available here."""
    native = _native()
    if native is None:
        return None
    opener = _openers.get(key)
    if opener is None:
        with _lock:
            if len(_openers) >= 8:  # a few cache keys at most (rotation): bounded
                _openers.clear()
            opener = _openers.setdefault(key, RowOpener(native, key))
    return opener


os.register_at_fork(after_in_child=_after_fork_in_child)


def available() -> bool:
    """Whether sealed runs open through the native loop in this process."""
    return _native() is not None

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
the reader keeps ``cryptography``'s call per entry. ``BAGUA_LIGHTNING_NATIVE_GCM=0`` turns it off.
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

    def _call(self, target: Any, first: int, stride: int, n: int, header: int, text_len: int, nonces: bytes,
              aad: bytes, ends: Any) -> int:
        return int(self._native.open_rows(ctypes.byref(self._native.evp), self._context().ctx, target, first, stride,
                                          n, header, text_len, nonces, aad, ends))

    def open_rows(self, buf: bytearray, first: int, stride: int, n: int, header: int, text_len: int, nonces: bytes,
                  aads: list[bytes], threads: int = 1) -> Failed | None:
        """Open ``n`` rows of ``buf`` in place: row ``r`` at ``first + r * stride``, its ciphertext the
        ``text_len`` bytes ``header`` bytes in, then its 16-byte tag; its nonce ``nonces[12 r:12 r + 12]``, its
        associated data ``aads[r]``. With ``threads`` > 1 the rows are split into that many runs, opened at once
        (the GIL is released for each; :func:`threads_for` says how many pay off).

        Returns None when every row opened; else a :class:`Failed`, saying which rows are open and which did
        not open (each run stops at its first row that does not).

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
        ends = list(accumulate(map(len, aads)))
        aad = b"".join(aads)
        holder = (ctypes.c_char * len(buf)).from_buffer(buf)
        try:
            base = ctypes.addressof(holder)
            runs = _split(n, max(1, threads))
            if len(runs) == 1:
                results = [self._call(base, first, stride, n, header, text_len, nonces, aad, (ctypes.c_long * n)(*ends))]
            else:
                def run(start: int, stop: int) -> int:
                    offset = ends[start - 1] if start else 0
                    run_ends = (ctypes.c_long * (stop - start))(*(e - offset for e in ends[start:stop]))
                    return self._call(base, first + start * stride, stride, stop - start, header, text_len,
                                      nonces[start * _NONCE:stop * _NONCE], aad[offset:], run_ends)

                pool = _pool(len(runs) - 1)
                later = [pool.submit(run, start, stop) for start, stop in runs[1:]]
                results = [run(*runs[0])]  # this thread opens the first run meanwhile
                results += [f.result() for f in later]
        finally:
            del holder
        if all(done == stop - start for done, (start, stop) in zip(results, runs, strict=True)):
            return None
        failed = Failed([], [])
        for done, (start, stop) in zip(results, runs, strict=True):
            if done == -1:
                raise ValueError("the native opener refused its arguments")
            if done < -1:
                failed.opened.extend(range(start, start - 2 - done))
                failed.rows.append((start - 2 - done, False))
            else:
                failed.opened.extend(range(start, start + done))
                if done < stop - start:
                    failed.rows.append((start + done, True))
        return failed


@dataclass
class Failed:
    """What a call left when some row did not open: the rows ``opened`` (plaintext now), and each row of
    ``rows`` that did not, with whether unauthenticated output was written over it (each run of rows stops
    there: the rows after it in its run are as received)."""

    opened: list[int]
    rows: list[tuple[int, bool]]


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


_pool_lock = threading.Lock()
_pools: dict[int, Any] = {}  # pid -> executor: a forked child (a DataLoader worker) makes its own


def _pool(workers: int) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    pid = os.getpid()
    with _pool_lock:
        pool = _pools.get(pid)
        if pool is None or pool._max_workers < workers:
            _pools.clear()  # any parent's: its threads do not exist in this process
            pool = _pools[pid] = ThreadPoolExecutor(max_workers=max(workers, MAX_THREADS - 1),
                                                    thread_name_prefix="bagua-seal-open")
        return pool


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


MAX_THREADS = 4
PARALLEL_MIN_BYTES = 256 * 1024  # a batch below this opens in one run: handing runs to threads costs more
ONE_RUN_MAX_ENTRY = 6 * 1024  # one run beats cryptography's call per entry only below about this entry size


def threads_for(n: int, text_len: int) -> int:
    """How many runs a batch of ``n`` entries of ``text_len`` bytes opens in: up to :data:`MAX_THREADS`, half of
    this process's cores, where the batch is big enough; 1 where one run is best; 0 where cryptography's call per
    entry is faster than one run (large entries on one or two cores: the system's OpenSSL may lack the wide-vector
    AES-GCM that cryptography's own build has)."""
    threads = min(MAX_THREADS, _cores() // 2)
    if threads >= 2 and n * text_len >= PARALLEL_MIN_BYTES:
        return min(threads, max(2, n * text_len // (PARALLEL_MIN_BYTES // 2)))
    return 1 if text_len <= ONE_RUN_MAX_ENTRY else 0


_lock = threading.Lock()
_loaded: list[_Native | None] = []  # [] not tried yet; [None] not available in this process
_openers: dict[bytes, RowOpener] = {}


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) starts with fresh locks and no pool: a lock another thread of the
    parent held at the fork (building the loop, say) would be held forever in the child, and the parent's pool
    threads do not exist there."""
    global _lock, _pool_lock
    _lock = threading.Lock()
    _pool_lock = threading.Lock()
    _pools.clear()


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

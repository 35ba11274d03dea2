"""Starting and always stopping the real processes tests talk to."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: Port blocks for servers lie wholly below Linux's ephemeral range (32768-60999), their cluster bus (+10000)
#: and TLS (+20000) ports too, so no client socket of any process takes one while a test starts its servers;
#: each pytest-xdist worker draws from its own slice, so two workers never race for one block.
BLOCK_LOW, EPHEMERAL_LOW = 10000, 32768
MAX_OFFSET = 20000  # the largest offset of a block's ports: TLS or read ports


def bindable(port: int) -> bool:
    """Whether a listening socket could bind ``port`` on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int, with_bus: bool = True, tls: bool = False) -> int:
    """First of ``n`` consecutive free ports, with their cluster bus ports (+10000) unless ``with_bus`` is False
    and their TLS ports (+20000, :func:`~bagua_lightning.core.redis_server.tls_port` there) when ``tls``.

    Drawn at random from this xdist worker's slice of the ports below the ephemeral range.
    """
    offsets = [0] + ([10000] if with_bus else []) + ([20000] if tls else [])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) % count if worker[2:].isdigit() else 0
    # Every call slices for the largest offset, whatever it asks: then a worker's blocks, bus and TLS/read ports
    # included, never meet another worker's, even where one asks for fewer offsets than the other.
    width = (EPHEMERAL_LOW - MAX_OFFSET - BLOCK_LOW) // count
    low = BLOCK_LOW + index * width
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, low + width - n)
        if all(bindable(base + i + o) for i in range(n) for o in offsets):
            return base
    raise RuntimeError(f"no block of {n} free ports found in {low}..{low + width - 1}")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll ``predicate`` until it is true; raise ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if predicate():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(interval_s)


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``timeout_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def running(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            log_path: str | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` in its own process group for the duration of the block; always stopped after."""
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield proc
    finally:
        stop_process(proc)
        if log_path:
            log.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def recording_tls_server(context: ssl.SSLContext, received: bytearray) -> Iterator[int]:
    """A TLS server on a free loopback port (yielded) that appends every byte it decrypts to ``received``:
    what a squatter with ``context``'s certificate would learn. Stopped with the block."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), conn:
                conn.settimeout(5)
                with context.wrap_socket(conn, server_side=True) as tls_conn:
                    while data := tls_conn.recv(65536):
                        received.extend(data)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()
        thread.join(10)  # every byte it received is in ``received``

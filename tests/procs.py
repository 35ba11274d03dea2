"""Starting and always stopping the real processes tests talk to."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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

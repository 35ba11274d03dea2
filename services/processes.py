"""The processes ``bagua-lightning up`` starts: liveness and identity by pid, and stopping them.

A recorded pid is only signalled after ``/proc/<pid>/cmdline`` shows it is still the process that was
started (pids are recycled); a zombie counts as gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (macOS): os.kill said it exists
    return state != "Z"


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def is_autotune_pid(pid: int) -> bool:
    """True when ``pid`` is a live autotune service (not a recycled pid of something else)."""
    if not pid_alive(pid):
        return False
    cmdline = _cmdline(pid)
    if cmdline is None:
        return not Path("/proc").is_dir()  # without /proc, trust the recorded pid
    return b"autotune" in cmdline and b"serve" in cmdline


def stop_pid(pid: int, is_ours: Callable[[int], bool], timeout_s: float = 10.0) -> bool:
    """SIGTERM ``pid`` (if ``is_ours``), SIGKILL it after ``timeout_s``; True when it was running."""
    if not is_ours(pid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reap(pid)
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    log.warning("pid %d did not stop within %.0f s of SIGTERM; sending SIGKILL", pid, timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        reap(pid)
        time.sleep(0.05)
    return True


def reap(pid: int) -> None:
    # When `up` ran in this very process (tests, the demo), the service is our child: reap it.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)

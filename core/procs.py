"""The process toolkit of every deployment (``up``, ``redis up``, the node-local cache server).

Identity that a stale or copied record cannot fool. Every process a deployment starts carries the
deployment's id in its environment (``BAGUA_LIGHTNING_DEPLOYMENT``); its record holds the pid, the start
time the kernel reports for it (:mod:`psutil`) and that id. A process is signalled only when all three
match the live process, so a recycled pid, a process of another deployment or anything started by someone
else is never touched. A deployment's folder carries a marker file naming the deployment and the folder's
own path; a folder is removed, and its records trusted, only when the marker names this deployment *and*
this path, so a copied state folder neither stops the original's processes nor deletes its data.

Also here, because both sides use them: the one poll-with-deadline helper, the one byte-size parser, and
owner-only files (0600 files in 0700 folders) for secrets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from .errors import ConfigurationError, ServiceUnavailableError
from .file_trust import check_own_folder, read_trusted

log = logging.getLogger(__name__)

ENV_DEPLOYMENT = "BAGUA_LIGHTNING_DEPLOYMENT"
MARKER_FILE = ".bagua-lightning-deployment"
_CREATE_TIME_TOLERANCE_S = 0.05  # psutil derives it from clock ticks; equal for one process within a boot

T = TypeVar("T")


class PollTimeoutError(ServiceUnavailableError):
    """:func:`poll`'s deadline passed before its predicate held."""


def new_deployment_id() -> str:
    """A fresh random deployment id (128 bits, hex)."""
    return secrets.token_hex(16)


@dataclass(frozen=True, kw_only=True)
class ProcessRecord:
    """Who a started process is: ``pid``, kernel ``create_time`` (seconds since the epoch), ``deployment``."""

    pid: int
    create_time: float
    deployment: str

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "create_time": self.create_time, "deployment": self.deployment}

    @classmethod
    def from_json(cls, data: Any) -> ProcessRecord:
        """Parse a record; ``ValueError`` naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"process record {data!r} is not an object")
        pid, created, dep = data.get("pid"), data.get("create_time"), data.get("deployment")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"process record pid {pid!r} is not a positive integer")
        if not isinstance(created, int | float) or isinstance(created, bool):
            raise ValueError(f"process record create_time {created!r} is not a number")
        if not isinstance(dep, str) or not dep:
            raise ValueError(f"process record deployment {dep!r} is not a string")
        return cls(pid=pid, create_time=float(created), deployment=dep)


def record(pid: int, deployment: str) -> ProcessRecord:
    """The record of the live process ``pid``, started (by us) with ``deployment`` in its environment."""
    return ProcessRecord(pid=pid, create_time=psutil.Process(pid).create_time(), deployment=deployment)


# The secrets' variables (core.services_file's ENV_REDIS_PASSWORD & co., and their *_FILE forms): never
# handed down to a process a deployment starts, which gets what it needs as a file's path or on stdin.
SECRET_ENV = ("BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "BAGUA_LIGHTNING_CACHE_KEY")


def child_env(deployment: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the secrets' variables, plus the deployment id (and ``extra``), for a
    process we start."""
    env = {k: v for k, v in os.environ.items() if k.removesuffix("_FILE") not in SECRET_ENV}
    env.update(extra or {})
    env[ENV_DEPLOYMENT] = deployment
    return env


def _process(rec: ProcessRecord) -> psutil.Process | None:
    """The live process ``rec`` describes, or None when pid, start time or deployment id differ."""
    try:
        proc = psutil.Process(rec.pid)
        if abs(proc.create_time() - rec.create_time) > _CREATE_TIME_TOLERANCE_S:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if proc.environ().get(ENV_DEPLOYMENT) != rec.deployment:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def pid_alive(pid: int) -> bool:
    """True while some process (not a zombie) has ``pid``; a query only, never a licence to signal."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def is_running(rec: ProcessRecord) -> bool:
    """True while the process ``rec`` describes runs (pid, start time and deployment id all match)."""
    return _process(rec) is not None


_DELETED = " (deleted)"  # what the kernel appends to a process's working folder once that folder is removed


def orphans(folder: Path) -> list[ProcessRecord]:
    """The processes of this user that a deployment started in ``folder`` (or below it) before the folder was
    deleted: their records, rebuilt from what survives in the processes themselves. Each carries a deployment
    id in its environment and its working folder, inside ``folder``, is one the kernel reports deleted: a
    folder of ours that no longer exists, so no live deployment's. A query; :func:`stop_many` stops them."""
    root = os.path.abspath(folder)
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real != os.getuid():
                continue
            cwd = os.readlink(f"/proc/{proc.pid}/cwd")
            if not cwd.endswith(_DELETED) or not (cwd[:-len(_DELETED)] + "/").startswith(root + "/"):
                continue
            deployment = proc.environ().get(ENV_DEPLOYMENT)
            if deployment:
                found.append(ProcessRecord(pid=proc.pid, create_time=proc.create_time(), deployment=deployment))
        except (psutil.Error, OSError):
            continue
    return found


def stop(rec: ProcessRecord, timeout_s: float = 10.0) -> bool:
    """SIGTERM the process of ``rec`` when it is still ours, SIGKILL it after ``timeout_s``.

    Returns:
        True when it was running and is now stopped; False when ``rec`` matches no live process (then
        nothing is signalled).
    """
    return bool(stop_many([rec], timeout_s))


def stop_many(records: list[ProcessRecord], timeout_s: float = 10.0) -> list[int]:
    """:func:`stop` for several processes at once: SIGTERM all that are still ours, wait for them together
    (polling every few milliseconds), SIGKILL what is left after ``timeout_s``; return the pids stopped."""
    live = [(rec, proc) for rec in records if (proc := _process(rec)) is not None]
    for rec in records:
        if all(rec is not r for r, _ in live):
            reap(rec.pid)
    for _, proc in live:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()

    def gone() -> bool:
        for rec, _ in live:
            reap(rec.pid)
        return not any(_running(proc) for _, proc in live)
    try:
        poll(gone, timeout_s, "processes to stop", max_interval_s=0.05)
    except PollTimeoutError:
        for rec, proc in live:
            if _running(proc):
                log.warning("pid %d did not stop within %.0f s of SIGTERM; sending SIGKILL", rec.pid, timeout_s)
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
        with contextlib.suppress(PollTimeoutError):
            poll(gone, timeout_s, "processes to be killed", max_interval_s=0.05)
    return [rec.pid for rec, _ in live]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def stop_child(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Stop a child this process started and has not reaped: its pid cannot have been reused, so it is
    signalled directly (its record may not match yet when it had no time to exec with its environment)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reap(pid: int) -> None:
    """Collect ``pid``'s exit status when it is our child (the service ran from this very process)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def poll(predicate: Callable[[], T | None], timeout_s: float, what: str,
         retry_on: tuple[type[BaseException], ...] = (OSError,), interval_s: float = 0.02,
         max_interval_s: float = 0.25) -> T:
    """Call ``predicate`` until it returns something truthy; return that, or fail after ``timeout_s``.

    Exceptions in ``retry_on`` count as "not yet" (the last one is named in the error); any other
    exception (e.g. a :class:`ServiceUnavailableError` saying the process exited) ends the wait at once.

    Raises:
        PollTimeoutError: nothing truthy before the deadline.
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    delay = interval_s
    last: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except retry_on as exc:
            if isinstance(exc, ServiceUnavailableError):
                raise  # a ConnectionError by type, but a verdict (e.g. the process exited), not a "not yet"
            last = exc
        if time.monotonic() > deadline:
            raise PollTimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                                          + (f" (last error: {last})" if last else ""))
        time.sleep(delay)
        delay = min(delay * 1.5, max_interval_s)


_SIZE = re.compile(r"(?i)^\s*(\d+)\s*(?:([kmgt])i?b?|(b))?\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_bytes(text: str | int) -> int:
    """``1073741824``, ``"1gb"``, ``"512MiB"``, ``"64k"``, ``"4t"`` -> bytes (1024-based, as Redis reads them).

    Raises:
        ConfigurationError: not a size, or negative.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigurationError(f"size {text!r} is negative; give bytes, 0 for no limit.")
        return text
    match = _SIZE.match(str(text))
    if match is None:
        raise ConfigurationError(f"size {text!r} is not bytes; give e.g. 1073741824, 1gb, 512mb, 4tb or 0.")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


# ------------------------------------------------------------------------------ owner-only files, markers


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it 0700; return it.

    Raises:
        UntrustedFileError: ``path`` exists and is another user's (it is never adopted).
    """
    path.mkdir(parents=True, exist_ok=True)
    check_own_folder(path, "folder")
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically with mode 0600 (in a 0700 folder)."""
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write() names no file: name it
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    return path


def new_secret_file(path: Path, nbytes: int = 32) -> Path:
    """A fresh random secret (URL-safe text) in the 0600 file ``path``; returns ``path``."""
    return write_private(path, secrets.token_urlsafe(nbytes))


def read_secret(path: str | Path) -> str:
    """The secret in ``path`` (surrounding whitespace dropped).

    Raises:
        ConfigurationError: unreadable or empty, naming the file.
        UntrustedFileError: another user owns it or may read or write it (or replace it: the folders above).
    """
    try:
        text = read_trusted(path, "secret file", secret=True).strip()
    except UnicodeDecodeError:
        raise ConfigurationError(f"secret file {path} is not UTF-8 text; restart the services "
                                 "(`bagua-lightning up`).") from None
    except OSError as exc:
        raise ConfigurationError(f"secret file {path} cannot be read ({exc.strerror}); run as the user who "
                                 "started the services, or give the secret through the environment.") from exc
    if not text:
        raise ConfigurationError(f"secret file {path} is empty; restart the services (`bagua-lightning up`).")
    return text


def write_marker(folder: Path, deployment: str, **extra: str) -> None:
    """Mark ``folder`` as belonging to ``deployment`` (the marker also names the folder's own path)."""
    data = {"deployment": deployment, "folder": str(folder.resolve()), **extra}
    write_private(folder / MARKER_FILE, json.dumps(data))


def read_marker(folder: Path) -> dict[str, str] | None:
    """The marker of ``folder`` when it names this very folder; None when absent, malformed or copied."""
    try:
        data = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("deployment"), str):
        return None
    if data.get("folder") != str(folder.resolve()):
        return None  # a copy of another deployment's folder
    return {str(k): str(v) for k, v in data.items()}


def owns(folder: Path, deployment: str) -> bool:
    """True when ``folder`` carries ``deployment``'s marker written for this very path."""
    marker = read_marker(folder)
    return marker is not None and marker["deployment"] == deployment


def remove_tree(folder: Path, deployment: str) -> bool:
    """Delete ``folder`` only when it carries ``deployment``'s marker; True when it was deleted."""
    if not owns(folder, deployment):
        if folder.exists():
            log.warning("not removing %s: it does not carry deployment %s's marker", folder, deployment)
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True

"""No rank waits forever: a watch over the other ranks of the job that ends this one when a peer fails.

A collective waits for every rank of its group. When one rank raises, exits or is killed, the others wait in
their next collective until the process group's timeout (Bagua's 30 minutes); on NCCL they wait in a CUDA
synchronisation no Python signal can interrupt. The watch, a daemon thread per rank started with the process
group (``torch_api.init_process_group``, ``BaguaStrategy``), ends that wait within seconds:

* every rank writes a heartbeat to the job's store (the rendezvous store) every ``interval_s``, with its pid,
  host and the operation it is in (:func:`set_op`);
* a rank that raises publishes its exception at once: from ``sys.excepthook`` (scripts, torchrun), from a
  ``multiprocessing`` finaliser (ranks started by ``multiprocessing``, as Bagua's tests do) and from
  ``BaguaStrategy.on_exception`` (a Trainer);
* a rank that exits writes an exit mark; a rank whose heartbeat stops without one (killed, crashed) or whose
  process is gone (same host) is dead; a job whose store host (rank 0) is gone has lost rank 0;
* a peer that *exited* (cleanly or not) only fails this rank when this rank's main thread has been blocked on
  the same line for ``stuck_s`` (waiting for that peer), so ranks that finish at different times still do.

Once a failure is known, the watch logs one line naming the failed rank, what it was doing and what this rank
was doing, aborts the process groups (NCCL's abort releases kernels that wait for the dead peer), raises
:class:`PeerFailedError` in the main thread and, if the process is still alive ``exit_grace_s`` later (a thread
blocked inside C++ never sees the exception), ends it with ``os._exit(1)``, as torch's NCCL watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``) does after its timeout. A process started by ``multiprocessing`` whose
parent is gone (a test harness killed by its timeout) ends the same way.

Environment: ``BAGUA_LIGHTNING_PEER_WATCH=0`` turns it off; ``BAGUA_LIGHTNING_PEER_DEAD_S`` (default 15 s),
``BAGUA_LIGHTNING_PEER_STUCK_S`` (10 s) and ``BAGUA_LIGHTNING_PEER_EXIT_GRACE_S`` (8 s) tune it.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import multiprocessing.util
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType, TracebackType

import torch.distributed as dist

__all__ = ["PeerFailedError", "WatchSettings", "explain", "failure", "job_failed", "report_failure", "set_op", "start",
           "stop"]

log = logging.getLogger(__name__)
_PREFIX = "bagua_lightning/peers/"
_ALL_PEERS_UP_TO = 16  # larger jobs: each rank watches its two ring neighbours (a failure is then published)


class PeerFailedError(RuntimeError):
    """Another rank of the job failed; the message names it and what each side was doing."""

    def __init__(self, message: str | None = None) -> None:
        # Raised asynchronously in the main thread without arguments: take the watch's verdict then.
        super().__init__(message or failure() or "another rank of the job failed")


@dataclass(kw_only=True, frozen=True)
class WatchSettings:
    """Timings of the watch, in seconds."""

    interval_s: float = 1.0
    """How often the heartbeat is written and the peers are read."""
    dead_s: float = 15.0
    """A peer whose heartbeat has not moved for this long (and that left no exit mark) is dead."""
    stuck_s: float = 10.0
    """After a peer exited: how long this rank's main thread may sit on one line before it is failed."""
    exit_grace_s: float = 8.0
    """After a failure: how long the process may take to end by itself before ``os._exit(1)``."""

    def __post_init__(self) -> None:
        for name in ("interval_s", "dead_s", "stuck_s", "exit_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WatchSettings.{name}={getattr(self, name)} must be a positive number of seconds")

    @classmethod
    def from_env(cls) -> WatchSettings:
        def value(name: str, default: float) -> float:
            raw = os.environ.get(name, "").strip()
            try:
                return float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name}={raw!r} must be a number of seconds") from None

        return cls(dead_s=value("BAGUA_LIGHTNING_PEER_DEAD_S", 15.0),
                   stuck_s=value("BAGUA_LIGHTNING_PEER_STUCK_S", 10.0),
                   exit_grace_s=value("BAGUA_LIGHTNING_PEER_EXIT_GRACE_S", 8.0))


class _State:
    """This process's watch (one per process, as torch.distributed keeps one default group)."""

    watch: _Watch | None = None
    op = "startup"
    verdict: str | None = None
    exiting = False
    self_failed = False
    explaining: str | None = None  # where the main thread's collective failed, while explain() waits
    hooks_installed = False


def set_op(name: str) -> None:
    """Name the operation this rank is in (sent with the heartbeat; named when a peer or this rank fails)."""
    _State.op = name


def failure() -> str | None:
    """The failure the watch found (None while every rank is well)."""
    return _State.verdict


def job_failed() -> bool:
    """Whether this job is broken: a peer failed (:func:`failure`) or this rank reported its own failure."""
    return _State.verdict is not None or _State.self_failed


def _client(store: dist.Store) -> dist.Store:
    """A connection of the watch's own to ``store``: its reads must not queue behind a blocked main thread."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        try:
            inner = dist.TCPStore(inner.host, inner.port, is_master=False, timeout=timedelta(seconds=5),
                                  wait_for_workers=False)
        except (RuntimeError, ValueError) as exc:  # keep the shared connection: slower to notice, still right
            log.debug("peer watch: own store connection refused (%s); sharing the job's", exc)
    return dist.PrefixStore(_PREFIX, inner)


def _main_frame() -> FrameType | None:
    return sys._current_frames().get(threading.main_thread().ident or -1)


def _where(frame: FrameType | None) -> str:
    if frame is None:
        return "unknown"
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


class _Watch(threading.Thread):
    def __init__(self, store: dist.Store, rank: int, world_size: int, settings: WatchSettings) -> None:
        super().__init__(name="bagua-peer-watch", daemon=True)
        self.store, self.rank, self.world_size, self.settings = store, rank, world_size, settings
        self.host = _host_identity()
        self.stop_event = threading.Event()
        self.seq = 0
        ring = {(rank - 1) % world_size, (rank + 1) % world_size}
        self.peers = sorted(set(range(world_size)) - {rank} if world_size <= _ALL_PEERS_UP_TO else ring - {rank})
        self.seen: dict[int, tuple[str, float]] = {}  # peer -> (last heartbeat, when it changed)
        self.gone: dict[int, str] = {}  # peers that exited: rank -> how
        self.blocked: tuple[int, int, float] | None = None  # (frame id, line, since) of the main thread

    # ---------------------------------------------------------------- store
    def beat(self) -> None:
        self.seq += 1
        self.store.set(f"hb/{self.rank}", f"{self.seq}|{os.getpid()}|{self.host}|{_State.op}")

    def read(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    # ---------------------------------------------------------------- judging
    def check_peers(self) -> str | None:
        published = self.read("failed")
        if published is not None:
            return published
        now = time.monotonic()
        for peer in self.peers:
            beat = self.read(f"hb/{peer}")
            if beat is None:
                continue  # not started yet: the rendezvous' own timeout covers a rank that never comes
            _, pid, host, op = [*beat.split("|", 3), "", "", ""][:4]
            exited = self.read(f"exit/{peer}")
            if exited is not None:
                self.gone.setdefault(peer, f"rank {peer} exited ({exited}; its last operation: {op})")
                continue
            last, since = self.seen.get(peer, ("", now))
            if beat != last:
                self.seen[peer] = (beat, now)
                since = now
            if host == self.host and pid.isdigit() and not _alive(int(pid)):
                return f"rank {peer} of {self.world_size} died (process {pid} is gone) while in {op}"
            if now - since > self.settings.dead_s:
                return (f"rank {peer} of {self.world_size} stopped answering (no heartbeat for "
                        f"{now - since:.0f} s, no exit: killed or hung) while in {op}")
        return self.check_gone(now)

    def check_gone(self, now: float) -> str | None:
        """A peer left: fail only when this rank's main thread is blocked (waiting for it)."""
        if not self.gone:
            self.blocked = None
            return None
        frame = _main_frame()
        key = (id(frame), frame.f_lineno if frame is not None else -1)
        if self.blocked is None or self.blocked[:2] != key:
            self.blocked = (*key, now)
            return None
        if now - self.blocked[2] < self.settings.stuck_s:
            return None
        return "; ".join(self.gone.values()) + f", and this rank has waited {now - self.blocked[2]:.0f} s since"

    def run(self) -> None:
        parent = multiprocessing.parent_process()
        while not self.stop_event.wait(self.settings.interval_s):
            if _State.exiting:
                return
            try:
                self.beat()
                verdict = self.check_peers()
            except (RuntimeError, ValueError, OSError) as exc:  # the store (rank 0's) is gone
                if self.rank == 0 or self.stop_event.is_set():
                    return
                self.gone.setdefault(0, f"rank 0 (the host of the job's store) is gone ({str(exc)[:120]})")
                verdict = self.check_gone(time.monotonic())
            if verdict is None and parent is not None and not parent.is_alive():
                verdict = f"the process that started this rank (pid {parent.pid}) is gone"
            if verdict is not None:
                _fail(verdict, self)
                return


def _host_identity() -> str:
    """Host name, boot id and pid namespace: pids are compared only between processes that share all three."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append(f"unknown-{os.getpid()}")  # nothing to compare by: never judge a pid of another process
    return "/".join(parts)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (of this host and pid namespace) still runs; a zombie (killed, not yet reaped
    by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _abort_groups() -> None:
    """Abort every process group (NCCL: the kernels waiting for a dead peer return)."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
    except (RuntimeError, ValueError, AttributeError) as exc:
        log.debug("peer watch: aborting the process groups: %s", exc)


def _fail(verdict: str, watch: _Watch | None) -> None:
    rank = watch.rank if watch is not None else -1
    explaining = _State.explaining  # the main thread waits in explain(): it raises the verdict itself
    where = explaining or _where(_main_frame())
    message = f"bagua_lightning: {verdict}; this rank ({rank}) was in {_State.op} at {where}; stopping this rank"
    _State.verdict = message
    if watch is not None:
        try:
            if int(watch.store.add("failed_count", 1)) == 1:
                watch.store.set("failed", verdict)
        except (RuntimeError, ValueError, OSError):
            pass  # the store is gone too: the others find out by themselves
    print(message, file=sys.stderr, flush=True)
    # Aborting can itself wait on the broken communicator: never let it hold up the exit below.
    threading.Thread(target=_abort_groups, name="bagua-peer-abort", daemon=True).start()
    main = threading.main_thread()
    if main.ident is not None and main.is_alive() and explaining is None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main.ident), ctypes.py_object(PeerFailedError))
    grace = watch.settings.exit_grace_s if watch is not None else 8.0
    deadline = time.monotonic() + grace
    while main.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if main.is_alive():
        print(f"{message} (the main thread did not stop within {grace:.0f} s: exiting)", file=sys.stderr, flush=True)
        os._exit(1)


_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "abort",
                "timed out", "Timeout", "DistBackendError", "DistNetworkError")


def _peer_caused(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the error a collective raises when a peer goes away."""
    if isinstance(exc, PeerFailedError) or (hasattr(dist, "DistError") and isinstance(exc, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_ERRORS)


def explain(exc: BaseException) -> BaseException:
    """``exc`` from a collective, or a :class:`PeerFailedError` naming the peer that caused it.

    A collective fails as soon as a peer's connection closes, before the watch has judged; for such an
    error wait (up to the time a dead peer takes to be noticed) for the verdict that names the peer.
    """
    watch = _State.watch
    if watch is None or isinstance(exc, PeerFailedError) or not _peer_caused(exc):
        return exc
    frames = traceback.extract_tb(exc.__traceback__)
    _State.explaining = f"{frames[-1].name} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" \
        if frames else "a collective"
    try:
        deadline = time.monotonic() + watch.settings.dead_s + 2 * watch.settings.interval_s
        while _State.verdict is None and watch.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        _State.explaining = None
    return PeerFailedError(_State.verdict) if _State.verdict is not None else exc


def report_failure(exc: BaseException | None, tb: TracebackType | None = None) -> None:
    """This rank is ending with ``exc``: publish it, so that the other ranks stop at once instead of waiting.

    An error a failed peer caused is not this rank's failure: then wait for the watch's verdict instead
    (it names the peer, on this rank's stderr).
    """
    watch = _State.watch
    if watch is None or exc is None or isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return
    if _State.verdict is not None or isinstance(explain(exc), PeerFailedError):
        return
    frames = traceback.extract_tb(tb or exc.__traceback__)
    where = f" in {frames[-1].name} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    verdict = (f"rank {watch.rank} of {watch.world_size} failed with {type(exc).__name__}: {str(exc)[:200]}"
               f"{where} while in {_State.op}")
    _State.self_failed = _State.exiting = True  # this rank goes down by itself: stop judging the others
    try:
        if int(watch.store.add("failed_count", 1)) == 1:
            watch.store.set("failed", verdict)
    except (RuntimeError, ValueError, OSError) as err:
        log.debug("peer watch: could not publish this rank's failure: %s", err)


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    report_failure(exc, tb)
    _previous_excepthook(kind, exc, tb)


_previous_excepthook = sys.excepthook


def _finalizer() -> None:
    # Runs inside multiprocessing's exit function, which the child calls while its target's exception is
    # still being handled: the one place such a rank's exception can be seen.
    report_failure(sys.exc_info()[1])


def _mark_exit() -> None:
    watch = _State.watch
    _State.exiting = True
    if watch is None:
        return
    # Stop the thread before the interpreter tears down: it must not sit in a store call of its own then.
    watch.stop_event.set()
    watch.join(timeout=2 * watch.settings.interval_s)
    if _State.verdict is None:
        try:
            watch.store.set(f"exit/{watch.rank}", "at interpreter exit")
        except (RuntimeError, ValueError, OSError):
            pass


def start(store: dist.Store | None, rank: int, world_size: int, settings: WatchSettings | None = None) -> bool:
    """Start this process's watch over the job's other ranks (idempotent); False when it does not run.

    Args:
        store: the job's store (the rendezvous store); None: torch.distributed's default one.
        rank: this process's global rank.
        world_size: the number of ranks.
        settings: timings; None: :meth:`WatchSettings.from_env`.
    """
    if world_size <= 1 or os.environ.get("BAGUA_LIGHTNING_PEER_WATCH", "1").strip() == "0":
        return False
    if _State.watch is not None and _State.watch.is_alive():
        return True
    if store is None:
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return False
    global _previous_excepthook
    if not _State.hooks_installed:
        _previous_excepthook, sys.excepthook = sys.excepthook, _excepthook
        if multiprocessing.parent_process() is not None:
            multiprocessing.util.Finalize(None, _finalizer, exitpriority=100)
        atexit.register(_mark_exit)  # registered last: runs before the other exit handlers
        _State.hooks_installed = True
    _State.verdict, _State.exiting, _State.self_failed, _State.op = None, False, False, "training"
    watch = _Watch(_client(store), rank, world_size, settings or WatchSettings.from_env())
    watch.beat()
    _State.watch = watch
    watch.start()
    return True


def stop() -> None:
    """Stop the watch (the process group is being destroyed on purpose)."""
    watch, _State.watch = _State.watch, None
    if watch is not None:
        watch.stop_event.set()


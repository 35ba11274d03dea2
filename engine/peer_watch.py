"""No rank waits forever: a watch over the other ranks of the job that ends this one when a peer fails.

A collective waits for every rank of its group. When one rank raises, exits or is killed, the others wait in
their next collective until the process group's timeout (Bagua's 30 minutes); on NCCL they wait in a CUDA
synchronisation no Python signal can interrupt. The watch, a daemon thread per rank started with the process
group (``torch_api.init_process_group``, ``BaguaStrategy``), ends that wait within seconds.

What each rank publishes in the job's store (the rendezvous store, keys under ``bagua_lightning/peers/``):

* ``hb/<rank>``: a heartbeat every ``interval_s``: a sequence number, pid, host and the operation the rank is
  in (:func:`set_op`);
* ``failed``: the first failure of the job, one line naming the rank. A rank that raises publishes its
  exception at once (from ``sys.excepthook`` for scripts and torchrun, from a ``multiprocessing`` finaliser for
  ranks started by ``multiprocessing`` as Bagua's tests do, from ``BaguaStrategy.on_exception`` in a Trainer:
  :func:`report_failure`): the others stop within ``interval_s``, not when its process has finished exiting
  (which takes seconds; its connections stay open until then);
* ``exit/<rank>``: an exit mark, written when the rank leaves on purpose (:func:`leave`: at interpreter exit,
  at the end of a ``multiprocessing`` rank, when the default group is destroyed).

How a rank judges its peers (each ``interval_s``, and at once when its own collective fails):

* a published failure fails every rank;
* a peer is *gone* when it left an exit mark, when its process is gone (same host: the pid is compared), or
  when its heartbeat has not moved for ``dead_s``; a gone peer fails this rank only when this rank is waiting
  for it: a collective of this rank failed with a peer's error (:func:`explain`: immediately), or this rank's
  main thread has sat on one line for ``stuck_s`` (a collective that cannot finish: NCCL). A finished rank
  whose process ended, with or without its exit mark (``os._exit`` writes none), is therefore never taken for
  a dead one while the others finish their last steps; a killed one is found by the first collective that
  needs it;
* a job whose store host (rank 0) is gone has lost rank 0 (a gone peer like the others).

Once a failure is known, the watch logs one line naming the failed rank, what it was doing and what this rank
was doing, aborts the process groups (NCCL's abort releases kernels that wait for the dead peer), raises
:class:`PeerFailedError` in the main thread and, if the main thread is blocked outside Python (a Gloo wait, a
CUDA synchronisation: it never sees the exception) or the process is still alive ``exit_grace_s`` later, ends it
with ``os._exit(1)``, as torch's NCCL watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) does after its timeout. A
process started by ``multiprocessing`` whose parent is gone (a test harness killed by its timeout) ends the
same way.

API: :func:`start` / :func:`leave` / :func:`stop` around the process group's life; :func:`set_op` names the
operation; :func:`explain` (or :func:`raise_named`) turns a collective's error into a :class:`PeerFailedError`
naming the peer; :func:`report_failure` publishes this rank's own failure; :func:`failure` (text) and
:func:`failed_peer` (a :class:`PeerFailure`: which rank, how) give the verdict; :func:`departed` lists the peers
seen leaving that this rank did not need; :func:`job_failed` says whether the job is broken. What happens after a verdict (stop this rank) is :func:`_fail`'s, the one place a policy
that lets the survivors go on would change.

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
from typing import NoReturn

import torch.distributed as dist

__all__ = ["PeerFailedError", "PeerFailure", "WatchSettings", "departed", "explain", "failed_peer", "failure",
           "job_failed", "leave", "raise_named", "report_failure", "set_op", "start", "stop"]

log = logging.getLogger(__name__)
_PREFIX = "bagua_lightning/peers/"
_ALL_PEERS_UP_TO = 16  # larger jobs: each rank watches its two ring neighbours (a failure is then published)
_TELLING = {"died": 0, "store": 1, "silent": 2, "exited": 3}  # which gone peer names a failure, first to last


class PeerFailedError(RuntimeError):
    """Another rank of the job failed; the message names it and what each side was doing."""

    def __init__(self, message: str | None = None) -> None:
        # Raised asynchronously in the main thread without arguments: take the watch's verdict then.
        super().__init__(message or failure() or "another rank of the job failed")


@dataclass(kw_only=True, frozen=True)
class PeerFailure:
    """Which rank failed and how (the structured form of :func:`failure`)."""

    rank: int | None
    """The failed rank; None when the line was published by a rank of another version or cannot be read."""
    how: str
    """``raised`` (published its exception), ``died`` (its process is gone), ``silent`` (no heartbeat for
    ``dead_s``), ``exited`` (left while this rank still needed it), ``store`` (rank 0, the store's host, is
    gone) or ``parent`` (the process that started this rank is gone)."""
    detail: str
    """One line: the rank, what happened, what it was doing."""


@dataclass(kw_only=True, frozen=True)
class WatchSettings:
    """Timings of the watch, in seconds."""

    interval_s: float = 1.0
    """How often the heartbeat is written and the peers are read."""
    dead_s: float = 15.0
    """A peer whose heartbeat has not moved for this long (and that left no exit mark) is gone."""
    stuck_s: float = 10.0
    """With a peer gone: how long this rank's main thread may sit on one line before it is failed."""
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
    peer: PeerFailure | None = None
    exiting = False
    self_failed = False
    explaining: str | None = None  # where the main thread's collective failed, while explain() waits
    hooks_installed = False


def set_op(name: str) -> None:
    """Name the operation this rank is in (sent with the heartbeat; named when a peer or this rank fails)."""
    _State.op = name


def failure() -> str | None:
    """The failure the watch found, as the line it printed (None while every rank is well)."""
    return _State.verdict


def failed_peer() -> PeerFailure | None:
    """The failure the watch found: which rank and how (None while every rank is well)."""
    return _State.peer


def departed() -> dict[int, PeerFailure]:
    """The peers this rank's watch has seen leave (``exited``, ``died``, ``silent``, ``store``) without this
    rank having needed them since: rank -> how (empty without a watch)."""
    watch = _State.watch
    return dict(watch.gone) if watch is not None else {}


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


def _published(line: str) -> PeerFailure:
    """A published failure line (``rank R of N ...``) in structured form."""
    words = line.split()
    rank = int(words[1]) if len(words) > 1 and words[0] == "rank" and words[1].isdigit() else None
    how = next((h for h, word in (("raised", "failed with"), ("died", "died"), ("silent", "stopped answering"),
                                  ("exited", "exited"), ("store", "host of the job's store"),
                                  ("parent", "started this rank")) if word in line), "raised")
    return PeerFailure(rank=rank, how=how, detail=line)


class _Watch(threading.Thread):
    def __init__(self, store: dist.Store, rank: int, world_size: int, settings: WatchSettings) -> None:
        super().__init__(name="bagua-peer-watch", daemon=True)
        self.store, self.rank, self.world_size, self.settings = store, rank, world_size, settings
        self.host = _host_identity()
        self.stop_event = threading.Event()
        self.wake = threading.Event()  # set by explain(): judge now, not at the next interval
        self.seq = 0
        ring = {(rank - 1) % world_size, (rank + 1) % world_size}
        self.peers = sorted(set(range(world_size)) - {rank} if world_size <= _ALL_PEERS_UP_TO else ring - {rank})
        self.seen: dict[int, tuple[str, float]] = {}  # peer -> (last heartbeat, when it changed)
        self.gone: dict[int, PeerFailure] = {}  # peers that left, died or went silent
        self.blocked: tuple[int, int, float] | None = None  # (frame id, line, since) of the main thread

    # ---------------------------------------------------------------- store
    def beat(self) -> None:
        self.seq += 1
        self.store.set(f"hb/{self.rank}", f"{self.seq}|{os.getpid()}|{self.host}|{_State.op}")

    def read(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    # ---------------------------------------------------------------- judging
    def check_peers(self, now: float) -> PeerFailure | None:
        published = self.read("failed")
        if published is not None:
            return _published(published)
        for peer in self.peers:
            self.look_at(peer, now)
        return self.check_gone(now)

    def look_at(self, peer: int, now: float) -> None:
        """Note whether ``peer`` is gone: exited, died or silent."""
        beat = self.read(f"hb/{peer}")
        if beat is None:
            return  # not started yet: the rendezvous' own timeout covers a rank that never comes
        _, pid, host, op = [*beat.split("|", 3), "", "", ""][:4]
        # Liveness first, the exit mark after: a peer that marks its exit and ends between the two reads is
        # then read as exited, never as died.
        dead = host == self.host and pid.isdigit() and not _alive(int(pid))
        exited = self.read(f"exit/{peer}")
        last, since = self.seen.get(peer, ("", now))
        if beat != last:
            self.seen[peer] = (beat, now)
            since = now
        n = self.world_size
        if exited is not None:
            self.gone[peer] = PeerFailure(rank=peer, how="exited",
                                          detail=f"rank {peer} of {n} exited ({exited}; its last operation: {op})")
        elif dead:
            self.gone[peer] = PeerFailure(rank=peer, how="died", detail=(
                f"rank {peer} of {n} died (process {pid} is gone, no exit mark) while in {op}"))
        elif now - since > self.settings.dead_s:
            self.gone[peer] = PeerFailure(rank=peer, how="silent", detail=(
                f"rank {peer} of {n} stopped answering (no heartbeat for {now - since:.0f} s, no exit: killed "
                f"or hung) while in {op}"))
        elif self.gone.get(peer) is not None and self.gone[peer].how == "silent":
            del self.gone[peer]  # its heartbeat moves again: it was only slow

    def note_main_thread(self, now: float) -> None:
        frame = _main_frame()
        key = (id(frame), frame.f_lineno if frame is not None else -1)
        if self.blocked is None or self.blocked[:2] != key:
            self.blocked = (*key, now)

    def check_gone(self, now: float) -> PeerFailure | None:
        """A peer is gone: fail only when this rank waits for it (its collective failed, or it is stuck)."""
        if not self.gone:
            return None
        first = min(self.gone.values(), key=lambda f: _TELLING.get(f.how, 0))  # the likeliest cause first
        others = [f.detail for f in self.gone.values() if f is not first]
        detail = "; ".join([first.detail, *others])
        if _State.explaining is not None:
            return PeerFailure(rank=first.rank, how=first.how, detail=f"{detail}, and this rank's collective failed")
        waited = now - self.blocked[2] if self.blocked is not None else 0.0
        if waited < self.settings.stuck_s:
            return None
        return PeerFailure(rank=first.rank, how=first.how, detail=f"{detail}, and this rank has waited {waited:.0f} s")

    def judge(self) -> PeerFailure | None:
        now = time.monotonic()
        self.note_main_thread(now)
        try:
            return self.check_peers(now)
        except (RuntimeError, ValueError, OSError) as exc:  # the store (rank 0's) is gone
            if self.rank == 0 or self.stop_event.is_set():
                return None
            self.gone.setdefault(0, PeerFailure(rank=0, how="store", detail=(
                f"rank 0 (the host of the job's store) is gone ({str(exc)[:120]})")))
            return self.check_gone(now)

    def run(self) -> None:
        parent = multiprocessing.parent_process()
        while not self.stop_event.is_set():
            self.wake.wait(self.settings.interval_s)
            self.wake.clear()
            if self.stop_event.is_set() or _State.exiting:
                return
            try:
                self.beat()
            except (RuntimeError, ValueError, OSError):
                pass  # judged below (the store is gone)
            verdict = self.judge()
            if verdict is None and parent is not None and not parent.is_alive():
                verdict = PeerFailure(rank=None, how="parent",
                                      detail=f"the process that started this rank (pid {parent.pid}) is gone")
            if verdict is not None and not self.stop_event.is_set():
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
    """Abort every process group (NCCL: the kernels waiting for a dead peer return), in a thread of its own:
    an abort can itself wait on a broken communicator."""
    def abort() -> None:
        try:
            if dist.is_available() and dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
        except (RuntimeError, ValueError, AttributeError) as exc:
            log.debug("peer watch: aborting the process groups: %s", exc)

    threading.Thread(target=abort, name="bagua-peer-abort", daemon=True).start()


def _publish(watch: _Watch, line: str) -> None:
    """Make ``line`` the job's failure unless another rank published one first."""
    try:
        if int(watch.store.add("failed_count", 1)) == 1:
            watch.store.set("failed", line)
    except (RuntimeError, ValueError, OSError) as exc:
        log.debug("peer watch: could not publish the failure: %s", exc)  # the others find out by themselves


def _fail(verdict: PeerFailure, watch: _Watch | None) -> None:
    """The policy after a verdict: say it, abort the groups, stop the main thread, end the process."""
    rank = watch.rank if watch is not None else -1
    explaining = _State.explaining  # the main thread waits in explain(): it raises the verdict itself
    where = explaining or _where(_main_frame())
    message = (f"bagua_lightning: {verdict.detail}; this rank ({rank}) was in {_State.op} at {where}; "
               "stopping this rank")
    _State.peer, _State.verdict = verdict, message
    if watch is not None:
        _publish(watch, verdict.detail)
    print(message, file=sys.stderr, flush=True)
    _abort_groups()
    main = threading.main_thread()
    if main.ident is not None and main.is_alive() and explaining is None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main.ident), ctypes.py_object(PeerFailedError))
    grace = watch.settings.exit_grace_s if watch is not None else 8.0
    why = _await_main_thread(main, grace)
    if why is not None:
        print(f"{message} ({why}: exiting)", file=sys.stderr, flush=True)
        os._exit(1)


_NATIVE_BLOCK_S = 1.0  # seconds: a main thread that ran no bytecode for this long after the verdict is in C/C++


def _await_main_thread(main: threading.Thread, grace_s: float) -> str | None:
    """Wait for the main thread to end (it raises :class:`PeerFailedError`); why it did not, if it did not.

    A thread blocked in C or C++ (a Gloo wait for the failed peer, a CUDA synchronisation) runs no bytecode,
    so it never sees the exception: its frame stays where it was. Waiting longer for it helps nobody.
    """
    deadline = time.monotonic() + grace_s
    frame = _main_frame()
    last, since = (id(frame), frame.f_lasti if frame is not None else -1), time.monotonic()
    while main.is_alive():
        now = time.monotonic()
        if now >= deadline:
            return f"the main thread did not stop within {grace_s:.0f} s"
        frame = _main_frame()
        here = (id(frame), frame.f_lasti if frame is not None else -1)
        if here != last or _State.explaining is not None:
            last, since = here, now
        elif now - since >= _NATIVE_BLOCK_S:
            return f"the main thread is blocked outside Python, at {_where(frame)}"
        time.sleep(0.05)
    return None


_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "abort",
                "timed out", "Timeout", "DistBackendError", "DistNetworkError")


def _peer_caused(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the error a collective raises when a peer goes away."""
    if isinstance(exc, PeerFailedError) or (hasattr(dist, "DistError") and isinstance(exc, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_ERRORS)


def explain(exc: BaseException) -> BaseException:
    """``exc`` from a collective, or a :class:`PeerFailedError` naming the peer that caused it.

    A collective fails as soon as a peer's connection closes, before the watch has judged: for such an error
    the watch judges at once (a gone peer then fails this rank) and, where no peer is known gone yet, this
    waits up to the time a silent peer takes to be noticed for the verdict that names it.
    """
    watch = _State.watch
    if watch is None or isinstance(exc, PeerFailedError) or not _peer_caused(exc):
        return exc
    frames = traceback.extract_tb(exc.__traceback__)
    _State.explaining = f"{frames[-1].name} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" \
        if frames else "a collective"
    try:
        watch.wake.set()
        deadline = time.monotonic() + watch.settings.dead_s + 2 * watch.settings.interval_s
        while _State.verdict is None and watch.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        _State.explaining = None
    return PeerFailedError(_State.verdict) if _State.verdict is not None else exc


def raise_named(exc: RuntimeError) -> NoReturn:
    """Re-raise ``exc`` from a collective, as a :class:`PeerFailedError` naming the peer that caused it.

    Use in ``except RuntimeError as exc: peer_watch.raise_named(exc)`` around code that communicates.
    """
    named = explain(exc)
    if named is exc:
        raise exc
    raise named from exc


def report_failure(exc: BaseException | None, tb: TracebackType | None = None) -> None:
    """This rank is ending with ``exc``: publish it, so that the other ranks stop at once instead of waiting
    for this process to end (its interpreter's exit can take seconds, its connections stay open till then).

    An error a failed peer caused is not this rank's failure: then wait for the watch's verdict instead
    (it names the peer, on this rank's stderr).
    """
    watch = _State.watch
    if watch is None or exc is None or isinstance(exc, (SystemExit, KeyboardInterrupt)) or _State.self_failed:
        return
    if _State.verdict is not None or isinstance(explain(exc), PeerFailedError):
        return
    frames = traceback.extract_tb(tb or exc.__traceback__)
    where = f" in {frames[-1].name} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    line = (f"rank {watch.rank} of {watch.world_size} failed with {type(exc).__name__}: {str(exc)[:200]}"
            f"{where} while in {_State.op}")
    _State.self_failed = _State.exiting = True  # this rank goes down by itself: stop judging the others
    _publish(watch, line)


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    report_failure(exc, tb)
    _previous_excepthook(kind, exc, tb)


_previous_excepthook = sys.excepthook


def _finalizer() -> None:
    # Runs inside multiprocessing's exit function, which the child calls while its target's exception is
    # still being handled: the one place such a rank's exception can be seen. A child started by fork ends
    # with os._exit afterwards (no atexit): its exit mark is written here too.
    report_failure(sys.exc_info()[1])
    leave("its multiprocessing target returned")


def leave(how: str = "at interpreter exit") -> None:
    """This rank leaves the job on purpose: stop the watch and write its exit mark (idempotent).

    Args:
        how: said in the exit mark (the peers name it if they still needed this rank).
    """
    watch, _State.watch = _State.watch, None
    _State.exiting = True
    if watch is None:
        return
    # Stop the thread before the interpreter tears down: it must not sit in a store call of its own then.
    watch.stop_event.set()
    watch.wake.set()
    if watch is not threading.current_thread():
        watch.join(timeout=2 * watch.settings.interval_s)
    if _State.verdict is None:
        try:
            watch.store.set(f"exit/{watch.rank}", how)
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
        atexit.register(leave)  # registered last: runs before the other exit handlers
        _State.hooks_installed = True
    _State.verdict, _State.peer, _State.exiting, _State.self_failed = None, None, False, False
    _State.op = "training"
    watch = _Watch(_client(store), rank, world_size, settings or WatchSettings.from_env())
    watch.beat()
    _State.watch = watch
    watch.start()
    return True


def stop() -> None:
    """The process group is being destroyed on purpose: this rank leaves the job (:func:`leave`)."""
    leave("destroyed its process group")

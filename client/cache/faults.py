"""Outage handling: warn once per outage, stop hammering what is down, resume when it answers again.

Two breakers share one back-off policy:

* :class:`NodeBreakers`, inside a :class:`~.store.RedisStore`: one back-off per Redis node (and one for
  connecting at all). A node that fails is skipped, without any network call, until its next try; the keys of
  the other nodes keep being read and written. It logs one warning when the store's outage starts (the first
  node that fails) and one info line when every node answers again.
* :class:`OutageTracker`, inside a :class:`~.loader.CacheLoader` over a store that does not isolate its nodes
  (a user's :class:`~.store.Store`): one back-off for the whole store.

Each process backs off on its own (a DataLoader worker too), but an outage is reported once for a training
process and its DataLoader workers together (:class:`SharedReport`): not once per worker and epoch. Only what
proves a node ends its outage: its client port answering, never its read port (:mod:`.nodes`), so a process
squatting a dead node's read port cannot make one outage look like many. How often calls failed meanwhile is
counted, not logged: the loader's :class:`~.loader.CacheStats` (``errors``, ``write_errors``) and ``outages``
here.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.context
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ...core.tls_trust import explain_untrusted

log = logging.getLogger("bagua_lightning.client.cache")
_quiet = [0]  # > 0: inside quiet_outages()


@contextlib.contextmanager
def quiet_outages() -> Iterator[None]:
    """Failures met inside are logged at debug level, not reported as an outage: for the flush at exit, whose
    entries are simply not cached when their store is gone (nothing should print after a job's, or a test
    session's, last line)."""
    _quiet[0] += 1
    try:
        yield
    finally:
        _quiet[0] -= 1


@dataclass(kw_only=True)
class OutagePolicy:
    """How the cache backs off while its store (or one of its nodes) is unreachable.

    Attributes:
        retry_initial_s: first wait, in seconds, before a failed node (or store) is tried again.
        retry_max_s: longest wait between tries, in seconds (the wait doubles per failed try).
    """

    retry_initial_s: float = 0.2
    retry_max_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError(
                f"retry_initial_s={self.retry_initial_s}, retry_max_s={self.retry_max_s}: need 0 < initial <= max."
            )


class _Backoff:
    """When a failing thing may be tried again: the wait doubles per failed try, up to the policy's maximum."""

    __slots__ = ("next_try", "since", "wait")

    def __init__(self, now: float, policy: OutagePolicy) -> None:
        self.since = now
        self.wait = policy.retry_initial_s
        self.next_try = now + self.wait

    def again(self, now: float, policy: OutagePolicy) -> None:
        self.wait = min(self.wait * 2, policy.retry_max_s)
        self.next_try = now + self.wait


class SharedReport:
    """Whether the current outage of one store has been reported, shared by the process that made the store and
    its DataLoader workers (inherited through ``fork``, handed over when a worker is spawned), so that the
    workers of every epoch report one outage once, and the first process that sees the store answer again
    reports its end. A plain ``pickle`` of the store (not a spawn) starts a report of its own.

    It also keeps when any of these processes last met a failure: a process that never met the outage (a later
    epoch's worker) ends it when its calls succeed and nobody has failed for a while (``quiet_for``).
    Claiming is a read then a write of shared memory, without a lock: two workers failing within the same
    microsecond may both report.
    """

    def __init__(self) -> None:
        self._state = multiprocessing.RawArray("d", 2)  # [reported and not ended (0/1), last failure (monotonic)]

    def __getstate__(self) -> dict[str, object]:
        spawning = multiprocessing.context.get_spawning_popen() is not None
        return {"_state": self._state if spawning else None}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._state = state["_state"] or multiprocessing.RawArray("d", 2)

    @property
    def open(self) -> bool:
        """An outage is reported and its end is not."""
        return bool(self._state[0])

    def failed(self, now: float) -> None:
        """Some process of the family met a failure at ``now`` (``time.monotonic()``, one clock machine-wide)."""
        self._state[1] = now

    def claim(self) -> bool:
        """True when no other process has reported the outage (this one reports it now)."""
        if self._state[0]:
            return False
        self._state[0] = 1
        return True

    def release(self) -> bool:
        """True when an outage was reported (this process reports its end now)."""
        if not self._state[0]:
            return False
        self._state[0] = 0
        return True

    def quiet_for(self, seconds: float) -> bool:
        """No process has met a failure for ``seconds``."""
        return time.monotonic() - self._state[1] > seconds


class NodeBreakers:
    """Per-node circuit breakers of one store, in one process.

    ``down`` maps the name of each failing node (``"host:port"``, or :data:`CONNECT` for setting up the
    connection) to its back-off; it is empty while everything answers, which is what the read path checks.
    One outage of the store lasts from the first node that fails until no node is down any more: one warning
    at its start, one info line at its end, for the process that made the store and its DataLoader workers
    together (``report``). ``hint`` ends the warning (what starts the store's servers).
    """

    def __init__(self, what: str, policy: OutagePolicy | None = None, hint: str = "") -> None:
        self.what = what
        self.policy = policy or OutagePolicy()
        self.hint = hint
        self.report = SharedReport()
        self.down: dict[str, _Backoff] = {}
        self.outages = 0
        self._since = 0.0

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()  # a pickled store (spawned worker) starts with every node presumed up
        state["down"] = {}
        return state

    def available(self, name: str) -> bool:
        """Whether to try node ``name`` now (up, or due for its next try)."""
        state = self.down.get(name)
        return state is None or time.monotonic() >= state.next_try

    def failure(self, name: str, exc: BaseException) -> None:
        """Node ``name`` failed: skip it until its next try."""
        now = time.monotonic()
        self.report.failed(now)
        state = self.down.get(name)
        if state is not None:
            state.again(now, self.policy)
            return
        exc = explain_untrusted(exc, None if name == CONNECT else name) or exc  # a server not ours: say so
        if not self.down:
            self.outages += 1
            self._since = now
            where = "" if name == CONNECT else f" at {name}"
            if not _quiet[0] and self.report.claim():
                log.warning("%s is unavailable%s (%s: %s); the keys it serves load from the source until it is "
                            "back%s (reported once per outage for this process and its DataLoader workers; "
                            "further failures are logged at debug level)",
                            self.what, where, type(exc).__name__, exc, self.hint)
            else:
                log.debug("%s is unavailable%s (%s: %s); already reported", self.what, where, type(exc).__name__, exc)
        else:
            log.debug("%s: %s is unavailable too (%s: %s)", self.what, name, type(exc).__name__, exc)
        self.down[name] = _Backoff(now, self.policy)

    def success(self, name: str) -> None:
        """Node ``name`` answered."""
        if self.down.pop(name, None) is not None:
            self._ended(name)

    def account(self, tried: list[str], failed: list[tuple[str, BaseException]]) -> BaseException | None:
        """After a call to the nodes ``tried``: the ``failed`` ones (name, error) fail, the others answered (only
        looked at while some node is down: otherwise the read path pays one read of shared memory, whether another
        process reported an outage that is now over). Returns the first error, or None."""
        for name, exc in failed:
            self.failure(name, exc)
        if self.down:
            bad = {name for name, _ in failed}
            for name in tried:
                if name not in bad:
                    self.success(name)
        elif tried and self.report.open and self.report.quiet_for(2 * self.policy.retry_max_s):
            self._ended(tried[0])  # another process (an earlier epoch's worker) reported the outage; it is over
        return failed[0][1] if failed else None

    def keep(self, names: set[str]) -> None:
        """Forget nodes that no longer serve anything (a failed master replaced by its promoted replica)."""
        for name in [n for n in self.down if n not in names and n != CONNECT]:
            del self.down[name]
            self._ended(name)

    def _ended(self, name: str) -> None:
        if not self.down and self.report.release():
            after = f" after {time.monotonic() - self._since:.1f} s" if self._since else ""
            log.info("%s is back%s (%s answers again); caching resumes", self.what, after, name)
        if not self.down:
            self._since = 0.0

    @property
    def in_outage(self) -> bool:
        return bool(self.down)


CONNECT = "connect"  # the breaker of setting up a store's connection (topology probe, slot map)


class OutageTracker:
    """A per-process circuit breaker around a whole store (one that does not isolate its nodes itself).

    While the store fails, samples come from the source; the store is tried again after a growing wait,
    so an outage costs one failed call per wait instead of one per batch. One warning is logged when an
    outage starts and one info line when the store answers again, for the process that made it and its
    DataLoader workers together (:class:`SharedReport`).
    """

    def __init__(self, what: str, policy: OutagePolicy | None = None) -> None:
        self.what = what
        self.policy = policy or OutagePolicy()
        self.report = SharedReport()
        self.in_outage = False
        self.outages = 0
        self._since = 0.0
        self._next_try = 0.0
        self._wait = self.policy.retry_initial_s

    def available(self) -> bool:
        """Whether to try the store now."""
        return not self.in_outage or time.monotonic() >= self._next_try

    def failure(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.report.failed(now)
        if not self.in_outage:
            self.in_outage = True
            self.outages += 1
            self._since = now
            self._wait = self.policy.retry_initial_s
            exc = explain_untrusted(exc) or exc
            if not _quiet[0] and self.report.claim():
                log.warning("%s is unavailable (%s: %s); loading samples from the source until it is back "
                            "(reported once per outage for this process and its DataLoader workers)",
                            self.what, type(exc).__name__, exc)
            else:
                log.debug("%s is unavailable (%s: %s); already reported", self.what, type(exc).__name__, exc)
        else:
            self._wait = min(self._wait * 2, self.policy.retry_max_s)
        self._next_try = now + self._wait

    def success(self) -> None:
        if self.in_outage:
            self.in_outage = False
            if self.report.release():
                log.info("%s is back after %.1f s; caching resumes", self.what, time.monotonic() - self._since)
        elif self.report.open and self.report.quiet_for(2 * self.policy.retry_max_s) and self.report.release():
            log.info("%s is back; caching resumes", self.what)  # reported by another process (an earlier worker)

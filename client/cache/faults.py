"""Outage handling: warn once per outage, stop hammering what is down, resume when it answers again.

Two breakers share one back-off policy:

* :class:`NodeBreakers`, inside a :class:`~.store.RedisStore`: one back-off per Redis node (and one for
  connecting at all). A node that fails is skipped, without any network call, until its next try; the keys of
  the other nodes keep being read and written. It logs one warning when the store's outage starts (the first
  node that fails) and one info line when every node answers again.
* :class:`OutageTracker`, inside a :class:`~.loader.CacheLoader` over a store that does not isolate its nodes
  (a user's :class:`~.store.Store`): one back-off for the whole store.

Both are per process: every DataLoader worker backs off (and warns) on its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ...core.tls_trust import explain_untrusted

log = logging.getLogger("bagua_lightning.client.cache")


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


class NodeBreakers:
    """Per-node circuit breakers of one store, in one process.

    ``down`` maps the name of each failing node (``"host:port"``, or :data:`CONNECT` for setting up the
    connection) to its back-off; it is empty while everything answers, which is what the read path checks.
    One outage of the store lasts from the first node that fails until no node is down any more: one warning
    at its start, one info line at its end.
    """

    def __init__(self, what: str, policy: OutagePolicy | None = None) -> None:
        self.what = what
        self.policy = policy or OutagePolicy()
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
        state = self.down.get(name)
        if state is not None:
            state.again(now, self.policy)
            return
        exc = explain_untrusted(exc, None if name == CONNECT else name) or exc  # a server not ours: say so
        if not self.down:
            self.outages += 1
            self._since = now
            where = "" if name == CONNECT else f" at {name}"
            log.warning("%s is unavailable%s (%s: %s); the keys it serves load from the source until it is back "
                        "(further failures in this outage are logged at debug level)",
                        self.what, where, type(exc).__name__, exc)
        else:
            log.debug("%s: %s is unavailable too (%s: %s)", self.what, name, type(exc).__name__, exc)
        self.down[name] = _Backoff(now, self.policy)

    def success(self, name: str) -> None:
        """Node ``name`` answered."""
        if self.down.pop(name, None) is not None:
            self._ended(name)

    def account(self, tried: list[str], failed: list[tuple[str, BaseException]]) -> BaseException | None:
        """After a call to the nodes ``tried``: the ``failed`` ones (name, error) fail, the others answered (only
        looked at while some node is down: the read path pays nothing for it otherwise). Returns the first
        error, or None."""
        for name, exc in failed:
            self.failure(name, exc)
        if self.down:
            bad = {name for name, _ in failed}
            for name in tried:
                if name not in bad:
                    self.success(name)
        return failed[0][1] if failed else None

    def keep(self, names: set[str]) -> None:
        """Forget nodes that no longer serve anything (a failed master replaced by its promoted replica)."""
        for name in [n for n in self.down if n not in names and n != CONNECT]:
            del self.down[name]
            self._ended(name)

    def _ended(self, name: str) -> None:
        if not self.down:
            log.info("%s is back after %.1f s (%s answers again); caching resumes", self.what,
                     time.monotonic() - self._since, name)

    @property
    def in_outage(self) -> bool:
        return bool(self.down)


CONNECT = "connect"  # the breaker of setting up a store's connection (topology probe, slot map)


class OutageTracker:
    """A per-process circuit breaker around a whole store (one that does not isolate its nodes itself).

    While the store fails, samples come from the source; the store is tried again after a growing wait,
    so an outage costs one failed call per wait instead of one per batch. One warning is logged when an
    outage starts and one info line when the store answers again.
    """

    def __init__(self, what: str, policy: OutagePolicy | None = None) -> None:
        self.what = what
        self.policy = policy or OutagePolicy()
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
        if not self.in_outage:
            self.in_outage = True
            self.outages += 1
            self._since = now
            self._wait = self.policy.retry_initial_s
            exc = explain_untrusted(exc) or exc
            log.warning("%s is unavailable (%s: %s); loading samples from the source until it is back",
                        self.what, type(exc).__name__, exc)
        else:
            self._wait = min(self._wait * 2, self.policy.retry_max_s)
        self._next_try = now + self._wait

    def success(self) -> None:
        if self.in_outage:
            self.in_outage = False
            log.info("%s is back after %.1f s; caching resumes", self.what, time.monotonic() - self._since)

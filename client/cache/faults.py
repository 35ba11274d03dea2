"""Outage handling: warn once per outage, stop hammering a dead store, resume when it answers again."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("bagua_lightning.client.cache")


@dataclass(kw_only=True)
class OutagePolicy:
    """How the cache backs off while its store is unreachable.

    Attributes:
        retry_initial_s: first wait, in seconds, before the store is tried again after a failure.
        retry_max_s: longest wait between tries, in seconds (the wait doubles per failed try).
    """

    retry_initial_s: float = 0.2
    retry_max_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError(
                f"retry_initial_s={self.retry_initial_s}, retry_max_s={self.retry_max_s}: need 0 < initial <= max."
            )


class OutageTracker:
    """A per-process circuit breaker around the store.

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
            log.warning("%s is unavailable (%s: %s); loading samples from the source until it is back",
                        self.what, type(exc).__name__, exc)
        else:
            self._wait = min(self._wait * 2, self.policy.retry_max_s)
        self._next_try = now + self._wait

    def success(self) -> None:
        if self.in_outage:
            self.in_outage = False
            log.info("%s is back after %.1f s; caching resumes", self.what, time.monotonic() - self._since)

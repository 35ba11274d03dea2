"""One reusable retry helper: exponential backoff with jitter, a bounded number of tries and a time budget.

Shaped like redis-py's ``Retry(backoff, retries, supported_errors)``: which
errors are transient is one predicate, units are in names.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

DEFAULT_BASE_S = 0.05  # seconds before the first retry
DEFAULT_CAP_S = 1.0  # seconds: the longest single wait


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """Wait ``min(cap_s, base_s * 2**failures)``, scaled by a random factor in [0.5, 1] ("equal jitter")."""

    base_s: float = DEFAULT_BASE_S
    cap_s: float = DEFAULT_CAP_S

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"need 0 <= base_s <= cap_s, got base_s={self.base_s}, cap_s={self.cap_s}")

    def compute(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (>= 1)."""
        wait = min(self.cap_s, self.base_s * 2 ** max(0, failures - 1))
        return wait * (0.5 + random.random() / 2)


@dataclass(frozen=True, slots=True)
class Retry:
    """Call a function again while it fails with a transient error.

    Attributes:
        backoff: how long to wait between tries.
        retries: retries after the first try (0: try once).
        retryable: True for errors worth retrying (e.g. gRPC UNAVAILABLE).
        budget_s: give up once this many seconds have passed since the first try,
            whatever ``retries`` says (None: no time budget).
    """

    backoff: ExponentialBackoff
    retries: int
    retryable: Callable[[BaseException], bool]
    budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")

    def call(self, func: Callable[[], T], on_retry: Callable[[BaseException, int, float], None] | None = None) -> T:
        """Run ``func``; on a retryable error wait and try again. The last error propagates."""
        start = time.monotonic()
        failures = 0
        while True:
            try:
                return func()
            except BaseException as exc:
                failures += 1
                if failures > self.retries or not self.retryable(exc):
                    raise
                wait = self.backoff.compute(failures)
                if self.budget_s is not None and time.monotonic() - start + wait > self.budget_s:
                    raise
                if on_retry is not None:
                    on_retry(exc, failures, wait)
                time.sleep(wait)

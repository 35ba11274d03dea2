"""Best plans kept in several stores at once, so that losing any one of them loses no plan.

``bagua-lightning autotune serve --state redis://... --state DIR`` keeps every plan in the
deployment's Redis (which runs without persistence: a restarted node comes back empty) and in a
directory on the service's disk (which a restarted service reads again). Every save goes to
each store; a load takes the newest copy and writes it back to a store that lacks it or holds an
older one, so a Redis node restarted empty is refilled by the next registration of each shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .persistence import (
    REDIS_SCHEMES,
    DirectoryPlanStore,
    Location,
    PlanStore,
    RedisPlanStore,
    StoredPlan,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class MirroredPlanStore:
    """Every operation on each of ``stores``.

    A save or delete is attempted on every store and raises the first failure afterwards (the
    store counts as failing, and the plan is still in the stores that took it). A load fails
    only when every store fails.
    """

    def __init__(self, stores: Sequence[PlanStore]) -> None:
        if len(stores) < 2:
            raise ValueError(f"a mirrored store needs at least two stores, got {len(stores)}")
        self.stores = tuple(stores)

    def _each(self, fn: Callable[[PlanStore], T | None]) -> tuple[list[T | None], list[Exception]]:
        results: list[T | None] = []
        errors: list[Exception] = []
        for store in self.stores:
            try:
                results.append(fn(store))
            except Exception as exc:  # the other stores still get the call
                results.append(None)
                errors.append(exc)
        return results, errors

    def load(self, key: str) -> StoredPlan | None:
        found, errors = self._each(lambda s: s.load(key))
        if len(errors) == len(self.stores):
            raise errors[0]
        copies = [c for c in found if c is not None]
        if not copies:
            return None
        newest = max(copies, key=lambda c: c.saved_at)
        for store, copy in zip(self.stores, found, strict=True):
            if copy is None or copy.saved_at < newest.saved_at:
                # Repair a store that lost the plan (a Redis node restarted empty) or missed a save.
                with contextlib.suppress(Exception):
                    store.save(key, newest)
                    logger.info("event=plan_repaired key=%s store=%r", key, store)
        return newest

    def save(self, key: str, stored: StoredPlan) -> None:
        if not stored.saved_at:  # one time for every copy: a load takes the newest by it
            stored = dataclasses.replace(stored, saved_at=time.time())
        self._raise_first(self._each(lambda s: s.save(key, stored))[1])

    def delete(self, key: str) -> bool:
        removed, errors = self._each(lambda s: s.delete(key))
        self._raise_first(errors)
        return any(removed)

    def keys(self, limit: int) -> list[str]:
        found, errors = self._each(lambda s: s.keys(limit))
        if len(errors) == len(self.stores):
            raise errors[0]
        merged: dict[str, None] = {}
        for keys in found:
            merged.update(dict.fromkeys(keys or ()))
        return list(merged)[:limit]

    def ping(self) -> None:
        self._raise_first(self._each(lambda s: s.ping())[1])

    def close(self) -> None:
        for store in self.stores:
            close: Any = getattr(store, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    @staticmethod
    def _raise_first(errors: list[Exception]) -> None:
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"MirroredPlanStore({', '.join(repr(s) for s in self.stores)})"


def open_store(location: Location | Sequence[Location] | None, *, timeout_s: float = 1.0) -> PlanStore | None:
    """A Redis store for ``redis://``, ``rediss://`` and ``unix://`` URLs, a directory store otherwise.

    Several locations make a :class:`MirroredPlanStore` that writes every plan to each (so a
    plan outlives the loss of any one of them). None, an empty string or an empty list keeps plans in
    memory only.
    """
    if location is None or isinstance(location, (str, os.PathLike)):
        locations = [] if location is None or str(location) == "" else [location]
    else:
        locations = [loc for loc in location if str(loc) != ""]
    stores: list[PlanStore] = []
    for loc in locations:
        text = str(loc)
        stores.append(RedisPlanStore(text, timeout_s=timeout_s) if text.startswith(REDIS_SCHEMES)
                      else DirectoryPlanStore(text))
    if not stores:
        return None
    if len(stores) == 1:
        return stores[0]
    return MirroredPlanStore(stores)

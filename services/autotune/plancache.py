"""The service's cache of plans encoded for the wire, counted in its memory budget.

Encoding a plan of many tensors costs far more than the rest of a call, and holds the GIL for
milliseconds that every other request would wait for: each issued plan is encoded once, with the
digest of its full layout, and responses carrying it are assembled from those bytes (:mod:`.wire`).

Entries are keyed by (job, model, version); the plan object is kept to check that an entry is still
that plan. Bounded: at most :data:`MAX_PER_MODEL` per model, :data:`MAX_ENTRIES` in all and
:data:`MAX_TENSORS` tensors in all, the least recently used going first. Each model's cached bytes
count in its session's footprint (the service's ``--max-memory`` budget): the service is told through
``account`` and may evict sessions in turn, whose encodings it drops here (:meth:`EncodedPlans.evicted`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from ...proto.plan import BucketPlan, plan_to_proto

MAX_ENTRIES = 1024  # encoded plans kept
MAX_TENSORS = 2_000_000  # tensors in all encoded plans kept (one tensor: ~50-1000 bytes)
MAX_PER_MODEL = 4  # the current, the best and the plans reports still name
ENTRY_BYTES = 256  # an entry's tuple, key, digest and bytes object headers

ModelKey = tuple[str, str]  # (job_id, model_name)
EntryKey = tuple[str, str, int]  # (job_id, model_name, plan version)


class EncodedPlan(NamedTuple):
    """One plan with its encoded ``Hyperparameters`` message and their digest."""

    plan: BucketPlan
    encoded: bytes
    digest: bytes


def digest_of(encoded: bytes) -> bytes:
    """The digest that identifies an encoded plan (the one a report's plan is compared by)."""
    return hashlib.blake2b(encoded, digest_size=16).digest()


def _tensor_count(plan: BucketPlan) -> int:
    return sum(len(b) for b in plan.buckets)


def _entry_bytes(entry: EncodedPlan) -> int:
    """Bytes one cached encoding holds (the plan itself is the session's, counted there)."""
    return ENTRY_BYTES + len(entry.encoded)


class EncodedPlans:
    """The encoded plans of held sessions; safe to call from many threads.

    Args:
        account: ``account(model, nbytes)`` counts ``nbytes`` of cached encodings in the session
            ``model``'s footprint (replacing the earlier count) and returns False when that session is
            not held (its encodings are then dropped). Called with this cache's lock held, so counts
            arrive in the order they were made; it may evict sessions, and :meth:`evicted` never waits
            for this lock, so there is no deadlock the other way round.
    """

    def __init__(self, account: Callable[[ModelKey, int], bool]) -> None:
        self._account = account
        self._entries: OrderedDict[EntryKey, EncodedPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._tensors = 0
        self._model_bytes: dict[ModelKey, int] = {}  # cached bytes per (job, model)
        self._dropped: list[ModelKey] = []  # evicted models whose encodings are still cached

    def entry(self, job_id: str, model_name: str, plan: BucketPlan) -> EncodedPlan:
        """``plan`` of the session (``job_id``, ``model_name``) encoded, from the cache or encoded now."""
        key = (job_id, model_name, plan.version)
        cached = self._entries.get(key)
        if cached is not None and cached.plan is plan:
            return cached
        encoded = plan_to_proto(plan).SerializeToString(deterministic=True)
        entry = EncodedPlan(plan, encoded, digest_of(encoded))
        model = (job_id, model_name)
        with self._lock:
            self._drop(key)
            self._entries[key] = entry
            self._tensors += _tensor_count(plan)
            self._model_bytes[model] = self._model_bytes.get(model, 0) + _entry_bytes(entry)
            changed = {model}
            mine = [k for k in self._entries if k[:2] == model]
            for k in mine[:max(0, len(mine) - MAX_PER_MODEL)]:  # its least recently used
                self._drop(k)
            while len(self._entries) > 1 and (len(self._entries) > MAX_ENTRIES or self._tensors > MAX_TENSORS):
                changed.add(next(iter(self._entries))[:2])
                self._drop(next(iter(self._entries)))
            for held in changed:
                if not self._account(held, self._model_bytes.get(held, 0)):
                    self._dropped.append(held)  # not held (evicted meanwhile): keep nothing of it
            self._drop_evicted()
        return entry

    def encoded(self, job_id: str, model_name: str, plan: BucketPlan) -> bytes:
        """``plan``'s encoded ``Hyperparameters`` message (see :meth:`entry`)."""
        return self.entry(job_id, model_name, plan).encoded

    def digest(self, job_id: str, model_name: str, plan: BucketPlan) -> bytes:
        """The digest of ``plan``'s encoding (see :meth:`entry` and :func:`digest_of`)."""
        return self.entry(job_id, model_name, plan).digest

    def evicted(self, model: ModelKey) -> None:
        """The service evicted ``model`` (its table lock held): drop its encodings now, or, while another
        thread (or this one, in :meth:`entry`) holds this cache's lock, when that one is done with it."""
        self._dropped.append(model)
        if self._lock.acquire(blocking=False):  # never wait: the service's lock is held
            try:
                self._drop_evicted()
            finally:
                self._lock.release()

    def cached_bytes(self) -> int:
        """Bytes of every encoded plan cached now (as counted in the memory budget)."""
        with self._lock:
            return sum(self._model_bytes.values())

    def items(self) -> list[tuple[EntryKey, EncodedPlan]]:
        """A snapshot of the entries, least recently cached first."""
        with self._lock:
            return list(self._entries.items())

    def _drop_evicted(self) -> None:
        """Lock held: drop the encodings of the models the service evicted."""
        while self._dropped:
            evicted = self._dropped.pop()
            for k in [k for k in self._entries if k[:2] == evicted]:
                self._drop(k)

    def _drop(self, key: EntryKey) -> None:
        """Lock held: forget one cached encoding."""
        old = self._entries.pop(key, None)
        if old is None:
            return
        self._tensors -= _tensor_count(old.plan)
        model = key[:2]
        left = self._model_bytes.get(model, 0) - _entry_bytes(old)
        if left > 0:
            self._model_bytes[model] = left
        else:
            self._model_bytes.pop(model, None)

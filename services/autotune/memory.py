"""Byte accounting of the service's model sessions, and which ones to evict when over budget.

The estimate is deterministic and O(1) per session (no tracemalloc, no walk over
objects): it counts what a session holds from numbers it already keeps — its
tensor declarations (name bytes and a fixed cost per tensor for the declaration
object, the name index and the plan encoded for the wire), the plans it
remembers (one reference per tensor plus one tuple per bucket) and its samples.
The constants were calibrated against the RSS growth of a service holding models
of 100,000 tensors (benchmarks/autotune_service_load.py); they err on the high side.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ResourceExhaustedError

if TYPE_CHECKING:
    from .session import ModelSession

# Bytes per declared tensor beyond its name: the TensorDeclaration (slots: 64 B), its entry in the name index
# (~100 B with the table's slack), its int objects, and its share of the plan encoded for the wire
# (upb message ~100 B + the cached responses that carry it).
TENSOR_BYTES = 400
NAME_COPIES = 3  # a name lives in the declaration's str, the encoded plan and a cached response
PLAN_TENSOR_BYTES = 8  # one tuple slot per tensor in each remembered plan
BUCKET_BYTES = 120  # one tuple (plus its header) per bucket in each remembered plan
SAMPLE_BYTES = 400  # one Sample with its means
BUCKET_TIMING_BYTES = 120  # one BucketTimingRecord in a sample
SESSION_BYTES = 16 * 1024  # the session object, its locks, tables and bounded caches when empty


def registration_bytes(tensors: int, name_bytes: int) -> int:
    """Bytes a fresh session of ``tensors`` tensors whose names total ``name_bytes`` bytes will hold."""
    return SESSION_BYTES + tensors * (TENSOR_BYTES + PLAN_TENSOR_BYTES) + NAME_COPIES * name_bytes


def session_bytes(session: ModelSession, name_bytes: int) -> int:
    """The estimated footprint of ``session`` now, its tensor names totalling ``name_bytes`` bytes.

    Cheap: from the counts the session keeps (its samples list is copied, at most ``max_samples``).
    """
    tensors = len(session.registration.tensors)
    buckets = max(1, len(session.current_plan.buckets))
    samples = len(session.samples)
    plans = session.plans_remembered + samples  # a sample keeps its plan alive
    return (registration_bytes(tensors, name_bytes)
            + plans * (tensors * PLAN_TENSOR_BYTES + buckets * BUCKET_BYTES)
            + samples * (SAMPLE_BYTES + buckets * BUCKET_TIMING_BYTES))


def format_bytes(n: int) -> str:
    """``1536 -> '1.5 KiB'`` (1024-based, as the ``--max-memory`` flag reads them)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def check_fits(model_name: str, needed: int, budget: int) -> None:
    """Refuse (RESOURCE_EXHAUSTED) a registration that alone needs more than the whole budget (0: none)."""
    if budget and needed > budget:
        raise ResourceExhaustedError(
            f"model {model_name[:80]!r} would hold about {format_bytes(needed)} ({needed} bytes), more than the "
            f"service's whole memory budget of {format_bytes(budget)}; raise --max-memory (autotune serve "
            "--max-memory 8GiB) or declare fewer tensors")


@dataclass(frozen=True, slots=True)
class Held:
    """One session as the budget sees it."""

    name: Hashable
    last_used: float
    nbytes: int


def choose_evictions(held: Iterable[Held], budget: int, keep: Hashable) -> list[Hashable]:
    """Names to evict, least recently used first, until the rest fit ``budget`` bytes (0: no budget).

    ``keep`` (the session just used) is never chosen: a registration that fits the budget alone
    always stays.
    """
    sessions = list(held)
    total = sum(h.nbytes for h in sessions)
    if not budget or total <= budget:
        return []
    chosen: list[Hashable] = []
    for h in sorted(sessions, key=lambda h: h.last_used):
        if total <= budget:
            break
        if h.name == keep:
            continue
        chosen.append(h.name)
        total -= h.nbytes
    return chosen


class MemoryAccount:
    """Accounted bytes per held session (updated by the service as sessions change), and evictions by bytes.

    Not thread-safe on its own: the service calls it under its table lock.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._bytes: dict[Hashable, int] = {}
        self._name_bytes: dict[Hashable, int] = {}
        self._cached: dict[Hashable, int] = {}  # bytes of the session's plans cached encoded by the servicer
        self.total = 0
        self.evicted_for_bytes = 0

    def update(self, name: Hashable, session: ModelSession, name_bytes: int | None = None) -> bool:
        """Re-measure ``session`` (``name_bytes``: its tensor names' total, given once at registration);
        True when the total is now over budget."""
        if name_bytes is not None:
            self._name_bytes[name] = name_bytes
        nbytes = session_bytes(session, self._name_bytes.get(name, 0)) + self._cached.get(name, 0)
        self.total += nbytes - self._bytes.get(name, 0)
        self._bytes[name] = nbytes
        return bool(self.budget) and self.total > self.budget

    def set_cached(self, name: Hashable, nbytes: int) -> bool:
        """Count ``nbytes`` of encoded plans cached for the held session ``name`` (replacing the earlier
        count); True when the total is now over budget."""
        delta = nbytes - self._cached.get(name, 0)
        self._cached[name] = nbytes
        self._bytes[name] = self._bytes.get(name, 0) + delta
        self.total += delta
        return bool(self.budget) and self.total > self.budget

    def forget(self, name: Hashable) -> None:
        self.total -= self._bytes.pop(name, 0)
        self._name_bytes.pop(name, None)
        self._cached.pop(name, None)

    def over_budget(self, sessions: dict[Any, ModelSession], keep: Hashable) -> list[Any]:
        """Names of ``sessions`` to evict (least recently used first) to get back under the budget."""
        return choose_evictions((Held(n, s.last_used, self._bytes.get(n, 0)) for n, s in sessions.items()),
                                self.budget, keep)

    @property
    def cached_total(self) -> int:
        """Bytes of encoded plans counted (:meth:`set_cached`) for every held session."""
        return sum(self._cached.values())

    def bytes_of(self, name: Hashable) -> int:
        return self._bytes.get(name, 0)

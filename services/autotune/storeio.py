"""The service's I/O to the plan store and the sample log, kept off every lock and every request's path.

Loads (at registration) run on a small pool with the store's deadline, so a hung
store delays only that registration, by at most ``timeout_s``. Saves and
sample-log records are queued (saves coalesced per key, records in a bounded
queue) and written by one writer thread. Every failure is counted; while the
latest store operation or sample-log write failed, :meth:`StoreIO.problem`
names it and the server's health turns NOT_SERVING.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .persistence import PlanStore, StoredPlan
from .samplelog import SampleLog

logger = logging.getLogger(__name__)

MAX_QUEUED_RECORDS = 10_000  # sample-log records waiting for the writer; older ones are dropped beyond
MAX_QUEUED_SAVES = 4096  # distinct keys waiting to be saved


class StoreIO:
    """Deadlined loads, queued saves and sample-log writes, with failure counters.

    Args:
        store: the plan store (None: plans are not persisted).
        sample_log: the sample log (None: samples are not logged).
        timeout_s: deadline of one store operation, in seconds.
    """

    def __init__(self, store: PlanStore | None, sample_log: SampleLog | None, *, timeout_s: float = 1.0) -> None:
        self.store = store
        self.sample_log = sample_log
        self.timeout_s = timeout_s
        self.store_errors = 0
        self.store_failing = False
        self.dropped = 0
        self._loads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="autotune-store")
        self._cv = threading.Condition()
        # key -> plan to save, or None: delete the key (in queue order, so a forget is not undone by an older save)
        self._saves: collections.OrderedDict[str, StoredPlan | None] = collections.OrderedDict()
        self._records: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._busy = False
        self._closed = False
        self._writer = threading.Thread(target=self._run, name="autotune-writer", daemon=True)
        self._writer.start()

    # -- health --------------------------------------------------------------------------------------
    @property
    def sample_log_errors(self) -> int:
        return self.sample_log.errors if self.sample_log is not None else 0

    def problem(self) -> str | None:
        """Why the service should not be SERVING now (None: store and sample log work)."""
        if self.store_failing:
            return f"the plan store {self.store!r} is failing"
        if self.sample_log is not None and self.sample_log.failing:
            return f"the sample log under {self.sample_log.directory} cannot be written"
        return None

    def _result(self, ok: bool, what: str, exc: BaseException | None = None) -> None:
        if ok:
            if self.store_failing:
                logger.info("event=store_recovered store=%r", self.store)
            self.store_failing = False
            return
        self.store_errors += 1
        if not self.store_failing:
            logger.warning("event=store_failed store=%r op=%s error=%r", self.store, what, exc)
        self.store_failing = True

    def _deadlined(self, what: str, fn: Any, *args: Any) -> Any:
        future = self._loads.submit(fn, *args)
        try:
            value = future.result(timeout=self.timeout_s)
        except FutureTimeout as exc:
            self._result(False, what, TimeoutError(f"no answer within {self.timeout_s} s"))
            raise TimeoutError(what) from exc
        except Exception as exc:
            self._result(False, what, exc)
            raise
        self._result(True, what)
        return value

    def ping(self) -> None:
        """Probe the store (and retry a failing sample log's directory); updates :meth:`problem`."""
        if self.store is not None:
            try:
                self._deadlined("ping", self.store.ping)
            except Exception:  # counted and logged by _deadlined
                pass
        if self.sample_log is not None and self.sample_log.failing:
            self.sample_log.probe()

    # -- operations ----------------------------------------------------------------------------------
    def load(self, key: str) -> StoredPlan | None:
        """The stored plan of ``key``; None when there is none or the store fails (counted)."""
        if self.store is None:
            return None
        try:
            stored: StoredPlan | None = self._deadlined("load", self.store.load, key)
        except Exception:
            return None
        return stored

    def keys(self, limit: int) -> list[str]:
        """At most ``limit`` keys of the store (empty when there is none); raises when it fails (counted)."""
        if self.store is None:
            return []
        keys: list[str] = self._deadlined("keys", self.store.keys, limit)
        return keys

    def delete(self, key: str) -> None:
        """Queue the removal of ``key`` (it replaces a queued save of that key)."""
        self.save(key, None)

    def save(self, key: str, stored: StoredPlan | None) -> None:
        """Queue a save (a newer plan for the same key replaces a queued one); None queues a delete."""
        if self.store is None:
            return
        with self._cv:
            self._saves[key] = stored
            self._saves.move_to_end(key)
            while len(self._saves) > MAX_QUEUED_SAVES:
                self._saves.popitem(last=False)
                self.dropped += 1
            self._cv.notify()

    def log(self, model_name: str, record: dict[str, Any]) -> None:
        """Queue a sample-log record."""
        if self.sample_log is None:
            return
        with self._cv:
            self._records.append((model_name, record))
            while len(self._records) > MAX_QUEUED_RECORDS:
                self._records.popleft()
                self.dropped += 1
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                while not self._saves and not self._records and not self._closed:
                    self._cv.wait()
                if self._closed and not self._saves and not self._records:
                    return
                save = self._saves.popitem(last=False) if self._saves else None
                record = self._records.popleft() if self._records else None
                self._busy = True
            if save is not None and self.store is not None:
                key, stored = save
                try:
                    if stored is None:
                        self._deadlined("delete", self.store.delete, key)
                    else:
                        self._deadlined("save", self.store.save, key, stored)
                except Exception:  # counted and logged by _deadlined
                    pass
            if record is not None and self.sample_log is not None:
                self.sample_log.write(*record)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write was attempted; False after ``timeout_s``."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._saves and not self._records and not self._busy,
                                     timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to ``timeout_s``), then stop."""
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._writer.join(timeout=timeout_s)
        self._loads.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.store, "close", None)
        if close is not None:
            close()

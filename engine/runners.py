"""Where a bucket's communication runs (a side CUDA stream, or one thread on CPU) and how it is timed.

:class:`BucketTimer` records per-bucket timings: CUDA events double-buffered so that
reading never synchronises, or ``time.monotonic`` on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..proto.plan import BucketTimingRecord, StepTimings


class CudaRunner:
    """Runs bucket jobs under a side stream: launched from autograd's thread, the host never waits."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, job: Callable[[], None]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            job()

    def wait_all(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def close(self) -> None:
        pass


class ThreadRunner:
    """Runs bucket jobs in submission order on one thread (Gloo collectives block their caller).

    Jobs submitted between two :meth:`wait_all` calls are one batch (one backward): once a job of a
    batch fails, the batch's later jobs do not run.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._batch = 0
        self._failed_batch = -1

    def submit(self, job: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagua-comm")
        batch = self._batch

        def run() -> None:
            if self._failed_batch == batch:
                return  # an earlier job of this backward failed: its later buckets are not communicated
            try:
                job()
            except BaseException:
                self._failed_batch = batch
                raise

        self._futures.append(self._pool.submit(run))

    def wait_all(self) -> None:
        """Wait for every job of the batch in order; on the first error raise it at once.

        A job still running then (a collective that a failed peer will never answer) is not waited for,
        and no later job of the batch starts.
        """
        futures, self._futures = self._futures, []
        self._batch += 1
        for f in futures:
            f.result()

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class BucketTimer:
    """Per-bucket timings; CUDA events double-buffered so reading never forces a sync."""

    def __init__(self, num_buckets: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.n = num_buckets
        self.step_id = -1
        if self.cuda:
            def ev() -> torch.cuda.Event:
                return torch.cuda.Event(enable_timing=True)

            # [parity] -> (bw_start, bw_end, ready[n], start[n], end[n])
            self._events = [
                (ev(), ev(), [ev() for _ in range(self.n)], [ev() for _ in range(self.n)],
                 [ev() for _ in range(self.n)])
                for _ in range(2)
            ]
            self._recorded: list[int] = [-1, -1]  # step id held by each parity
        else:
            self._t0 = 0.0
            self._t_end = 0.0
            self._ready = [0.0] * self.n
            self._start = [0.0] * self.n
            self._stop = [0.0] * self.n
            self._last: StepTimings | None = None

    def begin(self) -> None:
        self.step_id += 1
        if self.cuda:
            p = self.step_id % 2
            self._recorded[p] = -1
            self._events[p][0].record()
        else:
            self._t0 = time.monotonic()

    def ready(self, i: int) -> None:
        if self.cuda:
            self._events[self.step_id % 2][2][i].record()
        else:
            self._ready[i] = time.monotonic()

    def comm_start(self, i: int) -> None:  # on the side stream / communication thread
        if self.cuda:
            self._events[self.step_id % 2][3][i].record()
        else:
            self._start[i] = time.monotonic()

    def comm_end(self, i: int) -> None:
        if self.cuda:
            self._events[self.step_id % 2][4][i].record()
        else:
            self._stop[i] = time.monotonic()

    def backward_end(self) -> None:
        if self.cuda:
            self._events[self.step_id % 2][1].record()
        else:
            self._t_end = time.monotonic()

    def finished(self, nbytes: Sequence[int]) -> None:
        if self.cuda:
            self._recorded[self.step_id % 2] = self.step_id
            self._nbytes = list(nbytes)
            return
        ms = 1000.0
        self._last = StepTimings(
            buckets=[
                BucketTimingRecord(
                    bucket_index=i,
                    bytes=nbytes[i],
                    ready_ms=(self._ready[i] - self._t0) * ms,
                    comm_ms=(self._stop[i] - self._start[i]) * ms,
                    wait_ms=max(0.0, self._stop[i] - self._t_end) * ms,
                )
                for i in range(self.n)
            ],
            backward_ms=(self._t_end - self._t0) * ms,
        )

    def last(self) -> StepTimings | None:
        if not self.cuda:
            return self._last
        # Newest fully recorded step whose events have completed; never synchronises.
        for step in sorted((s for s in self._recorded if s >= 0), reverse=True):
            bw0, bw1, ready, start, end = self._events[step % 2]
            if not all(e.query() for e in (bw1, *end)):
                continue
            return StepTimings(
                buckets=[
                    BucketTimingRecord(
                        bucket_index=i,
                        bytes=self._nbytes[i],
                        ready_ms=bw0.elapsed_time(ready[i]),
                        comm_ms=start[i].elapsed_time(end[i]),
                        wait_ms=max(0.0, bw1.elapsed_time(end[i])),
                    )
                    for i in range(self.n)
                ],
                backward_ms=bw0.elapsed_time(bw1),
            )
        return None

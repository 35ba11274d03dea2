"""The end-of-fit advice: which algorithm would have been faster, said only as strongly as it was measured.

Where the network is the bottleneck the algorithm moves the step time 3-4x and the bucket plan does not, so
the summary of a tuned fit says so:

* under ``algorithm="auto"`` the candidates were measured on this job: the advice gives the measured ratio
  (``bytegrad was 3.53x as fast as gradient_allreduce here``);
* with a fixed ``gradient_allreduce`` whose exposed communication is most of its backward pass, it names
  the faster algorithm that an ``algorithm="auto"`` job of the same model and placement measured (the
  autotune service hands that selection back at registration), and otherwise bytegrad with an *estimate*
  (its gradients are a quarter of the bytes), labelled as such, with the way to measure it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...proto.plan import BucketTimingRecord, StepTimings
from .measurement import Measurement
from .selection import Selection

#: Exposed communication, as a share of backward + exposed communication, from which a fixed algorithm gets
#: advice: below it, communication mostly hides behind the backward pass and no algorithm gains much.
DOMINANT_SHARE = 0.5
#: How many times fewer bytes bytegrad sends than gradient_allreduce (MinMax uint8 for f32 gradients).
BYTEGRAD_BYTES_RATIO = 4.0


@dataclass(frozen=True, slots=True)
class CommunicationShare:
    """How much of the backward pass waited for communication.

    Attributes:
        backward_ms: the backward pass, in milliseconds.
        exposed_ms: the wait for communication after it (the last bucket's wait), in milliseconds.
        source: what the numbers are, for the message (``"mean of the last interval"``).
    """

    backward_ms: float
    exposed_ms: float
    source: str

    @property
    def total_ms(self) -> float:
        return self.backward_ms + self.exposed_ms

    @property
    def share(self) -> float:
        """Exposed communication / (backward + exposed communication); 0 when nothing was measured."""
        return self.exposed_ms / self.total_ms if self.total_ms > 0 else 0.0

    @classmethod
    def of(cls, measured: Measurement | None, last_step: StepTimings | None) -> CommunicationShare | None:
        """From the last interval's means (``measured``) when it has bucket timings, else from the last step."""
        if measured is not None and measured.timings:
            return cls._from(measured.timings, measured.backward_ms, "mean of the last interval")
        if last_step is not None and last_step.buckets:
            return cls._from(last_step.buckets, last_step.backward_ms, "last step")
        return None

    @classmethod
    def _from(cls, buckets: list[BucketTimingRecord], backward_ms: float, source: str) -> CommunicationShare:
        return cls(backward_ms=max(0.0, backward_ms), exposed_ms=max(0.0, max(b.wait_ms for b in buckets)),
                   source=source)


def measured_advice(selection: Selection | None) -> str | None:
    """``algorithm="auto"``: the kept candidate against the baseline (gradient_allreduce, else the slowest)."""
    if selection is None or selection.chosen is None or len(selection.step_ms) < 2:
        return None
    chosen, times = selection.chosen, selection.step_ms
    others = [n for n in times if n != chosen]
    other = "gradient_allreduce" if "gradient_allreduce" in others else max(others, key=lambda n: times[n])
    best = times[chosen]
    ratio = times[other] / best if best > 0 else float("inf")
    return (f"algorithm='auto' kept {chosen}: {chosen} was {ratio:.2f}x as fast as {other} here (measured in "
            f"flight, forward start to optimizer step end: {best:.1f} vs {times[other]:.1f} ms/step)")


def _measured_elsewhere(algorithm: str, earlier: Selection | None) -> tuple[str, float] | None:
    """(the faster algorithm, how many times as fast) when ``earlier`` measured ``algorithm`` and a faster one."""
    if earlier is None or earlier.chosen is None or earlier.chosen == algorithm or algorithm not in earlier.step_ms:
        return None
    best = earlier.step_ms[earlier.chosen]
    if best <= 0 or earlier.step_ms[algorithm] <= best:
        return None
    return earlier.chosen, earlier.step_ms[algorithm] / best


def estimated_advice(algorithm: str, share: CommunicationShare | None, earlier: Selection | None = None) -> str | None:
    """A fixed algorithm: advice when communication dominates and another algorithm is (or could be) faster.

    ``earlier``: what an ``algorithm="auto"`` job of this model and placement measured; when it measured
    ``algorithm`` and a faster one, that ratio is given instead of the estimate. Returns None when nothing was
    measured, communication hides behind the backward pass, or the algorithm already compresses (and nothing
    faster was measured).
    """
    if share is None or share.share < DOMINANT_SHARE:
        return None
    head = (f"communication is {100 * share.share:.0f} % of each backward pass ({share.exposed_ms:.1f} of "
            f"{share.total_ms:.1f} ms exposed, {share.source})")
    measured = _measured_elsewhere(algorithm, earlier)
    if measured is not None and earlier is not None:
        faster, ratio = measured
        return (f"{head}; {faster} was {ratio:.2f}x as fast as {algorithm} on this model and placement (measured "
                f"by job {earlier.job_id or '-'} under algorithm='auto': {earlier.step_ms[faster]:.1f} vs "
                f"{earlier.step_ms[algorithm]:.1f} ms/step): use BaguaStrategy(algorithm={faster!r})")
    if algorithm != "gradient_allreduce":
        return None
    estimate_ms = share.backward_ms + share.exposed_ms / BYTEGRAD_BYTES_RATIO
    speedup = share.total_ms / estimate_ms if estimate_ms > 0 else BYTEGRAD_BYTES_RATIO
    return (f"{head}; bytegrad sends a quarter of the bytes: an "
            f"estimated ~{speedup:.1f}x faster backward if its communication shrinks with them (estimate, not "
            "measured: BaguaStrategy(algorithm='auto') measures gradient_allreduce and bytegrad on this job and "
            "keeps the faster)")


def algorithm_advice(algorithm: str, *, selection: Selection | None, measured: Measurement | None = None,
                     last_step: StepTimings | None = None, earlier: Selection | None = None) -> str | None:
    """The summary's advice: measured under ``algorithm="auto"`` (``selection``), else measured by an earlier
    ``auto`` job of this shape (``earlier``), else an estimate."""
    if selection is not None and selection.chosen is not None:
        return measured_advice(selection)
    return estimated_advice(algorithm, CommunicationShare.of(measured, last_step), earlier)

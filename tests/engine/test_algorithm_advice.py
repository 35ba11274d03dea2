"""The end-of-fit advice: measured ratios under algorithm='auto', a labelled estimate for a fixed algorithm."""

from __future__ import annotations

import dataclasses

import pytest

from bagua_lightning.engine.autotune import AutotuneSummary
from bagua_lightning.engine.autotune.advice import CommunicationShare, algorithm_advice
from bagua_lightning.engine.autotune.measurement import Measurement
from bagua_lightning.engine.autotune.selection import Selection
from bagua_lightning.proto.plan import BucketTimingRecord, StepTimings


def _buckets(*waits: float) -> list[BucketTimingRecord]:
    return [BucketTimingRecord(bucket_index=i, bytes=1 << 20, ready_ms=1.0, comm_ms=w + 1, wait_ms=w)
            for i, w in enumerate(waits)]


# The 10 Gbit/s case: 700 ms of exposed communication after an 18 ms backward.
DOMINATED = Measurement(speed=44.0, timings=_buckets(120.0, 700.0), backward_ms=18.0)


def test_a_fixed_allreduce_waiting_on_the_network_gets_a_labelled_estimate() -> None:
    advice = algorithm_advice("gradient_allreduce", selection=None, measured=DOMINATED)
    assert advice is not None
    assert advice.startswith("communication is 97 % of each backward pass (700.0 of 718.0 ms exposed, mean of "
                             "the last interval)")
    # (18 + 700) / (18 + 700 / 4) = 3.7: said as an estimate, with the way to measure it.
    assert "estimated ~3.7x faster backward" in advice and "estimate, not measured" in advice
    assert "algorithm='auto'" in advice and "was " not in advice


def test_no_advice_when_communication_hides_or_the_algorithm_compresses() -> None:
    hidden = Measurement(speed=100.0, timings=_buckets(0.0, 4.0), backward_ms=30.0)
    assert algorithm_advice("gradient_allreduce", selection=None, measured=hidden) is None
    assert algorithm_advice("bytegrad", selection=None, measured=DOMINATED) is None
    assert algorithm_advice("gradient_allreduce", selection=None) is None  # nothing measured


def test_the_last_step_stands_in_when_no_interval_measured_buckets() -> None:
    step = StepTimings(buckets=_buckets(90.0), backward_ms=10.0)
    share = CommunicationShare.of(Measurement(speed=1.0, timings=[], backward_ms=0.0), step)
    assert share is not None and share.source == "last step" and share.share == pytest.approx(0.9)
    advice = algorithm_advice("gradient_allreduce", selection=None, last_step=step)
    assert advice is not None and "90 % of each backward pass" in advice and "last step" in advice


def test_under_auto_the_advice_is_the_measured_ratio() -> None:
    sel = Selection(step_ms={"gradient_allreduce": 170.0, "bytegrad": 50.0}, chosen="bytegrad", decided_at=26)
    advice = algorithm_advice("bytegrad", selection=sel, measured=DOMINATED)
    assert advice == ("algorithm='auto' kept bytegrad: bytegrad was 3.40x as fast as gradient_allreduce here "
                      "(measured in flight, forward start to optimizer step end: 50.0 vs 170.0 ms/step)")
    # Without gradient_allreduce among the candidates the slowest is the baseline.
    sel = Selection(step_ms={"bytegrad": 50.0, "decentralized": 60.0, "async": 80.0}, chosen="bytegrad",
                    decided_at=3)
    assert "1.60x as fast as async" in (algorithm_advice("bytegrad", selection=sel) or "")
    # A choice among one candidate, or still measuring: nothing measured to compare.
    assert algorithm_advice("bytegrad", selection=Selection({"bytegrad": 5.0}, "bytegrad", 3)) is None
    assert algorithm_advice("gradient_allreduce", selection=Selection(), measured=DOMINATED) is not None


def test_the_summary_line_carries_the_advice() -> None:
    summary = AutotuneSummary(model_name="m", service="s", registered=True, plan_version=2, num_buckets=3,
                              bucket_size=1024, hierarchical=False, completed=True, plans_applied=2,
                              speed_before=40.0, speed_after=44.0, advice="communication is 97 % of each step")
    assert summary.line().endswith("(1.10x). communication is 97 % of each step")
    assert dataclasses.replace(summary, advice="").line().endswith("(1.10x)")


def test_a_fixed_algorithm_cites_what_an_auto_job_of_its_shape_measured() -> None:
    earlier = Selection(step_ms={"gradient_allreduce": 170.0, "bytegrad": 50.0}, chosen="bytegrad", decided_at=26,
                        job_id="run-1")
    advice = algorithm_advice("gradient_allreduce", selection=None, measured=DOMINATED, earlier=earlier)
    assert advice == ("communication is 97 % of each backward pass (700.0 of 718.0 ms exposed, mean of the last "
                      "interval); bytegrad was 3.40x as fast as gradient_allreduce on this model and placement "
                      "(measured by job run-1 under algorithm='auto': 50.0 vs 170.0 ms/step): use "
                      "BaguaStrategy(algorithm='bytegrad')")
    # What the earlier job did not measure, or measured slower, is no evidence: back to the labelled estimate.
    other = Selection(step_ms={"bytegrad": 50.0, "decentralized": 60.0}, chosen="bytegrad", decided_at=8)
    assert "estimate, not measured" in (algorithm_advice("gradient_allreduce", selection=None, measured=DOMINATED,
                                                         earlier=other) or "")
    slower = Selection(step_ms={"gradient_allreduce": 50.0, "bytegrad": 60.0}, chosen="gradient_allreduce",
                       decided_at=8)
    assert algorithm_advice("gradient_allreduce", selection=None, measured=DOMINATED, earlier=slower) is not None
    assert "was " not in (algorithm_advice("gradient_allreduce", selection=None, measured=DOMINATED,
                                           earlier=slower) or "")
    # A fixed bytegrad gets advice only from a measurement: decentralized measured faster on its shape.
    faster = Selection(step_ms={"bytegrad": 90.0, "decentralized": 30.0}, chosen="decentralized", decided_at=8,
                       job_id="run-9")
    assert algorithm_advice("bytegrad", selection=None, measured=DOMINATED) is None
    assert "decentralized was 3.00x as fast as bytegrad" in (algorithm_advice(
        "bytegrad", selection=None, measured=DOMINATED, earlier=faster) or "")

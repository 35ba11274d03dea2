"""What a tuner hands back: the next plan to measure, and whether it has nothing better to try."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ...proto.plan import BucketPlan
from .costmodel import Sample

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, slots=True)
class Proposal:
    """The next plan to measure.

    Attributes:
        plan: the plan (its version is assigned by the session).
        converged: True when the tuner expects nothing better than what it measured;
            the session may then complete early and hand back the best measured plan.
        reason: short tag for logs ("explore", "model", "initial", "ei", ...).
        predicted_ms: the planner's predicted communication finish time (ms from the
            start of backward), when it has a model; None otherwise.
    """

    plan: BucketPlan
    converged: bool = False
    reason: str = ""
    predicted_ms: float | None = None


class Tuner(Protocol):
    """A tuner is a function of the measured history: the session owns all state."""

    def propose(self, samples: Sequence[Sample]) -> Proposal: ...

    def final(self, samples: Sequence[Sample]) -> Sample:
        """The measured sample whose plan is handed back for good once tuning completes."""
        ...


def exit_with_parent(parent_pid: int, period_s: float = 1.0) -> None:
    """Worker initializer: exit once the service process is gone (a SIGKILLed service leaves no workers)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def propose_in_worker(tuner: Tuner, history: Sequence[Sample]) -> Proposal:
    """``tuner.propose(history)``: the function a tuning worker process runs (tuners are pure)."""
    return tuner.propose(history)

"""``algorithm="auto"``: measure the candidate algorithms in flight and keep the fastest.

The one knob with a 3-4x effect where the network is the bottleneck is the algorithm itself (bytegrad
sends a quarter of gradient_allreduce's bytes), and on NVLink none of them is faster than allreduce. So
the job measures instead of guessing:

1. every candidate, in the order given, drives the model for ``warmup_steps`` untimed steps (buckets,
   communicators and compression kernels warm up), then ``trial_steps`` timed steps; each step is the
   time between two batch starts, taken after a device synchronisation, so the GPU's queue is counted;
2. after the last trial every rank contributes its median step time per candidate and the group takes the
   maximum per candidate (a job is as slow as its slowest rank); every rank then picks the argmin of the
   same numbers, so all ranks choose the same algorithm without a broadcast, at the same step;
3. the chosen algorithm drives the rest of the training (its bucket plan then tuned as a fixed
   algorithm's would be, with ``autotune=True``).

Switching happens between two steps through
:meth:`~bagua_lightning.engine.ddp.BaguaDistributedDataParallel.switch_algorithm`, which averages the
replicas after an algorithm that let them drift (decentralized, async). The default candidates are the
synchronous algorithms whose result equals or approximates allreduce's; the others are opt-in.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Candidates measured when the user names none: the result equals (gradient_allreduce) or approximates
#: (bytegrad, MinMax uint8 gradients) an allreduce of the gradients.
DEFAULT_CANDIDATES = ("gradient_allreduce", "bytegrad")
#: What may be measured: every algorithm that needs nothing beyond the model and its optimizers (qadam
#: needs its own optimizer, so it cannot be switched to in flight).
SELECTABLE = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async")


@dataclass(kw_only=True)
class AutoSettings:
    """How ``algorithm="auto"`` measures.

    Attributes:
        candidates: algorithm names to measure, in this order (the first also drives the warm-up of the
            job); default :data:`DEFAULT_CANDIDATES`.
        warmup_steps: untimed steps after each switch, >= 1.
        trial_steps: timed steps per candidate, >= 3 (the median of them is its step time).
        prefix: how the front door spells these arguments, for error messages (``BaguaStrategy``'s
            ``auto_candidates``; ``""`` for ``AutoAlgorithm(candidates=...)``).
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    warmup_steps: int = 3
    trial_steps: int = 10
    prefix: str = "auto_"

    def __post_init__(self) -> None:
        p = self.prefix
        if isinstance(self.candidates, str) or not isinstance(self.candidates, Sequence):
            raise ConfigurationError(f"{p}candidates={self.candidates!r}; give a list of algorithm names, "
                                     f"e.g. {list(DEFAULT_CANDIDATES)}.")
        self.candidates = tuple(self.candidates)
        unknown = [c for c in self.candidates if c not in SELECTABLE]
        if unknown:
            raise ConfigurationError(
                f"{p}candidates has {unknown}, which algorithm='auto' cannot measure; choose from "
                f"{list(SELECTABLE)} (qadam needs its own optimizer: use algorithm='qadam').")
        if not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ConfigurationError(f"{p}candidates={list(self.candidates)}; name each algorithm once, at "
                                     "least one.")
        for name in ("warmup_steps", "trial_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigurationError(f"{p}{name}={value!r} is not a number of steps; give a whole number.")
        if self.warmup_steps < 1:
            raise ConfigurationError(f"{p}warmup_steps={self.warmup_steps}; give at least 1.")
        if self.trial_steps < 3:
            raise ConfigurationError(f"{p}trial_steps={self.trial_steps}; give at least 3 (a median of fewer "
                                     "steps is noise).")

    @property
    def steps_to_decide(self) -> int:
        """Training steps until the choice is made."""
        return len(self.candidates) * (self.warmup_steps + self.trial_steps)


def choose(step_ms: Sequence[float]) -> int:
    """Index of the fastest candidate (the first of equals): the same on every rank given the same numbers."""
    if not step_ms:
        raise ValueError("no candidate was measured")
    return min(range(len(step_ms)), key=lambda i: (step_ms[i], i))


@dataclass
class Selection:
    """What ``algorithm="auto"`` measured and chose.

    Attributes:
        step_ms: each candidate's step time (median over its trial, slowest rank), in milliseconds.
        chosen: the candidate kept (None while measuring).
        decided_at: the training step at which it was switched to for good.
        job_id: the job that measured it, when it came from the autotune service ("" for this job's own).
    """

    step_ms: dict[str, float] = field(default_factory=dict)
    chosen: str | None = None
    decided_at: int | None = None
    job_id: str = ""

    def reason(self) -> str:
        """``bytegrad: 48.1 ms/step (kept); gradient_allreduce: 170.0 ms/step (3.53x slower)``."""
        if self.chosen is None:
            return "still measuring"
        best = self.step_ms[self.chosen]
        parts = [f"{self.chosen}: {best:.1f} ms/step (kept)"]
        for name, ms in sorted(self.step_ms.items(), key=lambda kv: kv[1]):
            if name != self.chosen:
                parts.append(f"{name}: {ms:.1f} ms/step ({ms / best:.2f}x slower)")
        return "; ".join(parts)

    def metrics(self) -> dict[str, float]:
        """For Lightning's loggers: each candidate's step time and the chosen index."""
        out = {f"bagua/auto/{name}_step_ms": ms for name, ms in self.step_ms.items()}
        if self.chosen is not None:
            out["bagua/auto/chosen_index"] = float(list(self.step_ms).index(self.chosen))
        return out


class AlgorithmSelector:
    """Drives the measurement of ``algorithm="auto"``; every rank creates one and calls it at every batch start.

    Args:
        settings: the candidates and trial lengths.
        switch: hands the model to the named algorithm (a fresh instance); called between steps.
        group: the process group whose ranks decide together (None: the default group).
        device: where the group's collectives run (CUDA for NCCL, CPU for Gloo); its synchronisation times
            the steps.
        clock: seconds, monotonic.
    """

    def __init__(self, settings: AutoSettings, switch: Callable[[str], None], *,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings
        self._switch = switch
        self._group = group
        self._device = device or torch.device("cpu")
        self._clock = clock
        self._index = 0  # the candidate being measured; the model starts on candidates[0]
        self._steps_on_candidate = 0
        self._last: float | None = None
        self._times: dict[str, list[float]] = {name: [] for name in settings.candidates}
        self.selection = Selection()

    @property
    def done(self) -> bool:
        return self.selection.chosen is not None

    @property
    def current(self) -> str:
        """The algorithm driving the model now."""
        return self.selection.chosen or self.settings.candidates[self._index]

    def on_batch_start(self, step: int) -> Selection | None:
        """Call at the start of every training batch (before its forward), on every rank.

        Returns the :class:`Selection` at the step where the choice is made, else None.
        """
        if self.done:
            return None
        s = self.settings
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        now = self._clock()
        timed = self._steps_on_candidate > s.warmup_steps  # the step that just ended was a trial step
        if timed and self._last is not None:
            self._times[self.current].append((now - self._last) * 1000.0)
        self._last = now
        if self._steps_on_candidate < s.warmup_steps + s.trial_steps:
            self._steps_on_candidate += 1
            return None
        if self._index + 1 < len(s.candidates):  # next candidate
            self._index += 1
            self._steps_on_candidate = 1
            self._switch(self.current)
            self._last = self._clock()
            return None
        return self._decide(step)

    def _decide(self, step: int) -> Selection:
        names = list(self.settings.candidates)
        local = torch.tensor([statistics.median(self._times[n]) for n in names], dtype=torch.float64,
                             device=self._device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)  # the job's pace: its slowest rank
        step_ms = [float(v) for v in local.cpu()]
        chosen = names[choose(step_ms)]
        self.selection = Selection(step_ms=dict(zip(names, step_ms, strict=True)), chosen=chosen, decided_at=step)
        if chosen != names[-1]:
            self._switch(chosen)
        log.info("algorithm='auto' chose %s at step %d: %s", chosen, step, self.selection.reason())
        return self.selection

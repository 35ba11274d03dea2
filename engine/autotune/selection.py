"""``algorithm="auto"``: measure the candidate algorithms in flight and keep the fastest.

The one knob with a 3-4x effect where the network is the bottleneck is the algorithm itself (bytegrad
sends a quarter of gradient_allreduce's bytes), and on NVLink none of them is faster than allreduce. So
the job measures instead of guessing (:class:`AlgorithmSelector`, driven by the registered engine algorithm
``auto``, :mod:`bagua_lightning.engine.algorithms.auto`, behind both ``BaguaStrategy(algorithm="auto")`` and
``with_bagua(..., AutoAlgorithm(...))``):

1. **What is timed is the step, not the loop**: from the start of a training forward to the end of the
   last ``optimizer.step()`` of that step, so the backward, the communication it leaves exposed and the
   algorithm's own work at the step's ends are in, and whatever the loop does between steps (data loading,
   validation, logging, checkpoints) is not. On GPU with CUDA events on the current stream, read only when
   the choice is made (no synchronisation in the steps); on CPU with the monotonic clock.
2. **The trial steps are spread** so that the job's warm-up and the machine's drift fall on every candidate
   alike: each candidate's ``trial_steps`` are split over two rounds run in mirrored order, A B C | C B A
   (linear drift then weighs the same on every candidate), each visit after ``warmup_steps`` untimed steps
   (buckets, communicators and compression kernels warm up; the last candidate of the first round goes
   straight on into the second).
   When the fastest candidates end within :data:`RUNOFF_MARGIN` of one another, or within the trial's own
   noise (:data:`RUNOFF_NOISE_Z` standard errors of the difference of two medians, from the steps' spread),
   those leaders run another pair of mirrored rounds (a runoff, at most :data:`MAX_RUNOFFS`) and are judged
   on all their timed steps: candidates a few percent apart on a noisy machine are told apart by more
   evidence, the clear cases cost nothing more.
3. **The slowest rank decides**: each rank takes the median of each candidate's timed steps, the group takes
   the maximum per candidate (a job is as slow as its slowest rank), and every rank picks the argmin of the
   same numbers: the same algorithm on every rank, at the same step, without a broadcast.
4. The chosen algorithm then drives the rest of the training as if picked by hand: ``auto`` hands it to the
   driver and leaves the step path (no timing, synchronisation or indirection left behind).

The default candidates are the synchronous algorithms whose result equals or approximates allreduce's; the
others are opt-in. Which algorithms may be candidates is derived from the registry
(:func:`~bagua_lightning.engine.algorithms.base.switchable_algorithms`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Candidates measured when the user names none: the result equals (gradient_allreduce) or approximates
#: (bytegrad, MinMax uint8 gradients) an allreduce of the gradients. Opt-in (``auto_candidates=[...]``):
#: powersgd, because it changes what is trained (a rank-r approximation with error feedback, whose rank and
#: start step want tuning per model, as torch's docs say) and auto judges speed only; half_allreduce, because
#: it approximates an allreduce but sends twice bytegrad's bytes, so where the link matters bytegrad is the
#: faster of the two (docs/benchmarks.md, compressors.py) and one more candidate would lengthen every trial.
DEFAULT_CANDIDATES = ("gradient_allreduce", "bytegrad")
#: How many rounds a candidate's trial steps are spread over (mirrored order: A B | B A).
ROUNDS = 2
#: Candidates whose step time is within this fraction of the fastest's run a runoff (ROUNDS more rounds) ...
RUNOFF_MARGIN = 0.03
#: ... or within this many standard errors of the difference (the trial's own noise, from its spread).
RUNOFF_NOISE_Z = 2.0
#: At most this many runoffs by default (``AutoSettings.max_runoffs``); then the lowest median of the last
#: one's candidates is kept.
MAX_RUNOFFS = 3
#: Why a job of one rank chooses without measuring (:meth:`Selection.alone`).
ONE_RANK = "one rank: nothing to communicate"
#: Standard error of a median of n normal samples from their median absolute deviation: 1.2533 * 1.4826 * MAD / sqrt(n).
_SE_OF_MEDIAN = 1.2533 * 1.4826


@dataclass(kw_only=True)
class AutoSettings:
    """How ``algorithm="auto"`` measures.

    Attributes:
        candidates: algorithm names to measure (the first also drives the warm-up of the job); default
            :data:`DEFAULT_CANDIDATES`. Which names exist is checked by ``auto`` against the registry.
        warmup_steps: untimed steps after each switch, >= 1.
        trial_steps: timed steps per candidate, >= 3 (the median of them is its step time), spread over
            :data:`ROUNDS` rounds.
        max_runoffs: at most this many runoffs of candidates too close to tell apart (0: none; then the choice
            comes at :attr:`steps_to_decide` exactly).
        prefix: how the front door spells these arguments, for error messages (``BaguaStrategy``'s
            ``auto_candidates``; ``""`` for ``AutoAlgorithm(candidates=...)``).
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    warmup_steps: int = 3
    trial_steps: int = 10
    max_runoffs: int = MAX_RUNOFFS
    prefix: str = "auto_"

    def __post_init__(self) -> None:
        p = self.prefix
        if isinstance(self.candidates, str) or not isinstance(self.candidates, Sequence):
            raise ConfigurationError(f"{p}candidates={self.candidates!r}; give a list of algorithm names, "
                                     f"e.g. {list(DEFAULT_CANDIDATES)}.")
        self.candidates = tuple(self.candidates)
        if not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ConfigurationError(f"{p}candidates={list(self.candidates)}; name each algorithm once, at "
                                     "least one.")
        for name in ("warmup_steps", "trial_steps", "max_runoffs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                noun = "runoffs" if name == "max_runoffs" else "steps"
                raise ConfigurationError(f"{p}{name}={value!r} is not a number of {noun}; give a whole number.")
        if self.max_runoffs < 0:
            raise ConfigurationError(f"{p}max_runoffs={self.max_runoffs}; give 0 (no runoff) or more.")
        if self.warmup_steps < 1:
            raise ConfigurationError(f"{p}warmup_steps={self.warmup_steps}; give at least 1.")
        if self.trial_steps < 3:
            raise ConfigurationError(f"{p}trial_steps={self.trial_steps}; give at least 3 (a median of fewer "
                                     "steps is noise).")

    def blocks(self, names: Sequence[str] | None = None) -> list[Block]:
        """The trial schedule of ``names`` (default: the candidates): each one's visits in order
        (A B C | C B A; C's two visits are one)."""
        names = self.candidates if names is None else tuple(names)
        first = (self.trial_steps + 1) // 2
        out = [Block(name, self.warmup_steps, first) for name in names]
        for name in reversed(names):
            if out[-1].candidate == name:  # no switch between the rounds: no second warm-up either
                out[-1] = Block(name, out[-1].warmup, self.trial_steps)
            else:
                out.append(Block(name, self.warmup_steps, self.trial_steps - first))
        return out

    @property
    def steps_to_decide(self) -> int:
        """Training steps until the choice is made when no runoff is needed."""
        return sum(b.warmup + b.timed for b in self.blocks())

    def plan_line(self) -> str:
        """What will be measured, for the log at the start of the fit."""
        return (f"algorithm='auto': measuring {', '.join(self.candidates)} ({self.trial_steps} timed steps each "
                f"over {ROUNDS} mirrored rounds, {self.warmup_steps} warm-up steps a visit), then keeping the fastest")

    def measured(self, device: torch.device, ranks: int) -> str:
        """What a candidate's step time is, in words (the summary line and the docs say the same)."""
        clock = "CUDA events" if device.type == "cuda" else "monotonic clock"
        return (f"step = forward start to optimizer step end ({clock}), median of {self.trial_steps} steps per "
                f"candidate in {ROUNDS} mirrored rounds, as many more in a runoff of those within "
                f"{RUNOFF_MARGIN:.0%} or the noise of the fastest, slowest of {ranks} rank{'s' if ranks != 1 else ''}")


@dataclass(frozen=True, slots=True)
class Block:
    """One visit of a candidate: ``warmup`` untimed steps, then ``timed`` timed ones."""

    candidate: str
    warmup: int
    timed: int


def _median(times: Sequence[float]) -> float:
    return statistics.median(times) if times else float("inf")


def _se_of_median(times: Sequence[float]) -> float:
    """Standard error of the median of ``times`` from their spread (0 for fewer than 3: no spread to see)."""
    if len(times) < 3:
        return 0.0
    mid = statistics.median(times)
    return _SE_OF_MEDIAN * statistics.median(abs(t - mid) for t in times) / math.sqrt(len(times))


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
        measured: what a step time is (:meth:`AutoSettings.measured`; "" when not known).
        runoff: the candidates of the last runoff (too close to tell apart before it); () when none was held.
        runoffs: how many runoffs were held.
        note: why the choice needed no measurement ("" when it was measured), e.g. :data:`ONE_RANK`.
    """

    step_ms: dict[str, float] = field(default_factory=dict)
    chosen: str | None = None
    decided_at: int | None = None
    job_id: str = ""
    measured: str = ""
    runoff: tuple[str, ...] = ()
    runoffs: int = 0
    note: str = ""

    @classmethod
    def alone(cls, candidates: Sequence[str]) -> Selection:
        """The choice of a job of one rank, made at step 0 without measuring: the first candidate (with nothing
        to communicate every candidate trains alike, and none is faster than another)."""
        return cls(chosen=candidates[0], decided_at=0, note=ONE_RANK)

    def reason(self) -> str:
        """``bytegrad: 48.1 ms/step (kept); gradient_allreduce: 170.0 ms/step (3.53x slower)``."""
        if self.chosen is None:
            return "still measuring"
        if self.note:
            return self.note
        best = self.step_ms[self.chosen]
        parts = [f"{self.chosen}: {best:.1f} ms/step (kept)"]
        for name, ms in sorted(self.step_ms.items(), key=lambda kv: kv[1]):
            if name != self.chosen:
                # Out of the runoff: measured in the first rounds only (its median may even be below a leader's
                # whose runoff steps were slower; it was judged out before them).
                first = ", first rounds" if self.runoff and name not in self.runoff else ""
                parts.append(f"{name}: {ms:.1f} ms/step ({ms / best:.2f}x{' slower' if ms >= best else ''}{first})")
        runoff = ""
        if self.runoff:
            runoff = f" after {'a runoff' if self.runoffs <= 1 else f'{self.runoffs} runoffs, the last'} of " \
                     f"{' and '.join(self.runoff)}"
        return "; ".join(parts) + runoff

    def line(self) -> str:
        """The summary line: ``algorithm='auto' chose X at step N: <reason> (<what was measured>)``."""
        head = f"algorithm='auto' chose {self.chosen} at step {self.decided_at}: {self.reason()}"
        return f"{head} ({self.measured})" if self.measured else head

    def metrics(self) -> dict[str, float]:
        """For Lightning's loggers: each candidate's step time and the chosen index."""
        out = {f"bagua/auto/{name}_step_ms": ms for name, ms in self.step_ms.items()}
        if self.chosen is not None and self.chosen in self.step_ms:
            out["bagua/auto/chosen_index"] = float(list(self.step_ms).index(self.chosen))
        return out


class StepMarks:
    """Time stamps of step ends: CUDA events on ``device``'s current stream, else the monotonic clock.

    Events are only read by :meth:`elapsed_ms`, which the selector calls once, when it decides: the steps
    themselves never wait for the device.
    """

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self._clock = clock

    def mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return self._clock()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.device.type == "cuda":
            end.synchronize()  # at once for all but the last step (events complete in stream order)
            return float(start.elapsed_time(end))
        return (end - start) * 1000.0


class AlgorithmSelector:
    """Drives the measurement of ``algorithm="auto"`` on one rank (every rank creates one).

    Call :meth:`on_forward_start` before the candidate's own hook at the start of every training forward, and
    :meth:`on_step_end` after every ``optimizer.step()``.

    Args:
        settings: the candidates and trial lengths.
        switch: hands the model to the named algorithm (a fresh instance); called between steps.
        group: the process group whose ranks decide together (None: the default group).
        device: where the model computes (CUDA: steps timed with CUDA events; else the clock).
        reduce_device: where the group's collectives run (CUDA for NCCL, CPU for Gloo); default ``device``.
        clock: seconds, monotonic (CPU timing).
    """

    def __init__(self, settings: AutoSettings, switch: Callable[[str], None], *,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 reduce_device: torch.device | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings
        self._switch = switch
        self._group = group
        self._marks = StepMarks(device or torch.device("cpu"), clock)
        self._reduce_device = reduce_device or self._marks.device
        self._blocks = settings.blocks()
        self._block = 0
        self._in_block = 0  # steps started in the current block
        self._open: tuple[str, Any] | None = None  # (candidate, start mark) of the timed step under way
        self._end: Any = None  # the latest optimizer step end of that step
        self._samples: list[tuple[str, Any, Any]] = []
        self._times: dict[str, list[float]] = {name: [] for name in settings.candidates}  # this rank's, in ms
        self._leaders: tuple[str, ...] = ()  # the candidates of the latest runoff, once one is scheduled
        self._runoffs = 0
        self.selection = Selection()

    @property
    def done(self) -> bool:
        return self.selection.chosen is not None

    @property
    def current(self) -> str:
        """The algorithm driving the model now."""
        return self.selection.chosen or self._blocks[self._block].candidate

    def on_forward_start(self, step: int) -> Selection | None:
        """Start of a training forward, before the candidate's hook; may switch candidates first.

        Returns the :class:`Selection` at the step where the choice is made, else None.
        """
        if self.done:
            return None
        self._close_step()
        block = self._blocks[self._block]
        if self._in_block == block.warmup + block.timed:
            self._block += 1
            if self._block == len(self._blocks):
                decided = self._decide(step)
                if decided is not None:
                    return decided
            previous, block = block, self._blocks[self._block]  # the next visit (the runoff's first, maybe)
            if block.candidate != previous.candidate:
                self._switch(block.candidate)
            self._in_block = 0
        if self._in_block >= block.warmup:
            self._open = (block.candidate, self._marks.mark())
        self._in_block += 1
        return None

    def on_step_end(self) -> None:
        """After an ``optimizer.step()`` (the last one of a step marks its end)."""
        if self._open is not None:
            self._end = self._marks.mark()

    def _close_step(self) -> None:
        if self._open is not None and self._end is not None:
            self._samples.append((self._open[0], self._open[1], self._end))
        self._open, self._end = None, None  # a step without an optimizer step is not counted

    def _decide(self, step: int) -> Selection | None:
        """The choice, or None when a runoff of the leaders was scheduled instead (every rank alike)."""
        names = list(self.settings.candidates)
        for name, start, end in self._samples:
            self._times[name].append(self._marks.elapsed_ms(start, end))
        self._samples.clear()
        local = torch.tensor([_median(self._times[n]) for n in names] + [_se_of_median(self._times[n]) for n in names],
                             dtype=torch.float64, device=self._reduce_device)
        ranks = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)  # the job's pace: its slowest rank
            ranks = dist.get_world_size(self._group)
        values = [float(v) for v in local.cpu()]
        step_ms = dict(zip(names, values[:len(names)], strict=True))
        se = dict(zip(names, values[len(names):], strict=True))
        contenders = self._leaders or tuple(names)  # after a runoff only its candidates were measured again
        best = min(contenders, key=lambda n: (step_ms[n], names.index(n)))
        leaders = tuple(n for n in contenders if step_ms[n] - step_ms[best] <= max(
            RUNOFF_MARGIN * step_ms[best], RUNOFF_NOISE_Z * math.hypot(se[n], se[best])))
        if len(leaders) > 1 and self._runoffs < self.settings.max_runoffs:  # the same numbers on every rank: the same runoff
            self._leaders = leaders
            self._runoffs += 1
            self._schedule_runoff(leaders)
            log.info("algorithm='auto': %s too close to tell apart (%s); measuring them again (runoff %d of at most %d)",
                     ", ".join(leaders), ", ".join(f"{n} {step_ms[n]:.1f} +- {se[n]:.1f} ms/step" for n in leaders),
                     self._runoffs, self.settings.max_runoffs)
            return None
        self.selection = Selection(step_ms=step_ms, chosen=best, decided_at=step,
                                   measured=self.settings.measured(self._marks.device, ranks),
                                   runoff=self._leaders, runoffs=self._runoffs)
        if best != self._blocks[-1].candidate:
            self._switch(best)
        log.info("%s", self.selection.line())
        return self.selection

    def _schedule_runoff(self, leaders: tuple[str, ...]) -> None:
        """ROUNDS more mirrored rounds of ``leaders``, the one running now first (it needs no warm-up)."""
        current = self._blocks[-1].candidate
        order = sorted(leaders, key=lambda n: n != current)
        blocks = self.settings.blocks(order)
        if blocks[0].candidate == current:
            blocks[0] = Block(current, 0, blocks[0].timed)
        self._blocks.extend(blocks)

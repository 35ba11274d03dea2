"""``auto``: an algorithm that measures its candidates in flight and hands the model to the fastest.

The one implementation of the feature: ``BaguaStrategy(algorithm="auto")`` wraps its model with it, and
Bagua's ``AutoAlgorithm(candidates=[...])`` (``with_bagua``) is derived from its registration. Each hook goes
to the candidate driving the model now; at the start of a training forward the selector
(:class:`~bagua_lightning.engine.autotune.selection.AlgorithmSelector`, which says what is timed and how)
may hand the model to the next candidate, or, after the last trial, to the one kept. A hand-over between
candidates tears the previous one down, averages the replicas when it let them drift (an algorithm that
averages weights, not gradients) and sets the next one up on the same bucket plan and optimizers, so every
rank switches at the same forward without a broadcast. Once the choice is made, the chosen algorithm is
handed to the driver, which calls it directly from then on: ``auto`` leaves the step path.

The candidates ``auto`` accepts are derived from the registry
(:func:`~bagua_lightning.engine.algorithms.base.switchable_algorithms`): an algorithm's own file is all it
takes for ``auto`` to try it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...core.errors import ConfigurationError
from ..autotune.selection import DEFAULT_CANDIDATES, MAX_RUNOFFS, AlgorithmSelector, AutoSettings, Selection
from ..parameters import average_module_parameters
from .base import ALGORITHMS, Algorithm, get_algorithm_class, register_algorithm, switchable_algorithms

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...proto.plan import BucketPlan, StepTimings
    from ..comm import CommContext


def auto_settings(candidates: Sequence[str] | None, warmup_steps: int, trial_steps: int, *, prefix: str = "",
                  candidate_kwargs: Mapping[str, Any] | None = None, max_runoffs: int = MAX_RUNOFFS) -> AutoSettings:
    """Validated settings of ``auto``; ConfigurationError names a bad value and the fix.

    ``prefix`` is how the front door spells the arguments (``"auto_"`` for ``BaguaStrategy``).
    """
    settings = AutoSettings(candidates=DEFAULT_CANDIDATES if candidates is None else candidates,  # type: ignore[arg-type]
                            warmup_steps=warmup_steps, trial_steps=trial_steps, max_runoffs=max_runoffs,
                            prefix=prefix)
    selectable = switchable_algorithms()
    unknown = [c for c in settings.candidates if c not in selectable]
    if unknown:
        own = [n for n in unknown if n in ALGORITHMS and ALGORITHMS[n].spec.optimizer_arg is not None]
        hint = "".join(f" ({n} needs its own optimizer: use algorithm={n!r})" for n in own)
        raise ConfigurationError(f"{prefix}candidates has {unknown}, which algorithm='auto' cannot measure; "
                                 f"choose from {selectable}{hint}.")
    for name in settings.candidates:  # the keyword arguments go to every candidate
        try:
            get_algorithm_class(name).from_kwargs(**dict(candidate_kwargs or {}))
        except (ConfigurationError, TypeError) as exc:
            raise ConfigurationError(f"algorithm='auto': candidate {name!r} refuses the arguments given: "
                                     f"{exc}") from None
    return settings


@register_algorithm(name="auto", bagua_name="AutoAlgorithm",
                    description="measures its candidate algorithms while training and keeps the fastest",
                    exposed=("selection",), switchable=False)
class AutoAlgorithm(Algorithm):
    """Measure ``candidates`` in flight, then train with the fastest (every rank switches at the same step).

    Each candidate's step (forward start to optimizer step end) is timed over ``trial_steps`` steps spread
    over two mirrored rounds (A B | B A), each visit after ``warmup_steps`` untimed steps; the group keeps
    the candidate whose median step time (slowest rank) is lowest; candidates within 3 % of the fastest first
    run a second pair of rounds (a runoff). What was measured and chosen is :attr:`selection` (also logged).

    Args:
        candidates: names of registered algorithms that need no optimizer of their own
            (:func:`~bagua_lightning.engine.algorithms.base.switchable_algorithms`), in the order of the first
            round; None: :data:`~bagua_lightning.engine.autotune.selection.DEFAULT_CANDIDATES`.
        warmup_steps: untimed steps after each switch (>= 1).
        trial_steps: timed steps per candidate (>= 3; their median counts).
        candidate_kwargs: keyword arguments given to every candidate (e.g. ``{"hierarchical": False}``).
        max_runoffs: at most this many runoffs of candidates too close to tell apart (0: none).
    """

    def __init__(self, candidates: Sequence[str] | None = None, warmup_steps: int = 3, trial_steps: int = 10,
                 candidate_kwargs: Mapping[str, Any] | None = None, max_runoffs: int = MAX_RUNOFFS) -> None:
        self.settings = auto_settings(candidates, warmup_steps, trial_steps, candidate_kwargs=candidate_kwargs,
                                      max_runoffs=max_runoffs)
        self.candidates = list(self.settings.candidates)
        self.warmup_steps = warmup_steps
        self.trial_steps = trial_steps
        self.candidate_kwargs = dict(candidate_kwargs or {})
        self._current: Algorithm | None = None
        self._selector: AlgorithmSelector | None = None
        self._selection = Selection()
        self._module: nn.Module | None = None
        self._comm: CommContext | None = None
        self._plan: BucketPlan | None = None
        self._optimizers: list[torch.optim.Optimizer] = []

    @classmethod
    def of(cls, settings: AutoSettings, candidate_kwargs: Mapping[str, Any] | None = None) -> AutoAlgorithm:
        """An instance measuring as ``settings`` say (``BaguaStrategy(algorithm="auto")``'s, checked already)."""
        return cls(settings.candidates, settings.warmup_steps, settings.trial_steps, candidate_kwargs,
                   settings.max_runoffs)

    # ------------------------------------------------------------------ what was measured

    @property
    def selection(self) -> Selection:
        """Each candidate's measured step time and the one kept (``chosen`` None while measuring)."""
        return self._selector.selection if self._selector is not None else self._selection

    @property
    def current(self) -> Algorithm:
        """The candidate driving the model now (after the choice: the chosen algorithm)."""
        return self._set_up(self._current)

    @property
    def current_name(self) -> str:
        return self.current.name

    # Read by the driver and the wrapper: the answer of the candidate driving the model now.
    @property
    def uses_gradient_buckets(self) -> bool:  # type: ignore[override]
        return self._current is not None and self._current.uses_gradient_buckets

    @property
    def keeps_replicas_identical(self) -> bool:  # type: ignore[override]
        return self._current is None or self._current.keeps_replicas_identical

    @property
    def plan(self) -> BucketPlan | None:
        """The bucket plan of the candidate in use (None when it buckets no gradients)."""
        return getattr(self._current, "plan", None)

    # ------------------------------------------------------------------ life cycle

    def _start(self, name: str) -> None:
        module, comm, plan = self._module, self._comm, self._plan
        assert module is not None and comm is not None and plan is not None
        algorithm = get_algorithm_class(name).from_kwargs(**self.candidate_kwargs)
        hierarchical = getattr(algorithm, "hierarchical", None)
        if self.plan_is_default and isinstance(hierarchical, bool):
            # The default plan carries the candidate's own hierarchical flag, as when it is picked by hand.
            plan = dataclasses.replace(plan, is_hierarchical_reduce=hierarchical)
        algorithm.flatten = self.flatten
        algorithm.plan_is_default = self.plan_is_default
        algorithm.setup(module, comm, plan)
        if self._optimizers:
            algorithm.bind_optimizers(self._optimizers)
        self._current = algorithm

    def _switch(self, name: str) -> None:
        old = self.current
        old.teardown()
        if not old.keeps_replicas_identical:
            assert self._module is not None and self._comm is not None
            average_module_parameters(self._module, self._comm)
        self._start(name)

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        self._module, self._comm, self._plan = module, comm, plan
        if comm.world_size == 1:  # nothing to communicate, nothing to measure: decided at step 0
            self._selection = Selection.alone(self.settings.candidates)
            self._start(self.settings.candidates[0])
            if self._hand_over is not None:
                self._hand_over(self.current)
            return
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        reduce_device = device if comm.is_nccl else torch.device("cpu")
        self._selector = AlgorithmSelector(self.settings, self._switch, group=comm.group, device=device,
                                           reduce_device=reduce_device)
        self._start(self.settings.candidates[0])

    def bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)
        self.current.bind_optimizers(self._optimizers)

    def teardown(self) -> None:
        if self._current is not None:
            self._current.teardown()

    def _chosen(self) -> None:
        """The choice is made: keep what was measured, and hand the chosen algorithm to the driver."""
        assert self._selector is not None
        self._selection, self._selector = self._selector.selection, None
        if self._hand_over is not None:
            self._hand_over(self.current)  # the driver calls it directly from now on

    # ------------------------------------------------------------------ per step: the candidate in use

    def on_forward_start(self, step: int) -> None:
        if self._selector is not None and self._selector.on_forward_start(step) is not None:
            self._chosen()
        self.current.on_forward_start(step)

    def on_backward_start(self, step: int) -> None:
        self.current.on_backward_start(step)

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        self.current.on_grad_ready(param)

    def on_backward_end(self, step: int) -> None:
        self.current.on_backward_end(step)

    def on_optimizer_step_end(self, step: int) -> None:
        self.current.on_optimizer_step_end(step)
        if self._selector is not None:
            self._selector.on_step_end()

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.current.on_optimizer_step(optimizer, step)
        if self._selector is not None:
            self._selector.on_step_end()

    def apply_plan(self, plan: BucketPlan) -> None:
        # Reached only while measuring (after the choice the driver calls the chosen algorithm itself): the
        # candidate in use takes the plan (and checks it), and later candidates start on it too.
        self.current.apply_plan(plan)
        self._plan = plan

    def last_step_timings(self) -> StepTimings | None:
        return self.current.last_step_timings()

    def state_dict(self) -> dict[str, Any]:
        return self.current.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current.load_state_dict(state)

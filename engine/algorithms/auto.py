"""``auto``: an algorithm that measures its candidates in flight and hands the model to the fastest.

Bagua's spelling is ``AutoAlgorithm(candidates=[...])`` (``with_bagua``); ``BaguaStrategy(algorithm="auto")``
runs the same measurement (:class:`~bagua_lightning.engine.autotune.selection.AlgorithmSelector`) by
switching its wrapper's algorithm instead. Here the switching happens inside one engine algorithm, so any
driver of engine algorithms gets it: each hook goes to the candidate driving the model now, and at the
start of a training forward the selector may hand the model to the next candidate (or, after the last
trial, to the one kept). A hand-over tears the previous candidate down, averages the replicas when it let
them drift (decentralized, async) and sets the next one up on the same bucket plan and optimizers, so
every rank switches at the same forward without a broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..autotune.selection import DEFAULT_CANDIDATES, AlgorithmSelector, AutoSettings, Selection
from ..buckets import average_module_parameters
from .base import Algorithm, get_algorithm_class, register_algorithm

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...proto.plan import BucketPlan, StepTimings
    from ..comm import CommContext


@register_algorithm(name="auto", bagua_name="AutoAlgorithm",
                    description="measures its candidate algorithms while training and keeps the fastest",
                    exposed=("selection",))
class AutoAlgorithm(Algorithm):
    """Measure ``candidates`` in flight, then train with the fastest (every rank switches at the same step).

    Each candidate drives ``warmup_steps`` untimed then ``trial_steps`` timed training steps, in the order
    given; the group then keeps the candidate whose median step time (slowest rank) is lowest. What was
    measured and chosen is :attr:`selection` (also logged).

    Args:
        candidates: algorithm names (``"gradient_allreduce"``, ``"bytegrad"``, ``"decentralized"``,
            ``"low_precision_decentralized"``, ``"async"``), each with its default arguments; None:
            gradient_allreduce and bytegrad.
        warmup_steps: untimed steps after each switch (>= 1).
        trial_steps: timed steps per candidate (>= 3; their median counts).
    """

    def __init__(self, candidates: Sequence[str] | None = None, warmup_steps: int = 3, trial_steps: int = 10) -> None:
        self.settings = AutoSettings(
            candidates=DEFAULT_CANDIDATES if candidates is None else candidates,  # type: ignore[arg-type]
            warmup_steps=warmup_steps, trial_steps=trial_steps, prefix="")
        self.candidates = list(self.settings.candidates)
        self.warmup_steps = warmup_steps
        self.trial_steps = trial_steps
        self._current: Algorithm | None = None
        self._selector: AlgorithmSelector | None = None
        self._module: nn.Module | None = None
        self._comm: CommContext | None = None
        self._plan: BucketPlan | None = None
        self._optimizers: list[torch.optim.Optimizer] = []

    # ------------------------------------------------------------------ what was measured

    @property
    def selection(self) -> Selection:
        """Each candidate's measured step time and the one kept (``chosen`` None while measuring)."""
        return self._selector.selection if self._selector is not None else Selection()

    @property
    def current(self) -> Algorithm:
        """The candidate driving the model now."""
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
        algorithm = get_algorithm_class(name).from_kwargs()
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
        device = next((p.device for p in module.parameters()), torch.device("cpu")) if comm.is_nccl \
            else torch.device("cpu")
        self._selector = AlgorithmSelector(self.settings, self._switch, group=comm.group, device=device)
        self._start(self.settings.candidates[0])

    def bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)
        self.current.bind_optimizers(self._optimizers)

    def teardown(self) -> None:
        if self._current is not None:
            self._current.teardown()

    # ------------------------------------------------------------------ per step: the candidate in use

    def on_forward_start(self, step: int) -> None:
        if self._selector is not None and not self._selector.done:
            self._selector.on_batch_start(step)  # may hand the model to another candidate first
        self.current.on_forward_start(step)

    def on_backward_start(self, step: int) -> None:
        self.current.on_backward_start(step)

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        self.current.on_grad_ready(param)

    def on_backward_end(self, step: int) -> None:
        self.current.on_backward_end(step)

    def on_optimizer_step_end(self, step: int) -> None:
        self.current.on_optimizer_step_end(step)

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.current.on_optimizer_step(optimizer, step)

    def apply_plan(self, plan: BucketPlan) -> None:
        self._plan = plan  # later candidates start on it too
        self.current.apply_plan(plan)

    def last_step_timings(self) -> StepTimings | None:
        return self.current.last_step_timings()

    def state_dict(self) -> dict[str, Any]:
        return self.current.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current.load_state_dict(state)

"""Bagua's ``Algorithm`` (a factory) and ``AlgorithmImpl`` (one model's implementation, with its hooks).

``Algorithm.reify(process_group)`` returns a fresh :class:`AlgorithmImpl` for each
wrapped model, so one ``Algorithm`` object may serve several models, each with its
own state.

The ``AlgorithmImpl`` hooks are the public extension API, as in Bagua: a subclass
returns its Bagua tensors (:meth:`AlgorithmImpl.init_tensors`), groups them into
buckets (:meth:`AlgorithmImpl.tensors_to_buckets`), appends operations to each bucket
(:meth:`AlgorithmImpl.init_operations`) and returns the functions run before forward,
per parameter gradient, after backward and after ``optimizer.step()``. The defaults
mark each parameter's gradient ready as autograd produces it, and wait for nothing
(bucket operations finish in the thread that marks the last tensor ready).

The builtin algorithms are :class:`EngineAlgorithmImpl` subclasses: each holds one
instance of the engine's algorithm (``bagua_lightning.engine.algorithms``), the
implementation ``BaguaStrategy`` runs too, and ``with_bagua`` drives that instance
directly (overlapping communication with backward). Their Bagua hooks call the same
engine hooks, so calling them by hand behaves as the engine does.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ...engine.algorithms.base import Algorithm as EngineAlgorithm
from ...engine.buckets import trainable_parameters
from ...engine.comm import CommContext
from ...proto.plan import BucketPlan
from ..bucket import BaguaBucket

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = ["Algorithm", "AlgorithmImpl", "EngineAlgorithmImpl"]


class AlgorithmImpl:
    """One model's implementation of an algorithm (Bagua's ``AlgorithmImpl``).

    Args:
        process_group: the :class:`~bagua_lightning.torch_api.communication.BaguaProcessGroup` to work on.
    """

    def __init__(self, process_group: BaguaProcessGroup) -> None:
        self.process_group = process_group
        self._communication_tensor_names: set[str] = set()

    def need_reset(self) -> bool:
        """True to rebuild tensors, buckets, operations and hooks before the next forward."""
        return False

    def init_tensors(self, bagua_module: nn.Module) -> list[torch.Tensor]:
        """Bagua tensors to communicate: every communicated parameter, with its gradient as effective tensor."""
        tensors = []
        for name, param in bagua_module.bagua_build_params():  # type: ignore[operator]
            param.bagua_ensure_grad()
            tensors.append(param.ensure_bagua_tensor(
                name, bagua_module.bagua_module_name,
                getter_closure=lambda p: p.grad,
                setter_closure=lambda p, t: setattr(p, "grad", t),
            ))
        self._communication_tensor_names = {t._bagua_name for t in tensors}
        return tensors

    def tensors_to_buckets(self, tensors: list[list[torch.Tensor]], do_flatten: bool) -> list[BaguaBucket]:
        """Buckets following Bagua's suggestion ``tensors`` (one bucket per list)."""
        return [BaguaBucket(group, name=f"bucket_{i}", flatten=do_flatten) for i, group in enumerate(tensors)]

    def init_operations(self, bagua_module: nn.Module, bucket: BaguaBucket) -> None:
        """Append this algorithm's operations to ``bucket`` (default: none)."""
        bucket.clear_ops()

    def init_forward_pre_hook(self, bagua_module: nn.Module) -> Callable[[Any], None]:
        """The function run before each training forward; it takes the forward's input."""
        return lambda input: None

    def init_backward_hook(self, bagua_module: nn.Module) -> Callable[[str, torch.nn.Parameter], None]:
        """The function run as each parameter's gradient is ready; takes its name and the parameter."""

        def hook(parameter_name: str, parameter: torch.nn.Parameter) -> None:
            if parameter_name in self._communication_tensor_names:
                parameter.bagua_mark_communication_ready()  # type: ignore[attr-defined]

        return hook

    def init_post_backward_hook(self, bagua_module: nn.Module) -> Callable[[], None]:
        """The function run when backward is done (bucket operations have finished by then)."""
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_module: nn.Module) -> Callable[[torch.optim.Optimizer], None]:
        """The function run after each ``optimizer.step()``; takes the optimizer."""
        return lambda optimizer: None


def _steps(bagua_module: nn.Module) -> int:
    """Optimizer steps the module's driver counted (the engine hooks' ``step``)."""
    driver = getattr(bagua_module, "_bagua_driver", None)
    return int(driver.step) if driver is not None else 0


class Algorithm(abc.ABC):
    """Base class of Bagua's algorithms: a factory of one :class:`AlgorithmImpl` per model."""

    @abc.abstractmethod
    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        """A new implementation working on ``process_group`` (called once per wrapped model)."""


class EngineAlgorithmImpl(AlgorithmImpl):
    """A builtin algorithm: Bagua's hooks over one instance of the engine's algorithm.

    Args:
        process_group: the process group to work on.
        engine: the engine algorithm instance (not set up; this implementation owns it).
    """

    #: Bagua's state names exposed on ``model.bagua_buckets[i]``, mapped to engine state (subclasses).
    bucket_state: ClassVar[dict[str, str]] = {}

    def __init__(self, process_group: BaguaProcessGroup, engine: EngineAlgorithm) -> None:
        super().__init__(process_group)
        self.engine = engine
        self._step = 0

    def init_forward_pre_hook(self, bagua_module: nn.Module) -> Callable[[Any], None]:
        return lambda input: self.engine.on_forward_start(_steps(bagua_module))

    def init_backward_hook(self, bagua_module: nn.Module) -> Callable[[str, torch.nn.Parameter], None]:
        return lambda name, param: self.engine.on_grad_ready(param)

    def init_post_backward_hook(self, bagua_module: nn.Module) -> Callable[[], None]:
        return lambda: self.engine.on_backward_end(_steps(bagua_module))

    def init_post_optimizer_step_hook(self, bagua_module: nn.Module) -> Callable[[torch.optim.Optimizer], None]:
        return lambda optimizer: self.engine.on_optimizer_step_end(_steps(bagua_module))

    def describe_buckets(self, bagua_module: nn.Module, plan: BucketPlan | None) -> list[BaguaBucket]:
        """``model.bagua_buckets``: one unflattened bucket per engine bucket, with the engine's state."""
        if plan is None:
            return []
        by_name = dict(trainable_parameters(bagua_module))
        state_names = self.bucket_state
        return [
            BaguaBucket.describing(
                [by_name[n].ensure_bagua_tensor(n, bagua_module.bagua_module_name)  # type: ignore[attr-defined]
                 for n in names],
                f"bucket_{i}",
                {k: self._state_getter(attr, i) for k, attr in state_names.items()},
            )
            for i, names in enumerate(plan.tensor_names)
        ]

    def _state_getter(self, attr: str, index: int) -> Callable[[], Any]:
        def get() -> Any:
            values = getattr(self.engine, attr)
            if callable(values):
                values = values()
            return values[index]

        return get


class HookedAlgorithm(EngineAlgorithm):
    """Runs a user's :class:`AlgorithmImpl` through the engine's driver (the same hooks the builtins get).

    ``setup`` builds the impl's tensors and buckets (grouped as the engine's plan
    suggests) and their operations; each driver hook calls the impl's hook function.
    """

    name: ClassVar[str] = "custom"

    def __init__(self, impl: AlgorithmImpl, bagua_module: nn.Module, do_flatten: bool) -> None:
        self.impl = impl
        self.bagua_module = bagua_module
        self.do_flatten = do_flatten
        self.buckets: list[BaguaBucket] = []
        self._names: dict[int, str] = {}
        self._plan: BucketPlan | None = None
        self.forward_input: Any = None

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        self._plan = plan
        self._build()

    def _build(self) -> None:
        impl, module = self.impl, self.bagua_module
        tensors = impl.init_tensors(module)
        by_name = {t._bagua_name: t for t in tensors}  # type: ignore[attr-defined]
        grouped: list[list[torch.Tensor]] = []
        used: set[str] = set()
        for names in self._plan.tensor_names if self._plan is not None else []:
            group = [by_name[n] for n in names if n in by_name]
            used.update(n for n in names if n in by_name)
            if group:
                grouped.append(group)
        rest = [t for n, t in by_name.items() if n not in used]
        if rest:
            grouped.append(rest)
        self.buckets = impl.tensors_to_buckets(grouped, self.do_flatten)
        comm = impl.process_group.comm
        for bucket in self.buckets:
            bucket._default_comm = comm
            impl.init_operations(module, bucket)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._forward_pre = impl.init_forward_pre_hook(module)
        self._backward = impl.init_backward_hook(module)
        self._post_backward = impl.init_post_backward_hook(module)
        self._post_step = impl.init_post_optimizer_step_hook(module)
        setattr(module, "bagua_buckets", self.buckets)  # noqa: B010  (nn.Module's __setattr__ typing)

    def on_forward_start(self, step: int) -> None:
        if self.impl.need_reset():
            self._build()
        self._forward_pre(self.forward_input)

    def on_backward_start(self, step: int) -> None:
        for bucket in self.buckets:
            bucket._reset_ready()

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        self._backward(self._names[id(param)], param)

    def on_backward_end(self, step: int) -> None:
        self._post_backward()

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self._post_step(optimizer)

    def bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass

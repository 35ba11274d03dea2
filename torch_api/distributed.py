"""``with_bagua`` on every ``torch.nn.Module`` (Bagua's ``BaguaModule``), driven by the engine.

``model.with_bagua(optimizers, algorithm)`` reifies ``algorithm`` for this model,
broadcasts parameters, buffers and optimizer state from the group's first rank, and
hooks the model itself (forward pre/post hooks, per-parameter gradient hooks,
optimizer step hooks) through the engine's
:class:`~bagua_lightning.engine.ddp.AlgorithmDriver`, the same driver
``BaguaStrategy`` uses. It returns the same module. Calling it again switches the
algorithm (the previous one is torn down first).

A rank outside ``process_group`` trains locally: nothing is broadcast or communicated.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.errors import ConfigurationError
from ..engine.buckets import IGNORE_ATTRIBUTE, default_plan, trainable_parameters
from ..engine.ddp import AlgorithmDriver
from ..engine.elastic_step import ElasticBatchSampler, ElasticSteps
from ..engine.fault_tolerance import FaultTolerance
from . import env
from .algorithms.base import Algorithm, AlgorithmImpl, EngineAlgorithmImpl, HookedAlgorithm
from .bucket import BaguaBucket
from .fault_tolerance import ElasticModule

if TYPE_CHECKING:  # pragma: no cover
    from .process_group import BaguaProcessGroup

__all__ = ["BaguaModule"]


class BaguaModule:
    """The attributes and methods ``with_bagua`` gives every ``torch.nn.Module`` (patched on import).

    Attributes (after ``with_bagua``):
        bagua_optimizers: the optimizers passed to ``with_bagua``.
        bagua_algorithm: the :class:`~bagua_lightning.torch_api.algorithms.AlgorithmImpl` reified for this module.
        process_group: the process group the module communicates on.
        bagua_module_name: the module's unique name.
        parameters_to_ignore: names in ``_bagua_params_and_buffers_to_ignore``.
        bagua_train_step_counter: training forwards run since wrapping.
        bagua_buckets: the module's buckets.
    """

    bagua_module_name: str | None = None

    def bagua_build_params(self: Any) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every communicated parameter that requires a gradient.

        Left out: names in ``_bagua_params_and_buffers_to_ignore`` and parameters marked ``expert``.
        """
        return trainable_parameters(self)

    def with_bagua(
        self: Any,
        optimizers: Sequence[torch.optim.Optimizer],
        algorithm: Algorithm,
        process_group: BaguaProcessGroup | None = None,
        do_flatten: bool = True,
        fault_tolerance: FaultTolerance | None = None,
    ) -> Any:
        """Enable distributed data-parallel training of this module with ``algorithm``.

        Args:
            optimizers: the optimizer(s) training the module.
            algorithm: the distributed algorithm (an :class:`~bagua_lightning.torch_api.algorithms.Algorithm`;
                one object may serve several modules).
            process_group: the group to communicate in; None: the default group of ``init_process_group``.
            do_flatten: parameters move into one flat buffer per bucket (in bucket order) and gradients
                become views of flat communication buffers, as in Bagua. Values are unchanged; an
                optimizer fused before wrapping (``fuse_optimizer``) then finds its parameters moved and
                steps them one by one.
            fault_tolerance: train on while nodes fail and rejoin (docs/fault_tolerance.md): each node is
                one launch on the default group; take batches from :meth:`bagua_batch_sampler`, and
                ``optimizer.step()`` steps only when every node finished the step
                (:mod:`bagua_lightning.torch_api.fault_tolerance`). Algorithms that cannot are refused with
                the reason.

        Returns:
            This module, with Bagua's attributes set.
        """
        return BaguaModule._bagua_wrap(self, optimizers, algorithm, process_group, do_flatten, broadcast_state=True,
                                       fault_tolerance=fault_tolerance)

    def bagua_batch_sampler(self: Any, num_samples: int, batch_size: int, *, seed: int = 0,
                            shuffle: bool = True) -> ElasticBatchSampler:
        """Under ``with_bagua(fault_tolerance=...)``: the ``DataLoader(batch_sampler=...)`` that deals
        ``num_samples`` indices, ``batch_size`` per rank and step, over the nodes alive at each step.

        Use it with ``num_workers=0`` (workers would fetch before the step's nodes are known); ``len()`` is
        an upper bound. The same ``seed`` on every node.
        """
        elastic = getattr(self, "_bagua_elastic", None)
        if elastic is None:
            raise ConfigurationError("bagua_batch_sampler() needs with_bagua(..., fault_tolerance=FaultTolerance())")
        return elastic.batch_sampler(num_samples, batch_size, seed=seed, shuffle=shuffle)

    @property
    def bagua_fault_tolerance(self: Any) -> ElasticSteps | None:
        """This node's fault-tolerant steps (``last_commit``, ``steps_redone``, the sampler), or None."""
        elastic = getattr(self, "_bagua_elastic", None)
        return elastic.steps if elastic is not None else None

    def _bagua_wrap(
        self: Any,
        optimizers: Sequence[torch.optim.Optimizer],
        algorithm: Algorithm,
        process_group: BaguaProcessGroup | None,
        do_flatten: bool,
        *,
        broadcast_state: bool,
        fault_tolerance: FaultTolerance | None = None,
    ) -> Any:
        """:meth:`with_bagua`; ``broadcast_state=False`` re-wraps without broadcasting (weights are in use)."""
        if not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"algorithm must be a bagua_lightning.torch_api.algorithms.Algorithm, got {type(algorithm).__name__}; "
                "e.g. GradientAllReduceAlgorithm() from bagua_lightning.torch_api.algorithms.gradient_allreduce"
            )
        optimizers = list(optimizers)
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizers must be torch optimizers, got {type(opt).__name__}")
        if fault_tolerance is not None and process_group is not None:
            raise ConfigurationError("with_bagua(fault_tolerance=...) trains on the node's default group (each node "
                                     "is one launch); leave process_group=None")
        if process_group is None:
            from .communication import _get_default_group

            process_group = _get_default_group()
        BaguaModule._bagua_teardown(self)
        self.bagua_optimizers = optimizers
        self.process_group = process_group
        if self.bagua_module_name is None:
            self.bagua_module_name = f"{type(self).__name__}_{id(self)}"
        self.parameters_to_ignore = list(getattr(self, IGNORE_ATTRIBUTE, None) or [])
        self.bagua_train_step_counter = 0
        impl = algorithm.reify(process_group)
        if not isinstance(impl, AlgorithmImpl):
            raise TypeError(f"{type(algorithm).__name__}.reify must return an AlgorithmImpl, got {type(impl).__name__}")
        self.bagua_algorithm = impl
        elastic: ElasticModule | None = None
        if fault_tolerance is not None:  # before the engine is set up: it then averages buckets across nodes
            if not isinstance(impl, EngineAlgorithmImpl):
                raise ConfigurationError(f"with_bagua(fault_tolerance=...) runs the builtin algorithms; "
                                         f"{type(impl).__name__} is a custom AlgorithmImpl")
            elastic = ElasticModule(self, optimizers, impl.engine, fault_tolerance)
        self.bagua_buckets: list[BaguaBucket] = []
        driver: AlgorithmDriver | None = None
        hooked: HookedAlgorithm | None = None
        if process_group.is_member:
            if do_flatten:
                _flatten_parameters(self, bool(getattr(impl, "hierarchical", False)))
                for opt in optimizers:
                    _unfuse(opt)
            engine = impl.engine if isinstance(impl, EngineAlgorithmImpl) else \
                (hooked := HookedAlgorithm(impl, self, do_flatten))
            driver = AlgorithmDriver(self, engine, process_group.comm, flatten=do_flatten,
                                     bucket_size=env.get_default_bucket_size(), optimizers=optimizers,
                                     broadcast_state=broadcast_state)
            if isinstance(impl, EngineAlgorithmImpl):
                self.bagua_buckets = impl.describe_buckets(self, getattr(impl.engine, "plan", None)
                                                           or driver.initial_plan)

        def pre_forward(module: nn.Module, args: Any) -> None:
            if module.training:
                self.bagua_train_step_counter += 1
            if driver is not None:
                if hooked is not None:
                    hooked.forward_input = args
                driver.before_forward()

        def post_forward(module: nn.Module, args: Any, out: Any) -> None:
            if driver is not None:
                driver.after_forward(out)

        self._bagua_driver = driver
        if elastic is not None and driver is not None:
            elastic.bind(driver)
        self._bagua_elastic = elastic
        self._bagua_forward_hooks = [self.register_forward_pre_hook(pre_forward),
                                     self.register_forward_hook(post_forward)]
        return self

    def _bagua_teardown(self: Any) -> None:
        """Remove what a previous ``with_bagua`` installed (hooks, the algorithm's threads and buffers)."""
        for handle in getattr(self, "_bagua_forward_hooks", []):
            handle.remove()
        self._bagua_forward_hooks = []
        driver = getattr(self, "_bagua_driver", None)
        if driver is not None:
            driver.teardown()
        self._bagua_driver = None
        elastic = getattr(self, "_bagua_elastic", None)
        if elastic is not None:
            elastic.close()
        self._bagua_elastic = None

    def no_sync(self: Any) -> Any:
        """Backward passes of forwards run inside accumulate gradients locally, without communicating."""
        driver = getattr(self, "_bagua_driver", None)
        if driver is None:
            raise ConfigurationError("no_sync() needs a module wrapped with with_bagua(...) on a member rank")
        return driver.no_sync()


def _flatten_parameters(module: nn.Module, hierarchical: bool) -> None:
    """Move the communicated parameters into one contiguous buffer per bucket of the default plan.

    ``param.data`` is re-pointed at a view of the new buffer (same values, shape and ``Parameter``
    object), so optimizers keep stepping the same parameters. Done before the engine is set up, so its
    buckets see the final storage.
    """
    named = trainable_parameters(module)
    by_name = dict(named)
    plan = default_plan(named, bucket_size=env.get_default_bucket_size(), hierarchical=hierarchical)
    with torch.no_grad():
        for bucket in plan.buckets:
            kinds: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
            for decl in bucket:
                p = by_name[decl.name]
                if not p.is_sparse:
                    kinds.setdefault((p.dtype, p.device), []).append(p)
            for params in kinds.values():
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                offset = 0
                for p in params:
                    p.data = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()


def _unfuse(optimizer: torch.optim.Optimizer) -> None:
    """A fused optimizer whose parameters ``do_flatten`` just moved steps tensor by tensor from now on.

    As in Bagua: its flat layout (and its state's) is gone, so ``fuse_step()`` becomes ``step()`` (same
    result; ``_bagua_fused_count`` stops growing). Wrap with ``do_flatten=False`` to keep fused steps.
    """
    if hasattr(optimizer, "fuse_step") and hasattr(optimizer, "_bagua_fused_count"):
        def plain_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
            return self.step(closure)

        optimizer.fuse_step = types.MethodType(plain_step, optimizer)


def _patch_module() -> None:
    nn.Module.bagua_module_name = None  # type: ignore[attr-defined]
    nn.Module.bagua_build_params = BaguaModule.bagua_build_params  # type: ignore[attr-defined]
    nn.Module.with_bagua = BaguaModule.with_bagua  # type: ignore[attr-defined]
    nn.Module.bagua_batch_sampler = BaguaModule.bagua_batch_sampler  # type: ignore[attr-defined]
    nn.Module.bagua_fault_tolerance = BaguaModule.bagua_fault_tolerance  # type: ignore[attr-defined]
    nn.Module._bagua_teardown = BaguaModule._bagua_teardown  # type: ignore[attr-defined]
    nn.Module._bagua_wrap = BaguaModule._bagua_wrap  # type: ignore[attr-defined]


_patch_module()

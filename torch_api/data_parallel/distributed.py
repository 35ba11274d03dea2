"""Bagua's ``DistributedDataParallel``: PyTorch DDP's constructor plus ``optimizers`` and ``algorithm``.

The wrapper holds the module (``.module``) and runs ``module.with_bagua(...)``, so
``bagua_algorithm``, ``bagua_optimizers`` and ``bagua_buckets`` are the module's.
``find_unused_parameters=True`` needs no fallback to PyTorch's DDP: after a forward,
parameters outside the output's autograd graph leave the buckets (as Bagua rebuilt
its buckets), and ``inner.bagua_build_params()`` lists the ones communicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from ...engine.buckets import UNUSED_ATTRIBUTE
from ...engine.ddp import AlgorithmDriver
from .. import distributed as _distributed  # noqa: F401  (patches torch.nn.Module)
from ..algorithms.base import Algorithm
from ..algorithms.gradient_allreduce import GradientAllReduceAlgorithm

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0", "to_bagua_process_group"]


def to_bagua_process_group(process_group: Any = None) -> BaguaProcessGroup:
    """A Bagua process group for ``process_group`` (a torch group, a Bagua group, or None: the default)."""
    from ..communication import BaguaProcessGroup, _get_default_group, from_torch_group

    if process_group is None:
        return _get_default_group()
    if isinstance(process_group, BaguaProcessGroup):
        return process_group
    if isinstance(process_group, dist.ProcessGroup):
        return from_torch_group(process_group)
    raise TypeError(
        f"process_group must be None, a torch ProcessGroup or a BaguaProcessGroup, got {type(process_group).__name__}"
    )


def _reached_parameters(out: Any) -> set[int]:
    """ids of the tensors whose gradient the autograd graph of ``out`` accumulates."""
    stack = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    reached: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return reached


class DistributedDataParallel_V1_9_0(nn.Module):
    """PyTorch 1.9 DDP's interface over ``with_bagua`` (what :func:`DistributedDataParallel` returns).

    Args: as :func:`DistributedDataParallel`.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        algorithm: Algorithm | None = None,
    ) -> None:
        super().__init__()
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"device_ids can only be None or contain a single element, got {device_ids}")
        if dim != 0:
            raise ValueError(f"dim={dim} is not supported; inputs are not scattered, pass dim=0")
        if not broadcast_buffers:
            raise ValueError("broadcast_buffers=False is not supported: buffers are broadcast from the first rank")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("DistributedDataParallel is not needed for a module without trainable parameters")
        kinds = {p.device.type for p in module.parameters()}
        if len(kinds) != 1:
            raise ValueError(f"the module's parameters must be on one type of device, found {sorted(kinds)}")
        self.module = module
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._optimizers = list(optimizers)
        self._algorithm = algorithm if algorithm is not None else GradientAllReduceAlgorithm()
        self._process_group = to_bagua_process_group(process_group)
        self._flatten = gradient_as_bucket_view
        if module.bagua_module_name is None:
            module.bagua_module_name = f"{type(self).__name__}_{id(module)}"
        setattr(module, UNUSED_ATTRIBUTE, set())
        self._wrap(broadcast_state=True)

    def _wrap(self, *, broadcast_state: bool) -> None:
        self.module._bagua_wrap(self._optimizers, self._algorithm, self._process_group,  # type: ignore[operator]
                                self._flatten, broadcast_state=broadcast_state)

    @property
    def inner(self) -> nn.Module:
        """The wrapped module (Bagua's inner data-parallel object: ``bagua_build_params()`` and the rest)."""
        return self.module

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        out = self.module(*inputs, **kwargs)
        if self.find_unused_parameters and torch.is_grad_enabled() and self.module.training:
            reached = _reached_parameters(out)
            unused = {n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in reached}
            if unused != getattr(self.module, UNUSED_ATTRIBUTE):
                # Bagua rebuilds its buckets from the parameters the graph uses; so does the engine
                # (every rank runs the same graph, so every rank rebuilds at the same step).
                setattr(self.module, UNUSED_ATTRIBUTE, unused)
                steps = self.module.bagua_train_step_counter
                self._wrap(broadcast_state=False)  # the forward's weights are in use; they are equal already
                self.module.bagua_train_step_counter = steps
                driver: AlgorithmDriver | None = getattr(self.module, "_bagua_driver", None)
                if driver is not None:
                    driver.before_forward()
                    driver.after_forward(out)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in forwards/backwards run inside; the next one outside synchronises."""
        with self.module.no_sync():  # type: ignore[operator]
            yield

    @property
    def require_backward_grad_sync(self) -> bool:
        driver = getattr(self.module, "_bagua_driver", None)
        return bool(driver is None or driver._sync)

    @property
    def parameters_to_ignore(self) -> list[str]:
        return list(self.module.parameters_to_ignore)  # type: ignore[arg-type]

    @property
    def bagua_algorithm(self) -> Any:
        return self.module.bagua_algorithm

    @property
    def bagua_optimizers(self) -> Any:
        return self.module.bagua_optimizers

    @property
    def bagua_buckets(self) -> Any:
        return self.module.bagua_buckets


def DistributedDataParallel(
    module: nn.Module,
    device_ids: list[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    dim: int = 0,
    broadcast_buffers: bool = True,
    process_group: Any = None,
    bucket_cap_mb: int = 25,
    find_unused_parameters: bool = False,
    check_reduction: bool = False,
    gradient_as_bucket_view: bool = True,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    algorithm: Algorithm | None = None,
) -> DistributedDataParallel_V1_9_0:
    """PyTorch DDP's constructor plus Bagua's ``optimizers`` and ``algorithm`` (default: gradient allreduce).

    Args:
        module: the model (on its device).
        device_ids: None, or one device (the module's).
        output_device: accepted for DDP's signature (the module decides where its output lives).
        dim: accepted for DDP's signature (must be 0).
        broadcast_buffers: must be True: buffers are broadcast from the first rank at wrap time.
        process_group: a torch ProcessGroup, a BaguaProcessGroup or None (the default group).
        bucket_cap_mb: accepted for DDP's signature (the bucket size is ``BAGUA_DEFAULT_BUCKET_SIZE``'s).
        find_unused_parameters: parameters without a gradient in a backward count as zero gradients.
        check_reduction: deprecated in DDP, ignored.
        gradient_as_bucket_view: gradients become views of the communication buckets.
        optimizers: the optimizer(s) training the module.
        algorithm: the Bagua algorithm (default ``GradientAllReduceAlgorithm()``).
    """
    return DistributedDataParallel_V1_9_0(
        module, device_ids, output_device, dim, broadcast_buffers, process_group, bucket_cap_mb,
        find_unused_parameters, check_reduction, gradient_as_bucket_view, optimizers, algorithm,
    )

"""Bagua's ``DistributedDataParallel``: PyTorch DDP's constructor plus ``optimizers`` and ``algorithm``.

The wrapper holds the module (``.module``) and runs ``module.with_bagua(...)``, so
``bagua_algorithm``, ``bagua_optimizers`` and ``bagua_buckets`` are the module's.
``find_unused_parameters=True`` needs no fallback to PyTorch's DDP: the engine
treats a parameter that received no gradient in a backward as a zero gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

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


class DistributedDataParallel_V1_9_0(nn.Module):  # noqa: N801  (Bagua's name)
    """The wrapper :func:`DistributedDataParallel` returns (PyTorch 1.9 DDP's interface)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: Any = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        algorithm: Algorithm | None = None,
    ) -> None:
        super().__init__()
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("DistributedDataParallel is not needed for a module without trainable parameters")
        kinds = {p.device.type for p in module.parameters()}
        if len(kinds) != 1:
            raise ValueError(f"the module's parameters must be on one type of device, found {sorted(kinds)}")
        self.module = module
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = True
        if module.bagua_module_name is None:  # type: ignore[attr-defined]
            module.bagua_module_name = f"{type(self).__name__}_{id(module)}"  # type: ignore[attr-defined]
        module.with_bagua(  # type: ignore[attr-defined, operator]
            list(optimizers), algorithm if algorithm is not None else GradientAllReduceAlgorithm(),
            process_group=to_bagua_process_group(process_group), do_flatten=gradient_as_bucket_view,
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

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

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        # Bagua's wrapper keeps the module's keys under "module." as PyTorch's DDP does.
        return super().state_dict(*args, **kwargs)


def DistributedDataParallel(  # noqa: N802  (Bagua's name: a function that returns the wrapper)
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
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids can only be None or contain a single element, got {device_ids}")
    if dim != 0:
        raise ValueError(f"dim={dim} is not supported; inputs are not scattered, pass dim=0")
    if not broadcast_buffers:
        raise ValueError("broadcast_buffers=False is not supported: buffers are broadcast from the first rank")
    return DistributedDataParallel_V1_9_0(
        module, process_group=process_group, find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view, optimizers=optimizers, algorithm=algorithm,
    )

"""The fused optimizer under its module names (implementation: ``engine/contrib/fused_optimizer.py``).

``FusedOptimizer`` is the class form of :func:`fuse_optimizer` that Bagua scripts written before
``fuse_optimizer`` existed use: ``FusedOptimizer(optimizer, do_flatten)`` converts ``optimizer`` in place and
returns an optimizer whose ``step`` is the fused step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...engine.contrib.fused_optimizer import fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["FusedOptimizer", "fuse_optimizer", "fuse_step", "is_fused_optimizer"]


class FusedOptimizer(torch.optim.Optimizer):
    """Any optimizer with its update fused per contiguous run of parameters.

    The wrapped optimizer is converted in place (see :func:`fuse_optimizer`), so it stays usable on its own:
    its ``step()`` updates tensor by tensor, this object's ``step()`` is its ``fuse_step()``. Both share one
    set of parameter groups and one state.

    Args:
        optimizer: Any ``torch.optim.Optimizer`` with an element-wise update rule, not yet fused.
        do_flatten: Move the parameters, gradients and parameter-shaped state into flat buffers. Leave it off
            when ``with_bagua`` (or ``BaguaStrategy``) lays the parameters out already.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, or its update rule is not element-wise.
        RuntimeError: ``optimizer`` is already fused.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, do_flatten: bool = False) -> None:
        fuse_optimizer(optimizer, do_flatten=do_flatten)
        # Optimizer.__init__ sets up the hook registries; the groups and state are then the wrapped ones
        # (same objects), so a learning-rate scheduler or a state_dict sees one optimizer.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one fused parameter update; see :func:`fuse_step`."""
        return fuse_step(self.optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter, as the wrapped optimizer's ``zero_grad`` does."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (the unfused layout)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an (unfused or fused) optimizer's state dict into the flat buffers."""
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

"""Bagua's ``BaguaTensor``: methods patched onto ``torch.Tensor`` (``ensure_bagua_tensor`` and the rest).

A Bagua tensor is a *proxy* (usually a parameter) plus a getter closure that returns
the *effective* tensor communicated (for gradient algorithms ``param.grad``) and a
setter closure that replaces it. :meth:`BaguaTensor.bagua_mark_communication_ready`
tells the bucket holding the tensor that its effective tensor is final for this
step; when every tensor of a bucket is ready, the bucket runs its operations
(:mod:`bagua_lightning.torch_api.bucket`).

Importing this module patches ``torch.Tensor`` (as importing ``bagua.torch_api`` did).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

Getter = Callable[[torch.Tensor], torch.Tensor]
Setter = Callable[[torch.Tensor, torch.Tensor], None]


class ReadyListener(Protocol):
    """What a Bagua tensor needs of the bucket holding it (:class:`~.bucket.BaguaBucket`)."""

    def _mark_ready(self, tensor: torch.Tensor) -> None:
        """``tensor`` is final for this step."""


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _no_setter(proxy: torch.Tensor, new: torch.Tensor) -> None:
    return None


class BaguaTensor:
    """The methods Bagua adds to ``torch.Tensor`` (patched on import; not instantiated)."""

    _bagua_name: str
    _bagua_module_name: str | None
    _bagua_getter: Getter
    _bagua_setter: Setter
    _bagua_bucket: ReadyListener | None

    def ensure_bagua_tensor(
        self: Any,
        name: str | None = None,
        module_name: str | None = None,
        getter_closure: Getter | None = None,
        setter_closure: Setter | None = None,
    ) -> torch.Tensor:
        """Make this tensor a Bagua tensor in place and return it.

        Args:
            name: unique name of the tensor (default: a name from its id).
            module_name: ``model.bagua_module_name`` of the model it belongs to.
            getter_closure: proxy -> effective tensor (default: the tensor itself).
            setter_closure: ``(proxy, new)`` replaces the effective tensor (default: no-op).
        """
        if getattr(self, "_bagua_name", None) is not None and name is None:
            return self  # already a Bagua tensor: keep its registration
        self._bagua_name = name if name is not None else f"tensor_{id(self)}"
        self._bagua_module_name = module_name
        self._bagua_getter = getter_closure if getter_closure is not None else _identity
        self._bagua_setter = setter_closure if setter_closure is not None else _no_setter
        self._bagua_bucket = None
        return self

    def to_bagua_tensor(
        self: Any,
        name: str | None = None,
        module_name: str | None = None,
        getter_closure: Getter | None = None,
        setter_closure: Setter | None = None,
    ) -> torch.Tensor:
        """A new Bagua tensor sharing this tensor's storage (see :meth:`ensure_bagua_tensor`)."""
        new = self.view(self.shape) if not isinstance(self, torch.nn.Parameter) else \
            torch.nn.Parameter(self.data, requires_grad=self.requires_grad)
        return BaguaTensor.ensure_bagua_tensor(new, name, module_name, getter_closure, setter_closure)

    def is_bagua_tensor(self: Any) -> bool:
        """Whether :meth:`ensure_bagua_tensor` made this a Bagua tensor."""
        return getattr(self, "_bagua_name", None) is not None

    def _require_bagua(self: Any) -> None:
        if not BaguaTensor.is_bagua_tensor(self):
            raise RuntimeError("this tensor is not a Bagua tensor; call tensor.ensure_bagua_tensor(...) first")

    def bagua_getter_closure(self: Any) -> torch.Tensor:
        """The effective tensor (what communication works on)."""
        BaguaTensor._require_bagua(self)
        return self._bagua_getter(self)

    def bagua_setter_closure(self: Any, tensor: torch.Tensor) -> None:
        """Replace the effective tensor with ``tensor``."""
        BaguaTensor._require_bagua(self)
        self._bagua_setter(self, tensor)

    def bagua_ensure_grad(self: Any) -> torch.Tensor:
        """Give the tensor a zero gradient if it has none; returns the tensor."""
        if self.grad is None:
            with torch.no_grad():
                self.grad = torch.zeros_like(self)
        return self

    def bagua_set_storage(self: Any, storage: Any, storage_offset: int = 0) -> None:
        """Point the effective tensor at ``storage`` (from ``storage_offset``), keeping its values' shape."""
        effective = BaguaTensor.bagua_getter_closure(self)
        with torch.no_grad():
            effective.set_(storage, storage_offset, effective.shape, effective.stride())

    def bagua_backend_tensor(self: Any) -> torch.Tensor:
        """The effective tensor (the engine has no separate backend tensor)."""
        return BaguaTensor.bagua_getter_closure(self)

    def bagua_mark_communication_ready(self: Any) -> None:
        """This tensor is final for the step: its bucket runs its operations once all its tensors are."""
        BaguaTensor._require_bagua(self)
        bucket = self._bagua_bucket
        if bucket is None:
            raise RuntimeError(
                f"Bagua tensor {self._bagua_name!r} is in no bucket; build buckets "
                "(AlgorithmImpl.tensors_to_buckets) before marking it ready"
            )
        bucket._mark_ready(self)

    def bagua_mark_communication_ready_without_synchronization(self: Any) -> None:
        """As :meth:`bagua_mark_communication_ready` (the engine orders streams itself)."""
        BaguaTensor.bagua_mark_communication_ready(self)


_METHODS = (
    "ensure_bagua_tensor",
    "to_bagua_tensor",
    "is_bagua_tensor",
    "bagua_getter_closure",
    "bagua_setter_closure",
    "bagua_ensure_grad",
    "bagua_set_storage",
    "bagua_backend_tensor",
    "bagua_mark_communication_ready",
    "bagua_mark_communication_ready_without_synchronization",
)


def _patch_tensor() -> None:
    for name in _METHODS:
        setattr(torch.Tensor, name, getattr(BaguaTensor, name))


_patch_tensor()

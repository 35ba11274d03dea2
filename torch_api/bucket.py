"""Bagua's ``BaguaBucket``: Bagua tensors communicated together, and the operations run on them.

A bucket runs its operations, in the order they were appended, once every tensor in
it was marked ready (:meth:`~bagua_lightning.torch_api.tensor.BaguaTensor.bagua_mark_communication_ready`).
The operations are the engine's collectives (:mod:`bagua_lightning.engine.comm`):
a centralized synchronous operation is the same allreduce, hierarchical allreduce or
compressed (ByteGrad) exchange the builtin algorithms run. Operations run in the
thread that marks the last tensor ready (autograd's, during backward), so they are
finished when ``backward()`` returns.

The builtin algorithms (``GradientAllReduceAlgorithm``, ...) keep their own buckets in
the engine (overlapped with backward); their ``model.bagua_buckets`` describe those
buckets and expose the algorithm's state under Bagua's names (``_peer_weight``,
``_weight``, ``_left_peer_weight``, ``_right_peer_weight``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..engine.comm import CommContext, all_reduce_, hierarchical_all_reduce_
from ..engine.compressed_comm import compressed_all_reduce_
from . import tensor as _tensor  # noqa: F401  (patches torch.Tensor)

if TYPE_CHECKING:  # pragma: no cover
    from .process_group import BaguaProcessGroup

#: The compression Bagua's operations accept (MinMax uint8 chunks, as ByteGrad's).
COMPRESSIONS = ("MinMaxUInt8",)


def _comm_of(group: BaguaProcessGroup | None, default: CommContext | None) -> CommContext:
    if group is not None:
        return group.comm
    if default is not None:
        return default
    from .communication import _get_default_group

    return _get_default_group().comm


class BaguaBucket:
    """A list of Bagua tensors communicated together.

    Args:
        tensors: Bagua tensors (``ensure_bagua_tensor`` was called on each).
        name: the bucket's unique name.
        flatten: make the effective tensors views of one contiguous buffer (their
            setter closures are called with the views).
        alignment: pad the buffer so its length is a multiple of this.
    """

    def __init__(self, tensors: list[torch.Tensor], name: str, flatten: bool, alignment: int = 1) -> None:
        if not tensors:
            raise ValueError(f"bucket {name!r} needs at least one tensor")
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        for t in tensors:
            if not t.is_bagua_tensor():  # type: ignore[attr-defined]
                raise ValueError(f"bucket {name!r}: every tensor must be a Bagua tensor (call ensure_bagua_tensor)")
        self.name = name
        self.tensors = list(tensors)
        self.alignment = alignment
        self._ops: list[Callable[[BaguaBucket], None]] = []
        self._ready: set[int] = set()
        self._default_comm: CommContext | None = None
        self._engine_state: dict[str, Callable[[], Any]] = {}
        effective = [t.bagua_getter_closure() for t in self.tensors]  # type: ignore[attr-defined]
        numel = sum(e.numel() for e in effective)
        self._padding = math.ceil(numel / alignment) * alignment - numel
        self._flat: torch.Tensor | None = None
        if flatten:
            first = effective[0]
            self._flat = torch.zeros(numel + self._padding, dtype=first.dtype, device=first.device)
            offset = 0
            with torch.no_grad():
                for t, e in zip(self.tensors, effective, strict=True):
                    view = self._flat[offset : offset + e.numel()].view_as(e)
                    view.copy_(e)
                    t.bagua_setter_closure(view)  # type: ignore[attr-defined]
                    offset += e.numel()
        for t in self.tensors:
            t._bagua_bucket = self  # type: ignore[attr-defined]

    @classmethod
    def describing(cls, tensors: list[torch.Tensor], name: str,
                   state: dict[str, Callable[[], Any]]) -> BaguaBucket:
        """A bucket that describes one of the engine's buckets (no operations, no flattening).

        ``state`` maps attribute names (Bagua's, e.g. ``_peer_weight``) to functions that read
        the engine's current state for this bucket.
        """
        bucket = cls(tensors, name, flatten=False)
        bucket._engine_state = dict(state)
        return bucket

    def __getattr__(self, name: str) -> Any:
        # Builtin algorithms expose their per-bucket state (``_peer_weight``, ...) through here.
        state = self.__dict__.get("_engine_state", {})
        if name in state:
            return state[name]()
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ tensors

    def _effective(self) -> list[torch.Tensor]:
        return [t.bagua_getter_closure() for t in self.tensors]  # type: ignore[attr-defined]

    def check_flatten(self) -> bool:
        """True if the effective tensors are contiguous in memory, in order."""
        effective = self._effective()
        expected = effective[0].data_ptr()
        for e in effective:
            if not e.is_contiguous() or e.data_ptr() != expected:
                return False
            expected += e.numel() * e.element_size()
        return True

    def flattened_tensor(self) -> torch.Tensor:
        """The effective tensors (and padding) as one contiguous tensor: the buffer itself when flattened."""
        if self._flat is not None and self.check_flatten() and self._effective()[0].data_ptr() == self._flat.data_ptr():
            return self._flat
        effective = self._effective()
        parts = [e.detach().reshape(-1) for e in effective]
        if self._padding:
            parts.append(torch.zeros(self._padding, dtype=effective[0].dtype, device=effective[0].device))
        return torch.cat(parts)

    def bytes(self) -> int:
        """Bytes the bucket's effective tensors (and padding) occupy."""
        effective = self._effective()
        return sum(e.numel() * e.element_size() for e in effective) + self._padding * effective[0].element_size()

    # ------------------------------------------------------------------ operations

    def append_python_op(self, python_function: Callable[[str], None], group: Any = None) -> BaguaBucket:
        """Append ``python_function(bucket_name)`` to the operations run when the bucket is ready."""
        self._ops.append(lambda bucket: python_function(bucket.name))
        return self

    def append_centralized_synchronous_op(
        self,
        hierarchical: bool = False,
        average: bool = True,
        scattergather: bool = False,
        compression: str | None = None,
        group: BaguaProcessGroup | None = None,
    ) -> BaguaBucket:
        """Append a sum (or average) of the bucket over all ranks of ``group``.

        Args:
            hierarchical: reduce within the node first, then among node leaders, then broadcast.
            average: average instead of sum.
            scattergather: accepted for Bagua's signature; the compressed exchange is always a
                scatter-gather and the plain one an allreduce.
            compression: None, or ``"MinMaxUInt8"`` (ByteGrad's compressed exchange).
            group: the process group (None: the algorithm's, else the default group).
        """
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r} is not supported; use None or one of {list(COMPRESSIONS)}")

        def op(bucket: BaguaBucket) -> None:
            comm = _comm_of(group, bucket._default_comm)
            n = sum(e.numel() for e in bucket._effective())
            parts = comm.world_size if compression is not None else 1
            flat = bucket.flattened_tensor()
            if flat.numel() % parts:
                flat = torch.cat([flat, flat.new_zeros(parts - flat.numel() % parts)])
            if compression is not None:
                compressed_all_reduce_(flat, comm, average=average, hierarchical=hierarchical)
            elif hierarchical:
                hierarchical_all_reduce_(flat, comm, average=average)
            else:
                all_reduce_(flat, comm, average=average)
            bucket._scatter_back(flat, n)

        self._ops.append(op)
        return self

    def append_decentralized_synchronous_op(self, peer_weight: torch.Tensor, hierarchical: bool = True,
                                            peer_selection_mode: str = "all", group: Any = None) -> Any:
        """Not provided as a bucket operation: use ``DecentralizedAlgorithm`` (the engine's implementation)."""
        raise NotImplementedError(
            "decentralized averaging runs as the engine's DecentralizedAlgorithm; wrap the model with "
            "with_bagua([...], DecentralizedAlgorithm(...)) instead of appending the operation to a bucket"
        )

    def append_low_precision_decentralized_synchronous_op(self, weight: torch.Tensor, left_peer_weight: torch.Tensor,
                                                          right_peer_weight: torch.Tensor, hierarchical: bool = True,
                                                          compression: str = "MinMaxUInt8", group: Any = None) -> Any:
        """Not provided as a bucket operation: use ``LowPrecisionDecentralizedAlgorithm``."""
        raise NotImplementedError(
            "low precision decentralized averaging runs as the engine's LowPrecisionDecentralizedAlgorithm; wrap "
            "the model with with_bagua([...], LowPrecisionDecentralizedAlgorithm(...)) instead"
        )

    def append_asynchronous_model_average_op(self, peer_selection_mode: str, group: Any = None) -> Any:
        """Not provided as a bucket operation: use ``AsyncModelAverageAlgorithm``."""
        raise NotImplementedError(
            "asynchronous model averaging runs as the engine's AsyncModelAverageAlgorithm; wrap the model with "
            "with_bagua([...], AsyncModelAverageAlgorithm(...)) instead"
        )

    def clear_ops(self) -> BaguaBucket:
        """Remove every appended operation."""
        self._ops = []
        return self

    # ------------------------------------------------------------------ execution

    def _scatter_back(self, flat: torch.Tensor, numel: int) -> None:
        """Write ``flat`` (the reduced buffer) into the effective tensors unless it is their own storage."""
        if self._flat is not None and flat.data_ptr() == self._flat.data_ptr():
            return
        offset = 0
        with torch.no_grad():
            for e in self._effective():
                e.copy_(flat[offset : offset + e.numel()].view_as(e))
                offset += e.numel()

    def _mark_ready(self, tensor: torch.Tensor) -> None:
        self._ready.add(id(tensor))
        if len(self._ready) == len(self.tensors):
            self._ready = set()
            for op in self._ops:
                op(self)

    def _reset_ready(self) -> None:
        self._ready = set()

    def __repr__(self) -> str:
        return f"BaguaBucket(name={self.name!r}, tensors={len(self.tensors)})"

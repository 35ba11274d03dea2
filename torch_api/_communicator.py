"""The operation methods of a Bagua communicator (``comm.allreduce_inplace(tensor, op)``, ``comm.abort()``).

Bagua's communicator objects exposed the collectives as methods taking positional arguments
(``allreduce(send, recv, op)``, ``broadcast(tensor, root_rank)``, ``send(tensor, peer_rank)``, ...), and
``abort()`` to interrupt an operation stuck on a peer that will never answer. The methods here run the
module-level primitives of :mod:`.communication` on this communicator.

An operation runs on a helper thread while the calling thread waits for it or for ``abort()``, whichever
comes first, so that ``abort()`` from another thread releases a caller blocked on a peer. After
``abort()`` every operation of the communicator returns at once without communicating.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch

from ._ops import ReduceOp

__all__ = ["CommunicatorOps", "bind_primitives", "operations_left_behind"]

log = logging.getLogger(__name__)

# A peer that aborts and exits closes its connections, which fails the operation this rank still waits
# in; Bagua's NCCL operation would have hung until this rank aborted too. Such a failure followed by this
# rank's own abort() within this many seconds is read as that abort, not as an error.
_ABORT_GRACE_S = 5.0
_POLL_S = 0.02
# An operation left behind by abort() still sits in the backend; the process may only exit once it has
# failed (the backend's threads abort the process otherwise), which happens when its peers go away.
_EXIT_WAIT_S = 60.0
_left_behind: set[threading.Thread] = set()


def _wait_left_behind() -> None:
    from ..engine import peer_watch

    if peer_watch.job_failed():
        return  # a rank failed: the peers the operation waits for are not coming
    deadline = time.monotonic() + _EXIT_WAIT_S
    for thread in list(_left_behind):
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_wait_left_behind)


def operations_left_behind() -> bool:
    """Whether abort() left an operation of this process in the backend (its groups are then unusable)."""
    return any(thread.is_alive() for thread in _left_behind)


def bind_primitives(module: ModuleType) -> None:
    """Make ``module``'s primitives (``send``, ``allreduce``, ...) the ones the communicator methods run."""
    CommunicatorOps._primitives = module


class CommunicatorOps:
    """Bagua's communicator methods; mixed into :class:`~.process_group.BaguaCommunicator`."""

    _abort_event: threading.Event
    #: The module whose primitives the methods run (:mod:`.communication`). It binds itself as it loads
    #: (:func:`bind_primitives`): it sits above this module, whose class the process groups it imports use.
    _primitives: ClassVar[ModuleType | None] = None

    def _init_ops(self) -> None:
        self._abort_event = threading.Event()

    def abort(self) -> None:
        """Stop the communicator: a pending operation returns, and every later one returns at once.

        On NCCL the torch group is aborted too, as Bagua's ``ncclCommAbort``: kernels already queued that wait
        for a peer return, so a later ``synchronize()`` of their stream does not hang.
        """
        self._abort_event.set()
        group = getattr(self, "torch_group", None)
        if group is not None and getattr(self, "backend", "") == "nccl":
            try:
                torch.distributed.distributed_c10d._abort_process_group(group)
            except (RuntimeError, ValueError, AttributeError) as exc:  # already aborted or destroyed
                log.debug("aborting the NCCL group of %r: %s", self, exc)

    def check_abort(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._abort_event.is_set()

    def device_id(self) -> int:
        """The CUDA device index of an NCCL communicator; -1 on the CPU (Gloo)."""
        device: torch.device = self.device  # type: ignore[attr-defined]
        return device.index if device.type == "cuda" and device.index is not None else -1

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args, comm=self)`` until it returns or the communicator is aborted."""
        if self.check_abort():
            return
        errors: list[BaseException] = []
        done = threading.Event()
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        stream = torch.cuda.current_stream() if device is not None else None

        def work() -> None:
            try:
                if device is not None and stream is not None:
                    # The current device and stream are per thread: carry the caller's over.
                    torch.cuda.set_device(device)
                    with torch.cuda.stream(stream):
                        fn(*args, comm=self)
                else:
                    fn(*args, comm=self)
            except BaseException as exc:  # handed to the caller below
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=work, name="bagua-communicator-op", daemon=True)
        thread.start()
        while not done.wait(_POLL_S):
            if self.check_abort():
                _left_behind.add(thread)
                return
        if errors:
            err = errors[0]
            if isinstance(err, RuntimeError) and self._abort_event.wait(_ABORT_GRACE_S):
                return
            raise err

    def _fns(self) -> Any:
        if self._primitives is None:
            raise RuntimeError("Bagua's communication primitives are not loaded; import bagua_lightning.torch_api")
        return self._primitives

    def send(self, tensor: torch.Tensor, peer_rank: int) -> None:
        """Send ``tensor`` to communicator rank ``peer_rank``."""
        self._run(self._fns().send, tensor, peer_rank)

    def recv(self, tensor: torch.Tensor, peer_rank: int) -> None:
        """Receive into ``tensor`` from communicator rank ``peer_rank``."""
        self._run(self._fns().recv, tensor, peer_rank)

    def broadcast(self, tensor: torch.Tensor, root_rank: int) -> None:
        """Copy ``tensor`` of communicator rank ``root_rank`` into ``tensor`` on every rank."""
        self._run(self._fns().broadcast, tensor, root_rank)

    def allreduce(self, send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: int = ReduceOp.SUM) -> None:
        """Reduce ``send_tensor`` over the ranks with ``op`` (a :class:`ReduceOp` or its value) into ``recv_tensor``."""
        self._run(self._fns().allreduce, send_tensor, recv_tensor, op)

    def allreduce_inplace(self, tensor: torch.Tensor, op: int = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` over the ranks with ``op``, in place."""
        self._run(self._fns().allreduce_inplace, tensor, op)

    def reduce(self, send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int,
               op: int = ReduceOp.SUM) -> None:
        """Reduce ``send_tensor`` with ``op`` into ``recv_tensor`` of communicator rank ``dst``."""
        self._run(self._fns().reduce, send_tensor, recv_tensor, dst, op)

    def reduce_inplace(self, tensor: torch.Tensor, dst: int, op: int = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` with ``op`` into ``tensor`` of communicator rank ``dst``."""
        self._run(self._fns().reduce_inplace, tensor, dst, op)

    def allgather(self, send_tensor: torch.Tensor, recv_tensor: torch.Tensor) -> None:
        """Concatenate every rank's ``send_tensor`` into ``recv_tensor``, in rank order."""
        self._run(self._fns().allgather, send_tensor, recv_tensor)

    def allgather_inplace(self, tensor: torch.Tensor) -> None:
        """Allgather where each rank's input is its own slice of ``tensor``."""
        self._run(self._fns().allgather_inplace, tensor)

    def gather(self, send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int) -> None:
        """Concatenate every rank's ``send_tensor`` into ``recv_tensor`` of communicator rank ``dst``."""
        self._run(self._fns().gather, send_tensor, recv_tensor, dst)

    def gather_inplace(self, tensor: torch.Tensor, count: int, dst: int) -> None:
        """Gather ``count`` elements per rank into ``tensor`` of communicator rank ``dst``."""
        self._run(self._fns().gather_inplace, tensor, count, dst)

    def scatter(self, send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int) -> None:
        """Split ``send_tensor`` of communicator rank ``src`` into every rank's ``recv_tensor``."""
        self._run(self._fns().scatter, send_tensor, recv_tensor, src)

    def scatter_inplace(self, tensor: torch.Tensor, count: int, src: int) -> None:
        """Scatter ``count`` elements per rank from ``tensor`` of communicator rank ``src``."""
        self._run(self._fns().scatter_inplace, tensor, count, src)

    def reduce_scatter(self, send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: int = ReduceOp.SUM) -> None:
        """Reduce ``send_tensor`` with ``op`` and give each rank its slice in ``recv_tensor``."""
        self._run(self._fns().reduce_scatter, send_tensor, recv_tensor, op)

    def reduce_scatter_inplace(self, tensor: torch.Tensor, op: int = ReduceOp.SUM) -> None:
        """Reduce-scatter where each rank's result is its own slice of ``tensor``."""
        self._run(self._fns().reduce_scatter_inplace, tensor, op)

    def alltoall(self, send_tensor: torch.Tensor, recv_tensor: torch.Tensor) -> None:
        """Send slice ``i`` of ``send_tensor`` to rank ``i``; receive rank ``i``'s into slice ``i`` of ``recv_tensor``."""
        self._run(self._fns().alltoall, send_tensor, recv_tensor)

    def alltoall_inplace(self, tensor: torch.Tensor) -> None:
        """Alltoall with ``tensor`` as both input and output."""
        self._run(self._fns().alltoall_inplace, tensor)

    def alltoall_v(self, send_tensor: torch.Tensor, send_counts: list[int], send_displs: list[int],
                   recv_tensor: torch.Tensor, recv_counts: list[int], recv_displs: list[int]) -> None:
        """Alltoall with per-rank element counts and offsets."""
        self._run(self._fns().alltoall_v, send_tensor, send_counts, send_displs, recv_tensor, recv_counts,
                  recv_displs)

    def alltoall_v_inplace(self, tensor: torch.Tensor, counts: list[int], displs: list[int],
                           recv_counts: list[int] | None = None, recv_displs: list[int] | None = None) -> None:
        """:meth:`alltoall_v` with ``tensor`` as both input and output (``counts``/``displs`` serve both
        directions unless ``recv_counts``/``recv_displs`` are given)."""
        if recv_counts is None and recv_displs is None:
            self._run(self._fns().alltoall_v_inplace, tensor, counts, displs)
        else:
            self._run(self._fns().alltoall_v, tensor, counts, displs, tensor,
                      counts if recv_counts is None else recv_counts, displs if recv_displs is None else recv_displs)

    def barrier(self) -> None:
        """Wait until every rank of the communicator reaches this call."""
        self._run(self._fns().barrier)

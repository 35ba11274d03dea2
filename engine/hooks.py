"""Bagua's compressed allreduce as PyTorch DDP communication hooks.

A communication hook replaces DDP's allreduce of each gradient bucket
(``(state, GradBucket) -> Future[Tensor]``, see ``torch.distributed.algorithms.ddp_comm_hooks``).
:func:`bytegrad_hook` runs ByteGrad's exchange on the bucket: MinMax uint8 chunks
all-to-all, the owner of each chunk sums and recompresses it, an all-gather brings the
reduced chunks back (:func:`~bagua_lightning.engine.compressed_comm.compressed_exchange_`), so
plain ``DistributedDataParallel`` moves about a quarter of the bytes of a float32
allreduce::

    from bagua_lightning.hooks import ByteGradState, bytegrad_hook

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(ByteGradState(), bytegrad_hook)

    # or with Lightning's DDP strategy (which registers hooks on CUDA devices only)
    Trainer(strategy=DDPStrategy(ddp_comm_state=ByteGradState(), ddp_comm_hook=bytegrad_hook))

The error of a gradient value is that of ByteGrad: at most half a quantisation level of
its chunk on each rank's contribution, plus half a level of the reduced chunk. On CUDA the
exchange runs on the fused Triton kernels and is queued on the current stream; on Gloo
it runs in the hook, so each bucket's exchange finishes before the next bucket's starts.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's
# annotations with the real ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .compressed_comm import ExchangeBuffers, compressed_exchange_

__all__ = ["ByteGradState", "bytegrad_hook"]


@dataclass(kw_only=True)
class ByteGradState:
    """State of :func:`bytegrad_hook`: the group to reduce over and buffers reused every step.

    Attributes:
        process_group: the group whose ranks reduce the gradients; None is the default
            (world) group.
        average: average the gradients over the ranks (DDP's behaviour) or sum them.
    """

    process_group: dist.ProcessGroup | None = None
    average: bool = True
    # Per bucket index: the exchange's send/receive buffers, and a padded copy of a bucket whose
    # length the group size does not divide (DDP rebuilds its buckets once; both follow the shapes).
    _buffers: dict[int, ExchangeBuffers] = field(default_factory=dict, repr=False)
    _padded: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.average, bool):
            raise TypeError(f"ByteGradState: average must be a bool, got {self.average!r}")

    def buffers(self, index: int) -> ExchangeBuffers:
        """The exchange buffers of bucket ``index``."""
        return self._buffers.setdefault(index, ExchangeBuffers())

    def padded(self, index: int, flat: torch.Tensor, multiple: int) -> torch.Tensor:
        """``flat`` copied into a zero-padded buffer whose length ``multiple`` divides (``flat`` if it does)."""
        n = flat.numel()
        size = -(-n // multiple) * multiple
        if size == n:
            return flat
        buf = self._padded.get(index)
        if buf is None or buf.numel() != size or buf.dtype != flat.dtype or buf.device != flat.device:
            buf = self._padded[index] = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        buf[:n].copy_(flat)
        buf[n:].zero_()  # the exchange leaves values in the padding
        return buf


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()
    )
    fut.set_result(tensor)
    return fut


def bytegrad_hook(
    state: ByteGradState | dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients reduced with ByteGrad's compressed exchange.

    Args:
        state: a :class:`ByteGradState` (buffers kept between steps), or, like DDP's
            built-in hooks, a process group or None (default group; buffers allocated
            on every call).
        bucket: the gradient bucket DDP hands to the hook.

    Returns:
        A future holding the bucket's flat tensor, now the average (or sum) over the
        ranks as every rank decodes it: all ranks hold the same values.
    """
    if state is None or isinstance(state, dist.ProcessGroup):
        state = ByteGradState(process_group=state)
    elif not isinstance(state, ByteGradState):
        raise TypeError(
            f"bytegrad_hook: state must be a ByteGradState, a ProcessGroup or None, got {type(state).__name__}; "
            "register the hook with ddp.register_comm_hook(ByteGradState(), bytegrad_hook)"
        )
    flat = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    if world == 1:
        return _done(flat)
    index = bucket.index()
    work = state.padded(index, flat, world)
    compressed_exchange_(work, state.process_group, world, scale=1.0 / world if state.average else 1.0,
                         buffers=state.buffers(index))
    if work is not flat:
        flat.copy_(work[: flat.numel()])
    return _done(flat)

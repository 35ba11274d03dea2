"""PyTorch DDP communication hooks running Bagua's compressed allreduce (``bytegrad_hook``).

``ddp.register_comm_hook(ByteGradState(), bytegrad_hook)`` or Lightning's
``DDPStrategy(ddp_comm_state=ByteGradState(), ddp_comm_hook=bytegrad_hook)``; see
:mod:`bagua_lightning.engine.hooks`. Importing this module imports neither Lightning nor
Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from bagua_lightning.engine.hooks import ByteGradState, bytegrad_hook

__all__ = ["ByteGradState", "bytegrad_hook"]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    # torch.distributed and the exchange load when a hook is first asked for.
    if name in __all__:
        from bagua_lightning.engine import hooks

        return getattr(hooks, name)
    raise AttributeError(f"module 'bagua_lightning.hooks' has no attribute {name!r}")

"""bagua-lightning: Bagua's training-acceleration system on PyTorch 2.x and Lightning 2.x.

Importing the package registers ``"bagua"`` in Lightning's strategy registry when
Lightning is installed, so ``Trainer(strategy="bagua")`` works after
``import bagua_lightning``. The service-side code (``bagua_lightning.services``)
does not need torch; set ``BAGUA_LIGHTNING_NO_STRATEGY=1`` to skip importing the
trainer side (the service container and the CLI's service commands do).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["BaguaStrategy", "QAdamOptimizer", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from bagua_lightning.strategy import BaguaStrategy, QAdamOptimizer


def _lightning_available() -> bool:
    return importlib.util.find_spec("lightning") is not None


def _register() -> None:
    from bagua_lightning.strategy.registry import register_bagua_strategy

    register_bagua_strategy()


if os.environ.get("BAGUA_LIGHTNING_NO_STRATEGY", "0") != "1" and _lightning_available():
    _register()


def __getattr__(name: str) -> Any:
    # Lazy re-exports keep `import bagua_lightning.services...` free of torch.
    if name in ("BaguaStrategy", "QAdamOptimizer"):
        from bagua_lightning import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'bagua_lightning' has no attribute {name!r}")

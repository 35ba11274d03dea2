"""bagua-lightning: Bagua's training-acceleration system on PyTorch 2.x and Lightning 2.x.

Importing the package makes ``Trainer(strategy="bagua")`` work without importing
Lightning itself: when ``lightning.pytorch`` is already imported the strategies are
registered at once, otherwise right after ``lightning.pytorch`` finishes importing
(a one-shot import hook). So ``import bagua_lightning.client`` (or ``.services``,
``.proto``) stays free of Lightning and fast, and there is nothing to opt out of.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["BaguaStrategy", "QAdamOptimizer", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from bagua_lightning.strategy import BaguaStrategy, QAdamOptimizer

_LIGHTNING_PACKAGE = "lightning.pytorch"


def _register() -> None:
    from bagua_lightning.strategy.registry import register_bagua_strategy

    register_bagua_strategy()


class _RegisterAfterLoad(importlib.abc.Loader):
    """Runs the real loader of ``lightning.pytorch``, then registers our strategies."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # The spec keeps pointing at the real loader, so tools that read sources still work.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _register()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


class _LightningWatcher(importlib.abc.MetaPathFinder):
    """One-shot finder: wraps the loader of ``lightning.pytorch`` the first time it is imported."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _LIGHTNING_PACKAGE:
            return None
        _remove_watcher()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisterAfterLoad(spec.loader)
        return spec


def _remove_watcher() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LightningWatcher)]


def _lightning_installed() -> bool:
    try:
        return importlib.util.find_spec("lightning") is not None
    except (ImportError, ValueError):  # an import system that refuses the name (e.g. the service image)
        return False


def _install_registration() -> None:
    if _LIGHTNING_PACKAGE in sys.modules:
        _register()
    elif _lightning_installed() and not any(isinstance(f, _LightningWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningWatcher())


_install_registration()


_LAZY = ("BaguaStrategy", "QAdamOptimizer")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    # Lazy re-exports keep `import bagua_lightning.services...` free of torch and Lightning.
    if name in _LAZY:
        from bagua_lightning import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'bagua_lightning' has no attribute {name!r}")

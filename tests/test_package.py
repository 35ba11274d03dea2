"""The package root: importing the trainer-side client is free of Lightning; the strategy registers itself."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("module", ["bagua_lightning", "bagua_lightning.client", "bagua_lightning.services",
                                    "bagua_lightning.proto"])
def test_importing_the_package_does_not_import_lightning(module: str) -> None:
    out = _run(f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in "
               "('lightning', 'pytorch_lightning', 'torch')))")
    assert out == "[]"


@pytest.mark.parametrize("order", ["bagua_first", "lightning_first"])
def test_strategy_is_registered_whichever_is_imported_first(order: str) -> None:
    imports = ["import bagua_lightning", "import lightning.pytorch"]
    if order == "lightning_first":
        imports.reverse()
    out = _run("; ".join([*imports, "from lightning.pytorch.strategies import StrategyRegistry",
                          "print('bagua' in StrategyRegistry)"]))
    assert out == "True"


def test_lightning_sources_stay_readable_after_registration() -> None:
    # The one-shot hook hands lightning.pytorch's real loader back: tools that read sources keep working.
    out = _run("import bagua_lightning, inspect, lightning.pytorch as lp; "
               "print(type(lp.__loader__).__name__, len(inspect.getsource(lp)) > 0)")
    assert out == "SourceFileLoader True"

"""The Lightning private attributes ``BaguaStrategy`` relies on: present on the installed Lightning, and a
warning naming the Lightning version when one is gone (instead of silently losing the feature)."""

from __future__ import annotations

import types
import warnings

import lightning
import lightning.pytorch as pl
import pytest

from bagua_lightning import BaguaStrategy
from bagua_lightning.strategy.contrib.lightning import BaguaSyncBatchNorm, adapt_trainer, missing_internals


def _trainer(**kwargs: object) -> pl.Trainer:
    return pl.Trainer(strategy=BaguaStrategy(), accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, **kwargs)  # type: ignore[arg-type]


def test_the_installed_lightning_has_every_internal_used() -> None:
    trainer = _trainer()
    assert missing_internals(trainer.strategy, trainer) == []


def test_today_sync_batchnorm_and_load_balancing_loaders_are_adapted() -> None:
    trainer = _trainer(sync_batchnorm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on a supported Lightning
        adapt_trainer(trainer.strategy, trainer)
    assert isinstance(trainer.strategy._layer_sync, BaguaSyncBatchNorm)
    assert getattr(trainer._data_connector._requires_distributed_sampler, "_keeps_load_balancing", False)


def test_a_renamed_internal_is_a_warning_naming_it_and_the_version() -> None:
    strategy = types.SimpleNamespace()  # a Lightning whose Strategy lost _layer_sync
    trainer = types.SimpleNamespace(_data_connector=types.SimpleNamespace())  # ... and the connector's method
    assert [m.split(":")[0] for m in missing_internals(strategy, trainer)] == [
        "strategy._layer_sync", "trainer._data_connector._requires_distributed_sampler"]
    with pytest.warns(UserWarning) as record:
        adapt_trainer(strategy, trainer)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert f"strategy._layer_sync, which Lightning {lightning.__version__} does not have" in messages[0]
    assert "_requires_distributed_sampler" in messages[1] and "DistributedSampler" in messages[1]


def test_a_trainer_without_a_data_connector_is_named() -> None:
    trainer = types.SimpleNamespace()
    assert [m.split(":")[0] for m in missing_internals(_trainer().strategy, trainer)] == ["trainer._data_connector"]

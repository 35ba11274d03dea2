"""``BaguaStrategy(fault_tolerance=...)``: Lightning's loop on the engine's fault-tolerant steps.

The per-step protocol is the engine's (:class:`~bagua_lightning.engine.elastic_step.ElasticSteps`, the one
``ElasticTraining`` and ``torch_api`` use); this module only fits it into Lightning's loop:

* **The train loader begins the step.** The strategy replaces the train ``DataLoader`` with an
  :class:`ElasticLoader` over the same dataset and ``collate_fn``. Lightning's fetcher does not prefetch a
  loader that has a length, so each ``next()`` comes after the previous step's optimizer step: it joins the
  step's quorum (a node that is behind heals from a live peer first), deals this rank's share of the
  epoch's next indices (``ElasticSampler``: the global batch shrinks and grows with the world, logged) and
  fetches and collates them in the main process (``num_workers > 0`` is refused: workers fetch ahead, before
  the quorum is known).
* **The strategy's ``optimizer_step`` ends it.** It runs the closure (forward and backward: each bucket
  reduced inside the node, then averaged across the nodes), asks whether every node finished the step, and
  steps the optimizer only then. When a node failed, nothing is applied: the strategy begins the step again
  at once, re-dealt over the nodes alive now, and runs the closure on the new share (``training_step`` gets
  that batch), inside the same Lightning batch. Lightning's counters (``global_step``, ``batch_idx``, LR
  schedulers, callbacks) therefore count committed steps only.
* **A rank with nothing to train** (the epoch's last, short step) gets :data:`EMPTY_SHARE` as its batch: its
  ``training_step`` is not called, its backward runs the algorithm's hooks on zero gradients, so every
  collective of the step still matches.
* **The epoch ends when its data does.** ``len()`` is an upper bound (the steps left with only
  ``min_nodes`` nodes). The step that spends the epoch's last index marks Lightning's batch as the last, so
  epoch-end validation, epoch LR schedulers and checkpoints run as usual (with ``val_check_interval=1.0``
  validation runs at that last batch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _is_dataloader_shuffled
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from ..core.errors import ConfigurationError
from ..engine.algorithms.base import Algorithm
from ..engine.elastic_step import (
    ElasticSteps,
    fault_tolerance_refusal,
    load_node_state,
    node_state,
    zero_backward,
)
from ..engine.fault_tolerance import ElasticSampler, FaultTolerance

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from ..engine.ddp import BaguaDistributedDataParallel
    from .settings import BaguaSettings

log = logging.getLogger(__name__)

__all__ = ["EMPTY_SHARE", "ElasticLightning", "ElasticLoader", "EmptyShare"]


class _Strategy(Protocol):
    """What this module uses of ``BaguaStrategy`` (which imports this module, not the other way round)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def optimizers(self) -> list[Any]: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def bagua_module(self) -> BaguaDistributedDataParallel | None: ...

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any: ...

    @staticmethod
    def _unwrap(optimizer: Any) -> torch.optim.Optimizer: ...


class EmptyShare:
    """The batch of a rank whose share of a step is empty (its ``training_step`` does not run)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "EMPTY_SHARE"


EMPTY_SHARE = EmptyShare()


class ElasticLoader:
    """The train loader under fault tolerance: each ``next()`` begins a step and returns this rank's share.

    Args:
        steps: the node's fault-tolerant steps (its sampler deals the epoch).
        dataset: a map-style dataset (``dataset[i]``).
        collate_fn: the original loader's.
    """

    def __init__(self, steps: ElasticSteps, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.steps, self.dataset, self.collate_fn = steps, dataset, collate_fn

    def __len__(self) -> int:
        return self.steps.steps_bound()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.steps.epoch_done:
            raise StopIteration
        return self.next_share()

    def next_share(self) -> Any:
        """Begin a step (quorum, healing, dealing) and fetch this rank's share of it."""
        indices = self.steps.begin()
        if not indices:
            return EMPTY_SHARE
        return self.collate_fn([self.dataset[i] for i in indices])


class ElasticLightning:
    """What ``BaguaStrategy`` does differently under fault tolerance (its hooks call these).

    Args:
        config: the nodes' settings.
        settings: the strategy's, checked now (algorithms that cannot train so are refused with the reason).
    """

    def __init__(self, config: FaultTolerance, settings: BaguaSettings) -> None:
        for cls in settings.algorithm_classes:
            refusal = fault_tolerance_refusal(cls)
            if refusal is not None:
                raise MisconfigurationException(f"BaguaStrategy(fault_tolerance=...): {refusal}.")
        if settings.auto is not None:
            raise MisconfigurationException(
                "BaguaStrategy(fault_tolerance=...) needs a fixed algorithm: algorithm='auto' switches algorithms "
                "while training, which is not written for a changing set of nodes; pick one, e.g. "
                "algorithm='gradient_allreduce'.")
        if settings.autotune:
            raise MisconfigurationException(
                "BaguaStrategy(fault_tolerance=...) does not autotune yet (a plan must change on every node at "
                "the same committed step); drop autotune=True, or use ElasticTraining(autotune=...).")
        self.config = config
        self.steps: ElasticSteps | None = None
        self.loader: ElasticLoader | None = None
        self._strategy: _Strategy | None = None
        self._redo: Any = None  # the re-dealt batch of a step begun again inside optimizer_step
        self._in_step = False

    @staticmethod
    def of(value: FaultTolerance | bool | None, settings: BaguaSettings) -> ElasticLightning | None:
        """``fault_tolerance=``: a :class:`FaultTolerance`, True (one from the environment), or None/False."""
        if value is None or value is False:
            return None
        if value is True:
            value = FaultTolerance()
        if not isinstance(value, FaultTolerance):
            raise ConfigurationError(
                f"fault_tolerance must be a FaultTolerance, True or None, got {value!r}; e.g. "
                "BaguaStrategy(fault_tolerance=FaultTolerance(min_nodes=1))")
        return ElasticLightning(value, settings)

    # ------------------------------------------------------------------ set-up

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse what the per-step commit cannot serve, naming the fix."""
        module = trainer.lightning_module
        if trainer.num_nodes != 1:
            raise MisconfigurationException(
                f"BaguaStrategy(fault_tolerance=...) with Trainer(num_nodes={trainer.num_nodes}): each node is a "
                "job of its own; launch one torchrun per node with Trainer(num_nodes=1) and its own "
                "BAGUA_LIGHTNING_NODE_ID (the nodes meet at the lighthouse).")
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"BaguaStrategy(fault_tolerance=...) commits every batch; Trainer(accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}) is not supported: raise the batch size instead.")
        if module is not None and not module.automatic_optimization:
            raise MisconfigurationException(
                "BaguaStrategy(fault_tolerance=...) needs automatic optimization (a failed step is redone by "
                "running training_step again): set self.automatic_optimization = True.")

    def start(self, strategy: _Strategy, algorithm: Algorithm) -> None:
        """Join the job's nodes and make ``algorithm`` (not set up yet) average its buckets across them."""
        self.close()
        self._strategy = strategy
        self.steps = ElasticSteps(self.config, state=self.state_dict, load_state=self.load_state_dict,
                                  local_rank=strategy.global_rank, local_size=strategy.world_size)
        self.steps.prepare(algorithm)

    def process_dataloader(self, dataloader: object, trainer: pl.Trainer | None) -> object:
        """The train loader dealt over the nodes (other stages' loaders are left as they are)."""
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, torch.utils.data.IterableDataset):
            raise MisconfigurationException(
                f"BaguaStrategy(fault_tolerance=...) deals the train data by index; got {type(dataloader).__name__}"
                ": return a torch DataLoader over a map-style dataset (dataset[i]) from train_dataloader().")
        if dataloader.num_workers > 0:
            raise MisconfigurationException(
                f"BaguaStrategy(fault_tolerance=...) fetches each step's batch once the step's nodes are known; "
                f"DataLoader(num_workers={dataloader.num_workers}) would fetch ahead of that: use num_workers=0.")
        if dataloader.batch_size is None:
            raise MisconfigurationException(
                "BaguaStrategy(fault_tolerance=...) deals batch_size indices per rank and step; the train "
                "DataLoader has a batch_sampler of its own: pass DataLoader(dataset, batch_size=...) instead.")
        assert self.steps is not None, "start() runs in configure_ddp, before the loaders"
        sampler = ElasticSampler(len(dataloader.dataset), dataloader.batch_size,  # type: ignore[arg-type]
                                 shuffle=_is_dataloader_shuffled(dataloader))
        self.steps.sampler = sampler
        rank_zero_info(f"fault tolerance: the train loader deals {sampler.num_samples} samples, batch_size="
                       f"{sampler.batch_size} per rank, over the nodes alive at each step (the global batch "
                       "shrinks and grows with them)")
        self.loader = ElasticLoader(self.steps, dataloader.dataset, dataloader.collate_fn)
        return self.loader

    def on_train_start(self, trainer: pl.Trainer) -> None:
        # The epoch ends at its last index, before the loader's length (an upper bound): validate there.
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_interval == 1.0:
            trainer.val_check_batch = float("inf")

    # ------------------------------------------------------------------ the step

    def training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[..., Any]) -> Any:
        steps = self._open_steps()
        if self._redo is not None:
            args = (self._redo, *args[1:])
        if not steps.indices:  # nothing to train: the backward runs the hooks on zero gradients
            return torch.zeros((), device=self._module_device(), requires_grad=True)
        return run(*args, **kwargs)

    def pre_backward(self) -> None:
        """After Lightning zeroed the gradients: an empty share's backward is the hooks on zero gradients."""
        steps = self._open_steps()
        if not steps.indices:
            strategy = self._strategy
            assert strategy is not None and strategy.bagua_module is not None
            zero_backward(strategy.bagua_module.driver)

    def optimizer_step(self, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any]) -> Any:
        """Run the closure; step the optimizer when every node finished the step, else redo it re-dealt."""
        steps, loader = self._open_steps(), self.loader
        assert loader is not None
        self._in_step = True
        try:
            while True:
                result = closure()

                def commit(done: Any = result) -> None:
                    step(lambda: done)

                if steps.end(commit):
                    break
                self._redo = self._to_device(loader.next_share())  # the step again, over the nodes alive now
        finally:
            self._redo, self._in_step = None, False
        if steps.epoch_done:  # this step spent the epoch's last index: Lightning's epoch ends with it
            steps.sampler.next_epoch()
            trainer = self._trainer()
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
        return result

    def _open_steps(self) -> ElasticSteps:
        if self.steps is None or not self.steps.open:
            raise MisconfigurationException(
                "BaguaStrategy(fault_tolerance=...): a training step ran without its batch from the elastic "
                "train loader (the strategy replaces train_dataloader(); do not iterate it yourself).")
        return self.steps

    def _trainer(self) -> pl.Trainer:
        strategy = self._strategy
        assert strategy is not None and strategy.lightning_module is not None
        return strategy.lightning_module.trainer

    def _module_device(self) -> torch.device:
        assert self._strategy is not None
        return self._strategy.root_device

    def _to_device(self, batch: Any) -> Any:
        """What Lightning's loop does to a fetched batch before ``training_step``."""
        trainer, strategy = self._trainer(), self._strategy
        assert strategy is not None and strategy.lightning_module is not None
        batch = trainer.precision_plugin.convert_input(batch)
        batch = strategy.lightning_module.on_before_batch_transfer(batch, 0)
        return strategy.batch_to_device(batch, dataloader_idx=0)

    # ------------------------------------------------------------------ what a healing node takes

    def _parts(self) -> tuple[Any, list[torch.optim.Optimizer], Any]:
        strategy, steps = self._strategy, self.steps
        assert strategy is not None and steps is not None and strategy.bagua_module is not None
        return strategy.bagua_module.module, [strategy._unwrap(o) for o in strategy.optimizers], \
            strategy.bagua_module.driver

    def state_dict(self) -> dict[str, Any]:
        """The engine's healing state and Lightning's counters that decide what the node does next."""
        module, optimizers, driver = self._parts()
        assert self.steps is not None
        trainer = self._trainer()
        epoch_loop = trainer.fit_loop.epoch_loop
        return {
            **node_state(module, optimizers, self.steps.sampler, driver),
            "lightning": {
                "epoch_progress": trainer.fit_loop.epoch_progress.state_dict(),
                "optim_progress": epoch_loop.automatic_optimization.optim_progress.state_dict(),
                "batches_that_stepped": int(getattr(epoch_loop, "_batches_that_stepped", 0)),
                "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        module, optimizers, driver = self._parts()
        assert self.steps is not None
        load_node_state(state, module, optimizers, self.steps.sampler, driver)
        trainer = self._trainer()
        epoch_loop, saved = trainer.fit_loop.epoch_loop, state["lightning"]
        trainer.fit_loop.epoch_progress.load_state_dict(saved["epoch_progress"])
        progress = epoch_loop.automatic_optimization.optim_progress
        progress.load_state_dict(saved["optim_progress"])
        if self._in_step:  # healed while redoing inside optimizer_step: Lightning counts this step as begun
            progress.optimizer.step.increment_ready()
        if hasattr(epoch_loop, "_batches_that_stepped"):
            epoch_loop._batches_that_stepped = int(saved["batches_that_stepped"])
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, saved["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(scheduler_state)
        log.info("fault tolerance: healed from a live peer at step %d (global_step %d, epoch %d)", driver.step,
                 trainer.global_step, trainer.current_epoch)

    def close(self) -> None:
        if self.steps is not None:
            self.steps.shutdown()
            self.steps = None
        self.loader = None

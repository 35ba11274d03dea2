"""``BaguaStrategy``: Bagua's algorithms as a Lightning 2.x strategy, on plain ``torch.distributed``.

A thin subclass of Lightning's ``DDPStrategy``: launching, process-group set-up,
``reduce``/``broadcast``/``barrier`` and checkpoint plumbing are DDP's; the model is
wrapped in :class:`~bagua_lightning.engine.ddp.BaguaDistributedDataParallel`
instead of ``DistributedDataParallel``, which drives the chosen algorithm. With one rank there is nothing to
communicate: the model is left unwrapped (single-device speed; ``auto`` chooses at step 0, autotune has nothing
to tune), except for an algorithm with an optimizer of its own (qadam), whose step needs the engine.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ..engine import peer_watch
from ..engine.algorithms.auto import AutoAlgorithm
from ..engine.algorithms.base import (
    Algorithm,
    AlgorithmOptimizerError,
    algorithm_classes,
)
from ..engine.autotune import DEFAULT_INTERVAL as DEFAULT_AUTOTUNE_INTERVAL
from ..engine.autotune import (
    AutotuneController,
    AutotuneState,
    AutotuneSummary,
    BoundaryReport,
    batch_size_of,
)
from ..engine.autotune.advice import algorithm_advice
from ..engine.autotune.selection import Selection
from ..engine.comm import CommContext
from ..engine.ddp import BaguaDistributedDataParallel
from ..engine.elastic_step import ElasticSteps
from ..engine.fault_tolerance import FaultTolerance
from ..proto.plan import DEFAULT_BUCKET_SIZE, BucketPlan, StepTimings
from .fault_tolerant import ElasticLightning
from .logged_metrics import cached_datasets, training_metrics
from .settings import BaguaSettings

log = logging.getLogger(__name__)

#: Key under which a checkpoint stores the algorithm's own state (when it has any).
CHECKPOINT_KEY = "bagua_algorithm_state"
#: Key under which a checkpoint stores the autotuner's state (job id, plan in use, tuning progress).
AUTOTUNE_CHECKPOINT_KEY = "bagua_autotune_state"
_LOAD_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(DDPStrategy.load_checkpoint).parameters


class BaguaStrategy(DDPStrategy):
    """Distributed training with one of Bagua's algorithms.

    The strategy's settings (``flatten``, ``autotune``, ``bucket_size``, ``autotune_service``,
    ``autotune_interval``, ``autotune_token``, ``autotune_tls``, ``autotune_model_name``, ``auto_candidates``,
    ``auto_warmup_steps``, ``auto_trial_steps``, ``auto_max_runoffs``) are each documented in
    :class:`~bagua_lightning.strategy.settings.BaguaSettings`, which validates them
    (:class:`~bagua_lightning.core.errors.ConfigurationError` naming a bad value and the fix). ``accelerator``,
    ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``start_method``,
    ``process_group_backend`` and ``timeout`` are as for ``DDPStrategy`` (``process_group_backend`` None: by
    device).

    Args:
        algorithm: the name of a registered algorithm (``engine/algorithms/``; each is also a ``bagua_<name>``
            strategy alias) or ``"auto"`` (measure ``auto_candidates`` while training and keep the fastest:
            :mod:`bagua_lightning.engine.autotune.selection`).
        **bagua_kwargs: the algorithm's keyword arguments (e.g. ``hierarchical``, ``average``,
            ``peer_selection_mode``, ``sync_interval_ms``); unknown ones raise ``ConfigurationError`` listing
            the accepted ones.
        fault_tolerance: train on while nodes fail and rejoin (docs/fault_tolerance.md): a
            :class:`~bagua_lightning.engine.fault_tolerance.FaultTolerance`, or True for one read from the
            environment (``TORCHFT_LIGHTHOUSE``, ``BAGUA_LIGHTNING_NODE_ID``); each node is its own launch.
            Algorithms that cannot train so are refused here, with the reason
            (:mod:`bagua_lightning.strategy.fault_tolerant`).
    """

    strategy_name = "bagua"

    def __init__(
        self,
        algorithm: str = "gradient_allreduce",
        flatten: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        autotune: bool = False,
        *,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        autotune_service: str | None = None,
        autotune_interval: int = DEFAULT_AUTOTUNE_INTERVAL,
        autotune_token: str | None = None,
        autotune_tls: bool | str | Path = False,
        autotune_model_name: str | None = None,
        auto_candidates: list[str] | tuple[str, ...] | None = None,
        auto_warmup_steps: int = 3,
        auto_trial_steps: int = 10,
        auto_max_runoffs: int = 3,
        fault_tolerance: FaultTolerance | bool | None = None,
        **bagua_kwargs: Any,
    ) -> None:
        self.settings = BaguaSettings(
            algorithm=algorithm, flatten=flatten, autotune=autotune, bucket_size=bucket_size,
            autotune_service=autotune_service, autotune_interval=autotune_interval, autotune_token=autotune_token,
            autotune_tls=autotune_tls, autotune_model_name=autotune_model_name, auto_candidates=auto_candidates,
            auto_warmup_steps=auto_warmup_steps, auto_trial_steps=auto_trial_steps,
            auto_max_runoffs=auto_max_runoffs, bagua_kwargs=dict(bagua_kwargs))
        self._autotune: AutotuneController | None = None
        self._autotune_state: AutotuneState | None = None  # the latest state (kept after the fit for checkpoints)
        self._resume_autotune: AutotuneState | None = None  # from the checkpoint a fit resumes
        self._logged_step = -1
        self.autotune_summary: AutotuneSummary | None = None
        self._auto_algorithm: AutoAlgorithm | None = None  # the fit's ``auto`` (kept after it: its selection)
        self._alone: Selection | None = None  # one rank: the model is not wrapped (``auto``'s choice, if auto)
        # An algorithm's checkpointed state read before the model is wrapped (Lightning restores the model before
        # the strategy's setup): loaded into the algorithm once configure_ddp has set it up.
        self._pending_algorithm_state: dict[str, Any] | None = None
        self._auto_reported = False
        self._elastic = ElasticLightning.of(fault_tolerance, self.settings)  # None: the job ends with a rank
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.flatten = flatten
        self.autotune = autotune
        self.bucket_size = bucket_size
        self._comm: CommContext | None = None

    # ------------------------------------------------------------------ set-up

    @property
    def comm(self) -> CommContext | None:
        """Process groups of this job (None before the process group exists)."""
        return self._comm

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        if self._comm is None:
            self._comm = CommContext.build(local_size=max(1, self.num_processes))
        peer_watch.start(None, self.global_rank, self.world_size)  # no rank waits forever on a failed one

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Contrib inside a Trainer: our SyncBatchNorm for sync_batchnorm=True (torch's refuses CPU), and
        # loaders on a LoadBalancingDistributedBatchSampler kept (Lightning would swap in a DistributedSampler).
        from .contrib.lightning import adapt_trainer

        module = self._lightning_module
        adapt_trainer(self, module._trainer if module is not None else None)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        precision = getattr(self.precision_plugin, "precision", None)
        for cls in self.settings.algorithm_classes:
            refused = cls.unsupported_precisions.get(str(precision))
            if trainer.state.fn == TrainerFn.FITTING and refused is not None:
                raise MisconfigurationException(
                    f"Bagua {cls.name} does not support precision={precision!r} ({refused})."
                )
        if self._elastic is not None:
            self._elastic.check_trainer(trainer)
        super().setup(trainer)
        wrapper = self.bagua_module
        if self._alone is not None and trainer.state.fn == TrainerFn.FITTING:
            if self.settings.auto is not None:
                rank_zero_info(self._alone.line())
            if self.settings.autotune_settings is not None:
                rank_zero_info("autotune: one rank: nothing to communicate, nothing to tune")
        if wrapper is not None:
            try:
                wrapper.attach_optimizers([self._unwrap(o) for o in self.optimizers])
            except AlgorithmOptimizerError as exc:
                raise MisconfigurationException(str(exc)) from exc
            fitting = trainer.state.fn == TrainerFn.FITTING
            if self.settings.auto is not None and fitting:
                rank_zero_info(self.settings.auto.plan_line())
            elif self.settings.autotune_settings is not None and fitting:
                self._start_autotune(wrapper)

    @staticmethod
    def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
        return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

    @override
    def configure_ddp(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        if self._comm is None:
            raise RuntimeError("BaguaStrategy: the process group is not set up; setup_environment must run first")
        algorithm: Algorithm = self.settings.algorithm_class.from_kwargs(**self.settings.bagua_kwargs)
        self._alone = None
        if self.world_size == 1 and algorithm.spec.optimizer_arg is None and self._elastic is None:
            # One rank, nothing to communicate: the module trains as under Lightning's single-device strategy
            # (no wrapper, no hooks, no per-step measurement); ``auto`` has chosen at step 0. An algorithm with
            # an optimizer of its own (qadam) keeps its engine: that optimizer's step needs it.
            candidates = self.settings.auto.candidates if self.settings.auto is not None else (algorithm.name,)
            self._alone = Selection.alone(candidates)
            return
        if self.settings.auto is not None:  # the one ``auto``: the registered engine algorithm
            algorithm = self._auto_algorithm = AutoAlgorithm.of(self.settings.auto, self.settings.bagua_kwargs)
            self._auto_reported = False
        if self._elastic is not None:  # join the other nodes; each bucket is then averaged across them
            self._elastic.start(self, algorithm)
        self.model = BaguaDistributedDataParallel(
            self.model, algorithm, self._comm, flatten=self.flatten, bucket_size=self.bucket_size
        )
        pending, self._pending_algorithm_state = self._pending_algorithm_state, None
        if pending is not None and pending.get("algorithm") == self.algorithm_name:
            algorithm.load_state_dict(pending["state"])

    @property
    def fault_tolerance_steps(self) -> ElasticSteps | None:
        """Under ``fault_tolerance``, this node's steps during a fit (its sampler, ``last_commit``,
        ``steps_redone``); None otherwise."""
        return self._elastic.steps if self._elastic is not None else None

    @property
    def bagua_module(self) -> BaguaDistributedDataParallel | None:
        """The wrapper installed for fitting (None outside ``fit``)."""
        return self.model if isinstance(self.model, BaguaDistributedDataParallel) else None

    @property
    def algorithm(self) -> Algorithm | None:
        """The running algorithm instance (None outside ``fit``)."""
        module = self.bagua_module
        return module.algorithm if module is not None else None

    @property
    def algorithm_name(self) -> str:
        """The algorithm driving the model (``algorithm="auto"``: the candidate measured now, then the one kept)."""
        algorithm, chosen = self.algorithm, self.selection.chosen if self.selection is not None else None
        if algorithm is not None:
            return algorithm.current_name if isinstance(algorithm, AutoAlgorithm) else algorithm.name
        if self._alone is not None:
            return self._alone.chosen or self.settings.algorithm_names[0]
        return chosen or self.settings.algorithm_names[0]

    @property
    def selection(self) -> Selection | None:
        """What ``algorithm="auto"`` measured and chose (None for a fixed algorithm, or before the fit)."""
        if self._alone is not None and self.settings.auto is not None:
            return self._alone
        return self._auto_algorithm.selection if self._auto_algorithm is not None else None

    # ------------------------------------------------------------------ autotune hook points

    @property
    def bucket_plan(self) -> BucketPlan | None:
        module = self.bagua_module
        return module.bucket_plan if module is not None else None

    def apply_plan(self, plan: BucketPlan) -> None:
        """Re-bucket with ``plan``; call at a step boundary with the same plan on every rank."""
        module = self.bagua_module
        if module is None:
            raise RuntimeError("apply_plan needs a running fit (the model is not wrapped)")
        module.driver.apply_plan(plan)

    def last_step_timings(self) -> StepTimings | None:
        """Per-bucket timings of the latest measured step (None when not available)."""
        module = self.bagua_module
        return module.last_step_timings() if module is not None else None

    # ------------------------------------------------------------------ autotune

    def _report_choice(self) -> None:
        """Once ``auto`` has chosen (seen at the next batch start): the summary line, the loggers, and the
        chosen algorithm's buckets tuned as a fixed algorithm's would be."""
        selection = self.selection
        if self._auto_reported or selection is None or selection.chosen is None:
            return
        self._auto_reported = True
        rank_zero_info(selection.line())
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and self.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(selection.metrics(), step=trainer.global_step)
        wrapper = self.bagua_module
        if self.settings.autotune_settings is not None and wrapper is not None:
            if wrapper.algorithm.uses_gradient_buckets:
                self._start_autotune(wrapper)
            else:
                rank_zero_info(f"autotune: {selection.chosen} communicates no gradient buckets; nothing left to tune")

    def _start_autotune(self, wrapper: BaguaDistributedDataParallel) -> None:
        assert self.settings.autotune_settings is not None and self._comm is not None
        self._stop_autotune()
        resume, self._resume_autotune = self._resume_autotune, None
        self._autotune = AutotuneController(  # tunes the driver itself (the wrapper forwards no plan)
            self.settings.autotune_settings, wrapper.driver, wrapper.module, model_prefix=type(wrapper.module).__name__,
            nproc_per_node=self._comm.local_size, group=self._comm.group,
            device=self.root_device if self._comm.is_nccl else torch.device("cpu"), resume=resume,
            selection=self.selection)
        self._log_autotune(self._autotune.setup())

    def _stop_autotune(self) -> None:
        if self._autotune is not None:
            self._autotune_state = self._autotune.state()
            self._autotune.close()
            self._autotune = None

    @property
    def autotune_state(self) -> AutotuneState | None:
        """The autotuner's state (job id, plan in use, progress): live during a fit, the last one after."""
        return self._autotune.state() if self._autotune is not None else self._autotune_state

    def _log_autotune(self, report: BoundaryReport | None) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if report is None or trainer is None or not self.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(report.metrics(), step=trainer.global_step)

    def _log_training_metrics(self, trainer: pl.Trainer) -> None:
        """Rank 0, every ``log_every_n_steps`` steps: the plan version and bucket count in use and the
        hit rate of the train loader's ``CachedDataset`` (rank 0's loader and its workers)."""
        step = trainer.global_step
        every = int(getattr(trainer, "log_every_n_steps", 50))  # set by Lightning's logger connector; 0: off
        if not self.is_global_zero or every <= 0 or step % every or step == self._logged_step or not trainer.loggers:
            return
        self._logged_step = step
        version = self._autotune.version if self._autotune is not None else None
        metrics = training_metrics(self.bucket_plan, version, cached_datasets(trainer.train_dataloader))
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if self._auto_algorithm is not None and not self._auto_reported:
            self._report_choice()
        if self._autotune is not None:
            self._log_autotune(self._autotune.on_batch_start(trainer.global_step, batch_size_of(batch)))
        self._log_training_metrics(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._elastic is not None:
            self._elastic.on_train_start(self.lightning_module.trainer)  # type: ignore[union-attr]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        if self._elastic is None:
            return dataloader
        module = self.lightning_module
        return self._elastic.process_dataloader(dataloader, module._trainer if module is not None else None)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._elastic is None:
            return super().training_step(*args, **kwargs)
        return self._elastic.training_step(args, kwargs, super().training_step)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._elastic is not None:
            self._elastic.pre_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        parent = super().optimizer_step
        if self._elastic is None:
            return parent(optimizer, closure, model, **kwargs)
        return self._elastic.optimizer_step(closure, lambda c: parent(optimizer, c, model, **kwargs))

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._autotune is not None:
            self._autotune.pause()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self._autotune is not None:
            self._autotune.resume()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._auto_algorithm is not None:
            self._report_choice()  # a choice made at the last step
        if self._autotune is not None:
            advice = algorithm_advice(self.algorithm_name, selection=self.selection,
                                      measured=self._autotune.last_measured, last_step=self.last_step_timings(),
                                      earlier=self._autotune.earlier_selection)
            self.autotune_summary = dataclasses.replace(self._autotune.summary(), advice=advice or "")
            rank_zero_info(self.autotune_summary.line())
            self._stop_autotune()

    @override
    def on_exception(self, exception: BaseException) -> None:
        peer_watch.report_failure(exception)  # first: the other ranks stop waiting for this one
        self._stop_autotune()
        super().on_exception(exception)

    # ------------------------------------------------------------------ Lightning hooks

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        module = self.bagua_module
        if module is None:
            yield None
            return
        with module.no_sync():
            yield None

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        algorithm = self.algorithm
        if algorithm is not None:
            state = algorithm.state_dict()
            if state:
                checkpoint[CHECKPOINT_KEY] = {"algorithm": self.algorithm_name, "state": state}
        autotune_state = self.autotune_state
        if autotune_state is not None:
            checkpoint[AUTOTUNE_CHECKPOINT_KEY] = autotune_state.to_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning < 2.5 has no weights_only here (and loads with torch's default); pass it only where taken.
        checkpoint = (super().load_checkpoint(checkpoint_path, weights_only=weights_only)
                      if _LOAD_TAKES_WEIGHTS_ONLY else super().load_checkpoint(checkpoint_path))
        saved = checkpoint.get(AUTOTUNE_CHECKPOINT_KEY)
        self._resume_autotune = None
        if saved is not None and self.settings.autotune_settings is not None:
            try:
                self._resume_autotune = AutotuneState.from_dict(saved)
            except ValueError as exc:
                log.warning("autotune: %s; the resumed job starts tuning afresh", exc)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        saved = checkpoint.get(CHECKPOINT_KEY)
        algorithm = self.algorithm
        if saved and algorithm is None:
            self._pending_algorithm_state = dict(saved)  # the model is not wrapped yet: configure_ddp loads it
        elif saved and algorithm is not None and saved.get("algorithm") == self.algorithm_name:
            algorithm.load_state_dict(saved["state"])

    @override
    def teardown(self) -> None:
        self._stop_autotune()
        if self._elastic is not None:
            self._elastic.close()
        module = self.bagua_module
        if module is not None:
            module.teardown()
            self.model = module.module
        if self._comm is not None:
            self._comm.destroy_groups()
            self._comm = None
        super().teardown()

    @classmethod
    def ensure_registered(cls) -> None:
        """Register in Lightning's ``StrategyRegistry`` unless already there (idempotent)."""
        if cls.strategy_name not in StrategyRegistry:
            cls.register_strategies(StrategyRegistry)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Bagua's algorithms on torch.distributed (bagua-lightning)"
        )
        # One alias per registered algorithm (``Trainer(strategy="bagua_bytegrad")``), as Lightning registers
        # ``ddp_spawn``.
        for name, algorithm in algorithm_classes().items():
            strategy_registry.register(
                f"{cls.strategy_name}_{name}", cls,
                description=f"BaguaStrategy with {name}: {algorithm.spec.description}", algorithm=name,
            )


BaguaStrategy.ensure_registered()

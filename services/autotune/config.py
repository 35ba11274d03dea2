"""Configuration of the autotuning service (the ``autotune serve`` options), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.errors import ConfigurationError
from ...proto.plan import DEFAULT_BUCKET_SIZE

TUNERS = ("auto", "bayes", "planner")
MAX_SAMPLES = 10_000  # measured plans per model: the tuners' work grows with it


@dataclass(kw_only=True, slots=True)
class ServiceConfig:
    """How the service tunes; defaults follow Bagua's autotune service.

    Attributes:
        world_size: ranks per job when ``RegisterTensors`` leaves ``world_size`` at 0.
        autotune_level: 0 hands back the default plan only (tuning off); 1 tunes.
        max_samples: measured plans per model after which tuning completes and the
            best plan is handed back for good.
        warmup_time_s: seconds after a model's registration during which reports are
            accepted but not used (speeds are unstable at start-up), in seconds.
        sampling_confidence_time_s: minimum time each plan is held before the next
            one is chosen, in seconds.
        default_bucket_size: bucket size of the initial plan, in bytes.
        tuner: ``"auto"`` (model-based planner when reports carry bucket timings,
            Bayesian baseline otherwise), ``"bayes"`` or ``"planner"``.
        early_stop: let the model-based planner complete before ``max_samples`` once
            its model predicts no better plan than the best one measured.
        min_log2_bucket_size: lower end of the Bayesian search space, log2 of bytes.
        max_log2_bucket_size: upper end of the Bayesian search space, log2 of bytes.
        seed: seed of the Bayesian baseline's random initial points.
        max_models: models held at once; registering one more evicts the least recently
            used model (its best plan stays in the store; its trainers register again).
        max_memory: bytes of model state held at once (estimated per session from its tensors, plans
            and samples, :mod:`.memory`); past it the least recently used models are evicted (their
            best plans stay in the store), and a registration that alone needs more is refused with
            RESOURCE_EXHAUSTED. 0: no byte budget (``max_models`` still applies).
        max_tensors: tensors per model / spans per request; more get RESOURCE_EXHAUSTED.
        max_request_bytes: largest accepted gRPC message, in bytes.
        max_name_bytes: longest model or tensor name, in UTF-8 bytes; longer get RESOURCE_EXHAUSTED.
        max_layouts: measured layouts (plans) whose statistics a model keeps; the least
            recently reported one is dropped beyond it (the current plan's never).
        max_plans: issued plans a model remembers (by version) for reports that name them.
        store_timeout_s: deadline of one plan-store operation, in seconds.
        tuning_processes: worker processes that compute the tuners' proposals (0: in the
            request that takes a sample, which then waits milliseconds for it). With workers
            a new plan is handed back one ask later, and requests never wait for a tuner.
    """

    world_size: int = 1
    autotune_level: int = 1
    max_samples: int = 60
    warmup_time_s: float = 30.0
    sampling_confidence_time_s: float = 5.0
    default_bucket_size: int = DEFAULT_BUCKET_SIZE
    tuner: str = "auto"
    early_stop: bool = True
    min_log2_bucket_size: float = 16.0
    max_log2_bucket_size: float = 30.0
    seed: int = 0
    max_models: int = 1024
    max_memory: int = 2 * 1024**3
    max_tensors: int = 100_000
    max_request_bytes: int = 16 * 1024**2
    max_name_bytes: int = 1024
    max_layouts: int = 64
    max_plans: int = 256
    store_timeout_s: float = 1.0
    tuning_processes: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigurationError(f"world_size must be >= 1, got {self.world_size}")
        if self.autotune_level not in (0, 1):
            raise ConfigurationError(
                f"autotune_level must be 0 (default plan only) or 1 (tune), got {self.autotune_level}")
        if not 1 <= self.max_samples <= MAX_SAMPLES:
            raise ConfigurationError(f"max_samples must be in [1, {MAX_SAMPLES}], got {self.max_samples}")
        for name in ("warmup_time_s", "sampling_confidence_time_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigurationError(f"{name} must be a finite number of seconds >= 0, got {value}")
        if self.default_bucket_size <= 0:
            raise ConfigurationError(f"default_bucket_size must be > 0 bytes, got {self.default_bucket_size}")
        if self.tuner not in TUNERS:
            raise ConfigurationError(f"tuner must be one of {TUNERS}, got {self.tuner!r}")
        if not 0 < self.min_log2_bucket_size < self.max_log2_bucket_size <= 40:
            raise ConfigurationError(
                "the Bayesian search space needs 0 < min_log2_bucket_size < max_log2_bucket_size <= 40, got "
                f"{self.min_log2_bucket_size}, {self.max_log2_bucket_size}")
        for name in ("max_models", "max_tensors", "max_request_bytes", "max_name_bytes", "max_layouts",
                     "max_plans"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_layouts < 2 or self.max_plans < 2:
            raise ConfigurationError(
                f"max_layouts and max_plans must be >= 2 (the current and the best plan), got "
                f"{self.max_layouts} and {self.max_plans}")
        if isinstance(self.max_memory, bool) or not isinstance(self.max_memory, int) or self.max_memory < 0:
            raise ConfigurationError(f"max_memory must be a whole number of bytes >= 0 (0: no budget), got "
                                     f"{self.max_memory!r}; e.g. 2147483648 (autotune serve --max-memory 2GiB)")
        if not 0 <= self.tuning_processes <= 64:
            raise ConfigurationError(f"tuning_processes must be in [0, 64], got {self.tuning_processes}")
        if not math.isfinite(self.store_timeout_s) or self.store_timeout_s <= 0:
            raise ConfigurationError(f"store_timeout_s must be a positive number of seconds, got "
                                     f"{self.store_timeout_s}")

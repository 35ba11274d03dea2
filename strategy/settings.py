"""What a :class:`~bagua_lightning.strategy.BaguaStrategy` is asked to do, validated on construction.

Bad values raise :class:`~bagua_lightning.core.errors.ConfigurationError` naming the value and the fix,
when the strategy is built rather than when ``fit`` starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import ConfigurationError
from ..core.services_file import resolve_autotune_address
from ..engine.algorithms.auto import auto_settings
from ..engine.algorithms.base import Algorithm, algorithm_classes, get_algorithm_class
from ..engine.autotune import DEFAULT_INTERVAL as DEFAULT_AUTOTUNE_INTERVAL
from ..engine.autotune import AutotuneSettings
from ..engine.autotune.selection import AutoSettings
from ..proto.plan import DEFAULT_BUCKET_SIZE


@dataclass(kw_only=True, slots=True)
class BaguaSettings:
    """The strategy's own arguments (Lightning's are ``DDPStrategy``'s), and what is derived from them."""

    algorithm: str = "gradient_allreduce"
    """The name of a registered algorithm (one file of ``engine/algorithms/`` each;
    :func:`~bagua_lightning.engine.algorithms.base.algorithm_classes` lists them, and an unknown name is refused
    with that list), or ``"auto"``: measure ``auto_candidates`` while training and keep the fastest."""

    flatten: bool = True
    """Communicate flat buckets with gradients as views of them (no copy)."""

    autotune: bool = False
    """Tune the bucket plan with the autotune service while training; only for algorithms that communicate
    gradients in buckets (``uses_gradient_buckets``; with ``"auto"``: once it has chosen one)."""

    bucket_size: int = DEFAULT_BUCKET_SIZE
    """Bytes per bucket of the default plan (Bagua's default: 10 MiB)."""

    autotune_service: str | None = None
    """``host:port`` of the autotune service; None: ``BAGUA_LIGHTNING_AUTOTUNE_SERVICE``, else the services
    file ``bagua-lightning up`` writes, else ``127.0.0.1:29600``."""

    autotune_interval: int = DEFAULT_AUTOTUNE_INTERVAL
    """Steps between two autotune step boundaries (report, ask, apply)."""

    autotune_token: str | None = None
    """Bearer token of the autotune service; None: ``BAGUA_LIGHTNING_AUTOTUNE_TOKEN`` (or the services file's
    token when the service is the one that file records), else no token."""

    autotune_tls: bool | str | Path = False
    """True: TLS with the system's root certificates; a path: TLS with that PEM file as the CA of the
    service's certificate; False: plaintext."""

    autotune_model_name: str | None = None
    """The name the model is tuned under (printable, at most 200 characters); None: the LightningModule's
    class name and a fingerprint of its parameters."""

    auto_candidates: list[str] | tuple[str, ...] | None = None
    """With ``algorithm="auto"``: the algorithms to measure (registered, needing no optimizer of their own:
    :func:`~bagua_lightning.engine.algorithms.base.switchable_algorithms`); None:
    :data:`~bagua_lightning.engine.autotune.selection.DEFAULT_CANDIDATES`."""

    auto_warmup_steps: int = 3
    """With ``algorithm="auto"``: untimed steps after each switch."""

    auto_trial_steps: int = 10
    """With ``algorithm="auto"``: timed steps per candidate (their median counts)."""

    auto_max_runoffs: int = 3
    """With ``algorithm="auto"``: at most this many runoffs of candidates too close to tell apart (0: none)."""

    bagua_kwargs: dict[str, Any] = field(default_factory=dict)
    """The algorithm's keyword arguments (with ``"auto"``: every candidate's); unknown ones are refused with
    the accepted list."""

    auto: AutoSettings | None = field(init=False)
    """Derived: how ``auto`` measures (None for a fixed algorithm)."""

    algorithm_classes: list[type[Algorithm]] = field(init=False)
    """Derived: the engine classes of the algorithm (with ``"auto"``: of the candidates, in order)."""

    autotune_settings: AutotuneSettings | None = field(init=False)
    """Derived: where and how to tune (None without ``autotune``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.flatten, bool):
            raise ConfigurationError(f"flatten must be a bool, got {self.flatten!r}")
        size = self.bucket_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ConfigurationError(f"bucket_size must be a positive number of bytes, got {size!r}")
        self.auto = None
        if self.algorithm == "auto":  # the algorithm's keyword arguments go to every candidate
            self.auto = auto_settings(self.auto_candidates, self.auto_warmup_steps, self.auto_trial_steps,
                                      prefix="auto_", candidate_kwargs=self.bagua_kwargs,
                                      max_runoffs=self.auto_max_runoffs)
        elif self.auto_candidates is not None:
            raise ConfigurationError(f"auto_candidates={list(self.auto_candidates)} needs algorithm='auto' "
                                     f"(algorithm={self.algorithm!r} is fixed).")
        self.algorithm_classes = [get_algorithm_class(name) for name in self.algorithm_names]
        self.algorithm_class.from_kwargs(**self.bagua_kwargs)  # validate now, not at fit
        if not isinstance(self.autotune, bool):
            raise ConfigurationError(f"autotune must be a bool, got {self.autotune!r}")
        self.autotune_settings = None
        tls = self.autotune_tls
        if not isinstance(tls, bool | str | Path):
            raise ConfigurationError(f"autotune_tls must be a bool or a CA certificate path, got {tls!r}")
        if (self.autotune_service is not None or self.autotune_model_name is not None) and not self.autotune:
            # Bad values fail now, naming them.
            AutotuneSettings(address=self.autotune_service or "127.0.0.1:1", model_name=self.autotune_model_name)
        if self.autotune:
            if self.auto is None and not self.algorithm_class.uses_gradient_buckets:
                raise ConfigurationError(
                    f"autotune=True needs an algorithm that communicates gradients in buckets; {self.algorithm!r} "
                    "averages weights outside backward, so there is no bucket plan to tune. Use one of "
                    f"{_bucketed_algorithms()}, or drop autotune=True")
            self.autotune_settings = AutotuneSettings(
                address=resolve_autotune_address(self.autotune_service), interval=self.autotune_interval,
                token=self.autotune_token, tls=tls is not False, root_certificates=None if isinstance(tls, bool)
                else tls, model_name=self.autotune_model_name)

    @property
    def algorithm_names(self) -> tuple[str, ...]:
        """The algorithm (with ``"auto"``: the candidates, the first driving the warm-up)."""
        return self.auto.candidates if self.auto is not None else (self.algorithm,)

    @property
    def algorithm_class(self) -> type[Algorithm]:
        """The engine class of the algorithm (with ``"auto"``: of the first candidate)."""
        return self.algorithm_classes[0]


def _bucketed_algorithms() -> list[str]:
    """The registered algorithms that communicate gradients in buckets (those ``autotune=True`` can tune);
    ``auto``'s ``uses_gradient_buckets`` is a property of the instance (true once it has chosen such a one)."""
    return sorted(name for name, cls in algorithm_classes().items() if cls.uses_gradient_buckets is True)

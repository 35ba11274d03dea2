"""The interface every engine algorithm implements, and the registry that maps Bagua's names to classes.

An engine algorithm instance holds one model's state between ``setup`` and
``teardown``. ``bagua_lightning.torch_api``'s ``Algorithm`` objects are factories
over these classes (one instance per wrapped model).

Life cycle, driven by :class:`~bagua_lightning.engine.ddp.AlgorithmDriver` (behind
``BaguaDistributedDataParallel`` and ``with_bagua``) and by the strategy's hooks::

    algo = AlgorithmClass.from_kwargs(**bagua_kwargs)   # validates kwargs (ValueError names them)
    algo.flatten = flatten                              # set by the wrapper (BaguaStrategy(flatten=...))
    algo.setup(module, comm, plan)                      # once, after the module is on its device
    algo.bind_optimizers(optimizers)                    # once the optimizers exist
    per training step:
        algo.on_forward_start(step)                     # before the wrapped forward
        algo.on_backward_start(step)                    # first thing in backward (autograd's thread)
        ... backward: algo.on_grad_ready(param) for every parameter as autograd finishes its grad
        algo.on_backward_end(step)                      # queued on autograd's engine: runs before backward() returns
        algo.on_optimizer_step_end(step)                # after optimizer.step()
    algo.apply_plan(plan)                               # between steps, on every rank at the same step
    algo.teardown()                                     # stops threads, frees buffers; idempotent

``step`` is the number of completed optimizer steps (0 for the first step). Hooks
that communicate must make the same calls in the same order on every rank; a
decision that could differ between ranks (e.g. "is it time to sync?") must depend
only on ``step`` and on values every rank agrees on.

Gradient accumulation: while the wrapper's ``no_sync()`` is active, the wrapper
does not call ``on_forward_start``/``on_backward_start``/``on_grad_ready``/
``on_backward_end``; gradients accumulate locally. ``on_forward_start`` is also
skipped for forwards without gradients (validation, ``torch.no_grad``).

Optimizers: ``algo.bind_optimizers(optimizers)`` is called once the training
optimizers exist (after ``setup``, before the first step; again if they are
replaced). The wrapper calls ``on_optimizer_step_end`` from a step post-hook it
registers on each of them, so it also runs outside Lightning.

Shared machinery for gradient-bucket algorithms lives in
:mod:`bagua_lightning.engine.buckets` (``BucketEngine``: flat buckets, in-order
launch as buckets become ready, per-bucket timings, plan re-application) and the
collectives in :mod:`bagua_lightning.engine.comm` (``all_reduce_``,
``hierarchical_all_reduce_``, ``compressed_all_reduce_``).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ...errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from ...proto.plan import BucketPlan, StepTimings
    from ..comm import CommContext


_T = TypeVar("_T")


class Algorithm(abc.ABC):
    """Base class of Bagua's algorithms.

    Subclasses declare their keyword arguments (with Bagua's defaults) in
    ``__init__``; :meth:`from_kwargs` rejects unknown ones with the accepted list.
    """

    #: Bagua's name, e.g. "gradient_allreduce"; the key in :data:`ALGORITHMS`.
    name: ClassVar[str]
    #: True when the algorithm communicates gradients in buckets built from a
    #: BucketPlan (so autotune applies to it).
    uses_gradient_buckets: ClassVar[bool] = False
    #: True when parameters stay identical on all ranks after every step.
    keeps_replicas_identical: ClassVar[bool] = True
    #: Flat buckets with tensors as views (BaguaStrategy(flatten=...)); set before setup.
    flatten: bool = True
    #: True when setup's plan is the default cut (re-cut in gradient-ready order after the
    #: first backward); False when the caller chose it (kept as given). Set before setup.
    plan_is_default: bool = True
    #: True while an AlgorithmDriver drives this instance (one model per instance).
    _driven: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Algorithm:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise ConfigurationError(
                f"algorithm {cls.name!r} got unknown argument(s) {unknown}; it accepts {accepted}"
            )
        return cls(**kwargs)

    @abc.abstractmethod
    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        """Allocate buffers and process groups; called once on every rank."""

    def on_forward_start(self, step: int) -> None:  # noqa: B027
        """Before the forward of training step ``step``."""

    def on_backward_start(self, step: int) -> None:  # noqa: B027
        """A communicating backward started (called from autograd's thread, before any on_grad_ready)."""

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:  # noqa: B027
        """Autograd finished accumulating ``param.grad`` in this backward."""

    def on_backward_end(self, step: int) -> None:  # noqa: B027
        """All gradients of this backward are ready; finish (wait for) gradient communication."""

    def bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:  # noqa: B027
        """The training optimizers (unwrapped torch optimizers); may raise ConfigurationError."""

    def on_optimizer_step_end(self, step: int) -> None:  # noqa: B027
        """After ``optimizer.step()`` of step ``step``."""

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """After ``optimizer.step()`` of step ``step``, with the optimizer (default: :meth:`on_optimizer_step_end`)."""
        self.on_optimizer_step_end(step)

    def apply_plan(self, plan: BucketPlan) -> None:  # noqa: B027
        """Re-bucket with ``plan``; all ranks call this at the same step boundary."""

    def last_step_timings(self) -> StepTimings | None:
        """Per-bucket timings of the last communicating step, or None when not measured."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state to checkpoint (e.g. optimizer-side replicas); must be tensors or plain data."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore what :meth:`state_dict` returned."""

    def teardown(self) -> None:  # noqa: B027
        """Stop threads, release buffers and process groups; safe to call twice."""

    def _set_up(self, value: _T | None) -> _T:
        """``value`` (state made by :meth:`setup`), or a clear error when used outside setup..teardown."""
        if value is None:
            raise RuntimeError(f"algorithm {self.name!r} is used before setup() or after teardown()")
        return value


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name`` (Bagua's algorithm names)."""
    _import_builtin_algorithms()
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown Bagua algorithm {name!r}; choose one of {sorted(ALGORITHMS)}"
        ) from None


_BUILTIN_MODULES: tuple[str, ...] = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "q_adam",
    "async_model_average",
)


def _import_builtin_algorithms() -> None:
    import importlib

    for module in _BUILTIN_MODULES:
        importlib.import_module(f"{__package__}.{module}")

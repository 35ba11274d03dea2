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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ...core.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from ...proto.plan import BucketPlan, StepTimings
    from ..comm import CommContext


_T = TypeVar("_T")
_A = TypeVar("_A", bound="Algorithm")


class Algorithm(abc.ABC):
    """Base class of Bagua's algorithms.

    Subclasses declare their keyword arguments (with Bagua's defaults) in
    ``__init__``; :meth:`from_kwargs` rejects unknown ones with the accepted list.
    """

    #: Bagua's name, e.g. "gradient_allreduce"; the key in :data:`ALGORITHMS` (set by :func:`register_algorithm`).
    name: ClassVar[str]
    #: The registration (set by :func:`register_algorithm`).
    spec: ClassVar[AlgorithmSpec]
    #: Precisions the algorithm refuses, each with the reason and the fix (Lightning's ``precision=``).
    unsupported_precisions: ClassVar[Mapping[str, str]] = {}
    #: True when the algorithm communicates gradients in buckets built from a
    #: BucketPlan (so autotune applies to it).
    uses_gradient_buckets: ClassVar[bool] = False
    #: Why the algorithm cannot train fault-tolerantly (``ElasticTraining`` refuses it with this), or None when
    #: it can. Gradient-bucket algorithms can; the weight-averaging ones and qadam say why not.
    fault_tolerance_refusal: ClassVar[str | None] = (
        "it is not a gradient-bucket algorithm: its exchange of weights is not yet written for a changing "
        "set of nodes; use gradient_allreduce, bytegrad or another gradient algorithm"
    )
    #: True when parameters stay identical on all ranks after every step.
    keeps_replicas_identical: ClassVar[bool] = True
    #: Flat buckets with tensors as views (BaguaStrategy(flatten=...)); set before setup.
    flatten: bool = True
    #: True when setup's plan is the default cut (re-cut in gradient-ready order after the
    #: first backward); False when the caller chose it (kept as given). Set before setup.
    plan_is_default: bool = True
    #: True while an AlgorithmDriver drives this instance (one model per instance).
    _driven: bool = False
    #: Set by the driving :class:`~bagua_lightning.engine.ddp.AlgorithmDriver` before ``setup``: hands the
    #: module to another algorithm instance, already set up on it, which the driver then calls directly
    #: (``auto`` leaves the step path so once it has chosen). None when nothing drives this instance.
    _hand_over: Callable[[Algorithm], None] | None = None

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

    @classmethod  # noqa: B027
    def check_optimizer(cls, optimizer: object) -> None:
        """Raise :class:`AlgorithmOptimizerError` when ``optimizer`` cannot drive this algorithm.

        For algorithms registered with ``optimizer_arg``: Bagua's constructor takes the optimizer.
        """

    def _set_up(self, value: _T | None) -> _T:
        """``value`` (state made by :meth:`setup`), or a clear error when used outside setup..teardown."""
        if value is None:
            raise RuntimeError(f"algorithm {self.name!r} is used before setup() or after teardown()")
        return value


class AlgorithmOptimizerError(ConfigurationError):
    """An algorithm was bound to optimizers it cannot work with (e.g. qadam without its QAdamOptimizer)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmSpec:
    """Everything the front doors derive from one registered algorithm.

    ``BaguaStrategy`` registers the Lightning alias ``bagua_<name>`` with :attr:`description`;
    ``bagua_lightning.torch_api.algorithms`` derives Bagua's ``<bagua_name>`` (the ``Algorithm``
    factory) and ``<bagua_name>Impl`` from the engine class's constructor and the fields below.
    """

    #: Bagua's algorithm name: ``BaguaStrategy(algorithm=name)``, ``Trainer(strategy=f"bagua_{name}")``.
    name: str
    #: One line for Lightning's strategy registry (what the algorithm exchanges, and when).
    description: str
    #: The ``torch_api`` class name, e.g. ``"GradientAllReduceAlgorithm"`` (Bagua's name).
    bagua_name: str
    #: Bagua's state on ``model.bagua_buckets[i]``: Bagua's attribute name -> the engine attribute (or
    #: method) holding one value per bucket.
    bucket_state: Mapping[str, str] = field(default_factory=dict)
    #: The first constructor argument of Bagua's class when the algorithm needs the model's optimizer
    #: (qadam's ``q_adam_optimizer``), checked with the engine's :meth:`Algorithm.check_optimizer`; None: none.
    optimizer_arg: str | None = None
    #: Methods Bagua's classes offer that take the wrapped module (``abort``/``resume``): each calls
    #: the engine method of the same name.
    module_methods: tuple[str, ...] = ()
    #: Engine attributes Bagua's classes read through, e.g. ``auto``'s ``selection``: on ``<bagua_name>Impl``
    #: its engine instance's; on the ``<bagua_name>`` factory, those of the model it was last reified for.
    exposed: tuple[str, ...] = ()
    #: True when the algorithm can take a model over from another one between two steps and hand it on
    #: (tear down, set up on the same module and optimizers): ``auto`` may measure it when it also needs no
    #: optimizer of its own. False for ``auto`` itself.
    switchable: bool = True

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.bagua_name.isidentifier():
            raise ValueError(f"algorithm names must be identifiers, got {self.name!r} / {self.bagua_name!r}")
        if not self.description:
            raise ValueError(f"algorithm {self.name!r} needs a description for Lightning's registry")


#: Every registered algorithm, by Bagua's name.
ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(
    *,
    name: str,
    description: str,
    bagua_name: str,
    bucket_state: Mapping[str, str] | None = None,
    optimizer_arg: str | None = None,
    module_methods: tuple[str, ...] = (),
    exposed: tuple[str, ...] = (),
    switchable: bool = True,
) -> Callable[[type[_A]], type[_A]]:
    """Class decorator: the one registration of an engine algorithm (see :class:`AlgorithmSpec`).

    A module of this package that registers an algorithm is all it takes: the Lightning alias and
    Bagua's ``torch_api`` classes are derived from the registration.
    """
    spec = AlgorithmSpec(name=name, description=description, bagua_name=bagua_name,
                         bucket_state=dict(bucket_state or {}), optimizer_arg=optimizer_arg,
                         module_methods=module_methods, exposed=exposed, switchable=switchable)

    def register(cls: type[_A]) -> type[_A]:
        taken = ALGORITHMS.get(name)
        if taken is not None and taken.__qualname__ != cls.__qualname__:
            raise ValueError(f"algorithm name {name!r} is taken by {taken.__qualname__}")
        for method in module_methods:
            if not callable(getattr(cls, method, None)):
                raise ValueError(f"algorithm {name!r} offers {method!r} to Bagua's API but has no such method")
        for attribute in exposed:
            if not hasattr(cls, attribute):
                raise ValueError(f"algorithm {name!r} exposes {attribute!r} to Bagua's API but has no such attribute")
        cls.name = name
        cls.spec = spec
        ALGORITHMS[name] = cls
        return cls

    return register


def algorithm_classes() -> dict[str, type[Algorithm]]:
    """Every registered algorithm by name (importing this package registered each of its modules)."""
    return dict(ALGORITHMS)


def switchable_algorithms() -> list[str]:
    """The algorithms ``auto`` may measure, in registration order: those that need no optimizer of their own
    and accept a switch (:attr:`AlgorithmSpec.switchable`). Derived from the registry, so a new algorithm's
    file is all it takes for ``auto`` to try it."""
    return [name for name, cls in ALGORITHMS.items() if cls.spec.switchable and cls.spec.optimizer_arg is None]


def get_algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name`` (Bagua's algorithm names)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown Bagua algorithm {name!r}; choose one of {sorted(ALGORITHMS)}"
        ) from None

"""Bagua's ``Algorithm`` (a factory) and ``AlgorithmImpl`` (one model's implementation, with its hooks).

``Algorithm.reify(process_group)`` returns a fresh :class:`AlgorithmImpl` for each
wrapped model, so one ``Algorithm`` object may serve several models, each with its
own state.

The ``AlgorithmImpl`` hooks are the public extension API, as in Bagua: a subclass
returns its Bagua tensors (:meth:`AlgorithmImpl.init_tensors`), groups them into
buckets (:meth:`AlgorithmImpl.tensors_to_buckets`), appends operations to each bucket
(:meth:`AlgorithmImpl.init_operations`) and returns the functions run before forward,
per parameter gradient, after backward and after ``optimizer.step()``. The defaults
mark each parameter's gradient ready as autograd produces it, and wait for nothing
(bucket operations finish in the thread that marks the last tensor ready).

The builtin algorithms are derived from the engine's registrations
(:func:`bagua_algorithm`): Bagua's class is an :class:`EngineAlgorithm` factory with the
engine class's constructor, and its implementation an :class:`EngineAlgorithmImpl`
holding one instance of the engine's algorithm (``bagua_lightning.engine.algorithms``),
the implementation ``BaguaStrategy`` runs too; ``with_bagua`` drives that instance
directly (overlapping communication with backward). Their Bagua hooks call the same
engine hooks, so calling them by hand behaves as the engine does.
"""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ...engine.algorithms.base import Algorithm as _EngineAlgorithm
from ...engine.algorithms.base import AlgorithmSpec, algorithm_classes, get_algorithm_class
from ...engine.buckets import trainable_parameters
from ...engine.comm import CommContext
from ...proto.plan import BucketPlan
from ..bucket import BaguaBucket

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = ["Algorithm", "AlgorithmImpl", "EngineAlgorithm", "EngineAlgorithmImpl", "bagua_algorithm", "bagua_algorithms"]


class AlgorithmImpl:
    """One model's implementation of an algorithm (Bagua's ``AlgorithmImpl``).

    Args:
        process_group: the :class:`~bagua_lightning.torch_api.communication.BaguaProcessGroup` to work on.
    """

    def __init__(self, process_group: BaguaProcessGroup) -> None:
        self.process_group = process_group
        self._communication_tensor_names: set[str] = set()

    def need_reset(self) -> bool:
        """True to rebuild tensors, buckets, operations and hooks before the next forward."""
        return False

    def init_tensors(self, bagua_module: nn.Module) -> list[torch.Tensor]:
        """Bagua tensors to communicate: every communicated parameter, with its gradient as effective tensor."""
        tensors = []
        for name, param in bagua_module.bagua_build_params():  # type: ignore[operator]
            param.bagua_ensure_grad()
            tensors.append(param.ensure_bagua_tensor(
                name, bagua_module.bagua_module_name,
                getter_closure=lambda p: p.grad,
                setter_closure=lambda p, t: setattr(p, "grad", t),
            ))
        self._communication_tensor_names = {t._bagua_name for t in tensors}
        return tensors

    def tensors_to_buckets(self, tensors: list[list[torch.Tensor]], do_flatten: bool) -> list[BaguaBucket]:
        """Buckets following Bagua's suggestion ``tensors`` (one bucket per list)."""
        return [BaguaBucket(group, name=f"bucket_{i}", flatten=do_flatten) for i, group in enumerate(tensors)]

    def init_operations(self, bagua_module: nn.Module, bucket: BaguaBucket) -> None:
        """Append this algorithm's operations to ``bucket`` (default: none)."""
        bucket.clear_ops()

    def init_forward_pre_hook(self, bagua_module: nn.Module) -> Callable[[Any], None]:
        """The function run before each training forward; it takes the forward's input."""
        return lambda input: None

    def init_backward_hook(self, bagua_module: nn.Module) -> Callable[[str, torch.nn.Parameter], None]:
        """The function run as each parameter's gradient is ready; takes its name and the parameter."""

        def hook(parameter_name: str, parameter: torch.nn.Parameter) -> None:
            if parameter_name in self._communication_tensor_names:
                parameter.bagua_mark_communication_ready()  # type: ignore[attr-defined]

        return hook

    def init_post_backward_hook(self, bagua_module: nn.Module) -> Callable[[], None]:
        """The function run when backward is done (bucket operations have finished by then)."""
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_module: nn.Module) -> Callable[[torch.optim.Optimizer], None]:
        """The function run after each ``optimizer.step()``; takes the optimizer."""
        return lambda optimizer: None


def _steps(bagua_module: nn.Module) -> int:
    """Optimizer steps the module's driver counted (the engine hooks' ``step``)."""
    driver = getattr(bagua_module, "_bagua_driver", None)
    return int(driver.step) if driver is not None else 0


class Algorithm(abc.ABC):
    """Base class of Bagua's algorithms: a factory of one :class:`AlgorithmImpl` per model."""

    @abc.abstractmethod
    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        """A new implementation working on ``process_group`` (called once per wrapped model)."""


class EngineAlgorithmImpl(AlgorithmImpl):
    """A builtin algorithm: Bagua's hooks over one instance of the engine's algorithm.

    Args:
        process_group: the process group to work on.
        engine: the engine algorithm instance (not set up; this implementation owns it).
    """

    #: Bagua's state names exposed on ``model.bagua_buckets[i]``, mapped to engine state (subclasses).
    bucket_state: ClassVar[dict[str, str]] = {}

    def __init__(self, process_group: BaguaProcessGroup, engine: _EngineAlgorithm) -> None:
        super().__init__(process_group)
        self.engine = engine
        self._step = 0

    def init_forward_pre_hook(self, bagua_module: nn.Module) -> Callable[[Any], None]:
        return lambda input: self.engine.on_forward_start(_steps(bagua_module))

    def init_backward_hook(self, bagua_module: nn.Module) -> Callable[[str, torch.nn.Parameter], None]:
        return lambda name, param: self.engine.on_grad_ready(param)

    def init_post_backward_hook(self, bagua_module: nn.Module) -> Callable[[], None]:
        return lambda: self.engine.on_backward_end(_steps(bagua_module))

    def init_post_optimizer_step_hook(self, bagua_module: nn.Module) -> Callable[[torch.optim.Optimizer], None]:
        return lambda optimizer: self.engine.on_optimizer_step_end(_steps(bagua_module))

    def describe_buckets(self, bagua_module: nn.Module, plan: BucketPlan | None) -> list[BaguaBucket]:
        """``model.bagua_buckets``: one unflattened bucket per engine bucket, with the engine's state."""
        if plan is None:
            return []
        by_name = dict(trainable_parameters(bagua_module))
        state_names = self.bucket_state
        return [
            BaguaBucket.describing(
                [by_name[n].ensure_bagua_tensor(n, bagua_module.bagua_module_name)  # type: ignore[attr-defined]
                 for n in names],
                f"bucket_{i}",
                {k: self._state_getter(attr, i) for k, attr in state_names.items()},
            )
            for i, names in enumerate(plan.tensor_names)
        ]

    def _state_getter(self, attr: str, index: int) -> Callable[[], Any]:
        def get() -> Any:
            values = getattr(self.engine, attr)
            if callable(values):
                values = values()
            return values[index]

        return get


class HookedAlgorithm(_EngineAlgorithm):
    """Runs a user's :class:`AlgorithmImpl` through the engine's driver (the same hooks the builtins get).

    ``setup`` builds the impl's tensors and buckets (grouped as the engine's plan
    suggests) and their operations; each driver hook calls the impl's hook function.
    """

    name: ClassVar[str] = "custom"

    def __init__(self, impl: AlgorithmImpl, bagua_module: nn.Module, do_flatten: bool) -> None:
        self.impl = impl
        self.bagua_module = bagua_module
        self.do_flatten = do_flatten
        self.buckets: list[BaguaBucket] = []
        self._names: dict[int, str] = {}
        self._plan: BucketPlan | None = None
        self.forward_input: Any = None

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        self._plan = plan
        self._build()

    def _build(self) -> None:
        impl, module = self.impl, self.bagua_module
        tensors = impl.init_tensors(module)
        by_name = {t._bagua_name: t for t in tensors}  # type: ignore[attr-defined]
        grouped: list[list[torch.Tensor]] = []
        used: set[str] = set()
        for names in self._plan.tensor_names if self._plan is not None else []:
            group = [by_name[n] for n in names if n in by_name]
            used.update(n for n in names if n in by_name)
            if group:
                grouped.append(group)
        rest = [t for n, t in by_name.items() if n not in used]
        if rest:
            grouped.append(rest)
        self.buckets = impl.tensors_to_buckets(grouped, self.do_flatten)
        comm = impl.process_group.comm
        for bucket in self.buckets:
            bucket._default_comm = comm
            impl.init_operations(module, bucket)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._forward_pre = impl.init_forward_pre_hook(module)
        self._backward = impl.init_backward_hook(module)
        self._post_backward = impl.init_post_backward_hook(module)
        self._post_step = impl.init_post_optimizer_step_hook(module)
        setattr(module, "bagua_buckets", self.buckets)  # noqa: B010  (nn.Module's __setattr__ typing)

    def on_forward_start(self, step: int) -> None:
        if self.impl.need_reset():
            self._build()
        self._forward_pre(self.forward_input)

    def on_backward_start(self, step: int) -> None:
        for bucket in self.buckets:
            bucket._reset_ready()

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        self._backward(self._names[id(param)], param)

    def on_backward_end(self, step: int) -> None:
        self._post_backward()

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self._post_step(optimizer)

    def bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass


def _bind(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a derived constructor by name, defaults applied (TypeError names a wrong call)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


class EngineAlgorithm(Algorithm):
    """Bagua's class of a registered engine algorithm (built by :func:`bagua_algorithm`).

    Its constructor is the engine class's (Bagua's arguments and defaults), after the
    optimizer for algorithms that need one (``QAdamAlgorithm(q_adam_optimizer, ...)``);
    the arguments are checked now and kept as attributes.
    """

    #: The engine class this builds (set by :func:`bagua_algorithm`).
    engine_class: ClassVar[type[_EngineAlgorithm]]
    #: The implementation :meth:`reify` returns (set by :func:`bagua_algorithm`).
    impl_class: ClassVar[type[RegisteredAlgorithmImpl]]
    #: Bagua's constructor arguments, without ``self`` (set by :func:`bagua_algorithm`).
    arguments: ClassVar[inspect.Signature]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._arguments = _bind(self.arguments, args, kwargs)
        self.engine_class(**_adopt(self, self.engine_class, self._arguments))  # validate now, not at wrap time
        self._latest: RegisteredAlgorithmImpl | None = None

    def reify(self, process_group: BaguaProcessGroup) -> RegisteredAlgorithmImpl:
        self._latest = self.impl_class(process_group, **self._arguments)
        return self._latest


class RegisteredAlgorithmImpl(EngineAlgorithmImpl):
    """One model's implementation of a registered engine algorithm (built by :func:`bagua_algorithm`).

    Takes the process group, then the same arguments as its :class:`EngineAlgorithm`.
    """

    #: The engine class whose instance this owns (set by :func:`bagua_algorithm`).
    engine_class: ClassVar[type[_EngineAlgorithm]]
    #: The arguments after the process group, as :attr:`EngineAlgorithm.arguments` (set by :func:`bagua_algorithm`).
    arguments: ClassVar[inspect.Signature]

    def __init__(self, process_group: BaguaProcessGroup, *args: Any, **kwargs: Any) -> None:
        arguments = _bind(self.arguments, args, kwargs)
        super().__init__(process_group, self.engine_class(**_adopt(self, self.engine_class, arguments)))


def _adopt(owner: object, engine: type[_EngineAlgorithm], arguments: dict[str, Any]) -> dict[str, Any]:
    """Keep ``arguments`` as attributes of ``owner`` (the optimizer as ``optimizer``, checked); the engine's."""
    engine_kwargs = dict(arguments)
    optimizer_arg = engine.spec.optimizer_arg
    if optimizer_arg is not None:
        optimizer = engine_kwargs.pop(optimizer_arg)
        engine.check_optimizer(optimizer)
        owner.optimizer = optimizer  # type: ignore[attr-defined]
    for key, value in engine_kwargs.items():
        setattr(owner, key, value)
    return engine_kwargs


def _module_method(engine: type[_EngineAlgorithm], name: str, on_impl: bool) -> Callable[..., None]:
    """Bagua's ``abort``/``resume``-style method: the engine method of the same name, given the module."""

    def on_factory(self: EngineAlgorithm, bagua_module: nn.Module) -> None:
        getattr(bagua_module.bagua_algorithm, name)(bagua_module)

    def on_implementation(self: RegisteredAlgorithmImpl, bagua_module: nn.Module) -> None:
        getattr(self.engine, name)(bagua_module)

    method = on_implementation if on_impl else on_factory
    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(engine, name).__doc__
    return method


def _exposed(engine: type[_EngineAlgorithm], name: str, on_impl: bool) -> property:
    """An engine attribute read through: the impl's engine's, or (factory) that of the latest model wrapped."""

    def on_implementation(self: RegisteredAlgorithmImpl) -> Any:
        return getattr(self.engine, name)

    def on_factory(self: EngineAlgorithm) -> Any:
        latest = self._latest
        return getattr(latest.engine, name) if latest is not None else None

    doc = getattr(getattr(engine, name), "__doc__", None) or ""
    return property(on_implementation if on_impl else on_factory,
                    doc=doc if on_impl else f"{doc} Of the model this object last wrapped (None before).")


@functools.cache
def bagua_algorithm(name: str) -> tuple[type[EngineAlgorithm], type[RegisteredAlgorithmImpl]]:
    """Bagua's ``Algorithm`` class and its ``AlgorithmImpl`` for the engine algorithm registered as ``name``.

    Both are derived from the registration (:class:`~bagua_lightning.engine.algorithms.base.AlgorithmSpec`):
    the names (``<bagua_name>``, ``<bagua_name>Impl``), the constructor (the engine class's, after the
    optimizer when the algorithm needs one), the state on ``model.bagua_buckets[i]`` and the methods
    taking the wrapped module. The same name always gives the same two classes.
    """
    engine = get_algorithm_class(name)
    spec: AlgorithmSpec = engine.spec
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [p for p in inspect.signature(engine.__init__).parameters.values() if p.name != "self"]
    if spec.optimizer_arg is not None:
        params.insert(0, inspect.Parameter(spec.optimizer_arg, positional))
    module = __package__  # where every registered algorithm's classes resolve by name (pickle, repr)

    def factory_init(self: EngineAlgorithm, *args: Any, **kwargs: Any) -> None:
        EngineAlgorithm.__init__(self, *args, **kwargs)

    def impl_init(self: RegisteredAlgorithmImpl, process_group: BaguaProcessGroup, *args: Any, **kwargs: Any) -> None:
        RegisteredAlgorithmImpl.__init__(self, process_group, *args, **kwargs)

    self_param = inspect.Parameter("self", positional)
    factory_init.__signature__ = inspect.Signature([self_param, *params])  # type: ignore[attr-defined]
    impl_init.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [self_param, inspect.Parameter("process_group", positional), *params])
    shared: dict[str, Any] = {"__module__": module, "engine_class": engine, "arguments": inspect.Signature(params)}
    methods: dict[str, Any] = {m: _module_method(engine, m, on_impl=True) for m in spec.module_methods}
    methods.update({a: _exposed(engine, a, on_impl=True) for a in spec.exposed})
    impl_cls = type(f"{spec.bagua_name}Impl", (RegisteredAlgorithmImpl,), {
        **shared, **methods, "__init__": impl_init, "bucket_state": dict(spec.bucket_state),
        "__doc__": f"One model's ``{spec.name}``: the process group, then :class:`{spec.bagua_name}`'s arguments.",
    })
    methods = {m: _module_method(engine, m, on_impl=False) for m in spec.module_methods}
    methods.update({a: _exposed(engine, a, on_impl=False) for a in spec.exposed})
    factory_cls = type(spec.bagua_name, (EngineAlgorithm,), {
        **shared, **methods, "__init__": factory_init, "impl_class": impl_cls,
        "__doc__": f"Create Bagua's ``{spec.name}`` algorithm.\n\n{inspect.cleandoc(engine.__doc__ or '')}",
    })
    return factory_cls, impl_cls


def bagua_algorithms() -> dict[str, type[EngineAlgorithm]]:
    """Bagua's class of every registered engine algorithm, by Bagua's class name (``"QAdamAlgorithm"``)."""
    classes = [bagua_algorithm(name)[0] for name in algorithm_classes()]
    return {cls.__name__: cls for cls in classes}

"""One registration per algorithm: the Lightning alias and Bagua's torch_api classes are derived from it."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.strategies import _StrategyRegistry
from torch import nn

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms import base
from bagua_lightning.engine.algorithms.base import (
    Algorithm,
    algorithm_classes,
    register_algorithm,
    switchable_algorithms,
)
from bagua_lightning.strategy import BaguaStrategy
from bagua_lightning.torch_api import algorithms as bagua_algorithms
from bagua_lightning.torch_api.algorithms.base import bagua_algorithm


class _Toy(Algorithm):
    """A toy algorithm: averages nothing."""

    def __init__(self, rounds: int = 3, label: str = "x") -> None:
        if rounds < 1:
            raise ConfigurationError(f"toy: rounds must be >= 1, got {rounds}")
        self.rounds = rounds
        self.label = label
        self.per_bucket = [1.0, 2.0]

    def setup(self, module: nn.Module, comm: Any, plan: Any) -> None:
        pass

    def pause(self, module: nn.Module | None = None) -> None:
        """Pause the toy."""
        self.paused = module


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Algorithm]]:
    """``_Toy`` registered as ``toy`` for one test only (the registry is restored after)."""
    algorithm_classes()  # the builtins first, so the restored registry keeps them
    monkeypatch.setattr(base, "ALGORITHMS", dict(base.ALGORITHMS))
    cls = register_algorithm(name="toy", description="averages nothing", bagua_name="ToyAlgorithm",
                             bucket_state={"_per_bucket": "per_bucket"}, module_methods=("pause",))(_Toy)
    yield cls
    bagua_algorithm.cache_clear()


def _registrations_in_files() -> dict[str, str]:
    """``{name: module}`` of every ``@register_algorithm(name=...)`` written in ``engine/algorithms/*.py``."""
    found: dict[str, str] = {}
    for path in sorted(Path(base.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_algorithm":
                (name,) = [kw.value.value for kw in node.keywords if kw.arg == "name"]  # type: ignore[attr-defined]
                assert name not in found, f"{name!r} is registered in {found[name]} and {path.stem}"
                found[name] = path.stem
    return found


def test_every_registration_reaches_the_registry_once() -> None:
    """The registry (``ALGORITHMS``) is the list: every algorithm file's registration is in it, under its own
    name, with its own Bagua class name; a new file needs no edit here."""
    classes = algorithm_classes()
    assert classes == base.ALGORITHMS
    assert {name: cls.__module__.rpartition(".")[2] for name, cls in classes.items()} == _registrations_in_files()
    assert {"gradient_allreduce", "auto"} <= set(classes)  # Bagua's default, and the one that picks
    assert all(cls.spec.name == name == cls.name for name, cls in classes.items())
    assert len({c.spec.bagua_name for c in classes.values()}) == len(classes)


@pytest.mark.parametrize("name", sorted(algorithm_classes()))
def test_each_registered_algorithm_reaches_both_front_doors(name: str) -> None:
    cls = algorithm_classes()[name]
    # Bagua's class of each, by Bagua's name, from the package.
    assert getattr(bagua_algorithms, cls.spec.bagua_name) is bagua_algorithm(name)[0]
    registry = _StrategyRegistry()
    BaguaStrategy.register_strategies(registry)
    assert registry[f"bagua_{name}"]["init_params"] == {"algorithm": name}
    assert registry[f"bagua_{name}"]["description"] == f"BaguaStrategy with {name}: {cls.spec.description}"
    # auto may try it exactly when it is switchable and needs no optimizer of its own
    assert (name in switchable_algorithms()) == (cls.spec.switchable and cls.spec.optimizer_arg is None)


def test_autotune_on_an_algorithm_without_buckets_names_the_ones_with() -> None:
    from bagua_lightning.strategy.settings import BaguaSettings

    bucketed = sorted(n for n, c in algorithm_classes().items() if c.uses_gradient_buckets is True)
    assert "gradient_allreduce" in bucketed and "decentralized" not in bucketed
    with pytest.raises(ConfigurationError, match="no bucket plan to tune") as info:
        BaguaSettings(algorithm="decentralized", autotune=True)
    assert str(bucketed) in str(info.value)


#: Docstrings that describe the algorithm arguments: they point at the registry instead of listing it.
_DESCRIBING_THE_CHOICE = ["bagua_lightning.strategy.settings", "bagua_lightning.strategy.strategy",
                          "bagua_lightning.engine.algorithms.auto", "bagua_lightning.engine.autotune.selection"]


@pytest.mark.parametrize("module_name", _DESCRIBING_THE_CHOICE)
def test_docstrings_name_no_list_of_algorithms(module_name: str) -> None:
    """A list of the algorithms written in a docstring goes stale when one is added: at most two names (an
    example, a default) per docstring."""
    module = importlib.import_module(module_name)
    names = [n for n in algorithm_classes() if n != "auto"]
    docs = {module_name: module.__doc__ or ""}
    for attr, value in vars(module).items():
        if getattr(value, "__module__", None) == module_name and inspect.isclass(value):
            docs[attr] = inspect.getdoc(value) or ""
            docs[f"{attr}.__init__"] = inspect.getdoc(value.__init__) or ""
            source = inspect.getsource(value)  # attribute docstrings (a dataclass field's) are not __doc__
            docs.update({f"{attr} field {i}": text for i, text in enumerate(re.findall(r'"""(.*?)"""', source, re.S))})
    for where, text in docs.items():
        named = {n for n in names if re.search(rf"\b{n}\b", text)}
        assert len(named) <= 2, f"{module_name} {where} lists {sorted(named)}: point at the registry instead"


def test_one_file_is_enough_for_both_front_doors(toy: type[Algorithm]) -> None:
    # Lightning: a bagua_<name> alias with the registered description.
    registry = _StrategyRegistry()
    BaguaStrategy.register_strategies(registry)
    assert registry["bagua_toy"]["description"] == "BaguaStrategy with toy: averages nothing"
    assert registry["bagua_toy"]["init_params"] == {"algorithm": "toy"}
    # Bagua's API: the class by Bagua's name, with the engine's constructor, checked at once.
    factory = bagua_algorithms.ToyAlgorithm
    assert factory is bagua_algorithm("toy")[0]
    params = inspect.signature(factory.__init__).parameters
    assert {k: v.default for k, v in params.items() if k != "self"} == {"rounds": 3, "label": "x"}
    with pytest.raises(ConfigurationError, match="rounds must be >= 1, got 0"):
        factory(rounds=0)
    with pytest.raises(TypeError, match="colour"):
        factory(colour="red")
    algorithm = factory(5, label="y")
    assert (algorithm.rounds, algorithm.label) == (5, "y")
    group: Any = object()
    impl = algorithm.reify(group)
    assert type(impl).__name__ == "ToyAlgorithmImpl" and impl.process_group is group
    assert isinstance(impl.engine, toy) and (impl.engine.rounds, impl.engine.label) == (5, "y")
    # The registered state and methods: bucket state by Bagua's name, a method taking the module.
    assert type(impl).bucket_state == {"_per_bucket": "per_bucket"}
    module = nn.Linear(1, 1)
    impl.pause(module)
    assert impl.engine.paused is module


def test_algorithms_needing_the_optimizer_take_it_first() -> None:
    from bagua_lightning.engine.algorithms.q_adam import QAdamOptimizer, QAdamOptimizerError
    from bagua_lightning.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamAlgorithmImpl

    model = nn.Linear(2, 2)
    optimizer = QAdamOptimizer(model.parameters(), lr=0.1)
    algorithm = QAdamAlgorithm(optimizer, hierarchical=False)
    assert algorithm.optimizer is optimizer and algorithm.hierarchical is False
    impl = algorithm.reify(object())  # type: ignore[arg-type]
    assert isinstance(impl, QAdamAlgorithmImpl) and impl.optimizer is optimizer and impl.engine.hierarchical is False
    with pytest.raises(QAdamOptimizerError, match="got SGD"):
        QAdamAlgorithmImpl(object(), torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_taken_name_or_a_missing_method_is_refused(toy: type[Algorithm]) -> None:
    class Other(_Toy):
        pass

    with pytest.raises(ValueError, match="'toy' is taken by _Toy"):
        register_algorithm(name="toy", description="d", bagua_name="OtherAlgorithm")(Other)
    with pytest.raises(ValueError, match="offers 'resume'"):
        register_algorithm(name="other", description="d", bagua_name="OtherAlgorithm",
                           module_methods=("resume",))(Other)
    with pytest.raises(ValueError, match="needs a description"):
        register_algorithm(name="other", description="", bagua_name="OtherAlgorithm")(Other)

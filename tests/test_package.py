"""The package root: importing the trainer-side client is free of Lightning; the strategy registers itself;
the packaging (dependencies, version, licence, Python floor, the service lock) tells the truth."""

from __future__ import annotations

import ast
import email.parser
import importlib
import importlib.metadata
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

import bagua_lightning


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


# -- packaging that tells the truth ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_FOLDERS = sorted({Path(p).parts[0] for p in PYPROJECT["tool"]["setuptools"]["package-dir"].values()})
# Extras a user installs for a feature; [dev] only serves the tests and the tools below.
USER_EXTRAS = ("service", "demo", "kernels")
DEV_TOOLS = {"proto/codegen.py"}  # regenerates the gRPC stubs: a developer's tool (grpcio-tools in [dev])
LOCK = ROOT / "services" / "requirements.lock"


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "bagua_lightning"}


def test_every_imported_package_is_declared() -> None:
    project = PYPROJECT["project"]
    user = _names(project["dependencies"])
    for extra in USER_EXTRAS:
        user |= _names(project["optional-dependencies"][extra])
    dev = user | {n for n in _names(project["optional-dependencies"]["dev"]) if n != "bagua-lightning"}
    dists = importlib.metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    files = [p for folder in PACKAGE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))
             if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    assert len(files) > 50  # the walk found the package
    for path in files:
        rel = str(path.relative_to(ROOT))
        declared = dev if rel in DEV_TOOLS else user
        for module in _third_party_imports(path):
            names = {canonicalize_name(d) for d in dists.get(module, [module])}
            if not names & declared:
                missing.setdefault(f"{module} ({', '.join(sorted(names))})", []).append(rel)
    assert not missing, f"imported but not declared in [project] dependencies or {USER_EXTRAS}: {missing}"


def test_tests_and_benchmarks_import_only_what_dev_installs() -> None:
    project = PYPROJECT["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    # A requirement's extras are installed too (redis[hiredis] brings hiredis).
    declared = {canonicalize_name(n) for r in requirements for n in (r.name, *r.extras)}
    dists = importlib.metadata.packages_distributions()
    missing = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            # scripts importing their neighbours, and tests importing the benchmarks' own modules
            local = {p.stem for p in path.parent.glob("*.py")} | {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
            for module in _third_party_imports(path) - local - {"tests", "benchmarks"}:
                names = {canonicalize_name(d) for d in dists.get(module, [module])}
                if not names & declared:
                    missing.append(f"{path.relative_to(ROOT)}: {module}")
    assert not missing, f"imported but not declared in any extra (add it to [dev]): {missing}"


def test_typing_extensions_is_a_dependency_of_the_strategy() -> None:
    # strategy/ imports typing_extensions at module level: a trainer install must bring it.
    assert "typing_extensions" in _third_party_imports(ROOT / "strategy" / "strategy.py")
    assert "typing-extensions" in _names(PYPROJECT["project"]["dependencies"])


def test_one_version_source() -> None:
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "bagua_lightning.__version__"}
    assigned = [str(p.relative_to(ROOT)) for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.py")
                if "__version__ =" in p.read_text()]
    assert assigned == ["src/bagua_lightning/__init__.py"]
    assert "version=" not in (ROOT / "setup.py").read_text()
    assert Version(bagua_lightning.__version__)  # a PEP 440 version


def test_cli_prints_the_version() -> None:
    result = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "--version"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"bagua-lightning {bagua_lightning.__version__}"


def test_licence_file_is_the_declared_apache_licence() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_python_floor_matches_the_code_and_the_tools() -> None:
    spec = SpecifierSet(PYPROJECT["project"]["requires-python"])
    # setup.py imports tomllib and the CLI calls logging.getLevelNamesMapping(): both 3.11+.
    assert "tomllib" in (ROOT / "setup.py").read_text()
    assert "getLevelNamesMapping" in (ROOT / "src" / "bagua_lightning" / "cli.py").read_text()
    assert "3.10" not in spec and "3.11" in spec
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == "3.11"
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in spec


def _lock_entries() -> dict[str, tuple[str, list[str]]]:
    """{name: (version, sha256 hashes)} of services/requirements.lock."""
    text = LOCK.read_text().replace("\\\n", " ")
    entries = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        name, _, version = requirement.partition("==")
        assert version, f"{line!r}: every lock line pins an exact version"
        hashes = [o.removeprefix("--hash=sha256:") for o in options if o.startswith("--hash=sha256:")]
        assert hashes and all(len(h) == 64 for h in hashes), f"{name}: no sha256 hash"
        entries[canonicalize_name(name)] = (version, hashes)
    return entries


def test_service_lock_pins_the_service_extra_and_the_build_backend() -> None:
    entries = _lock_entries()
    wanted = [*PYPROJECT["project"]["optional-dependencies"]["service"], *PYPROJECT["build-system"]["requires"]]
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in entries, f"{name} ({text}) is not in {LOCK.name}; run .ci/lock-service-requirements"
        assert entries[name][0] in requirement.specifier, f"{name}=={entries[name][0]} does not satisfy {text}"
        for extra in requirement.extras:  # redis[hiredis] needs hiredis locked too
            assert extra in entries, f"{extra} (extra of {name}) is not locked"
    dockerfile = (ROOT / "services" / "Dockerfile").read_text()
    assert "COPY services/requirements.lock" in dockerfile and "--require-hashes" in dockerfile


@pytest.mark.slow
def test_wheel_metadata_tells_the_truth(tmp_path: Path) -> None:
    # Built from this tree without isolation (offline): the version, the Python floor and the licence file.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        headers = email.parser.Parser().parsestr(archive.read(metadata).decode())
    assert headers["Version"] == bagua_lightning.__version__
    assert headers["Requires-Python"] == PYPROJECT["project"]["requires-python"]
    assert headers["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "typing-extensions>=4.5" in headers.get_all("Requires-Dist")


LAZY_MODULES = ["bagua_lightning", "bagua_lightning.hooks", "bagua_lightning.strategy", "bagua_lightning.client",
                "bagua_lightning.client.cache", "bagua_lightning.torch_api.algorithms"]


@pytest.mark.parametrize("name", LAZY_MODULES)
def test_lazy_modules_list_every_name_they_serve(name: str) -> None:
    module = importlib.import_module(name)
    listed = dir(module)
    assert listed == sorted(listed)
    for attr in listed:
        getattr(module, attr)  # each listed name resolves
    if hasattr(module, "__all__"):
        assert set(module.__all__) <= set(listed)


def test_lazy_names_show_in_dir() -> None:
    import bagua_lightning
    import bagua_lightning.client
    import bagua_lightning.hooks
    import bagua_lightning.torch_api.algorithms as algorithms

    assert {"bytegrad_hook", "ByteGradState"} <= set(dir(bagua_lightning.hooks))
    assert {"BaguaStrategy", "QAdamOptimizer"} <= set(dir(bagua_lightning))
    assert "CachedDataset" in dir(bagua_lightning.client)
    assert {"GradientAllReduceAlgorithm", "ByteGradAlgorithm"} <= set(dir(algorithms))


def test_every_module_with_a_lazy_getattr_defines_dir() -> None:
    from tests.test_imports import package_modules

    missing = []
    for name, (path, _) in package_modules().items():
        text = path.read_text()
        if "\ndef __getattr__(" in text and "\ndef __dir__(" not in text:
            missing.append(name)
    assert not missing, f"modules with a module-level __getattr__ but no __dir__: {missing}"

"""Fixtures shared by every test area. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.procs import free_port


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # gRPC honours http_proxy; tests only ever talk to loopback.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


@pytest.fixture(autouse=True)
def _restore_strategy_switch() -> Iterator[None]:
    # `cli.main` and some tests set BAGUA_LIGHTNING_NO_STRATEGY=1 in this process; left set, it would reach
    # later tests' Lightning workers, where Trainer(strategy="bagua") then finds no registered strategy.
    before = os.environ.get("BAGUA_LIGHTNING_NO_STRATEGY")
    yield
    if before is None:
        os.environ.pop("BAGUA_LIGHTNING_NO_STRATEGY", None)
    else:
        os.environ["BAGUA_LIGHTNING_NO_STRATEGY"] = before

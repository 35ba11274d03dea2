"""The same odd address gets the same answer from every entry point that takes one: ``RedisStore(hosts=...)``
(Bagua's dicts, ``host:port`` strings, one comma-separated string), the environment, the services file, the
command line (``status --autotune/--redis``, ``autotune serve --host/--port``, every ``--*-port``), the
autotune client, ``BaguaSettings`` and ``up``'s configuration. Each either returns what
:func:`~bagua_lightning.core.addresses.parse_address` returns, or fails with its error (the reason after the
value, word for word), whatever it calls the value."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning import cli
from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.client.cache import RedisStore
from bagua_lightning.client.cache.options import parse_hosts
from bagua_lightning.core.addresses import check_host, check_port, parse_address, parse_server
from bagua_lightning.core.args import bind_port_arg, port_arg
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.services_file import (
    ENV_AUTOTUNE,
    ENV_FILE,
    ENV_REDIS_HOSTS,
    FILE_VERSION,
    read_services_file,
    resolve_autotune_address,
    resolve_redis_hosts,
)

GOOD = [("[::1]:7000", ("::1", 7000)), (" 127.0.0.1:7000 ", ("127.0.0.1", 7000)),
        ("redis-0.svc:6379", ("redis-0.svc", 6379)), ("[fe80::1]:65535", ("fe80::1", 65535))]
BAD = ["host: 7000", "a b:7000", "h:+7000", "h:-1", "h:\uff17\uff10\uff10\uff10", "h:\u0667\u0660\u0660\u0660",
       "h:7000.0", "h:0", "h:65536", ":7000", "::1:7000", "[::1:7000", "[localhost]:7000", "[127.0.0.1]:7000",
       "h:", "h", "ho\tst:7000", "h\n:7000"]
BAD_HOSTS = ["a b", "", "[localhost]", "[127.0.0.1]", "h\n", " h", "[::1", "ho/st"]
BAD_PORTS = ["+7000", " 7000", "7000 ", "\uff17\uff10\uff10\uff10", "0x1b58", "0", "65536", "-1", "", "7_000"]


def reason(exc: BaseException, what: str) -> str:
    """What follows the name of the value in the reference error: the value and why it is refused."""
    text = str(exc)
    assert text.startswith(f"{what} "), text
    return text.removeprefix(f"{what} ").rstrip(".")


def status_cli(flag: str) -> Callable[[str], Any]:
    def run(text: str) -> Any:
        return cli.main(["status", flag, text])
    return run


def services_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        path = tmp_path / "services.json"
        path.write_text(json.dumps({"version": FILE_VERSION, "deployment": "d1", "autotune": text}))
        path.chmod(0o600)
        monkeypatch.setenv(ENV_FILE, str(path))
        info = read_services_file()
        assert info is not None
        return parse_address(info.autotune)
    return read


def address_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[[str], Any]]:
    """Each entry point as ``text -> (host, port)`` (or raising)."""

    def from_env(name: str, read: Callable[[], Any]) -> Callable[[str], Any]:
        def run(text: str) -> Any:
            monkeypatch.setenv(name, text)
            try:
                return read()
            finally:
                monkeypatch.delenv(name)
        return run

    def client(text: str) -> Any:
        c = AutotuneClient(target=text)
        try:
            return parse_address(c.target)
        finally:
            c.close()

    return {
        "parse_server": lambda text: parse_server(text, "hosts item"),
        "RedisStore hosts parsing": lambda text: parse_hosts([text])[0],
        "RedisStore hosts string": lambda text: parse_hosts(text)[0],
        "$BAGUA_LIGHTNING_REDIS_HOSTS": from_env(ENV_REDIS_HOSTS, lambda: tuple(resolve_redis_hosts()[0][0].values())),  # type: ignore[index]
        "$BAGUA_LIGHTNING_AUTOTUNE_SERVICE": from_env(ENV_AUTOTUNE, lambda: parse_address(resolve_autotune_address())),
        "autotune_service argument": lambda text: parse_address(resolve_autotune_address(text)),
        "AutotuneClient(target=...)": client,
        "services file": services_file(tmp_path, monkeypatch),
    }


def refusing_entry_points() -> dict[str, Callable[[str], Any]]:
    """Entry points that would connect to a good address: fed only the bad ones."""
    from bagua_lightning.strategy.settings import BaguaSettings

    return {
        "RedisStore(hosts=[...])": lambda text: RedisStore(hosts=[text]),
        "RedisStore(hosts='...')": lambda text: RedisStore(hosts=text),
        "BaguaSettings(autotune_service=...)": lambda text: BaguaSettings(autotune=True, autotune_service=text),
        "bagua-lightning status --autotune": status_cli("--autotune"),
        "bagua-lightning status --redis": status_cli("--redis"),
    }


@pytest.mark.parametrize(("text", "expected"), GOOD)
def test_a_good_address_is_read_alike_everywhere(text: str, expected: tuple[str, int], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_address(text) == expected
    for name, entry in address_entry_points(tmp_path, monkeypatch).items():
        assert entry(text) == expected, name


@pytest.mark.parametrize("text", BAD)
def test_a_bad_address_gets_the_same_error_everywhere(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigurationError) as ref:
        parse_address(text, "W")
    why = reason(ref.value, "W")
    assert why.startswith(repr(text))  # the whole value is named, then the part that is wrong
    entries = {**address_entry_points(tmp_path, monkeypatch), **refusing_entry_points()}
    for name, entry in entries.items():
        if name.startswith("bagua-lightning"):
            assert entry(text) == 2, name  # a usage error, exit status 2
            shown = capsys.readouterr()
            assert why in shown.out + shown.err, name
            continue
        with pytest.raises(ConfigurationError) as info:
            entry(text)
        assert why in str(info.value), f"{name}: {info.value}"
        assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_a_bad_host_gets_the_same_error_everywhere(host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from bagua_lightning.services.deploy_config import UpConfig

    with pytest.raises(ConfigurationError) as ref:
        check_host(host, "W")
    why = reason(ref.value, "W")
    path = tmp_path / "services.json"
    path.write_text(json.dumps({"version": FILE_VERSION, "deployment": "d1",
                                "redis": {"hosts": [{"host": host, "port": 7000}]}}))
    path.chmod(0o600)
    monkeypatch.setenv(ENV_FILE, str(path))
    entries: dict[str, Callable[[], Any]] = {
        "RedisStore(hosts=[{...}])": lambda: RedisStore(hosts=[{"host": host, "port": 7000}]),
        "RedisStore(hosts=[(h, p)])": lambda: RedisStore(hosts=[(host, 7000)]),
        "AutotuneClient(host=...)": lambda: AutotuneClient(host=host, port=7000),
        "services file": read_services_file,
        "up --host": lambda: UpConfig(host=host),
    }
    for name, entry in entries.items():
        with pytest.raises(ConfigurationError) as info:
            entry()
        assert why in str(info.value), f"{name}: {info.value}"
    assert cli.main(["autotune", "serve", "--host", host, "--port", "0"]) == 2
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("port", BAD_PORTS)
def test_a_bad_port_gets_the_same_error_everywhere(port: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bagua_lightning.services.deploy_config import UpConfig

    with pytest.raises(ConfigurationError) as ref:
        check_port(port, "W")
    why = reason(ref.value, "W")
    entries: dict[str, Callable[[], Any]] = {
        "RedisStore(hosts=[{...}])": lambda: RedisStore(hosts=[{"host": "127.0.0.1", "port": port}]),
        "AutotuneClient(port=...)": lambda: AutotuneClient(host="127.0.0.1", port=port),  # type: ignore[arg-type]
        "up --autotune-port": lambda: UpConfig(autotune_port=port),  # type: ignore[arg-type]
    }
    for name, entry in entries.items():
        with pytest.raises(ConfigurationError) as info:
            entry()
        assert why in str(info.value), f"{name}: {info.value}"
    with pytest.raises(argparse.ArgumentTypeError) as arg:  # shown as "argument --redis-port: ..."
        port_arg(port)
    assert str(arg.value) == f"port {why}"
    refused = why.split(";")[0]  # "'+7000' is not a TCP port" (the range given differs for a port to bind)
    if port != "0":  # a port to bind may be 0 (a free one)
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(refused)):
            bind_port_arg(port)
    for argv in (["up", "--redis-port", port], ["autotune", "serve", "--port", port]):
        if argv[-2] == "--port" and port == "0":
            continue
        with pytest.raises(SystemExit) as usage:
            cli.main(argv)
        assert usage.value.code == 2
        assert refused in capsys.readouterr().err


def test_bagua_hosts_keep_their_forms() -> None:
    """Bagua's ``[{"host": h, "port": "7000"}]`` (port a string of digits), tuples and strings give one list."""
    assert parse_hosts([{"host": "10.0.0.1", "port": "7000"}, ("[::1]", 7001), "h:7002"]) == [
        ("10.0.0.1", 7000), ("::1", 7001), ("h", 7002)]
    assert parse_hosts("10.0.0.1:7000, [::1]:7001") == [("10.0.0.1", 7000), ("::1", 7001)]
    for bad in ([], "", " , ", ["h:7000", "h:7000"], [7000]):
        with pytest.raises(ConfigurationError):
            parse_hosts(bad)  # type: ignore[arg-type]

"""Every user-facing error of the deployment commands: one line naming the value and the fix, exit 2 for
usage errors and 1 for failures, a traceback only with ``--debug``; ports and addresses validated where
they enter (flags, environment, services file); malformed services files never fall back to defaults."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.services import deploy
from tests.procs import free_port
from tests.services.conftest import cli, one_line_error


@pytest.mark.parametrize("args", [
    ["up", "--autotune-port", "99999"],
    ["up", "--redis-port", "0"],
    ["up", "--redis-port", "60000"],  # the cluster bus (port + 10000) would pass 65535
    ["up", "--maxmemory", "lots"],
    ["up", "--timeout", "-1"],
    ["up", "--host", "not a host"],
    ["up", "--host", "10.1.2.3", "--no-auth"],
    ["redis", "up", "--port", "70000"],
    ["redis", "up", "--single", "--nodes", "3"],
    ["redis", "up", "--host", "10.1.2.3", "--no-password"],
    ["redis", "down", "--port", "-3"],
    ["status", "--autotune", "127.0.0.1:99999"],
    ["status", "--redis", "127.0.0.1:7000,nohost"],
    ["demo", "--redis-port", "99999"],
    ["autotune", "serve", "--port", "99999"],
    ["autotune", "serve", "--metrics-port", "70000"],
    ["up", "--redis-port", "7²"],
    ["up", "--autotune-port", "٣٣"],
    ["up", "--replicas", "-1"],
    ["up", "--host", "0.0.0.0", "--announce-ip", "127.0.0.1"],
    ["redis", "up", "--port", "\u0667\u0660\u0660\u0660"],
    ["status", "--autotune", "127.0.0.1:7²"],
    ["status", "--redis", "127.0.0.1:٣"],
    ["cache", "ls", "--hosts", "127.0.0.1:65536"],
    ["--log-level", "LOUD", "status"],
    ["no-such-command"],
])
def test_usage_errors_are_one_line_with_exit_2(env: dict[str, str], args: list[str]) -> None:
    started = time.monotonic()
    result = cli(env, *args)
    assert time.monotonic() - started < 60  # refused at once, not after a health-check deadline
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    bad = next((a for a in args[1:] if (a not in ("--single", "--no-auth", "--no-password") and not a.startswith("--")
                and any(ch.isdigit() for ch in a)) or a in ("lots", "nohost", "LOUD", "not a host")), None)
    if bad is not None:
        assert bad.split(",")[-1] in lines[0] or bad in lines[0], lines[0]


@pytest.mark.parametrize(("variable", "value"), [
    ("BAGUA_LIGHTNING_REDIS_HOSTS", "127.0.0.1:99999"),
    ("BAGUA_LIGHTNING_REDIS_HOSTS", "127.0.0.1"),
    ("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "127.0.0.1:95136"),
])
def test_bad_addresses_in_the_environment(env: dict[str, str], variable: str, value: str) -> None:
    one_line_error(cli({**env, variable: value}, "status"), 2, variable, value)


@pytest.mark.parametrize("content", [
    "garbage{",
    "[" * 5000 + "]" * 5000,
    json.dumps({"version": 2, "deployment": "x", "redis": {"hosts": [{"host": "127.0.0.1"}]}}),
    json.dumps({"version": 2, "deployment": "x", "redis": {"hosts": [{"host": "127.0.0.1", "port": 99999}]}}),
    json.dumps({"version": 2, "deployment": "x", "autotune": 5}),
    json.dumps({"version": 2, "deployment": "x", "processes": {"redis": [{"pid": "1"}]}}),
    json.dumps(["not", "an", "object"]),
])
def test_malformed_services_file_is_a_clear_error_and_is_kept(env: dict[str, str], content: str) -> None:
    path = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    path.write_text(content)
    for command in ("status", "down", "up"):
        one_line_error(cli(env, command), 2, str(path), "delete it")
    assert path.read_text() == content  # never deleted, never replaced by defaults


def test_up_host_localhost_is_resolved(env: dict[str, str]) -> None:
    # Redis nodes meet and announce by address: a name is resolved once, where it enters.
    assert deploy.UpConfig(host="localhost", single=True).host == "127.0.0.1"
    result = cli(env, "up", "--host", "localhost", "--single", "--autotune-port", str(free_port()),
                 "--redis-port", str(free_port()), "--maxmemory", "32mb")
    try:
        assert result.returncode == 0, result.stderr
        assert "redis server: 127.0.0.1:" in result.stdout
    finally:
        assert cli(env, "down").returncode == 0


def test_taken_port_is_one_line_and_debug_shows_the_traceback(env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        one_line_error(cli(env, "up", "--single", "--autotune-port", port, "--redis-port", str(free_port())),
                       2, f"port {port}", "--autotune-port")
        debug = cli(env, "--debug", "up", "--single", "--autotune-port", port, "--redis-port", str(free_port()))
        assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_second_up_with_another_state_folder_on_the_same_ports_fails_fast(env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    ports = ["--single", "--autotune-port", str(free_port()), "--redis-port", str(free_port()), "--maxmemory", "32mb"]
    first = cli(env, "up", *ports)
    assert first.returncode == 0, first.stderr
    try:
        other = {**env, "XDG_STATE_HOME": str(tmp_path / "other"),
                 "BAGUA_LIGHTNING_SERVICES_FILE": str(tmp_path / "other.json")}
        started = time.monotonic()
        one_line_error(cli(other, "up", *ports), 2, "is not free")
        assert time.monotonic() - started < 30
        assert not (tmp_path / "other.json").exists()
    finally:
        assert cli(env, "down").returncode == 0


def test_a_port_claimed_by_a_starting_up_is_refused_at_once(env: dict[str, str]) -> None:
    port = free_port()
    with deploy._claim_ports([port]):
        one_line_error(cli(env, "up", "--single", "--autotune-port", str(port), "--redis-port", str(free_port())),
                       2, f"port {port}", "claimed")


def test_status_with_nothing_running_is_quick(env: dict[str, str]) -> None:
    # Measured, not asserted against a bound (the machine is shared): the result is printed for the log.
    started = time.monotonic()
    result = cli({**env, "BAGUA_LIGHTNING_REDIS_HOSTS": f"127.0.0.1:{free_port()}"}, "status")
    print(f"status with nothing running: {time.monotonic() - started:.2f} s")
    assert result.returncode == 1 and "UNHEALTHY" in result.stdout
    assert "Traceback" not in result.stderr and os.path.basename(env["BAGUA_LIGHTNING_SERVICES_FILE"]) in result.stderr


def test_failures_exit_1_with_one_line(env: dict[str, str], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-password"
    one_line_error(cli(env, "redis", "up", "--single", "--port", str(free_port()), "--password-file", str(missing),
                       "--state-dir", str(tmp_path / "s")), 2, str(missing))
    result = cli({**env, "BAGUA_LIGHTNING_REDIS_HOSTS": f"127.0.0.1:{free_port()}"}, "cache", "ls")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_cli_module_does_not_import_the_autotune_service_for_status(env: dict[str, str]) -> None:
    code = ("import sys; from bagua_lightning.cli import build_parser; build_parser(['status']); "
            "print(any(m.startswith(('bagua_lightning.services.autotune', 'torch', 'lightning')) for m in sys.modules))")
    out = subprocess.run([*cli.__globals__["CLI"][:1], "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_up_refuses_redis_ports_past_65535() -> None:
    with pytest.raises(ConfigurationError, match="60000"):
        deploy.UpConfig(redis_port=60000)  # its cluster bus ports (+10000) would pass 65535

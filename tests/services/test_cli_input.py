"""Ordinary input never breaks the CLI: ports parse strictly, and a reader that closes stdout early (``| head -1``)
ends the command quietly. Every command runs as its own process."""

from __future__ import annotations

import os
import subprocess

import pytest

from bagua_lightning.services import deploy
from tests.procs import free_port
from tests.services.conftest import CLI, cli, one_line_error

SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`


@pytest.mark.parametrize(("args", "value"), [
    (["up", "--redis-port"], " 80"),
    (["up", "--autotune-port"], "29600 "),
    (["demo", "--redis-port"], "+7000"),
    (["redis", "up", "--port"], "70 00"),
    (["redis", "down", "--port"], "7000\n"),
    (["autotune", "serve", "--port"], "\t29600"),
    (["up", "--replicas"], " 1"),
    (["demo", "--jobs"], " 2"),
    (["demo", "--epochs"], "0"),
    (["demo", "--workers"], "-1"),
    (["demo", "--transform-ms"], "nan"),
    (["demo", "--timeout"], "0"),
])
def test_ports_and_counts_with_spaces_or_signs_are_refused_in_one_line(env: dict[str, str], args: list[str],
                                                                      value: str) -> None:
    one_line_error(cli(env, *args, value), 2, repr(value), args[-1])


def _closed_stdout(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run the CLI with stdout a pipe whose reader is gone before the command writes anything."""
    proc = subprocess.Popen([*CLI, *args], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # the only reader: every write of the command now fails with EPIPE
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_closed_stdout_ends_quietly(env: dict[str, str], unbuffered: str) -> None:
    result = _closed_stdout({**env, "PYTHONUNBUFFERED": unbuffered}, "status")
    assert result.returncode == SIGPIPE_STATUS, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert "error" not in result.stderr, result.stderr


@pytest.mark.parametrize("args", [["--help"], ["up", "--help"], ["--version"], ["redis", "up", "--port", "x"]])
def test_help_and_usage_errors_with_a_closed_stdout_are_quiet(env: dict[str, str], args: list[str]) -> None:
    for unbuffered in ("1", ""):
        result = _closed_stdout({**env, "PYTHONUNBUFFERED": unbuffered}, *args)
        # argparse drops a failed write of help itself (exit 0); a usage error still says what was wrong
        assert result.returncode in (0, 2, SIGPIPE_STATUS), result
        assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_status_piped_into_head(env: dict[str, str]) -> None:
    # As typed at a shell: head may exit before or after status writes; either way no error and the first line.
    pipeline = f"{' '.join(CLI)} status | head -1; echo \"status=${{PIPESTATUS[0]}}\" >&2"
    result = subprocess.run(["bash", "-c", pipeline], env=env, capture_output=True, text=True, timeout=120)
    assert len(result.stdout.splitlines()) == 1, result.stdout  # what answers at the defaults varies
    assert result.stderr.splitlines()[-1] in ("status=0", "status=1", f"status={SIGPIPE_STATUS}"), result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


@pytest.mark.slow
def test_up_with_a_closed_stdout_leaves_the_services_up_and_says_nothing_more(env: dict[str, str]) -> None:
    ports = ["--autotune-port", str(free_port()), "--redis-port", str(free_port())]
    try:
        result = _closed_stdout(env, "up", "--single", "--maxmemory", "32mb", *ports, timeout=300)
        assert result.returncode == SIGPIPE_STATUS, result.stderr
        assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
        status = cli(env, "status")
        assert status.returncode == 0, (status.stdout, status.stderr)
        assert "autotune: healthy" in status.stdout and "redis: healthy" in status.stdout, status.stdout
    finally:
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            deploy.down(timeout_s=10)  # in this process: stops what the services file records, also on failure
        finally:
            os.environ.clear()
            os.environ.update(saved)


def test_a_broken_pipe_of_another_process_stays_an_error(env: dict[str, str]) -> None:
    # A command whose own write to a child's stdin fails reports it (exit 1), while its stdout is open.
    code = ("import os, sys, subprocess\n"
            "from bagua_lightning import cli\n"
            "def broken(args):\n"
            "    child = subprocess.Popen([sys.executable, '-c', 'pass'], stdin=subprocess.PIPE)\n"
            "    child.wait()\n"
            "    os.write(child.stdin.fileno(), b'x')\n"
            "def register(sub):\n"
            "    sub.add_parser('broken').set_defaults(func=broken)\n"
            "cli._COMMANDS['broken'] = '__main__'\n"
            "sys.modules['__main__'].register = register\n"
            "sys.exit(cli.main(['broken']))\n")
    result = subprocess.run([CLI[0], "-c", code], env=env, capture_output=True, text=True, timeout=120)
    one_line_error(result, 1, "BrokenPipeError")

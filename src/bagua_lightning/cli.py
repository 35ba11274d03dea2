"""The ``bagua-lightning`` command line: one entry point, subcommands owned by their packages.

Each subcommand lives next to the code it drives and exposes ``register(subparsers) -> None``, which adds
its parser and sets ``func`` (a callable taking the parsed namespace and returning an exit code). Modules
must not import torch at module level, so that ``bagua-lightning --help`` and the service commands start
fast and run in the torch-free service image.

Errors: every error reaches the user as one line naming the value and the fix. Usage errors (a bad flag
or value, :class:`~bagua_lightning.core.errors.ConfigurationError`) exit with 2, failures (a service that does
not come up, an unreachable server) with 1. ``--debug`` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from bagua_lightning.core.errors import BaguaLightningError, ConfigurationError

from . import __version__

# command -> the module that registers it (several commands may share one module).
_COMMANDS: dict[str, str] = {
    "autotune": "bagua_lightning.services.autotune.cli",  # autotune serve | simulate
    "redis": "bagua_lightning.services.redis_cli",  # redis up | down | status
    "cache": "bagua_lightning.client.cache_cli",  # cache ls | rm
    "up": "bagua_lightning.services.deploy_cli",  # up | down | status
    "down": "bagua_lightning.services.deploy_cli",
    "status": "bagua_lightning.services.deploy_cli",
    "rotate-secrets": "bagua_lightning.services.deploy_cli",
    "demo": "bagua_lightning.demo",  # demo
    "lighthouse": "bagua_lightning.lighthouse",  # the fault-tolerance coordinator
}
EXIT_FAILURE = 1
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``prog: error: ...; see prog --help``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv`` naming a command, only that command's module is imported (some import
    the whole autotune service, which takes seconds), else every command's (for ``--help``)."""
    parser = OneLineParser(
        prog="bagua-lightning",
        description="Bagua's training acceleration on PyTorch 2.x / Lightning 2.x: services and tools.",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("BAGUA_LIGHTNING_LOG_LEVEL", "INFO"),
        help="logging level (DEBUG, INFO, WARNING, ERROR); env BAGUA_LIGHTNING_LOG_LEVEL",
    )
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks of errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    command = next((a for a in argv or () if not a.startswith("-")), None)
    modules = [_COMMANDS[command]] if command in _COMMANDS else list(dict.fromkeys(_COMMANDS.values()))
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _command_words(argv: list[str]) -> list[str]:
    # The words after the global options (`--log-level X` takes a value).
    words, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            words.append(arg)
    return words


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, BaguaLightningError) else f"{type(exc).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A reader that closes stdout early (``bagua-lightning status | head -1``) ends it
    quietly, with the exit status of a process killed by SIGPIPE (141), as ``cat`` or ``yes`` would."""
    try:
        try:
            code = _main(argv)
        except SystemExit:  # --help, --version, usage errors: their output too is flushed here
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # what is still buffered: a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return _closed_stdout()
    return code


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone: a ``BrokenPipeError`` of another pipe (a
    child's stdin) stays an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or one that cannot be polled
        return False


def _closed_stdout() -> int:
    # Later writes (the interpreter's last flush of sys.stdout included) go nowhere instead of raising again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_words(argv))
    args = parser.parse_args(argv)
    level = str(args.log_level).upper()
    if level not in logging.getLevelNamesMapping():
        parser.error(f"--log-level {args.log_level!r} is not a level; give DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Any = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as exc:
        if _stdout_closed():
            raise  # the reader of our output has gone: main() ends quietly
        return _failed(args, exc)
    except Exception as exc:
        return _failed(args, exc)


def _failed(args: argparse.Namespace, exc: Exception) -> int:
    if args.debug:
        traceback.print_exception(exc)
    hint = "" if args.debug else " (--debug shows the traceback)"
    print(f"bagua-lightning {args.command}: error: {_one_line(exc)}"
          + ("" if isinstance(exc, BaguaLightningError) else hint), file=sys.stderr)
    return EXIT_USAGE if isinstance(exc, ConfigurationError) else EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The ``bagua-lightning`` command line: one entry point, subcommands owned by their packages.

Each subcommand lives next to the code it drives and exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` (a
callable taking the parsed namespace and returning an exit code). Modules are
imported only when listed here; they must not import torch at module level so
that ``bagua-lightning --help`` and the service commands start fast and run in
the torch-free service image.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

# (module, attribute) pairs; every module provides `register(subparsers)`.
_COMMAND_MODULES: tuple[str, ...] = (
    "bagua_lightning.services.autotune.cli",  # autotune serve | simulate
    "bagua_lightning.services.redis_cli",  # redis up | down | status
    "bagua_lightning.client.cache_cli",  # cache ls | rm
    "bagua_lightning.services.deploy",  # up | down | status
    "bagua_lightning.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bagua-lightning",
        description="Bagua's training acceleration on PyTorch 2.x / Lightning 2.x: services and tools.",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("BAGUA_LIGHTNING_LOG_LEVEL", "INFO"),
        help="logging level (DEBUG, INFO, WARNING, ERROR); env BAGUA_LIGHTNING_LOG_LEVEL",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # that command is not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``bagua-lightning lighthouse``: the coordinator of fault-tolerant training (torchft's Lighthouse).

The Lighthouse is Rust code in torchft's extension module, which needs no torch: this command loads that
module alone, without the ``torchft`` package (whose ``__init__`` imports torch), so it starts in a fraction
of a second and runs in the torch-free services image, where ``bagua-lightning up`` and ``docker compose
up`` start it beside the autotune service. The training side is :mod:`bagua_lightning.engine.elastic`.

torchft 0.2.0's Lighthouse has no credentials and no TLS: whoever reaches its port can join or stall a
job's quorum, and its dashboard (HTTP, same port) has a button per node that ends that node's trainer. It
listens on loopback unless ``--host`` says otherwise, and then warns in one line
(:func:`~bagua_lightning.services.deploy_config.lighthouse_warning`).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import logging
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType

from bagua_lightning.core.addresses import format_address
from bagua_lightning.core.errors import ConfigurationError

log = logging.getLogger(__name__)

_EXTENSION = "torchft._torchft"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``lighthouse`` to the ``bagua-lightning`` command line."""
    from bagua_lightning.core.args import bind_port_arg, positive_int_arg

    p = subparsers.add_parser(
        "lighthouse", help="run the fault-tolerance coordinator (torchft's Lighthouse) in the foreground",
        description="The coordinator of fault-tolerant training: forms each step's quorum of live nodes. "
                    "Trainers find it through TORCHFT_LIGHTHOUSE=http://HOST:PORT (or the services file, "
                    "when `bagua-lightning up` started it). It has no credentials or TLS (torchft 0.2.0): "
                    "keep it on loopback or a private network.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=bind_port_arg, default=29510, help="port to listen on (0: any free one)")
    p.add_argument("--min-nodes", type=positive_int_arg, default=1, help="nodes a quorum needs at least")
    p.add_argument("--join-timeout-ms", type=positive_int_arg, default=1000,
                   help="how long a quorum waits for the nodes of the last one before it forms without them")
    p.add_argument("--heartbeat-timeout-ms", type=positive_int_arg, default=2000,
                   help="a node silent this long is left out of the next quorum")
    p.set_defaults(func=_serve)


def torchft_extension() -> ModuleType:
    """torchft's compiled module (``LighthouseServer`` & co.), loaded without importing torch.

    Raises:
        ConfigurationError: torchft is not installed (the message names the fix).
    """
    if _EXTENSION in sys.modules:
        return sys.modules[_EXTENSION]
    package = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    folders = list(package.submodule_search_locations or []) if package is not None else []
    for folder in folders:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder) / f"_torchft{suffix}"
            if path.is_file():
                spec = importlib.util.spec_from_file_location(_EXTENSION, path)
                if spec is None or spec.loader is None:
                    continue
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                # A later `import torchft` in this process finds it here (an extension loads once per process).
                sys.modules[_EXTENSION] = module
                return module
    raise ConfigurationError("the lighthouse needs torchft's extension module: install it with "
                             "`pip install 'torchft>=0.2,<0.3'` (the services image: `pip install --no-deps torchft`)")


def _serve(args: argparse.Namespace) -> int:
    from bagua_lightning.core.addresses import check_host
    from bagua_lightning.services.deploy_config import lighthouse_warning

    host = check_host(args.host, "--host")
    server = torchft_extension().LighthouseServer(
        bind=format_address(host, args.port), min_replicas=args.min_nodes, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=50, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    port = int(str(server.address()).rpartition(":")[2])  # torchft names the machine, not the bound address
    warning = lighthouse_warning(host, port)
    if warning:
        log.warning("%s", warning)
    # One write, so that torchft's own log lines (the same file, another thread) cannot land inside it.
    sys.stdout.write(f"lighthouse listening on http://{format_address(host, port)}\n")
    sys.stdout.flush()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0

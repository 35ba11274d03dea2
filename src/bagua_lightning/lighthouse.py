"""``bagua-lightning lighthouse``: the coordinator of fault-tolerant training (torchft's Lighthouse).

Registering the command imports nothing heavy (the CLI and the services image run without torch); running
it imports torchft. The training side is :mod:`bagua_lightning.engine.elastic`.
"""

from __future__ import annotations

import argparse
import signal
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``lighthouse`` to the ``bagua-lightning`` command line."""
    from bagua_lightning.core.args import port_arg, positive_int_arg

    p = subparsers.add_parser(
        "lighthouse", help="run the fault-tolerance coordinator (torchft's Lighthouse) in the foreground",
        description="The coordinator of fault-tolerant training: forms each step's quorum of live nodes. "
                    "Trainers find it through TORCHFT_LIGHTHOUSE=http://HOST:PORT.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=port_arg, default=29510, help="port to listen on (0: any free one)")
    p.add_argument("--min-nodes", type=positive_int_arg, default=1, help="nodes a quorum needs at least")
    p.add_argument("--join-timeout-ms", type=positive_int_arg, default=1000,
                   help="how long a quorum waits for the nodes of the last one before it forms without them")
    p.add_argument("--heartbeat-timeout-ms", type=positive_int_arg, default=2000,
                   help="a node silent this long is left out of the next quorum")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=f"{args.host}:{args.port}", min_replicas=args.min_nodes,
                              join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=50,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(f"lighthouse listening on {server.address()}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0

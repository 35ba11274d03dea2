"""The ports of ``bagua-lightning up``: checked free, claimed machine-wide while services start on them, and,
when the user named none, picked as a free block.

A deployment listens on its autotune port and, per Redis node, on the client port, for a cluster on the
bus port (+10000) and, with client TLS and a password, on the read port (+20000); with TLS the client port is
the TLS port: :func:`~.deploy_config.deployment_ports`.
A named port that is taken fails at once with one line naming it and its flag; with no port named, the
defaults (7000.., 29600) are used when every port they imply is free, else the first free block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import socket
from collections.abc import Iterator

from ..core.errors import ConfigurationError
from ..core.redis_server import BUS_PORT_OFFSET
from .deploy_config import (
    DEFAULT_AUTOTUNE_PORT,
    DEFAULT_LIGHTHOUSE_PORT,
    DEFAULT_REDIS_PORT,
    UpConfig,
    deployment_ports,
)

# Where a Redis block is looked for when the default is taken: from the default up, below the ephemeral
# range (32768..) with the bus ports (+10000) too, then below the default.
_REDIS_SCAN = (range(DEFAULT_REDIS_PORT, 12000), range(2000, DEFAULT_REDIS_PORT))
_AUTOTUNE_SCAN = range(DEFAULT_AUTOTUNE_PORT, DEFAULT_AUTOTUNE_PORT + 400)
_LIGHTHOUSE_SCAN = range(DEFAULT_LIGHTHOUSE_PORT, DEFAULT_AUTOTUNE_PORT)  # below the autotune scan: never the same


class PortClaimedError(ConfigurationError):
    """Another ``bagua-lightning up`` is claiming the port right now."""


def port_free(host: str, port: int) -> OSError | None:
    """None when ``port`` on ``host`` can be bound now, else the error binding it gave."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Like the servers themselves: a port in TIME_WAIT is free, a listening one is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def require_free(host: str, wanted: list[tuple[str, int]]) -> None:
    """Fail early, naming the port and the flag, instead of finding a foreign server healthy."""
    for flag, port in wanted:
        exc = port_free(host, port)
        if exc is not None:
            raise ConfigurationError(
                f"port {port} on {host} is not free ({exc.strerror}); stop what uses it "
                f"(`bagua-lightning down`, `bagua-lightning redis down`) or pick another {flag}."
            ) from None


@contextlib.contextmanager
def claim_ports(ports: list[int]) -> Iterator[None]:
    """Claim ``ports`` machine-wide while services start on them (also across state folders and users).

    The claim is an abstract Unix socket per port: the kernel frees it when this process ends, however it
    ends, and a second ``up`` asking for the same port learns at once that it is taken.

    Raises:
        PortClaimedError: another ``up`` holds one of them.
    """
    held: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind(f"\0bagua-lightning-port-{port}")
            except OSError as exc:
                s.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise PortClaimedError(
                    f"port {port} is being claimed by another `bagua-lightning up` right now (another state "
                    "folder or user); wait for it and run `bagua-lightning status`, or pick other ports."
                ) from None
            held.append(s)
        yield
    finally:
        for s in held:
            s.close()


def with_lighthouse_port(cfg: UpConfig) -> UpConfig:
    """``cfg`` with a Lighthouse port: the named (or recorded) one, else 29510 when free, else the next free one
    below 29600 (none of the ports ``cfg`` names)."""
    if not cfg.lighthouse or cfg.lighthouse_port is not None:
        return cfg
    named = {cfg.autotune_port}
    if cfg.redis_port is not None:
        named |= {p for _, p in deployment_ports(dataclasses.replace(cfg, lighthouse=False), 0, cfg.redis_port)}
    for port in _LIGHTHOUSE_SCAN:
        if port not in named and port_free(cfg.host, port) is None:
            return dataclasses.replace(cfg, lighthouse_port=port)
    raise ConfigurationError(f"no free port for the Lighthouse on {cfg.host} in {_LIGHTHOUSE_SCAN.start}.."
                             f"{_LIGHTHOUSE_SCAN.stop - 1}; name one with --lighthouse-port, or --no-lighthouse.")


def _candidates(cfg: UpConfig) -> Iterator[tuple[int, int]]:
    autotune = [cfg.autotune_port] if cfg.autotune_port is not None else list(_AUTOTUNE_SCAN)
    if cfg.redis_port is not None:
        bases: list[int] = [cfg.redis_port]
    else:
        step = cfg.redis_node_count
        limit = 65535 - BUS_PORT_OFFSET - step
        bases = [b for r in _REDIS_SCAN for b in range(r.start, min(r.stop, limit), step)]
    for base in bases:
        redis_ports = set(range(base, base + cfg.redis_node_count))
        for port in autotune:
            if port not in redis_ports:
                yield port, base


def all_free(cfg: UpConfig, autotune_port: int, redis_port: int) -> bool:
    """True when every port of a deployment with these first ports is free (and no two coincide)."""
    wanted = [p for _, p in deployment_ports(cfg, autotune_port, redis_port)]
    return len(set(wanted)) == len(wanted) and all(port_free(cfg.host, p) is None for p in wanted)


@contextlib.contextmanager
def claimed(cfg: UpConfig) -> Iterator[UpConfig]:
    """``cfg`` with both ports set, every port of the deployment free and claimed for the block.

    Named ports are checked (one line naming a taken one and its flag); missing ones are picked: the
    defaults when all their ports are free, else the first free block (see the module doc).
    """
    cfg = with_lighthouse_port(cfg)
    if cfg.ports_chosen:
        chosen = cfg.with_ports(int(cfg.autotune_port or 0), int(cfg.redis_port or 0))
        wanted = deployment_ports(chosen, int(chosen.autotune_port or 0), int(chosen.redis_port or 0))
        require_free(cfg.host, wanted)
        with claim_ports([p for _, p in wanted]):
            require_free(cfg.host, wanted)  # a concurrent `up` may have finished between the check and the claim
            yield chosen
        return
    for autotune_port, redis_port in _candidates(cfg):
        if not all_free(cfg, autotune_port, redis_port):
            continue
        chosen = cfg.with_ports(autotune_port, redis_port)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(claim_ports([p for _, p in deployment_ports(chosen, autotune_port, redis_port)]))
        except PortClaimedError:
            continue
        with stack:
            if not all_free(chosen, autotune_port, redis_port):  # taken between the check and the claim
                continue
            yield chosen
        return
    named = "--autotune-port" if cfg.autotune_port is not None else "--redis-port"
    raise ConfigurationError(f"no free block of ports for the deployment on {cfg.host} (tried from "
                             f"{DEFAULT_REDIS_PORT} and {DEFAULT_AUTOTUNE_PORT}); name free ones with {named}.")

"""Training that survives a lost node: the survivors go on, a returning node heals from a live peer.

Built on torchft (``torchft.Manager`` and its Lighthouse): no consensus of our own. The unit of failure is
the *node*: one launcher (``torchrun`` or Lightning's) whose ranks form an ordinary process group inside the
node. Across nodes, every step:

1. :meth:`ElasticSession.begin_step` asks the Lighthouse for the step's quorum (the nodes alive now). A
   node that is behind (it returned, or it missed a commit) first loads the state of a live peer over HTTP
   (:class:`PeerCheckpointTransport`: tensors and plain values only, never a pickle);
2. :class:`ElasticSampler` deals the rest of the epoch's global order over the quorum's nodes, so a
   membership change re-shards what is left: no sample is skipped or seen twice;
3. the algorithm reduces each gradient bucket inside the node with its own bucket step (full precision
   with the node's ranks), then :meth:`ElasticSession.allreduce` averages it across the quorum's nodes
   (``GradientBucketAlgorithm.cross_node``);
4. :meth:`ElasticSession.commit` says whether every node of the quorum finished the step: only then does
   the optimizer step and the sampler advance; a step a node died in is redone by the survivors, never
   half-applied.

Below ``min_nodes`` the quorum waits ``quorum_timeout_s`` and then the job ends with one
:class:`FaultToleranceError` naming the nodes that were lost. docs/fault_tolerance.md has the design, the
failure model and what is not covered yet.
"""

from __future__ import annotations

import io
import logging
import os
import re
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import BaguaLightningError, ConfigurationError
from ..core.services_file import ENV_LIGHTHOUSE, recorded_lighthouse_url

log = logging.getLogger(__name__)

__all__ = [
    "ElasticSampler",
    "ElasticSession",
    "FaultTolerance",
    "FaultToleranceError",
    "Membership",
    "PeerCheckpointTransport",
]

#: The environment variables a node reads its settings from (a launcher's way to pass them).
LIGHTHOUSE_ENV = ENV_LIGHTHOUSE  # torchft's own variable
NODE_ID_ENV = "BAGUA_LIGHTNING_NODE_ID"


class FaultToleranceError(BaguaLightningError):
    """Training cannot go on: too few nodes are alive, or the coordinator cannot be reached."""


@dataclass(frozen=True, slots=True)
class FaultTolerance:
    """How a job survives lost nodes (``MIN:MAX`` nodes as in ``torchrun --nnodes``).

    Args:
        min_nodes: training goes on while at least this many nodes are alive.
        max_nodes: at most this many nodes train at once (None: any number that joins).
        lighthouse: the coordinator's address (``http://127.0.0.1:29510``); default: ``$TORCHFT_LIGHTHOUSE``.
        node_id: this node's name, ending in its number (``node0``); default: ``$BAGUA_LIGHTNING_NODE_ID``.
        timeout_s: a collective, commit or state transfer that takes longer fails its step (a hung node is
            dropped after this long).
        quorum_timeout_s: with fewer than ``min_nodes`` alive, wait this long for nodes to (re)join,
            then end with :class:`FaultToleranceError`.
        host: the address this node's state server listens on and advertises (loopback by default).
    """

    min_nodes: int = 1
    max_nodes: int | None = None
    lighthouse: str | None = None
    node_id: str | None = None
    timeout_s: float = 10.0
    quorum_timeout_s: float = 60.0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not isinstance(self.min_nodes, int) or isinstance(self.min_nodes, bool) or self.min_nodes < 1:
            raise ConfigurationError(f"FaultTolerance(min_nodes={self.min_nodes!r}): must be an int >= 1")
        if self.max_nodes is not None and (not isinstance(self.max_nodes, int) or self.max_nodes < self.min_nodes):
            raise ConfigurationError(
                f"FaultTolerance(max_nodes={self.max_nodes!r}): must be None or an int >= min_nodes={self.min_nodes}"
            )
        for name in ("timeout_s", "quorum_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigurationError(f"FaultTolerance({name}={value!r}): must be a number of seconds > 0")
        if self.node_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]*[0-9]", self.node_id):
            raise ConfigurationError(
                f"FaultTolerance(node_id={self.node_id!r}): must be letters, digits, '_', '.', '-' ending in "
                "the node's number, e.g. 'node0'"
            )

    def resolved(self) -> FaultTolerance:
        """These settings with the lighthouse and node id taken from the environment where not given (the
        lighthouse: ``$TORCHFT_LIGHTHOUSE``, else the one ``bagua-lightning up`` recorded in the services file)."""
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV) or recorded_lighthouse_url()
        if not lighthouse:
            raise ConfigurationError(
                f"fault tolerance needs the coordinator's address: pass FaultTolerance(lighthouse=...) or set "
                f"{LIGHTHOUSE_ENV} (e.g. http://127.0.0.1:29510; `bagua-lightning up` or `bagua-lightning "
                "lighthouse` starts one)"
            )
        node_id = self.node_id or os.environ.get(NODE_ID_ENV)
        if not node_id:
            raise ConfigurationError(
                f"fault tolerance needs this node's name: pass FaultTolerance(node_id='node0') or set {NODE_ID_ENV}"
            )
        return FaultTolerance(min_nodes=self.min_nodes, max_nodes=self.max_nodes, lighthouse=lighthouse,
                              node_id=node_id, timeout_s=self.timeout_s, quorum_timeout_s=self.quorum_timeout_s,
                              host=self.host)


@dataclass(frozen=True, slots=True)
class Membership:
    """The nodes of one step: this node's index among them and how many there are."""

    index: int
    count: int
    step: int
    nodes: tuple[str, ...]


# ---------------------------------------------------------------------------- healing from a live peer


class PeerCheckpointTransport:
    """torchft's checkpoint transport, on loopback by default, loading tensors and plain values only.

    A healthy node serves the state of the step it is at to the node that heals from it; the healing node
    loads it with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts, never an
    arbitrary pickle.
    """

    def __init__(self, host: str, timeout: timedelta) -> None:
        self._host = host
        self._timeout = timeout
        self._lock = threading.Condition()
        self._payload: bytes | None = None
        self._step = -1
        self._allowed = False
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                match = re.fullmatch(r"/checkpoint/(\d+)", self.path)
                body = transport._wait_for(int(match.group(1))) if match else None
                if body is None:
                    self.send_error(404, "no checkpoint for that step")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("checkpoint server: " + format, *args)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="bagua-ft-state", daemon=True)
        self._thread.start()

    def _wait_for(self, step: int) -> bytes | None:
        with self._lock:
            self._lock.wait_for(lambda: self._allowed and self._step >= step, self._timeout.total_seconds())
            return self._payload if self._allowed and self._step == step else None

    def metadata(self) -> str:
        port = self._server.server_address[1]
        return f"http://{self._host}:{port}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        buffer = io.BytesIO()
        torch.save(_to_cpu(state_dict), buffer)
        with self._lock:
            self._payload, self._step, self._allowed = buffer.getvalue(), step, True
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._allowed = False

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        if not metadata.startswith("http://"):
            raise FaultToleranceError(f"a peer advertised the state address {metadata!r}; expected http://host:port/")
        with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as reply:
            data = reply.read()
        return torch.load(io.BytesIO(data), weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


# ---------------------------------------------------------------------------- the session


class ElasticSession:
    """One node's membership in a fault-tolerant job: the quorum, the cross-node allreduce, the commit.

    Every rank of the node makes one; the node's rank 0 runs torchft's manager server and talks to the
    Lighthouse. ``state`` and ``load_state`` give and take everything a healing node needs (tensors and
    plain values).
    """

    def __init__(self, config: FaultTolerance, *, state: Callable[[], dict[str, Any]],
                 load_state: Callable[[dict[str, Any]], None]) -> None:
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError as e:  # pragma: no cover - torchft is a dependency
            raise ConfigurationError("fault tolerance needs torchft: pip install 'torchft>=0.2'") from e
        config = config.resolved()
        self.config = config
        if dist.is_available() and dist.is_initialized():
            group_rank, group_size = dist.get_rank(), dist.get_world_size()
        else:
            group_rank, group_size = 0, 1
        store_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store_port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None
        if store_port is None:
            raise ConfigurationError(
                "fault tolerance needs the node's store: launch each node with torchrun (or set MASTER_ADDR and "
                "MASTER_PORT and call torch.distributed.init_process_group first)"
            )
        timeout = timedelta(seconds=config.timeout_s)
        self._transport = PeerCheckpointTransport(config.host, timeout)
        self._members: tuple[str, ...] = ()
        self._seen: set[str] = set()
        self._listeners: list[Callable[[Membership | None, Membership], None]] = []
        self._commit_listeners: list[Callable[[bool], None]] = []
        self._last: Membership | None = None
        self._state, self._load_state = state, load_state
        self._group_rank, self._group_size = group_rank, group_size
        self._initial_sync = False  # set per quorum by _QuorumRecorder
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=load_state,
            state_dict=state,
            min_replica_size=config.min_nodes,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=config.lighthouse,
            replica_id=config.node_id,
            hostname=config.host,
            checkpoint_transport=self._transport,
        )
        _record_quorums(self)

    def begin_step(self) -> Membership:
        """Join this step's quorum (healing first when behind); raises :class:`FaultToleranceError` below MIN."""
        try:
            self.manager.start_quorum()
        except Exception as e:
            me = self.config.node_id
            lost = sorted((self._seen | set(self._members)) - {me})
            raise FaultToleranceError(
                f"no quorum of at least min_nodes={self.config.min_nodes} node(s) within "
                f"{self.config.quorum_timeout_s:g} s (coordinator {self.config.lighthouse}); this node {me} is "
                f"alive, lost: {lost} (the last quorum had {list(self._members)}): {type(e).__name__}: {e}"
            ) from e
        if self._initial_sync and self._group_size > 1:
            self._sync_node()
        index = self.manager.participating_rank()
        count = self.manager.num_participants()
        if count > (self.config.max_nodes or count):
            log.warning("fault tolerance: %d nodes joined, more than max_nodes=%d", count, self.config.max_nodes)
        membership = Membership(index=index if index is not None else 0, count=count,
                                step=self.manager.current_step(), nodes=self._members)
        old, self._last = self._last, membership
        if old is None or (old.nodes, old.count) != (membership.nodes, membership.count):
            for listener in self._listeners:
                listener(old, membership)
        return membership

    def _sync_node(self) -> None:
        """Give every rank of this node its local rank 0's state, after a quorum that synced the initial state.

        At step 0 torchft heals every node but one from a *primary* node, and it picks that primary per
        local rank (``local rank % nodes``): local rank 0 of every node takes node A's state, local rank 1
        node B's, so the ranks of one node end up holding different initial weights (and stay apart, since
        each applies the same averaged gradient to its own weights). Local rank 0's source is the same node
        for every node, so after this every rank of the job holds that node's state. Only after a quorum
        at step 0 with more than one node: that condition comes from the quorum itself, the same on every
        rank of the node, so they all take part. The state travels as one ``torch.save`` buffer and is
        loaded with ``weights_only=True``, as a healing transfer is.
        """
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        size = torch.zeros(1, dtype=torch.int64, device=device)
        if self._group_rank == 0:
            buffer = io.BytesIO()
            torch.save(_to_cpu(self._state()), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
            size.fill_(payload.numel())
        dist.broadcast(size, src=0)
        if self._group_rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src=0)
        if self._group_rank != 0:
            self._load_state(torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=True))
        log.info("fault tolerance: step 0: the node's ranks took local rank 0's state (torchft's initial sync "
                 "chooses a source node per local rank)")

    def add_membership_listener(self, listener: Callable[[Membership | None, Membership], None]) -> None:
        """Call ``listener(old, new)`` from :meth:`begin_step` when the step's nodes differ from the previous
        step's (and at the first step, with ``old`` None), after healing and before the step runs.

        Every rank of every node of the quorum calls it at the same step, so a listener may run collectives
        inside the node. What it raises ends :meth:`begin_step` with that error.
        """
        self._listeners.append(listener)

    def allreduce(self, tensor: torch.Tensor) -> Any:
        """Average ``tensor`` in place across the quorum's nodes; returns a work to wait on (never raises:
        a failure makes :meth:`commit` say False)."""
        return self.manager.allreduce(tensor)

    def add_commit_listener(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(committed)`` from :meth:`commit`, once the nodes have decided and before the
        optimizer steps (an algorithm that stages weights applies or drops them there)."""
        self._commit_listeners.append(listener)

    def commit(self) -> bool:
        """True when every node of the quorum finished this step: step the optimizer; False: redo it."""
        committed = bool(self.manager.should_commit())
        for listener in self._commit_listeners:
            listener(committed)
        return committed

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _record_quorums(session: ElasticSession) -> None:
    """Keep each quorum's node names, so that an error below MIN can name the lost ones.

    torchft's client returns the quorum (with its replica ids) to the manager and keeps none of it; this
    wraps the one call that receives it.
    """
    session.manager._client = _QuorumRecorder(session.manager._client, session)


class _QuorumRecorder:
    """torchft's manager client, passing every call through and noting each quorum's nodes."""

    def __init__(self, client: Any, session: ElasticSession) -> None:
        self._client = client
        self._session = session

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        session = self._session
        names = tuple(sorted(r.split(":")[0] for r in result.replica_ids))
        if names != session._members:
            log.info("fault tolerance: nodes now %s (were %s)", list(names), list(session._members))
        session._members = names
        session._seen.update(names)
        # torchft's init_sync at step 0 may heal a node's ranks from different nodes (ElasticSession._sync_node)
        session._initial_sync = result.max_step == 0 and len(result.replica_ids) > 1
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


# ---------------------------------------------------------------------------- data


class ElasticSampler:
    """An epoch's global order, dealt out step by step over the nodes alive at that step.

    Each step takes the next ``count * node_batch`` indices of the epoch's permutation (``node_batch =
    batch_size * ranks per node``): node ``index`` takes its ``node_batch`` of them and each of its ranks
    its ``batch_size``. The position moves only when the step commits, so a step that failed is redone
    with the same indices re-dealt over the survivors: over an epoch every index is seen exactly once. The
    global batch shrinks and grows with the world (logged at each change).
    """

    def __init__(self, num_samples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigurationError(f"ElasticSampler(num_samples={num_samples!r}): must be an int >= 1")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"ElasticSampler(batch_size={batch_size!r}): must be an int >= 1")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.epoch = 0
        self.position = 0
        self._last_count = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self) -> torch.Tensor:
        """The epoch's permutation (made once per epoch: every step of it slices the same one)."""
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = (self.epoch, torch.randperm(self.num_samples, generator=g))
            else:
                self._order = (self.epoch, torch.arange(self.num_samples))
        return self._order[1]

    @property
    def epoch_done(self) -> bool:
        return self.position >= self.num_samples

    def indices(self, membership: Membership, local_rank: int, local_size: int) -> list[int]:
        """This rank's indices for the step of ``membership`` (possibly empty at the end of an epoch)."""
        if membership.count != self._last_count:
            log.info("fault tolerance: %d node(s) train; global batch %d", membership.count,
                     membership.count * local_size * self.batch_size)
            self._last_count = membership.count
        start = self.position + (membership.index * local_size + local_rank) * self.batch_size
        stop = min(start + self.batch_size, self.num_samples)
        return self.order()[start:stop].tolist() if start < stop else []

    def step_indices(self, membership: Membership, local_size: int) -> list[int]:
        """Every index the step of ``membership`` deals out, over all its nodes and ranks."""
        start = self.position
        stop = min(start + membership.count * local_size * self.batch_size, self.num_samples)
        return self.order()[start:stop].tolist()

    def advance(self, membership: Membership, local_size: int) -> None:
        """The step of ``membership`` committed: its indices are spent."""
        self.position = min(self.num_samples, self.position + membership.count * local_size * self.batch_size)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[int]:  # pragma: no cover - a sampler's protocol; the loop uses indices()
        return iter(self.order()[self.position:].tolist())

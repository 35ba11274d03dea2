"""RedisStore(hosts=None): a protected node-local server, shared by jobs and ranks, started once."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import redis

from bagua_lightning.client import RedisStore
from bagua_lightning.core.local_redis import PASSWORD_FILE, local_dir
from bagua_lightning.core.redis_server import is_redis_pid
from tests.procs import free_port


def test_local_server_is_protected_bounded_and_shared(local_state: Path) -> None:
    capacity = 64 * 1024 * 1024
    first = RedisStore(hosts=None, capacity_per_node=capacity)
    assert first.local and first.managed_pid is not None
    (host, port), = first.hosts
    assert host == "127.0.0.1"
    with redis.Redis(host=host, port=port) as anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with redis.Redis(host=host, port=port, password=first.options.password) as admin:
        config = admin.config_get("*")
    assert config["bind"] == "127.0.0.1" and config["protected-mode"] == "yes"
    assert int(config["maxmemory"]) == capacity and config["maxmemory-policy"] == "allkeys-lfu"
    assert config["save"] == "" and config["appendonly"] == "no"
    for name in ("server.json", PASSWORD_FILE):
        assert oct(os.stat(local_dir() / name).st_mode & 0o777) == "0o600"
    assert first.options.password not in (local_dir() / "server.json").read_text()
    assert first.options.password not in (local_dir() / "data" / "redis.conf").read_text()

    first.set("shared", b"1")
    second = RedisStore(hosts=None, capacity_per_node=capacity)  # another job on the node
    assert second.hosts == first.hosts and second.managed_pid is None and second.get("shared") == b"1"
    second.shutdown()
    assert is_redis_pid(first.managed_pid)  # a store that found the server does not stop it
    pid = first.managed_pid
    first.shutdown()
    assert not is_redis_pid(pid)


def _rank(rank: int, port: int, state: str, out: Any) -> None:
    os.environ.update(XDG_STATE_HOME=state, LOCAL_RANK=str(rank),
                      BAGUA_LIGHTNING_SERVICES_FILE=os.path.join(state, "none.json"))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        store = RedisStore(hosts=None, capacity_per_node=32 * 1024 * 1024)
        store.set(f"rank{rank}", b"x")
        dist.barrier()
        out.put((rank, store.hosts[0][1], store.managed_pid, store.num_keys()))
    finally:
        dist.destroy_process_group()


def test_local_rank_zero_starts_the_server_and_the_others_find_it(local_state: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(local_state), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    (_, port0, pid0, keys0), (_, port1, pid1, keys1) = results
    assert port0 == port1 and pid0 is not None and pid1 is None
    assert keys0 == keys1 == 2


def test_a_server_started_for_one_node_serves_a_later_multi_node_job(local_state: Path) -> None:
    from bagua_lightning.core.local_redis import ensure_server, read_server, set_password

    first = ensure_server(32 * 1024 * 1024)
    assert first.binds == ("127.0.0.1",)
    # A later job spanning nodes reaches this node at another address and shares one password.
    again = ensure_server(32 * 1024 * 1024, bind="127.0.0.2")
    assert again.pid == first.pid and again.binds == ("127.0.0.1", "127.0.0.2")
    set_password(again, "the-jobs-password")
    with redis.Redis(host="127.0.0.2", port=again.port, password="the-jobs-password") as c:
        assert c.ping()
    with redis.Redis(host="127.0.0.1", port=again.port, password=first.password) as old, \
            pytest.raises(redis.AuthenticationError):
        old.ping()
    recorded = read_server()
    assert recorded is not None and recorded.password == "the-jobs-password" and recorded.binds == again.binds

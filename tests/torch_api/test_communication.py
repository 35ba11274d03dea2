"""Every primitive of ``bagua_lightning.torch_api.communication`` on real Gloo ranks, values checked on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_api.launch import run_case


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_primitive_gives_bagua_values(world_size: int, tmp_path: Path) -> None:
    """Each of Bagua's communication primitives (reductions, gathers, scatters, broadcast, send/recv...) on
    real ranks, every result checked against the value Bagua's semantics give."""
    out = run_case("primitives", world_size=world_size, log_dir=tmp_path)
    assert out.count("primitives ok") == world_size


COMMUNICATOR_WORKERS = Path(__file__).with_name("communicator_workers.py")


@pytest.mark.parametrize("world_size", [2, 4])
def test_communicator_methods(world_size: int, tmp_path: Path) -> None:
    """Bagua's communicator objects: ``comm.allreduce_inplace(tensor, op)`` and the rest, values checked."""
    out = run_case("methods", world_size=world_size, log_dir=tmp_path, script=COMMUNICATOR_WORKERS)
    assert out.count("methods ok") == world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_abort_releases_a_waiting_rank(world_size: int, tmp_path: Path) -> None:
    """A rank stuck in an allreduce nobody else joins is released by ``abort()`` and exits cleanly."""
    out = run_case("abort", world_size=world_size, log_dir=tmp_path, script=COMMUNICATOR_WORKERS, timeout_s=240)
    assert out.count("abort ok") == world_size


def test_bagua_script_env(tmp_path: Path) -> None:
    """A Bagua script under torchrun's variables: rank, sizes and node before and after init_process_group."""
    out = run_case("script", world_size=4, local_size=2, log_dir=tmp_path, script=COMMUNICATOR_WORKERS)
    assert out.count("script ok") == 4

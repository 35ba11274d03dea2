"""``BaguaProcessGroup`` on 4 real Gloo ranks laid out as 2 nodes x 2, and ``init_process_group`` with a store."""

from __future__ import annotations

from pathlib import Path

from tests.torch_api.launch import run_case


def test_subgroups_two_nodes_of_two(tmp_path: Path) -> None:
    out = run_case("process_group", world_size=4, local_size=2, log_dir=tmp_path)
    assert out.count("process group ok") == 4


def test_init_with_file_store_and_explicit_ranks(tmp_path: Path) -> None:
    store = tmp_path / "store"
    out = run_case("init_store", world_size=2, log_dir=tmp_path, args=(str(store),), launcher_env=False)
    assert out.count("init store ok") == 2


def test_init_adopts_an_initialised_torch_distributed(tmp_path: Path) -> None:
    out = run_case("adopt_torch", world_size=2, log_dir=tmp_path, args=(str(tmp_path / "store"),),
                   launcher_env=False)
    assert out.count("adopt ok") == 2


def test_torch_to_bagua_pg_map_forgets_destroyed_groups(tmp_path: Path) -> None:
    out = run_case("pg_map", world_size=2, log_dir=tmp_path)
    assert out.count("pg map ok") == 2

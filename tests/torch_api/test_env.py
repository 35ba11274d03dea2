"""``bagua_lightning.torch_api.env``: launcher variables (torchrun, Lightning, SLURM) before and after init."""

from __future__ import annotations

from pathlib import Path

import pytest

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.torch_api import env
from tests.torch_api.launch import run_case

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "SLURM_PROCID",
               "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
               "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def layout() -> tuple[int, int, int, int, int]:
    return env.get_rank(), env.get_world_size(), env.get_local_rank(), env.get_local_size(), env.get_node_rank()


def test_defaults_without_a_launcher(clean: pytest.MonkeyPatch) -> None:
    assert layout() == (0, 1, 0, 1, 0)


def test_torchrun(clean: pytest.MonkeyPatch) -> None:
    for k, v in dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1").items():
        clean.setenv(k, v)
    assert layout() == (5, 8, 1, 4, 1)


def test_lightning_launcher_sets_no_rank(clean: pytest.MonkeyPatch) -> None:
    for k, v in dict(WORLD_SIZE="4", LOCAL_RANK="1", NODE_RANK="1", LOCAL_WORLD_SIZE="2").items():
        clean.setenv(k, v)
    assert layout() == (3, 4, 1, 2, 1)


def test_slurm(clean: pytest.MonkeyPatch) -> None:
    for k, v in dict(SLURM_PROCID="6", SLURM_NTASKS="8", SLURM_LOCALID="2", SLURM_NTASKS_PER_NODE="4(x2)",
                     SLURM_NODEID="1").items():
        clean.setenv(k, v)
    assert layout() == (6, 8, 2, 4, 1)


def test_torchrun_wins_over_slurm(clean: pytest.MonkeyPatch) -> None:
    for k, v in dict(SLURM_PROCID="0", SLURM_NTASKS="1", RANK="3", WORLD_SIZE="4", LOCAL_RANK="1",
                     LOCAL_WORLD_SIZE="2").items():
        clean.setenv(k, v)
    assert layout() == (3, 4, 1, 2, 1)


def test_bad_values_name_the_variable(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigurationError, match="WORLD_SIZE='two'"):
        env.get_world_size()
    clean.setenv("BAGUA_REPORT_METRICS", "maybe")
    with pytest.raises(ConfigurationError, match="BAGUA_REPORT_METRICS"):
        env.is_report_metrics_switch_on()


def test_service_settings(clean: pytest.MonkeyPatch) -> None:
    for name in ("BAGUA_DEFAULT_BUCKET_SIZE", "BAGUA_AUTOTUNE", "BAGUA_SERVICE_PORT", "MASTER_ADDR",
                 "BAGUA_IS_OUTPUT_AUTOTUNE_LOG", "BAGUA_AUTOTUNE_WARMUP_TIME_S"):
        clean.delenv(name, raising=False)
    assert env.get_default_bucket_size() == 10 * 1024**2
    assert (env.get_autotune_level(), env.get_bagua_service_port(), env.get_master_addr()) == (0, -1, "127.0.0.1")
    assert env.get_autotune_max_samples() == 60 and env.get_autotune_warmup_time_s() == 30.0
    assert env.get_is_output_autotune_log() is False  # Bagua's bool("0") was True
    clean.setenv("BAGUA_DEFAULT_BUCKET_SIZE", "1024")
    clean.setenv("BAGUA_IS_OUTPUT_AUTOTUNE_LOG", "1")
    clean.setenv("BAGUA_AUTOTUNE_WARMUP_TIME_S", "2.5")
    assert env.get_default_bucket_size() == 1024 and env.get_is_output_autotune_log() is True
    assert env.get_autotune_warmup_time_s() == 2.5
    port = env.find_free_network_port()
    assert 0 < port < 65536


@pytest.mark.parametrize(("world_size", "local_size"), [(2, 2), (4, 2)])
def test_same_answers_before_and_after_init(world_size: int, local_size: int, tmp_path: Path) -> None:
    out = run_case("env", world_size=world_size, local_size=local_size, log_dir=tmp_path)
    assert out.count("env ok") == world_size


def test_local_size_from_hostnames_when_no_variable_gives_it(tmp_path: Path) -> None:
    out = run_case("hosts", world_size=2, log_dir=tmp_path, drop=("LOCAL_WORLD_SIZE",))
    assert out.count("hosts ok") == 2

"""The rest of Bagua's surface on real Gloo ranks: primitives against torch's, functional, bagua_patch,
parameter flattening, fork-started workers, and Bagua's launchers (``distributed.launch``, ``baguarun``)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bagua_lightning.distributed import baguarun, launch
from tests.procs import free_port
from tests.ranks import REPO
from tests.ranks import job_env as _env
from tests.torch_api.launch import run_case

WORKERS = Path(__file__).with_name("surface_workers.py")


@pytest.mark.parametrize("world_size", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_primitives_match_torch_distributed(world_size: int, tmp_path: Path) -> None:
    """reduce leaves the other ranks' tensors as NCCL does, torch's dist.reduce too; alltoall_v takes
    Bagua's displacement lists with or without the trailing total, matching all_to_all_single."""
    out = run_case("compare", world_size=world_size, log_dir=tmp_path, script=WORKERS, timeout_s=300)
    assert out.count("compare ok") == world_size


def test_functional_bagua_patch_and_helpers(tmp_path: Path) -> None:
    out = run_case("surface", world_size=2, log_dir=tmp_path, script=WORKERS, drop=("OMP_NUM_THREADS",),
                   env={"BAGUA_SERVICE_PORT": str(free_port())})
    assert out.count("surface ok") == 2


def test_do_flatten_moves_parameters_into_bucket_buffers(tmp_path: Path) -> None:
    out = run_case("flatten", world_size=2, log_dir=tmp_path, script=WORKERS)
    assert out.count("flatten ok") == 2


def _run(argv: list[str], tmp_path: Path, timeout_s: float = 240, **extra: str) -> subprocess.CompletedProcess[str]:
    env = _env({"CUDA_VISIBLE_DEVICES": "", **extra})
    env.pop("OMP_NUM_THREADS", None)
    env.pop("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", None)
    try:
        return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                              start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{argv} did not finish in {timeout_s} s: {e.stdout!r} {e.stderr!r}") from None


def test_fork_started_workers_train_together(tmp_path: Path) -> None:
    res = _run([sys.executable, str(WORKERS), "fork", str(free_port())], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fork ok" in res.stdout


def test_launch_module_starts_a_two_rank_job(tmp_path: Path) -> None:
    """Bagua's flags: --set_additional_flag puts --local_rank=N first; the service port and local size
    reach the ranks."""
    port, service = free_port(), free_port()
    res = _run([sys.executable, "-m", "bagua_lightning.distributed.launch", "--nproc_per_node=2",
                f"--master_port={port}", f"--bagua_service_port={service}", "--set_additional_flag",
                str(WORKERS), "launched", "--x", "1"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in (0, 1):
        assert (f"launched ok rank={rank} world=2 local_size=2 service_port={service} extra=None "
                f"args=['--local_rank={rank}', '--x', '1']") in res.stdout, res.stdout + res.stderr


def test_run_module_is_torchrun_with_baguas_flags(tmp_path: Path) -> None:
    service = free_port()
    res = _run([sys.executable, "-m", "bagua_lightning.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                "--bagua_service_port", str(service), str(WORKERS), "launched"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(f"service_port={service} extra=None args=[]") == 2, res.stdout + res.stderr


def test_baguarun_starts_a_two_rank_job_on_this_host(tmp_path: Path) -> None:
    """One local host: no SSH; -x sets a variable on every rank."""
    res = _run([sys.executable, "-m", "bagua_lightning.distributed.baguarun", "--host_list", "127.0.0.1",
                "--nproc_per_node", "2", "--master_port", str(free_port()), "-x", "BAGUA_TEST_EXTRA=on",
                str(WORKERS), "launched"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("extra=on args=[]") == 2, res.stdout + res.stderr


def test_baguarun_is_a_console_script() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["baguarun"].partition(":")
    assert (module, func) == ("bagua_lightning.distributed.baguarun", "main")
    assert callable(getattr(baguarun, func))


def test_launch_maps_baguas_flags_onto_torchrun() -> None:
    args = launch.parse_args(["--nnodes", "2", "--node-rank", "1", "--nproc_per_node=4", "--master_addr", "10.0.0.1",
                              "--master_port", "1234", "--logdir", "logs", "--autotune_level", "1",
                              "--default_bucket_size", "1024", "-m", "pkg.train", "--lr", "0.1"])
    plan = launch.plan(args)
    assert plan.argv == ["--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=10.0.0.1",
                         "--master_port=1234", "--log-dir=logs", "--redirects=3", "--module", "pkg.train",
                         "--lr", "0.1"]
    assert plan.env["BAGUA_AUTOTUNE"] == "1" and plan.env["BAGUA_DEFAULT_BUCKET_SIZE"] == "1024"
    assert plan.env["LOCAL_SIZE"] == "4" and plan.env["BAGUA_SERVICE_PORT"] == "29501"
    no_python = launch.plan(launch.parse_args(["--no_python", "--set_additional_flag", "./run.sh", "a"]))
    assert no_python.argv[-5:] == ["--module", "bagua_lightning.distributed._local_rank", "--exec", "./run.sh", "a"]


@pytest.mark.parametrize("argv, word", [
    (["--nproc_per_node", "0", "t.py"], "--nproc_per_node"),
    (["--nnodes", "2", "--node_rank", "2", "t.py"], "--node_rank"),
    (["--master_port", "70000", "t.py"], "--master_port"),
    (["-m", "--no_python", "t.py"], "--module"),
])
def test_launch_refuses_bad_flags_in_one_line(argv: list[str], word: str) -> None:
    res = subprocess.run([sys.executable, "-m", "bagua_lightning.distributed.launch", *argv], capture_output=True,
                         text=True, env=_env({}), cwd=REPO, timeout=60)
    assert res.returncode == 2 and word in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_baguarun_sends_variables_on_stdin_not_the_command_line() -> None:
    args = baguarun.parse_args(["--host_list", "h1,h2", "--nproc_per_node", "8", "--master_port", "1234",
                                "-x", "TOKEN=s3cret value", "train.py", "--epochs", "2"])
    assert args.host_list == ["h1", "h2"]
    script = baguarun.node_script(args, 1)
    assert "export TOKEN='s3cret value'" in script
    last = script.strip().splitlines()[-1]
    assert last.startswith("exec ") and "s3cret" not in last
    for part in ("--nnodes=2", "--node_rank=1", "--master_addr=h1", "--master_port=1234", "train.py --epochs 2"):
        assert part in last, last

"""deploy/slurm/train.sbatch: valid bash (and shellcheck-clean where shellcheck is installed), and what it
hands to srun, run with stand-ins for the SLURM commands (no SLURM here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"
SCRIPTS = [SBATCH, ROOT / "deploy" / "k8s" / "make-secret.sh"]
READ_SECRETS = ("from bagua_lightning.core.services_file import env_secret\n"
                "for name in ('REDIS_PASSWORD', 'AUTOTUNE_TOKEN', 'CACHE_KEY'):\n"
                "    print(env_secret('BAGUA_LIGHTNING_' + name))\n")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_bash(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt install shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_shellcheck_clean(script: Path) -> None:
    result = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def _stand_ins(folder: Path) -> Path:
    """srun, scontrol and bagua-lightning that record how they were called (SLURM is not installed here)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    record = ('printf "%s\\n" "$0 $*" >> "$RECORD"; '
              'env | grep -E "^(BAGUA_LIGHTNING|MASTER)_" | sort >> "$RECORD"\n')
    (bin_dir / "srun").write_text("#!/bin/sh\n" + record)
    (bin_dir / "bagua-lightning").write_text("#!/bin/sh\n" + record)
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-07\\ngpu-08\\n"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    record = tmp_path / "record.txt"
    base = {"PATH": f"{_stand_ins(tmp_path)}:{os.environ['PATH']}", "HOME": str(tmp_path), "RECORD": str(record),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)",
            "SLURM_JOB_NODELIST": "gpu-[07-08]"}
    result = subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, timeout=60,
                            env={**base, **env})
    return result, record.read_text() if record.exists() else ""


SERVICES = {"BAGUA_LIGHTNING_AUTOTUNE_SERVICE": "10.0.0.5:29600",
            "BAGUA_LIGHTNING_REDIS_HOSTS": "10.0.0.5:7000,10.0.0.6:7000"}


def test_ranks_start_with_srun_and_find_the_services_and_secrets(tmp_path: Path) -> None:
    secrets = tmp_path / ".config" / "bagua-lightning" / "secrets"
    secrets.mkdir(parents=True)
    for name, value in (("redis-password", "pw-1"), ("autotune-token", "tok-2"), ("cache-key", "key-3")):
        (secrets / name).write_text(value + "\n")
        (secrets / name).chmod(0o600)
    result, record = _run(tmp_path, **SERVICES)
    assert result.returncode == 0, result.stderr
    calls = [line for line in record.splitlines() if line.startswith("/")]
    assert [Path(c.split()[0]).name for c in calls] == ["bagua-lightning", "srun"]
    assert calls[0].split()[1:] == ["status", "--autotune", "10.0.0.5:29600", "--redis",
                                    "10.0.0.5:7000,10.0.0.6:7000"]
    assert calls[1].split()[1:] == ["--kill-on-bad-exit=1", "python", "-m", "bagua_lightning.examples.demo",
                                    "--nodes", "2", "--devices", "8", "--job", "slurm-4242", "--out",
                                    "bagua-lightning-demo/4242"]
    env = set(record.splitlines())
    assert {f"BAGUA_LIGHTNING_REDIS_PASSWORD_FILE={secrets / 'redis-password'}",
            f"BAGUA_LIGHTNING_AUTOTUNE_TOKEN_FILE={secrets / 'autotune-token'}",
            f"BAGUA_LIGHTNING_CACHE_KEY_FILE={secrets / 'cache-key'}",
            "BAGUA_LIGHTNING_AUTOTUNE_SERVICE=10.0.0.5:29600", "MASTER_ADDR=gpu-07", "MASTER_PORT=24242"} <= env
    # The secrets are files: never a value in the ranks' environment, nor on a command line.
    assert not any(value in record for value in ("pw-1", "tok-2", "key-3")), record
    # What a rank reads from them, with the environment srun handed it.
    ranks = dict(line.split("=", 1) for line in env if line.startswith("BAGUA_LIGHTNING_") and "=" in line)
    read = subprocess.run([sys.executable, "-c", READ_SECRETS], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], **ranks})
    assert read.returncode == 0, read.stderr
    assert read.stdout.split() == ["pw-1", "tok-2", "key-3"]


def test_a_given_program_replaces_the_demo(tmp_path: Path) -> None:
    result, record = _run(tmp_path, "python", "train.py", "--lr", "0.1", **SERVICES,
                          BAGUA_LIGHTNING_REDIS_PASSWORD="a", BAGUA_LIGHTNING_AUTOTUNE_TOKEN="b",
                          BAGUA_LIGHTNING_CACHE_KEY="c")
    assert result.returncode == 0, result.stderr
    (srun,) = [line for line in record.splitlines() if line.split()[0].endswith("/srun")]
    assert srun.split()[1:] == ["--kill-on-bad-exit=1", "python", "train.py", "--lr", "0.1"]


@pytest.mark.parametrize(("env", "message"), [
    ({}, "set BAGUA_LIGHTNING_AUTOTUNE_SERVICE=host:port"),
    ({"BAGUA_LIGHTNING_AUTOTUNE_SERVICE": "h:1"}, "set BAGUA_LIGHTNING_REDIS_HOSTS=host:port"),
    (SERVICES, "set BAGUA_LIGHTNING_REDIS_PASSWORD_FILE or write BAGUA_LIGHTNING_REDIS_PASSWORD's value into"),
])
def test_missing_services_or_secrets_stop_before_srun(tmp_path: Path, env: dict[str, str], message: str) -> None:
    result, record = _run(tmp_path, **env)
    assert result.returncode == 2 and message in result.stderr
    assert "srun" not in record


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "redis-password").write_text("pw")
    (secrets / "redis-password").chmod(0o644)
    result, record = _run(tmp_path, **SERVICES, BAGUA_LIGHTNING_SECRETS_DIR=str(secrets))
    assert result.returncode == 2 and "chmod 600" in result.stderr
    assert "srun" not in record


def test_secret_variables_given_are_kept_and_no_file_is_needed(tmp_path: Path) -> None:
    given = tmp_path / "elsewhere"
    given.write_text("pw-9")
    given.chmod(0o600)
    result, record = _run(tmp_path, **SERVICES, BAGUA_LIGHTNING_REDIS_PASSWORD_FILE=str(given),
                          BAGUA_LIGHTNING_AUTOTUNE_TOKEN="b", BAGUA_LIGHTNING_CACHE_KEY_FILE=str(given))
    assert result.returncode == 0, result.stderr
    env = set(record.splitlines())
    assert {f"BAGUA_LIGHTNING_REDIS_PASSWORD_FILE={given}", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN=b",
            f"BAGUA_LIGHTNING_CACHE_KEY_FILE={given}"} <= env
    assert not [line for line in env if line.startswith("BAGUA_LIGHTNING_AUTOTUNE_TOKEN_FILE=")]

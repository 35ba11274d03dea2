"""`bagua-lightning redis up` tells the user how to hand the password on as a file (``$NAME_FILE``), not how to
put its value into an environment; a real client process following that line reaches the real server."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.procs import free_port_block
from tests.services.conftest import cli

READ = ("from bagua_lightning.client import RedisStore\n"
        "store = RedisStore(hosts=None, cluster_mode=False)\n"
        "store.set('hint', b'followed'); print(store.get('hint').decode()); store.shutdown()\n")


def test_redis_up_prints_the_password_file_not_its_value(env: dict[str, str], tmp_path: Path) -> None:
    port = free_port_block(1, with_bus=False)
    state = tmp_path / "redis-state"
    up = cli(env, "redis", "up", "--single", "--port", str(port), "--state-dir", str(state))
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(shlex.split(line.split("#")[0])[1].split("=", 1)
                       for line in up.stdout.splitlines() if line.startswith("export "))
        assert set(exports) == {"BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_REDIS_PASSWORD_FILE"}, up.stdout
        password_file = Path(exports["BAGUA_LIGHTNING_REDIS_PASSWORD_FILE"])
        assert password_file.is_file() and oct(password_file.stat().st_mode & 0o777) == "0o600"
        assert password_file.read_text().strip() not in up.stdout  # the value is never printed
        # What the printed lines hand a client is enough to reach the server.
        child = {k: v for k, v in os.environ.items() if not k.startswith("BAGUA_LIGHTNING_")}
        child.update(exports, BAGUA_LIGHTNING_SERVICES_FILE=str(tmp_path / "none.json"))
        read = subprocess.run([sys.executable, "-c", READ], env=child, capture_output=True, text=True, timeout=60)
        assert read.returncode == 0 and read.stdout.strip() == "followed", read.stderr
    finally:
        down = cli(env, "redis", "down", "--state-dir", str(state))
        assert down.returncode == 0, down.stderr

"""``bagua_lightning.hooks.bytegrad_hook`` on plain DDP over 2 Gloo ranks, against DDP's own allreduce."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import REPO, run_ranks

WORKER = str(Path(__file__).with_name("hook_workers.py"))


def test_bytegrad_hook_matches_ddp_within_the_bytegrad_bound(tmp_path: Path) -> None:
    run_ranks(WORKER, [str(tmp_path)], world_size=2, log_dir=tmp_path, timeout_s=180)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert "error" not in res, res["error"]
        assert res["numel"] % 2 == 1  # the hook had to pad its bucket
        assert len(res["steps"]) == 3
        for step in res["steps"]:
            assert 0 < step["err"] <= step["bound"], step  # lossy, and within ByteGrad's bound
            assert step["identical_on_ranks"], step
            assert step["stateless_equal"], step


def test_hook_refuses_a_wrong_state() -> None:
    from bagua_lightning.hooks import bytegrad_hook

    with pytest.raises(TypeError, match="ByteGradState"):
        bytegrad_hook("not a state", None)  # type: ignore[arg-type]


def test_importing_the_hooks_module_loads_neither_lightning_nor_triton() -> None:
    code = ("import sys, bagua_lightning.hooks; "
            "print(sorted(m for m in ('lightning', 'triton', 'bagua_lightning.engine.hooks') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

"""Worker for tests/engine/autotune/test_jobs.py: one autotuned job in a plain torch loop.

Started with torchrun's environment variables (tests/strategy/launch.py:run_ranks); the job id
comes from the environment the test gives (``TORCHELASTIC_RUN_ID``) or is made by rank 0.
Writes ``<out>/<prefix>rank<r>.json`` with every step's plan and the job id.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bagua_lightning.engine.comm import CommContext
from tests.engine.autotune.controller_workers import run, wait_for


def meet(out: Path, name: str, other: str) -> None:
    (out / f"{name}.ready").touch()
    wait_for(out / f"{other}.ready", timeout_s=120.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--address", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--meet", default="",
                        help="NAME,OTHER: after set-up, write <out>/NAME.ready and wait for <out>/OTHER.ready "
                             "(both jobs registered before either tunes: they run concurrently)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    comm = CommContext.build(local_size=dist.get_world_size())
    result: dict[str, Any] = {}
    rc = 0
    try:
        result = run(comm, args.steps, address=args.address, model_name="shared-net",
                     after_setup=(lambda: meet(Path(args.out), *args.meet.split(","))) if args.meet else None)
    except Exception:
        result = {"error": traceback.format_exc()}
        rc = 1
    Path(args.out, f"{args.prefix}rank{comm.rank}.json").write_text(json.dumps(result, indent=1))
    comm.destroy_groups()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())

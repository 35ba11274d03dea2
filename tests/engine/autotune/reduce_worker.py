"""A rank of the measurement-reduction test: every rank brings its own interval; all get the job's view."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bagua_lightning.engine.autotune import Measurement, reduce_over_ranks
from bagua_lightning.proto.plan import BucketTimingRecord


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Rank r: speed 100 * (r + 1); bucket 1 communicates in (r + 1) ms; the last rank measured no timings.
    timings = [] if rank == dist.get_world_size() - 1 else [
        BucketTimingRecord(bucket_index=i, bytes=1000 * (i + 1), ready_ms=1.0 + i, comm_ms=float(rank + 1) * i,
                           wait_ms=0.5 * rank) for i in range(2)]
    mine = Measurement(speed=100.0 * (rank + 1), timings=timings, backward_ms=10.0 + rank)
    job = reduce_over_ranks(mine, 2, group=None, device=torch.device("cpu"), world_size=dist.get_world_size())
    Path(sys.argv[1], f"reduce{rank}.json").write_text(json.dumps({
        "speed": job.speed, "ranks": job.ranks, "min": job.speed_min, "max": job.speed_max, "std": job.speed_stddev,
        "backward_ms": job.backward_ms,
        "timings": [[t.bucket_index, t.bytes, t.comm_ms, t.comm_ms_max, t.wait_ms, t.wait_ms_max] for t in job.timings],
    }))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

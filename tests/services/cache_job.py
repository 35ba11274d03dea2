"""A trainer's cache, as its own process: ``python -m tests.services.cache_job NAME``.

Reads commands on stdin, one per line, and answers each with one JSON line on stdout:

* ``LO HI``: read samples LO..HI-1 through a :class:`CacheLoader` of dataset NAME (the deployment's services
  file and cache keys, as a job finds them), flush what it cached, answer the pass's ``hits``, ``misses``,
  ``corrupt`` and ``wrong`` (samples that differ from the source: never expected);
* ``quit``: end.

A sample is ``numpy.full(64, index)``: what a loader returns can be checked without the source.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from bagua_lightning.client.cache.loader import CacheLoader


def _load(indices: list[int]) -> list[np.ndarray]:
    return [np.full(64, i, dtype=np.int64) for i in indices]


def main() -> None:
    loader = CacheLoader(dataset_name=sys.argv[1], writer_buffer_size=64, outage_policy=None)
    try:
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            lo, hi = map(int, line.split())
            loader.reset_stats()
            wrong = 0
            for start in range(lo, hi, 64):
                indices = list(range(start, min(hi, start + 64)))
                got = loader.get_many(indices, _load)
                wrong += sum(int(not np.array_equal(g, e)) for g, e in zip(got, _load(indices), strict=True))
            loader.flush()
            stats = loader.stats
            print(json.dumps({"hits": stats.hits, "misses": stats.misses, "corrupt": stats.corrupt, "wrong": wrong}),
                  flush=True)
    finally:
        loader.cleanup()


if __name__ == "__main__":
    main()

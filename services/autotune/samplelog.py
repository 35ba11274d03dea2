"""A JSON-lines log of every sample per model, as Bagua's ``is_output_autotune_log`` did.

File names are safe and distinct for every model name: the name with every
character outside ``[A-Za-z0-9_.-]`` replaced (cut to 64 characters), then a
digest of the full name, so ``a/b`` and ``a_b`` get two files and a 10 kB name
still fits a file system's 255-byte limit. Writes are best-effort: a full or
read-only directory is counted and reported (health turns NOT_SERVING), never
raised into a request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .costmodel import Sample

logger = logging.getLogger(__name__)

_PREFIX_CHARS = 64


def log_file_name(model_name: str) -> str:
    """``<safe prefix>-<digest>.jsonl``: distinct for distinct names, at most ~90 bytes."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)[:_PREFIX_CHARS].lstrip(".") or "_"
    digest = hashlib.sha256(model_name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{safe}-{digest}.jsonl"


def sample_record(sample: Sample, *, model_name: str, job_id: str, index: int, train_iter: int, tuner: str,
                  next_reason: str) -> dict[str, Any]:
    """The log line of one measured plan (``index``: its number in the job's history, from 1)."""
    plan = sample.plan
    return {"time": time.time(), "model_name": model_name, "job_id": job_id, "sample": index,
            "train_iter": train_iter, "tuner": tuner, "plan_version": plan.version, "buckets": plan.tensor_names,
            "bucket_bytes": plan.bucket_bytes, "bucket_size": plan.bucket_size,
            "is_hierarchical_reduce": plan.is_hierarchical_reduce, "score": sample.score, "speed": sample.speed,
            "exposed_ms": sample.exposed_ms, "reports": sample.reports, "next": next_reason}


class SampleLog:
    """Appends one JSON object per line to ``<directory>/<log_file_name(model)>``.

    Attributes:
        errors: failed writes so far.
        failing: True while the latest write failed.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.errors = 0
        self.failing = False

    def path(self, model_name: str) -> Path:
        return self.directory / log_file_name(model_name)

    def write(self, model_name: str, record: dict[str, Any]) -> bool:
        """Append ``record``; False (logged once per outage) when the file cannot be written."""
        line = json.dumps(record, sort_keys=True) + "\n"
        try:
            with self._lock, open(self.path(model_name), "a") as handle:
                handle.write(line)
        except (OSError, ValueError) as exc:
            self.errors += 1
            if not self.failing:
                logger.warning("event=sample_log_failed dir=%s model=%r error=%r; samples are not logged until "
                               "it recovers", self.directory, model_name[:80], exc)
            self.failing = True
            return False
        if self.failing:
            logger.info("event=sample_log_recovered dir=%s", self.directory)
        self.failing = False
        return True

    def probe(self) -> bool:
        """Write and remove one byte in the directory; clears :attr:`failing` when that works."""
        probe = self.directory / f".probe-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(probe, "w") as handle:
                handle.write("x")
                handle.flush()
                os.fsync(handle.fileno())
            probe.unlink()
        except OSError:
            return False
        self.failing = False
        return True

    def read(self, model_name: str) -> Iterator[dict[str, Any]]:
        """The records of ``model_name`` in order (unparseable lines skipped); none when there is no file."""
        yield from read_records(self.path(model_name))


def read_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a sample log file, skipping lines that are not one."""
    if not os.path.exists(path):
        return
    with open(path) as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record

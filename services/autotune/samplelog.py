"""A JSON-lines log of every sample per model, as Bagua's ``is_output_autotune_log`` did."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any


class SampleLog:
    """Appends one JSON object per line to ``<directory>/<model_name>.jsonl``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def path(self, model_name: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name) or "_"
        return self.directory / f"{safe}.jsonl"

    def write(self, model_name: str, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock, open(self.path(model_name), "a") as handle:
            handle.write(line)

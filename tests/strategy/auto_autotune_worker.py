"""Worker for test_auto_algorithm.py: ``BaguaStrategy(algorithm="auto", autotune=True)`` against the autotune
service named by ``$AUTO_TEST_SERVICE``, under torchrun, one JSON per rank: what the strategy chose, the job it
registered and its end-of-fit summary."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from bagua_lightning.strategy import BaguaStrategy
from tests.strategy.auto_workers import Record
from tests.strategy.lightning_workers import trainer, worker_main


def torchrun_mode(out: Path) -> dict[str, Any]:
    strategy = BaguaStrategy(algorithm="auto", auto_candidates=["gradient_allreduce", "bytegrad"],
                             auto_warmup_steps=1, auto_trial_steps=3, auto_max_runoffs=0, autotune=True,
                             autotune_service=os.environ["AUTO_TEST_SERVICE"], autotune_interval=3,
                             autotune_model_name="auto-net", bucket_size=4096)
    model = Record()
    trainer(strategy, out, max_steps=16).fit(model)
    selection, summary, state = strategy.selection, strategy.autotune_summary, strategy.autotune_state
    assert selection is not None and summary is not None and state is not None
    return {"chosen": selection.chosen, "step_ms": selection.step_ms, "decided_at": selection.decided_at,
            "summary": summary.line(), "advice": summary.advice, "job_id": state.job_id,
            "model_name": state.model_name}


def nodes_mode(out: Path) -> dict[str, Any]:
    raise NotImplementedError("auto_autotune_worker runs under torchrun only")


if __name__ == "__main__":
    sys.exit(worker_main(torchrun_mode, nodes_mode))

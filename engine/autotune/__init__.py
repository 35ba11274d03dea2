"""The trainer side of autotuning, one module per responsibility.

* :mod:`.measurement`: one rank's interval (:class:`IntervalMeter`), the job's view
  (:func:`reduce_over_ranks`), and the reports and summary handed back;
* :mod:`.jobstate`: the job id the ranks agree on and the state a checkpoint keeps;
* :mod:`.plansync`: one broadcast of rank 0's decision and the cross-rank agreement check;
* :mod:`.worker`: the background thread that talks to the service;
* :mod:`.controller`: the protocol that ties them to the training loop (see there);
* :mod:`.elastic`: the controller of a fault-tolerant job, whose shape follows its nodes.
"""

from .controller import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_INTERVAL,
    DEFAULT_RPC_TIMEOUT_S,
    AutotuneController,
    AutotuneSettings,
    PlanTarget,
    batch_size_of,
    default_client,
    model_name_for,
)
from .jobstate import AutotuneState, launcher_job_id
from .measurement import AutotuneSummary, BoundaryReport, IntervalMeter, Measurement, reduce_over_ranks

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_INTERVAL",
    "DEFAULT_RPC_TIMEOUT_S",
    "AutotuneController",
    "AutotuneSettings",
    "AutotuneState",
    "AutotuneSummary",
    "BoundaryReport",
    "IntervalMeter",
    "Measurement",
    "PlanTarget",
    "batch_size_of",
    "default_client",
    "launcher_job_id",
    "model_name_for",
    "reduce_over_ranks",
]

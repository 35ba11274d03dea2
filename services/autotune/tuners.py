"""Which tuner a model gets: the model-based planner when its reports carry bucket timings, else Bayes."""

from __future__ import annotations

from collections.abc import Sequence

from ...proto.plan import TensorDeclaration
from .bayes import BayesianTuner
from .config import ServiceConfig
from .costmodel import Sample
from .planner import ModelBasedPlanner
from .proposal import Tuner
from .registration import Registration


def make_tuner(config: ServiceConfig, registration: Registration, order: Sequence[TensorDeclaration],
               sample: Sample) -> tuple[Tuner, str]:
    """The tuner ``config.tuner`` names for a model whose tensors are ready in ``order``, and its kind
    ("auto": the model-based planner when the first ``sample`` carries bucket timings, else Bayesian)."""
    kind = config.tuner
    if kind == "auto":
        kind = "planner" if sample.bucket_timings else "bayes"
    if kind == "planner":
        return ModelBasedPlanner(order, hierarchical_allowed=registration.hierarchical_allowed,
                                 whether_to_bucket=registration.whether_to_bucket), kind
    return BayesianTuner(order, hierarchical_allowed=registration.hierarchical_allowed,
                         whether_to_bucket=registration.whether_to_bucket, min_log2=config.min_log2_bucket_size,
                         max_log2=config.max_log2_bucket_size, seed=config.seed), kind

"""Prometheus metrics of the autotune service (``serve --metrics-port``).

Request metrics are counted as calls end (:class:`RpcMetrics`); the state of the
service (models held, plans issued, store and sample-log errors) is read from the
service when Prometheus scrapes (:class:`ServiceCollector`), so the request path
pays for nothing it does not need. Every metric lives in the server's own
registry, never in the process-wide default one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .service import AutotuneService

# Seconds: from 50 us (a cached answer) to 5 s (a store at its deadline).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0)


class RpcMetrics:
    """Calls by method and status code, their latency, and refused reports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter("bagua_autotune_rpcs", "RPCs answered, by method and status code",
                             ("method", "code"), registry=registry)
        self.latency = Histogram("bagua_autotune_rpc_seconds", "Time to answer an RPC, in seconds",
                                 ("method",), buckets=LATENCY_BUCKETS, registry=registry)
        self.refused = Counter("bagua_autotune_reports_refused", "ReportMetrics calls refused, by status code",
                               ("code",), registry=registry)
        self._children: dict[tuple[str, str], tuple[object, object]] = {}

    def observe(self, method: str, code: str, seconds: float) -> None:
        pair = self._children.get((method, code))
        if pair is None:  # labels() takes a lock and formats: keep the children
            pair = self._children[(method, code)] = (self.calls.labels(method, code), self.latency.labels(method))
        pair[0].inc()  # type: ignore[attr-defined]
        pair[1].observe(seconds)  # type: ignore[attr-defined]
        if method == "ReportMetrics" and code != "OK":
            self.refused.labels(code).inc()


class ServiceCollector(Collector):
    """Reads the service's state at scrape time."""

    def __init__(self, service: AutotuneService) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        service = self.service
        yield GaugeMetricFamily("bagua_autotune_models", "Models held now", value=len(service.model_names))
        yield CounterMetricFamily("bagua_autotune_models_evicted", "Models evicted as least recently used",
                                  value=service.evicted)
        yield CounterMetricFamily("bagua_autotune_models_evicted_for_memory",
                                  "Models evicted as least recently used to stay within --max-memory",
                                  value=service.memory.evicted_for_bytes)
        yield GaugeMetricFamily("bagua_autotune_memory_accounted_bytes",
                                "Estimated bytes of model state held now (what --max-memory bounds)",
                                value=service.memory.total)
        yield GaugeMetricFamily("bagua_autotune_memory_budget_bytes", "The --max-memory budget (0: none)",
                                value=service.config.max_memory)
        yield CounterMetricFamily("bagua_autotune_plans_issued", "Plans issued since start",
                                  value=service.plans_issued)
        yield CounterMetricFamily("bagua_autotune_store_errors", "Failed plan-store operations",
                                  value=service.io.store_errors)
        yield CounterMetricFamily("bagua_autotune_sample_log_errors", "Failed sample-log writes",
                                  value=service.io.sample_log_errors)
        yield CounterMetricFamily("bagua_autotune_writes_dropped", "Queued writes dropped (queue full)",
                                  value=service.io.dropped)
        yield GaugeMetricFamily("bagua_autotune_healthy", "1 while store and sample log work",
                                value=0.0 if service.io.problem() else 1.0)
        step_ms = GaugeMetricFamily("bagua_autotune_algorithm_step_ms",
                                    "algorithm='auto': each candidate's measured step time (median, slowest rank), "
                                    "in milliseconds", labels=("model", "job", "algorithm"))
        chosen = GaugeMetricFamily("bagua_autotune_algorithm_chosen",
                                   "algorithm='auto': 1 for the candidate kept", labels=("model", "job", "algorithm"))
        for model, job, choice in service.selections():
            for name, ms in choice.step_ms:
                step_ms.add_metric((model, job, name), ms)
            chosen.add_metric((model, job, choice.chosen), 1.0)
        yield step_ms
        yield chosen
        reshapes = CounterMetricFamily("bagua_autotune_job_reshapes",
                                       "Re-registrations of a job with another world size or ranks per node "
                                       "(an elastic resize), per held session", labels=("model", "job"))
        for model, job, count in service.reshapes():
            reshapes.add_metric((model, job), count)
        yield reshapes


def make_registry(service: AutotuneService) -> tuple[CollectorRegistry, RpcMetrics]:
    """A registry holding the service's metrics; the RpcMetrics to count calls with."""
    registry = CollectorRegistry(auto_describe=True)
    rpc = RpcMetrics(registry)
    registry.register(ServiceCollector(service))
    return registry, rpc

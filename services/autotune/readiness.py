"""Health of the autotune service by the gRPC health convention: liveness and readiness apart.

``grpc.health.v1`` answers for a service name. The two names this server publishes mean:

* ``""`` (:data:`LIVENESS`, the whole server): SERVING while the process serves RPCs. It turns NOT_SERVING
  only on shutdown. A liveness probe goes here: a failing store is no reason to restart the process.
* :data:`SERVICE_NAME` (``bagua_lightning.autotune.v1.AutotuneService``): SERVING while the plan store
  and the sample-log folder work (probed every :data:`HEALTH_PERIOD_S`), NOT_SERVING otherwise. A
  readiness probe goes here: a pod whose store is unreachable gets no new jobs, and is not restarted.

Both the threaded server (:mod:`.server`) and the ``grpc.aio`` one (:mod:`.aio_server`) take their names
and the :class:`ReadinessMonitor` from here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from grpc_health.v1 import health

from ...proto.autotune.v1 import autotune_pb2 as pb
from .service import AutotuneService

logger = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["AutotuneService"].full_name
"""The service's own health name: readiness (store and sample log work)."""
LIVENESS = ""
"""The whole server's health name: liveness (the process serves)."""
HEALTH_PERIOD_S = 1.0  # seconds between two probes of the store and the sample log
OPEN_PREFIX = f"/{health.SERVICE_NAME}/"  # methods callable without a token (probes carry none)


class ReadinessMonitor:
    """Publishes the readiness of ``service``: NOT_SERVING while its store or sample log fails.

    Liveness is not touched: the server sets it SERVING when built and NOT_SERVING on shutdown.

    Args:
        service: the service whose store and sample log are probed.
        publish: sets the readiness status of :data:`SERVICE_NAME` (True: SERVING).
        period_s: seconds between two probes.
    """

    def __init__(self, service: AutotuneService, publish: Callable[[bool], None],
                 period_s: float = HEALTH_PERIOD_S) -> None:
        if not period_s > 0:
            raise ValueError(f"the readiness probe period must be > 0 seconds, got {period_s!r}")
        self.service = service
        self.publish = publish
        self.period_s = period_s
        self._stop = threading.Event()
        self._ready: bool | None = None
        self._thread = threading.Thread(target=self._run, name="autotune-readiness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def check(self) -> bool:
        """Probe once and publish readiness when it changed; True when ready."""
        self.service.io.ping()
        problem = self.service.io.problem()
        ready = problem is None
        if ready != self._ready:
            self.publish(ready)
            if ready:
                logger.info("event=readiness status=SERVING")
            else:
                logger.warning("event=readiness status=NOT_SERVING reason=%r", problem)
            self._ready = ready
        return ready

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception:  # the monitor must outlive any one failed probe
                logger.exception("event=readiness_probe_failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.period_s + self.service.io.timeout_s + 1.0)

"""A job's shape history: every (world size, ranks per node) its session ran in, and where each started.

A job that re-registers with another shape (an elastic resize: a node lost or joined) gets a new session
for the new shape (:meth:`AutotuneService.register_session`); the new session carries the old one's
history with the new shape appended, so ``autotune show`` lists the job's shapes and the metrics count
its reshapes. Bounded: the first shape and the latest :data:`MAX_SHAPES` - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SHAPES = 64  # shapes kept per job: the first one and the latest 63

#: Where a shape's first plan came from (``JobShape.started_from`` on the wire).
STARTED_FROM = ("shared", "resumed", "default")


@dataclass(frozen=True, slots=True)
class JobShape:
    """One shape a job registered.

    Attributes:
        world_size: ranks of the job.
        nproc_per_node: ranks per node.
        registered_at: Unix time of the registration, seconds.
        plan_version: the version of the plan the shape started on.
        started_from: one of :data:`STARTED_FROM`.
        shared_key: the shared plan's store key when ``started_from`` is ``"shared"``, else "".
    """

    world_size: int
    nproc_per_node: int
    registered_at: float
    plan_version: int
    started_from: str
    shared_key: str = ""

    def __post_init__(self) -> None:
        if self.started_from not in STARTED_FROM:
            raise ValueError(f"started_from must be one of {STARTED_FROM}, got {self.started_from!r}")


@dataclass(frozen=True, slots=True)
class ShapeHistory:
    """The shapes of one job, oldest first (bounded), and how many reshapes it had in all."""

    shapes: tuple[JobShape, ...] = ()
    reshapes: int = 0  # re-registrations with another shape, dropped entries included

    def then(self, shape: JobShape) -> ShapeHistory:
        """This history with ``shape`` registered after it (a reshape unless it is the first)."""
        shapes = (*self.shapes, shape)
        if len(shapes) > MAX_SHAPES:
            shapes = (shapes[0], *shapes[len(shapes) - MAX_SHAPES + 1:])
        return ShapeHistory(shapes=shapes, reshapes=self.reshapes + (1 if self.shapes else 0))

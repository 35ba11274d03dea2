"""Bucket plans as plain dataclasses: the structure the service hands back and the strategy applies.

The same shape travels on the wire (``Hyperparameters`` in ``autotune.proto``);
:func:`plan_to_proto` / :func:`plan_from_proto` convert. Nothing here imports
torch or grpc, so the tuner (service side) and the strategy (trainer side) share
it without pulling each other's dependencies.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Bytes per element of every dtype the protocol accepts (Bagua's names).
DTYPE_SIZES: dict[str, int] = {
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "u8": 1,
    "f64": 8,
    "i64": 8,
    "i32": 4,
}

DEFAULT_BUCKET_SIZE = 10 * 1024**2  # bytes (Bagua's default: 10 MiB)
# Ranges of the numeric fields, checked wherever a plan enters (wire, stored plans, files): far beyond any
# real model, small enough that sums and products of them stay exact in int64 and finite in float64.
MAX_NUM_ELEMENTS = 2**40  # elements of one tensor
MAX_BUCKET_SIZE = 2**50  # bytes
MAX_PLAN_VERSION = 2**62


@dataclass(frozen=True, slots=True)
class TensorDeclaration:
    """One communicated tensor, as Bagua's ``TensorDeclaration``.

    Attributes:
        name: unique name within the model (a parameter's qualified name).
        num_elements: number of elements, > 0.
        dtype: one of :data:`DTYPE_SIZES` (``"f32"``, ``"f16"``, ``"bf16"``, ...).
    """

    name: str
    num_elements: int
    dtype: str = "f32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        if isinstance(self.num_elements, bool) or not isinstance(self.num_elements, int):
            raise TypeError(f"num_elements of tensor {self.name!r} must be an int, got {self.num_elements!r}")
        if not 0 < self.num_elements <= MAX_NUM_ELEMENTS:
            raise ValueError(
                f"num_elements of tensor {self.name!r} must be > 0 and <= 2**40, got {self.num_elements}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"dtype of tensor {self.name!r} is {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
            )

    @property
    def nbytes(self) -> int:
        return self.num_elements * DTYPE_SIZES[self.dtype]

    @classmethod
    def coerce(cls, value: TensorDeclaration | Mapping[str, Any]) -> TensorDeclaration:
        """Accept a declaration or a dict in Bagua's shape ``{"name", "num_elements", "dtype"}``."""
        if isinstance(value, TensorDeclaration):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {"name", "num_elements", "dtype"}
            if unknown:
                raise ValueError(
                    f"unknown keys {sorted(unknown)} in tensor declaration {dict(value)!r}; "
                    "expected name, num_elements, dtype"
                )
            return cls(name=value.get("name", ""), num_elements=value.get("num_elements", 0),
                       dtype=value.get("dtype", "f32"))
        raise TypeError(f"expected a TensorDeclaration or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_elements": self.num_elements, "dtype": self.dtype}


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """An ordered list of buckets plus the hierarchical flag (Bagua's ``BaguaHyperparameter``).

    Attributes:
        buckets: buckets in communication order; each an ordered tuple of tensor
            declarations of one dtype.
        bucket_size: target size the buckets were cut with, in bytes.
        is_hierarchical_reduce: reduce intra-node first, then among node leaders.
        version: monotonic plan version; 0 is the initial plan.
    """

    buckets: tuple[tuple[TensorDeclaration, ...], ...]
    bucket_size: int = DEFAULT_BUCKET_SIZE
    is_hierarchical_reduce: bool = False
    version: int = 0

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for index, bucket in enumerate(self.buckets):
            if not bucket:
                raise ValueError(f"bucket {index} of the plan is empty")
            dtypes = {t.dtype for t in bucket}
            if len(dtypes) != 1:
                raise ValueError(f"bucket {index} mixes dtypes {sorted(dtypes)}; a bucket holds one dtype")
            for t in bucket:
                if t.name in seen:
                    raise ValueError(f"tensor {t.name!r} appears in more than one bucket of the plan")
                seen.add(t.name)
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) \
                or not 0 < self.bucket_size <= MAX_BUCKET_SIZE:
            raise ValueError(f"bucket_size must be an int in (0, 2**50] bytes, got {self.bucket_size!r}")
        if isinstance(self.version, bool) or not isinstance(self.version, int) \
                or not 0 <= self.version <= MAX_PLAN_VERSION:
            raise ValueError(f"plan version must be an int in [0, 2**62], got {self.version!r}")

    @property
    def tensor_names(self) -> list[list[str]]:
        """Bucket partition as lists of tensor names."""
        return [[t.name for t in bucket] for bucket in self.buckets]

    @property
    def bucket_bytes(self) -> list[int]:
        return [sum(t.nbytes for t in bucket) for bucket in self.buckets]

    def same_layout(self, other: BucketPlan) -> bool:
        """True when both plans communicate identically (version aside)."""
        return (
            self.tensor_names == other.tensor_names
            and self.is_hierarchical_reduce == other.is_hierarchical_reduce
        )

    def fingerprint(self) -> str:
        """Stable short hash of the layout (partition + hierarchical flag), for cross-rank checks."""
        payload = json.dumps([self.tensor_names, self.is_hierarchical_reduce]).encode()
        return hashlib.sha256(payload).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Bagua's hyperparameter dict shape."""
        return {
            "buckets": [[t.to_dict() for t in bucket] for bucket in self.buckets],
            "bucket_size": self.bucket_size,
            "is_hierarchical_reduce": self.is_hierarchical_reduce,
            "plan_version": self.version,
        }

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> BucketPlan:
        return cls(
            buckets=tuple(tuple(TensorDeclaration.coerce(t) for t in b) for b in value.get("buckets", ())),
            bucket_size=int(value.get("bucket_size", DEFAULT_BUCKET_SIZE)),
            is_hierarchical_reduce=bool(value.get("is_hierarchical_reduce", False)),
            version=int(value.get("plan_version", 0)),
        )


def tensor_list_fingerprint(tensors: Iterable[TensorDeclaration]) -> str:
    """Order-independent hash of a tensor list (names, sizes, dtypes): identifies a model's shape."""
    rows = sorted((t.name, t.num_elements, t.dtype) for t in tensors)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def split_into_buckets(
    tensors: Sequence[TensorDeclaration],
    bucket_size: int,
    *,
    whether_to_bucket: bool = True,
) -> tuple[tuple[TensorDeclaration, ...], ...]:
    """Bagua's cut: group by dtype (first-seen order), keep ``tensors``' order, close a bucket at ``bucket_size``.

    A bucket closes as soon as its bytes reach ``bucket_size``; a tensor larger
    than the bucket size gets a bucket of its own. ``whether_to_bucket=False``
    puts each dtype group in a single bucket.
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be > 0 bytes, got {bucket_size}")
    groups: dict[str, list[TensorDeclaration]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    buckets: list[tuple[TensorDeclaration, ...]] = []
    for group in groups.values():
        if not whether_to_bucket:
            buckets.append(tuple(group))
            continue
        current: list[TensorDeclaration] = []
        current_bytes = 0
        for t in group:
            current.append(t)
            current_bytes += t.nbytes
            if current_bytes >= bucket_size:
                buckets.append(tuple(current))
                current, current_bytes = [], 0
        if current:
            buckets.append(tuple(current))
    return tuple(buckets)


def plan_to_proto(plan: BucketPlan) -> Any:
    """Convert to ``bagua_lightning.autotune.v1.Hyperparameters``."""
    from .autotune.v1 import autotune_pb2 as pb

    message = pb.Hyperparameters(bucket_size=plan.bucket_size, is_hierarchical_reduce=plan.is_hierarchical_reduce,
                                 plan_version=plan.version)
    for bucket in plan.buckets:
        add = message.buckets.add().tensors.add  # in place: ~3x faster than building and copying messages
        for t in bucket:
            add(name=t.name, num_elements=t.num_elements, dtype=t.dtype)
    return message


def plan_from_proto(message: Any) -> BucketPlan:
    """Convert from ``bagua_lightning.autotune.v1.Hyperparameters`` (validates it)."""
    return BucketPlan(
        buckets=tuple(
            tuple(TensorDeclaration(name=t.name, num_elements=int(t.num_elements), dtype=t.dtype)
                  for t in bucket.tensors)
            for bucket in message.buckets
        ),
        bucket_size=int(message.bucket_size) or DEFAULT_BUCKET_SIZE,
        is_hierarchical_reduce=bool(message.is_hierarchical_reduce),
        version=int(message.plan_version),
    )


@dataclass(slots=True)
class BucketTimingRecord:
    """Timings of one bucket in one step (see ``BucketTiming`` in the proto). Units: bytes and ms."""

    bucket_index: int
    bytes: int
    ready_ms: float
    comm_ms: float
    wait_ms: float
    comm_ms_max: float = 0.0  # aggregated reports: the slowest rank's comm_ms (0: one rank's report)
    wait_ms_max: float = 0.0  # aggregated reports: the largest wait_ms over ranks

    def to_dict(self) -> dict[str, Any]:
        return {
            "bucket_index": self.bucket_index,
            "bytes": self.bytes,
            "ready_ms": self.ready_ms,
            "comm_ms": self.comm_ms,
            "wait_ms": self.wait_ms,
            "comm_ms_max": self.comm_ms_max,
            "wait_ms_max": self.wait_ms_max,
        }


@dataclass(slots=True)
class StepTimings:
    """Per-bucket timings of one step plus the backward duration (ms)."""

    buckets: list[BucketTimingRecord] = field(default_factory=list)
    backward_ms: float = 0.0

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorDeclaration(_message.Message):
    __slots__ = ("name", "num_elements", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_elements: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., num_elements: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDeclaration]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorDeclaration, _Mapping]]] = ...) -> None: ...

class Hyperparameters(_message.Message):
    __slots__ = ("buckets", "bucket_size", "is_hierarchical_reduce", "plan_version")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_HIERARCHICAL_REDUCE_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    bucket_size: int
    is_hierarchical_reduce: bool
    plan_version: int
    def __init__(self, buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., bucket_size: _Optional[int] = ..., is_hierarchical_reduce: _Optional[bool] = ..., plan_version: _Optional[int] = ...) -> None: ...

class BucketTiming(_message.Message):
    __slots__ = ("bucket_index", "bytes", "ready_ms", "comm_ms", "wait_ms", "comm_ms_max", "wait_ms_max")
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    READY_MS_FIELD_NUMBER: _ClassVar[int]
    COMM_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    COMM_MS_MAX_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_MAX_FIELD_NUMBER: _ClassVar[int]
    bucket_index: int
    bytes: int
    ready_ms: float
    comm_ms: float
    wait_ms: float
    comm_ms_max: float
    wait_ms_max: float
    def __init__(self, bucket_index: _Optional[int] = ..., bytes: _Optional[int] = ..., ready_ms: _Optional[float] = ..., comm_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., comm_ms_max: _Optional[float] = ..., wait_ms_max: _Optional[float] = ...) -> None: ...

class ExecutionSpan(_message.Message):
    __slots__ = ("trace_id", "action", "tensor_name", "start_time", "end_time")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    trace_id: int
    action: str
    tensor_name: str
    start_time: int
    end_time: int
    def __init__(self, trace_id: _Optional[int] = ..., action: _Optional[str] = ..., tensor_name: _Optional[str] = ..., start_time: _Optional[int] = ..., end_time: _Optional[int] = ...) -> None: ...

class RegisterTensorsRequest(_message.Message):
    __slots__ = ("model_name", "tensor_list", "whether_to_bucket", "world_size", "nproc_per_node", "job_id", "resume_hyperparameters", "resume_completed")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_LIST_FIELD_NUMBER: _ClassVar[int]
    WHETHER_TO_BUCKET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_HYPERPARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RESUME_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    tensor_list: _containers.RepeatedCompositeFieldContainer[TensorDeclaration]
    whether_to_bucket: bool
    world_size: int
    nproc_per_node: int
    job_id: str
    resume_hyperparameters: Hyperparameters
    resume_completed: bool
    def __init__(self, model_name: _Optional[str] = ..., tensor_list: _Optional[_Iterable[_Union[TensorDeclaration, _Mapping]]] = ..., whether_to_bucket: _Optional[bool] = ..., world_size: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., job_id: _Optional[str] = ..., resume_hyperparameters: _Optional[_Union[Hyperparameters, _Mapping]] = ..., resume_completed: _Optional[bool] = ...) -> None: ...

class RegisterTensorsResponse(_message.Message):
    __slots__ = ("recommended_hyperparameters", "is_autotune_completed", "algorithm_selection")
    RECOMMENDED_HYPERPARAMETERS_FIELD_NUMBER: _ClassVar[int]
    IS_AUTOTUNE_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_SELECTION_FIELD_NUMBER: _ClassVar[int]
    recommended_hyperparameters: Hyperparameters
    is_autotune_completed: bool
    algorithm_selection: AlgorithmSelection
    def __init__(self, recommended_hyperparameters: _Optional[_Union[Hyperparameters, _Mapping]] = ..., is_autotune_completed: _Optional[bool] = ..., algorithm_selection: _Optional[_Union[AlgorithmSelection, _Mapping]] = ...) -> None: ...

class ReportMetricsRequest(_message.Message):
    __slots__ = ("model_name", "rank", "train_iter", "hyperparameters", "speed", "bucket_timings", "backward_ms", "ranks", "speed_min", "speed_max", "speed_stddev", "job_id")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ITER_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMETERS_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    BUCKET_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_MS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SPEED_MIN_FIELD_NUMBER: _ClassVar[int]
    SPEED_MAX_FIELD_NUMBER: _ClassVar[int]
    SPEED_STDDEV_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    rank: int
    train_iter: int
    hyperparameters: Hyperparameters
    speed: float
    bucket_timings: _containers.RepeatedCompositeFieldContainer[BucketTiming]
    backward_ms: float
    ranks: int
    speed_min: float
    speed_max: float
    speed_stddev: float
    job_id: str
    def __init__(self, model_name: _Optional[str] = ..., rank: _Optional[int] = ..., train_iter: _Optional[int] = ..., hyperparameters: _Optional[_Union[Hyperparameters, _Mapping]] = ..., speed: _Optional[float] = ..., bucket_timings: _Optional[_Iterable[_Union[BucketTiming, _Mapping]]] = ..., backward_ms: _Optional[float] = ..., ranks: _Optional[int] = ..., speed_min: _Optional[float] = ..., speed_max: _Optional[float] = ..., speed_stddev: _Optional[float] = ..., job_id: _Optional[str] = ...) -> None: ...

class ReportMetricsResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class AskHyperparametersRequest(_message.Message):
    __slots__ = ("model_name", "rank", "train_iter", "job_id")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ITER_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    rank: int
    train_iter: int
    job_id: str
    def __init__(self, model_name: _Optional[str] = ..., rank: _Optional[int] = ..., train_iter: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class AskHyperparametersResponse(_message.Message):
    __slots__ = ("recommended_hyperparameters", "is_autotune_completed")
    RECOMMENDED_HYPERPARAMETERS_FIELD_NUMBER: _ClassVar[int]
    IS_AUTOTUNE_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    recommended_hyperparameters: Hyperparameters
    is_autotune_completed: bool
    def __init__(self, recommended_hyperparameters: _Optional[_Union[Hyperparameters, _Mapping]] = ..., is_autotune_completed: _Optional[bool] = ...) -> None: ...

class ReportTensorExecutionOrderRequest(_message.Message):
    __slots__ = ("spans", "model_name", "job_id")
    SPANS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    spans: _containers.RepeatedCompositeFieldContainer[ExecutionSpan]
    model_name: str
    job_id: str
    def __init__(self, spans: _Optional[_Iterable[_Union[ExecutionSpan, _Mapping]]] = ..., model_name: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class ReportTensorExecutionOrderResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("model_name", "tensors", "total_bytes", "world_size", "nproc_per_node", "plan_version", "completed", "samples", "reports_accepted", "reports_ignored", "best_score", "has_best", "idle_s", "tuner", "layouts_tracked", "job_id", "fingerprint", "algorithm", "reshapes")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REPORTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REPORTS_IGNORED_FIELD_NUMBER: _ClassVar[int]
    BEST_SCORE_FIELD_NUMBER: _ClassVar[int]
    HAS_BEST_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    TUNER_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_TRACKED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    RESHAPES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    tensors: int
    total_bytes: int
    world_size: int
    nproc_per_node: int
    plan_version: int
    completed: bool
    samples: int
    reports_accepted: int
    reports_ignored: int
    best_score: float
    has_best: bool
    idle_s: float
    tuner: str
    layouts_tracked: int
    job_id: str
    fingerprint: str
    algorithm: str
    reshapes: int
    def __init__(self, model_name: _Optional[str] = ..., tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., world_size: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., plan_version: _Optional[int] = ..., completed: _Optional[bool] = ..., samples: _Optional[int] = ..., reports_accepted: _Optional[int] = ..., reports_ignored: _Optional[int] = ..., best_score: _Optional[float] = ..., has_best: _Optional[bool] = ..., idle_s: _Optional[float] = ..., tuner: _Optional[str] = ..., layouts_tracked: _Optional[int] = ..., job_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., algorithm: _Optional[str] = ..., reshapes: _Optional[int] = ...) -> None: ...

class JobShape(_message.Message):
    __slots__ = ("world_size", "nproc_per_node", "registered_at", "plan_version", "started_from", "shared_key")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_FROM_FIELD_NUMBER: _ClassVar[int]
    SHARED_KEY_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    nproc_per_node: int
    registered_at: float
    plan_version: int
    started_from: str
    shared_key: str
    def __init__(self, world_size: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., registered_at: _Optional[float] = ..., plan_version: _Optional[int] = ..., started_from: _Optional[str] = ..., shared_key: _Optional[str] = ...) -> None: ...

class SharedPlanSummary(_message.Message):
    __slots__ = ("key", "model_name", "job_id", "world_size", "nproc_per_node", "score", "completed", "buckets", "saved_at", "reports", "samples")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SAVED_AT_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    key: str
    model_name: str
    job_id: str
    world_size: int
    nproc_per_node: int
    score: float
    completed: bool
    buckets: int
    saved_at: float
    reports: int
    samples: int
    def __init__(self, key: _Optional[str] = ..., model_name: _Optional[str] = ..., job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., score: _Optional[float] = ..., completed: _Optional[bool] = ..., buckets: _Optional[int] = ..., saved_at: _Optional[float] = ..., reports: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "shared_plans")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PLANS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    shared_plans: _containers.RepeatedCompositeFieldContainer[SharedPlanSummary]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ..., shared_plans: _Optional[_Iterable[_Union[SharedPlanSummary, _Mapping]]] = ...) -> None: ...

class ForgetPlansRequest(_message.Message):
    __slots__ = ("match",)
    MATCH_FIELD_NUMBER: _ClassVar[int]
    match: str
    def __init__(self, match: _Optional[str] = ...) -> None: ...

class ForgetPlansResponse(_message.Message):
    __slots__ = ("removed", "warning")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedCompositeFieldContainer[SharedPlanSummary]
    warning: str
    def __init__(self, removed: _Optional[_Iterable[_Union[SharedPlanSummary, _Mapping]]] = ..., warning: _Optional[str] = ...) -> None: ...

class DescribeModelRequest(_message.Message):
    __slots__ = ("model_name", "job_id")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    job_id: str
    def __init__(self, model_name: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class SampleRecord(_message.Message):
    __slots__ = ("index", "plan_version", "bucket_size", "is_hierarchical_reduce", "bucket_bytes", "speed", "score", "exposed_ms", "reports", "train_iter")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_HIERARCHICAL_REDUCE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_MS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ITER_FIELD_NUMBER: _ClassVar[int]
    index: int
    plan_version: int
    bucket_size: int
    is_hierarchical_reduce: bool
    bucket_bytes: _containers.RepeatedScalarFieldContainer[int]
    speed: float
    score: float
    exposed_ms: float
    reports: int
    train_iter: int
    def __init__(self, index: _Optional[int] = ..., plan_version: _Optional[int] = ..., bucket_size: _Optional[int] = ..., is_hierarchical_reduce: _Optional[bool] = ..., bucket_bytes: _Optional[_Iterable[int]] = ..., speed: _Optional[float] = ..., score: _Optional[float] = ..., exposed_ms: _Optional[float] = ..., reports: _Optional[int] = ..., train_iter: _Optional[int] = ...) -> None: ...

class DescribeModelResponse(_message.Message):
    __slots__ = ("summary", "current", "best", "samples", "algorithm_selection", "shapes")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    BEST_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_SELECTION_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    summary: ModelSummary
    current: Hyperparameters
    best: Hyperparameters
    samples: _containers.RepeatedCompositeFieldContainer[SampleRecord]
    algorithm_selection: AlgorithmSelection
    shapes: _containers.RepeatedCompositeFieldContainer[JobShape]
    def __init__(self, summary: _Optional[_Union[ModelSummary, _Mapping]] = ..., current: _Optional[_Union[Hyperparameters, _Mapping]] = ..., best: _Optional[_Union[Hyperparameters, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[SampleRecord, _Mapping]]] = ..., algorithm_selection: _Optional[_Union[AlgorithmSelection, _Mapping]] = ..., shapes: _Optional[_Iterable[_Union[JobShape, _Mapping]]] = ...) -> None: ...

class AlgorithmCandidate(_message.Message):
    __slots__ = ("algorithm", "step_ms")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    step_ms: float
    def __init__(self, algorithm: _Optional[str] = ..., step_ms: _Optional[float] = ...) -> None: ...

class AlgorithmSelection(_message.Message):
    __slots__ = ("chosen", "candidates", "reason", "step", "job_id")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    chosen: str
    candidates: _containers.RepeatedCompositeFieldContainer[AlgorithmCandidate]
    reason: str
    step: int
    job_id: str
    def __init__(self, chosen: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[AlgorithmCandidate, _Mapping]]] = ..., reason: _Optional[str] = ..., step: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class ReportAlgorithmSelectionRequest(_message.Message):
    __slots__ = ("model_name", "job_id", "selection")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    job_id: str
    selection: AlgorithmSelection
    def __init__(self, model_name: _Optional[str] = ..., job_id: _Optional[str] = ..., selection: _Optional[_Union[AlgorithmSelection, _Mapping]] = ...) -> None: ...

class ReportAlgorithmSelectionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

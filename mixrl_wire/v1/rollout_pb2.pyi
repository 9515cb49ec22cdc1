from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT32: DType
DTYPE_UINT8: DType

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Recipe(_message.Message):
    __slots__ = ("name", "weight_format", "activation_format", "kv_dtype", "backend", "logit_noise", "round_weights")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LOGIT_NOISE_FIELD_NUMBER: _ClassVar[int]
    ROUND_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight_format: str
    activation_format: str
    kv_dtype: str
    backend: str
    logit_noise: float
    round_weights: RoundWeights
    def __init__(self, name: _Optional[str] = ..., weight_format: _Optional[str] = ..., activation_format: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., backend: _Optional[str] = ..., logit_noise: _Optional[float] = ..., round_weights: _Optional[_Union[RoundWeights, _Mapping]] = ...) -> None: ...

class RoundWeights(_message.Message):
    __slots__ = ("bits", "block_size")
    BITS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    bits: int
    block_size: int
    def __init__(self, bits: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "head_k", "max_new_tokens", "stop_token_ids", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HEAD_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    head_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., head_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class ComputeDevice(_message.Message):
    __slots__ = ("type", "name", "capability", "kernels")
    class KernelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    type: str
    name: str
    capability: str
    kernels: _containers.ScalarMap[str, str]
    def __init__(self, type: _Optional[str] = ..., name: _Optional[str] = ..., capability: _Optional[str] = ..., kernels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("group", "recipe", "accelerator", "capacity", "weight_formats", "name", "device")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMATS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    group: str
    recipe: Recipe
    accelerator: str
    capacity: int
    weight_formats: _containers.RepeatedScalarFieldContainer[str]
    name: str
    device: ComputeDevice
    def __init__(self, group: _Optional[str] = ..., recipe: _Optional[_Union[Recipe, _Mapping]] = ..., accelerator: _Optional[str] = ..., capacity: _Optional[int] = ..., weight_formats: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., device: _Optional[_Union[ComputeDevice, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "server_id", "heartbeat_interval_ms", "session_ttl_ms", "max_outstanding", "max_message_bytes", "vocab_size", "current_version", "partial_rollouts", "envs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ENVS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    server_id: str
    heartbeat_interval_ms: int
    session_ttl_ms: int
    max_outstanding: int
    max_message_bytes: int
    vocab_size: int
    current_version: int
    partial_rollouts: bool
    envs: _containers.RepeatedCompositeFieldContainer[EnvSpec]
    def __init__(self, session_id: _Optional[str] = ..., server_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., session_ttl_ms: _Optional[int] = ..., max_outstanding: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., vocab_size: _Optional[int] = ..., current_version: _Optional[int] = ..., partial_rollouts: _Optional[bool] = ..., envs: _Optional[_Iterable[_Union[EnvSpec, _Mapping]]] = ...) -> None: ...

class EnvSpec(_message.Message):
    __slots__ = ("name", "env", "options_json", "difficulty")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    DIFFICULTY_FIELD_NUMBER: _ClassVar[int]
    name: str
    env: str
    options_json: str
    difficulty: int
    def __init__(self, name: _Optional[str] = ..., env: _Optional[str] = ..., options_json: _Optional[str] = ..., difficulty: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("session_id", "max_samples")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_samples: int
    def __init__(self, session_id: _Optional[str] = ..., max_samples: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("lease_id", "task_id", "sample_indices", "group_size", "prompt_ids", "env", "payload", "sampling", "deadline_unix_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDICES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    task_id: int
    sample_indices: _containers.RepeatedScalarFieldContainer[int]
    group_size: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    env: str
    payload: bytes
    sampling: SamplingParams
    deadline_unix_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., task_id: _Optional[int] = ..., sample_indices: _Optional[_Iterable[int]] = ..., group_size: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., env: _Optional[str] = ..., payload: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("tasks", "retry_after_ms", "reason")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    retry_after_ms: int
    reason: str
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., retry_after_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id", "weights_version", "weight_failures", "active_samples")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    weights_version: int
    weight_failures: int
    active_samples: int
    def __init__(self, session_id: _Optional[str] = ..., weights_version: _Optional[int] = ..., weight_failures: _Optional[int] = ..., active_samples: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("current_version", "expired_lease_ids")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    expired_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, current_version: _Optional[int] = ..., expired_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReturnLeaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id", "reason", "env")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: str
    reason: str
    env: str
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., reason: _Optional[str] = ..., env: _Optional[str] = ...) -> None: ...

class ReturnLeaseResponse(_message.Message):
    __slots__ = ("requeued",)
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    requeued: int
    def __init__(self, requeued: _Optional[int] = ...) -> None: ...

class ProbeReport(_message.Message):
    __slots__ = ("session_id", "version", "logprobs", "previous_logprobs", "weights_digest", "weights_unchanged", "error")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    previous_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weights_digest: str
    weights_unchanged: bool
    error: str
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., previous_logprobs: _Optional[_Iterable[float]] = ..., weights_digest: _Optional[str] = ..., weights_unchanged: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ProbeAck(_message.Message):
    __slots__ = ("action", "reason", "verdict", "kl", "max_abs")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[ProbeAck.Action]
        RELOAD: _ClassVar[ProbeAck.Action]
        REVOKED: _ClassVar[ProbeAck.Action]
    OK: ProbeAck.Action
    RELOAD: ProbeAck.Action
    REVOKED: ProbeAck.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_FIELD_NUMBER: _ClassVar[int]
    action: ProbeAck.Action
    reason: str
    verdict: str
    kl: float
    max_abs: float
    def __init__(self, action: _Optional[_Union[ProbeAck.Action, str]] = ..., reason: _Optional[str] = ..., verdict: _Optional[str] = ..., kl: _Optional[float] = ..., max_abs: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "generate_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    generate_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., generate_ms: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("session_id", "lease_id", "task_id", "sample_index", "token_ids", "loss_mask", "logprobs", "logprobs_full", "versions", "head_ids", "head_logprobs", "support_indptr", "support_ids", "support_logprobs", "reward", "finish_reason", "timings", "reward_parts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FULL_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    HEAD_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_INDPTR_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REWARD_PARTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: str
    task_id: int
    sample_index: int
    token_ids: Array
    loss_mask: Array
    logprobs: Array
    logprobs_full: Array
    versions: Array
    head_ids: Array
    head_logprobs: Array
    support_indptr: Array
    support_ids: Array
    support_logprobs: Array
    reward: float
    finish_reason: str
    timings: Timings
    reward_parts: _containers.RepeatedCompositeFieldContainer[RewardPart]
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., task_id: _Optional[int] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Union[Array, _Mapping]] = ..., loss_mask: _Optional[_Union[Array, _Mapping]] = ..., logprobs: _Optional[_Union[Array, _Mapping]] = ..., logprobs_full: _Optional[_Union[Array, _Mapping]] = ..., versions: _Optional[_Union[Array, _Mapping]] = ..., head_ids: _Optional[_Union[Array, _Mapping]] = ..., head_logprobs: _Optional[_Union[Array, _Mapping]] = ..., support_indptr: _Optional[_Union[Array, _Mapping]] = ..., support_ids: _Optional[_Union[Array, _Mapping]] = ..., support_logprobs: _Optional[_Union[Array, _Mapping]] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., reward_parts: _Optional[_Iterable[_Union[RewardPart, _Mapping]]] = ...) -> None: ...

class RewardPart(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class SubmitAck(_message.Message):
    __slots__ = ("task_id", "sample_index", "code", "reason", "duplicate")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    sample_index: int
    code: int
    reason: str
    duplicate: bool
    def __init__(self, task_id: _Optional[int] = ..., sample_index: _Optional[int] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class FileDigest(_message.Message):
    __slots__ = ("path", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[FileDigest]
    def __init__(self, files: _Optional[_Iterable[_Union[FileDigest, _Mapping]]] = ...) -> None: ...

class WeightLocation(_message.Message):
    __slots__ = ("format", "path", "manifest", "store", "chain")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    format: str
    path: str
    manifest: Manifest
    store: str
    chain: _containers.RepeatedCompositeFieldContainer[WeightStep]
    def __init__(self, format: _Optional[str] = ..., path: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., store: _Optional[str] = ..., chain: _Optional[_Iterable[_Union[WeightStep, _Mapping]]] = ...) -> None: ...

class WeightStep(_message.Message):
    __slots__ = ("version", "base", "stored")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    version: int
    base: int
    stored: Manifest
    def __init__(self, version: _Optional[int] = ..., base: _Optional[int] = ..., stored: _Optional[_Union[Manifest, _Mapping]] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version", "locations", "published_unix_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    version: int
    locations: _containers.RepeatedCompositeFieldContainer[WeightLocation]
    published_unix_ms: int
    def __init__(self, version: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[WeightLocation, _Mapping]]] = ..., published_unix_ms: _Optional[int] = ...) -> None: ...

class WatchWeightsRequest(_message.Message):
    __slots__ = ("session_id", "after_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    after_version: int
    def __init__(self, session_id: _Optional[str] = ..., after_version: _Optional[int] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("session_id", "version", "format", "path", "offset", "have_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: int
    format: str
    path: str
    offset: int
    have_version: int
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[int] = ..., format: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., have_version: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("name", "samplers", "tokens_per_s", "share", "outstanding", "accepted", "probe_version", "probe_kl", "probe_max_abs", "useful_share", "idle_share", "samples_per_busy_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROBE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBE_KL_FIELD_NUMBER: _ClassVar[int]
    PROBE_MAX_ABS_FIELD_NUMBER: _ClassVar[int]
    USEFUL_SHARE_FIELD_NUMBER: _ClassVar[int]
    IDLE_SHARE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    samplers: int
    tokens_per_s: float
    share: float
    outstanding: int
    accepted: int
    probe_version: int
    probe_kl: float
    probe_max_abs: float
    useful_share: float
    idle_share: float
    samples_per_busy_s: float
    def __init__(self, name: _Optional[str] = ..., samplers: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., share: _Optional[float] = ..., outstanding: _Optional[int] = ..., accepted: _Optional[int] = ..., probe_version: _Optional[int] = ..., probe_kl: _Optional[float] = ..., probe_max_abs: _Optional[float] = ..., useful_share: _Optional[float] = ..., idle_share: _Optional[float] = ..., samples_per_busy_s: _Optional[float] = ...) -> None: ...

class SamplerStatus(_message.Message):
    __slots__ = ("session_id", "name", "group", "recipe", "accelerator", "accepted", "duplicates", "rejected", "rejections", "outstanding", "weights_version", "weight_failures", "last_seen_s_ago", "device", "verified_version", "probe_version", "probe_kl", "probe_max_abs", "probe_verdict", "probe_reason", "returned")
    class RejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReturnedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_AGO_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBE_KL_FIELD_NUMBER: _ClassVar[int]
    PROBE_MAX_ABS_FIELD_NUMBER: _ClassVar[int]
    PROBE_VERDICT_FIELD_NUMBER: _ClassVar[int]
    PROBE_REASON_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    group: str
    recipe: Recipe
    accelerator: str
    accepted: int
    duplicates: int
    rejected: int
    rejections: _containers.ScalarMap[str, int]
    outstanding: int
    weights_version: int
    weight_failures: int
    last_seen_s_ago: float
    device: ComputeDevice
    verified_version: int
    probe_version: int
    probe_kl: float
    probe_max_abs: float
    probe_verdict: str
    probe_reason: str
    returned: _containers.ScalarMap[str, int]
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., group: _Optional[str] = ..., recipe: _Optional[_Union[Recipe, _Mapping]] = ..., accelerator: _Optional[str] = ..., accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[int] = ..., rejections: _Optional[_Mapping[str, int]] = ..., outstanding: _Optional[int] = ..., weights_version: _Optional[int] = ..., weight_failures: _Optional[int] = ..., last_seen_s_ago: _Optional[float] = ..., device: _Optional[_Union[ComputeDevice, _Mapping]] = ..., verified_version: _Optional[int] = ..., probe_version: _Optional[int] = ..., probe_kl: _Optional[float] = ..., probe_max_abs: _Optional[float] = ..., probe_verdict: _Optional[str] = ..., probe_reason: _Optional[str] = ..., returned: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("server_id", "current_version", "uptime_s", "pending_samples", "outstanding_samples", "buffered_trajectories", "buffered_bytes", "ready_groups", "accepted", "duplicates", "rejected", "taken_groups", "requeued_samples", "groups", "samplers")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    TAKEN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    current_version: int
    uptime_s: float
    pending_samples: int
    outstanding_samples: int
    buffered_trajectories: int
    buffered_bytes: int
    ready_groups: int
    accepted: int
    duplicates: int
    rejected: int
    taken_groups: int
    requeued_samples: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerStatus]
    def __init__(self, server_id: _Optional[str] = ..., current_version: _Optional[int] = ..., uptime_s: _Optional[float] = ..., pending_samples: _Optional[int] = ..., outstanding_samples: _Optional[int] = ..., buffered_trajectories: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., ready_groups: _Optional[int] = ..., accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[int] = ..., taken_groups: _Optional[int] = ..., requeued_samples: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ..., samplers: _Optional[_Iterable[_Union[SamplerStatus, _Mapping]]] = ...) -> None: ...

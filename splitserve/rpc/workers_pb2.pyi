from splitserve.v1 import splitserve_pb2 as _splitserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("role", "worker_id", "address", "node", "incarnation", "max_inflight", "block_size", "metrics_address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: str
    worker_id: str
    address: str
    node: str
    incarnation: str
    max_inflight: int
    block_size: int
    metrics_address: str
    def __init__(self, role: _Optional[str] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., incarnation: _Optional[str] = ..., max_inflight: _Optional[int] = ..., block_size: _Optional[int] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class RegistryCommand(_message.Message):
    __slots__ = ("kind",)
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACCEPTED: _ClassVar[RegistryCommand.Kind]
        DRAIN: _ClassVar[RegistryCommand.Kind]
    ACCEPTED: RegistryCommand.Kind
    DRAIN: RegistryCommand.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    kind: RegistryCommand.Kind
    def __init__(self, kind: _Optional[_Union[RegistryCommand.Kind, str]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("prefill", "decode", "colocated")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    colocated: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., colocated: _Optional[int] = ...) -> None: ...

class ScaleReply(_message.Message):
    __slots__ = ("prefill", "decode", "colocated")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    colocated: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., colocated: _Optional[int] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("receiver_id", "incarnation", "control_address", "ranks")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    incarnation: str
    control_address: str
    ranks: _containers.RepeatedCompositeFieldContainer[KVRankEndpoint]
    def __init__(self, receiver_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., control_address: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[KVRankEndpoint, _Mapping]]] = ...) -> None: ...

class KVRankEndpoint(_message.Message):
    __slots__ = ("receiver_id", "incarnation", "control_address")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    incarnation: str
    control_address: str
    def __init__(self, receiver_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., control_address: _Optional[str] = ...) -> None: ...

class RankExpect(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "timeout_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RankRelease(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RankAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankEventsRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class RankEvent(_message.Message):
    __slots__ = ("transfer_id", "state", "error", "bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    state: str
    error: str
    bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "destination", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _splitserve_pb2.SamplingParams
    destination: KVDestination
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_splitserve_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer", "tokens", "finished", "preempted")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer: TransferResult
    tokens: Tokens
    finished: Finished
    preempted: Preempted
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer: _Optional[_Union[TransferResult, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., preempted: _Optional[_Union[Preempted, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "cached_tokens", "queue_ms", "compute_ms", "finish_reason", "stop_reason", "logprobs", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    cached_tokens: int
    queue_ms: float
    compute_ms: float
    finish_reason: _splitserve_pb2.FinishReason
    stop_reason: str
    logprobs: _splitserve_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_splitserve_pb2.TokenLogprobs]
    def __init__(self, token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., finish_reason: _Optional[_Union[_splitserve_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., logprobs: _Optional[_Union[_splitserve_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_splitserve_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("ok", "error", "transfer_ms", "bytes")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    transfer_ms: float
    bytes: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., transfer_ms: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "prefill_locally", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _splitserve_pb2.SamplingParams
    prefill_locally: bool
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_splitserve_pb2.SamplingParams, _Mapping]] = ..., prefill_locally: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("lease", "refused", "landed", "tokens", "finished", "preempted")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    lease: LeaseGranted
    refused: LeaseRefused
    landed: KVLanded
    tokens: Tokens
    finished: Finished
    preempted: Preempted
    def __init__(self, lease: _Optional[_Union[LeaseGranted, _Mapping]] = ..., refused: _Optional[_Union[LeaseRefused, _Mapping]] = ..., landed: _Optional[_Union[KVLanded, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., preempted: _Optional[_Union[Preempted, _Mapping]] = ...) -> None: ...

class LeaseGranted(_message.Message):
    __slots__ = ("destination", "blocks")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    destination: KVDestination
    blocks: int
    def __init__(self, destination: _Optional[_Union[KVDestination, _Mapping]] = ..., blocks: _Optional[int] = ...) -> None: ...

class LeaseRefused(_message.Message):
    __slots__ = ("reason", "free_blocks")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    free_blocks: int
    def __init__(self, reason: _Optional[str] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class KVLanded(_message.Message):
    __slots__ = ("wait_ms", "bytes")
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    wait_ms: float
    bytes: int
    def __init__(self, wait_ms: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("token_ids", "index", "logprobs", "prompt_logprobs", "sample")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_splitserve_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_splitserve_pb2.TokenLogprobs]
    sample: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_splitserve_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_splitserve_pb2.TokenLogprobs, _Mapping]]] = ..., sample: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "stop_reason", "sample")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _splitserve_pb2.FinishReason
    stop_reason: str
    sample: int
    def __init__(self, finish_reason: _Optional[_Union[_splitserve_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., sample: _Optional[int] = ...) -> None: ...

class Preempted(_message.Message):
    __slots__ = ("output_token_ids", "sample")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: int
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "block_size")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[CacheEvent.Kind]
        STORED: _ClassVar[CacheEvent.Kind]
        REMOVED: _ClassVar[CacheEvent.Kind]
        SNAPSHOT: _ClassVar[CacheEvent.Kind]
    KIND_UNSPECIFIED: CacheEvent.Kind
    STORED: CacheEvent.Kind
    REMOVED: CacheEvent.Kind
    SNAPSHOT: CacheEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    kind: CacheEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, kind: _Optional[_Union[CacheEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

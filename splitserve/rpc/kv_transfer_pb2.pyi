from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayoutFingerprint(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "weights_checksum", "tp_size", "tp_rank", "heads_start", "heads_stop")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    HEADS_START_FIELD_NUMBER: _ClassVar[int]
    HEADS_STOP_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weights_checksum: str
    tp_size: int
    tp_rank: int
    heads_start: int
    heads_stop: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., weights_checksum: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., heads_start: _Optional[int] = ..., heads_stop: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "sender_id", "sender_incarnation", "receiver_incarnation", "fingerprint", "sender_host")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SENDER_HOST_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender_id: str
    sender_incarnation: str
    receiver_incarnation: str
    fingerprint: LayoutFingerprint
    sender_host: str
    def __init__(self, protocol_version: _Optional[int] = ..., sender_id: _Optional[str] = ..., sender_incarnation: _Optional[str] = ..., receiver_incarnation: _Optional[str] = ..., fingerprint: _Optional[_Union[LayoutFingerprint, _Mapping]] = ..., sender_host: _Optional[str] = ...) -> None: ...

class SenderMessage(_message.Message):
    __slots__ = ("hello", "descriptor", "cancel")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    descriptor: bytes
    cancel: Cancel
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., descriptor: _Optional[bytes] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReceiverMessage(_message.Message):
    __slots__ = ("welcome", "ack")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    ack: Ack
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("protocol_version", "receiver_id", "receiver_incarnation", "generation", "store_host", "store_port", "store_prefix", "backend")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    STORE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    receiver_id: str
    receiver_incarnation: str
    generation: int
    store_host: str
    store_port: int
    store_prefix: str
    backend: str
    def __init__(self, protocol_version: _Optional[int] = ..., receiver_id: _Optional[str] = ..., receiver_incarnation: _Optional[str] = ..., generation: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., store_prefix: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("transfer_id", "seq", "status", "error")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[Ack.Status]
        LANDED: _ClassVar[Ack.Status]
        DONE: _ClassVar[Ack.Status]
        REFUSED: _ClassVar[Ack.Status]
        CANCELLED: _ClassVar[Ack.Status]
        FAILED: _ClassVar[Ack.Status]
    STATUS_UNSPECIFIED: Ack.Status
    LANDED: Ack.Status
    DONE: Ack.Status
    REFUSED: Ack.Status
    CANCELLED: Ack.Status
    FAILED: Ack.Status
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    seq: int
    status: Ack.Status
    error: str
    def __init__(self, transfer_id: _Optional[str] = ..., seq: _Optional[int] = ..., status: _Optional[_Union[Ack.Status, str]] = ..., error: _Optional[str] = ...) -> None: ...

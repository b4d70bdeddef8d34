from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeRequest(_message.Message):
    __slots__ = ("stream_id", "after_seq")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    after_seq: int
    def __init__(self, stream_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_count", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_count: int
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_count: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: str
    def __init__(self, medium: _Optional[str] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("stream_id", "snapshot", "last_seq", "ts", "block_size", "events", "hash_algo", "shared_media")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEDIA_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    snapshot: bool
    last_seq: int
    ts: float
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    hash_algo: str
    shared_media: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stream_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., last_seq: _Optional[int] = ..., ts: _Optional[float] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., hash_algo: _Optional[str] = ..., shared_media: _Optional[_Iterable[str]] = ...) -> None: ...

class RoutingInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoutingInfo(_message.Message):
    __slots__ = ("block_size", "tokenizer_files", "model")
    class TokenizerFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    tokenizer_files: _containers.ScalarMap[str, bytes]
    model: str
    def __init__(self, block_size: _Optional[int] = ..., tokenizer_files: _Optional[_Mapping[str, bytes]] = ..., model: _Optional[str] = ...) -> None: ...

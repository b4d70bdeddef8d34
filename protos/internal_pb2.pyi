from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("num_blocks", "block_size", "num_kv_heads", "head_dim", "layer_bits", "dtype", "stage_slots", "device", "rank_kv_heads", "rank_devices")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_BITS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STAGE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    RANK_DEVICES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    layer_bits: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    stage_slots: int
    device: str
    rank_kv_heads: _containers.RepeatedScalarFieldContainer[int]
    rank_devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layer_bits: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., stage_slots: _Optional[int] = ..., device: _Optional[str] = ..., rank_kv_heads: _Optional[_Iterable[int]] = ..., rank_devices: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolTerms(_message.Message):
    __slots__ = ("block_size", "layer_bits", "model", "sparsity")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_BITS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SPARSITY_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    layer_bits: _containers.RepeatedScalarFieldContainer[int]
    model: str
    sparsity: str
    def __init__(self, block_size: _Optional[int] = ..., layer_bits: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., sparsity: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("layout", "terms")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    layout: PoolLayout
    terms: PoolTerms
    def __init__(self, layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., terms: _Optional[_Union[PoolTerms, _Mapping]] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("block_size", "enable_compression", "default_bits", "layer_bits", "eviction_policy", "enable_prefix_caching", "lru_k", "prefix_caching_hash_algo", "adaptive", "adaptive_policy_candidates", "device", "gateway_lease_s", "metrics_port", "model", "compression_sparsity", "sparsity_policy", "sparsity_options")
    class LayerBitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BITS_FIELD_NUMBER: _ClassVar[int]
    LAYER_BITS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    LRU_K_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_POLICY_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_SPARSITY_FIELD_NUMBER: _ClassVar[int]
    SPARSITY_POLICY_FIELD_NUMBER: _ClassVar[int]
    SPARSITY_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    enable_compression: bool
    default_bits: int
    layer_bits: _containers.ScalarMap[int, int]
    eviction_policy: str
    enable_prefix_caching: bool
    lru_k: int
    prefix_caching_hash_algo: str
    adaptive: bool
    adaptive_policy_candidates: str
    device: str
    gateway_lease_s: float
    metrics_port: int
    model: str
    compression_sparsity: float
    sparsity_policy: str
    sparsity_options: str
    def __init__(self, block_size: _Optional[int] = ..., enable_compression: _Optional[bool] = ..., default_bits: _Optional[int] = ..., layer_bits: _Optional[_Mapping[int, int]] = ..., eviction_policy: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ..., lru_k: _Optional[int] = ..., prefix_caching_hash_algo: _Optional[str] = ..., adaptive: _Optional[bool] = ..., adaptive_policy_candidates: _Optional[str] = ..., device: _Optional[str] = ..., gateway_lease_s: _Optional[float] = ..., metrics_port: _Optional[int] = ..., model: _Optional[str] = ..., compression_sparsity: _Optional[float] = ..., sparsity_policy: _Optional[str] = ..., sparsity_options: _Optional[str] = ...) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("kind", "nbytes", "epoch", "path", "cuda", "ranks", "host_tier", "host_tier_blocks")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    nbytes: int
    epoch: int
    path: str
    cuda: CudaIpcHandle
    ranks: _containers.RepeatedCompositeFieldContainer[PoolHandle]
    host_tier: PoolHandle
    host_tier_blocks: int
    def __init__(self, kind: _Optional[str] = ..., nbytes: _Optional[int] = ..., epoch: _Optional[int] = ..., path: _Optional[str] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[PoolHandle, _Mapping]]] = ..., host_tier: _Optional[_Union[PoolHandle, _Mapping]] = ..., host_tier_blocks: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "device_index", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    device_index: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class NewSeq(_message.Message):
    __slots__ = ("seq_id", "token_ids", "cache_salt")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: bytes
    cache_salt: str
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("new_seqs", "appended", "commits", "finished", "running", "grows", "waiting", "token_budget", "max_num_seqs", "chunked_prefill", "epoch", "gateway_id", "copies_done", "block_scores")
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    GROWS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    COPIES_DONE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SCORES_FIELD_NUMBER: _ClassVar[int]
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSeq]
    appended: bytes
    commits: bytes
    finished: bytes
    running: bytes
    grows: bytes
    waiting: bytes
    token_budget: int
    max_num_seqs: int
    chunked_prefill: bool
    epoch: int
    gateway_id: str
    copies_done: int
    block_scores: _containers.RepeatedCompositeFieldContainer[BlockScores]
    def __init__(self, new_seqs: _Optional[_Iterable[_Union[NewSeq, _Mapping]]] = ..., appended: _Optional[bytes] = ..., commits: _Optional[bytes] = ..., finished: _Optional[bytes] = ..., running: _Optional[bytes] = ..., grows: _Optional[bytes] = ..., waiting: _Optional[bytes] = ..., token_budget: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., chunked_prefill: _Optional[bool] = ..., epoch: _Optional[int] = ..., gateway_id: _Optional[str] = ..., copies_done: _Optional[int] = ..., block_scores: _Optional[_Iterable[_Union[BlockScores, _Mapping]]] = ...) -> None: ...

class BlockScores(_message.Message):
    __slots__ = ("seq_id", "mass")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MASS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    mass: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., mass: _Optional[_Iterable[float]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("gateway_id",)
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    def __init__(self, gateway_id: _Optional[str] = ...) -> None: ...

class TableDelta(_message.Message):
    __slots__ = ("seq_id", "start", "blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    blocks: bytes
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., blocks: _Optional[bytes] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("preempted", "admitted", "tables", "used_blocks", "copies", "loaded", "copy_seq", "demotions")
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    COPY_SEQ_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    preempted: bytes
    admitted: bytes
    tables: _containers.RepeatedCompositeFieldContainer[TableDelta]
    used_blocks: int
    copies: bytes
    loaded: bytes
    copy_seq: int
    demotions: bytes
    def __init__(self, preempted: _Optional[bytes] = ..., admitted: _Optional[bytes] = ..., tables: _Optional[_Iterable[_Union[TableDelta, _Mapping]]] = ..., used_blocks: _Optional[int] = ..., copies: _Optional[bytes] = ..., loaded: _Optional[bytes] = ..., copy_seq: _Optional[int] = ..., demotions: _Optional[bytes] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("kv_cache_usage", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "prefix_queries_tokens", "prefix_hits_tokens", "evictions_by_policy", "eviction_policy", "recomputed_tokens", "cache_preemptions", "num_seqs", "epoch", "plan_calls", "attached_epoch", "tier_hit_tokens", "tier_blocks", "tier_capacity_blocks", "tier_moved_blocks", "tier_moved_bytes", "tier_health", "sparsity_blocks_dropped", "sparsity_blocks_demoted")
    class EvictionsByPolicyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TierHitTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TierBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TierCapacityBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TierMovedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TierMovedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TierHealthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_BY_POLICY_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_CALLS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_HEALTH_FIELD_NUMBER: _ClassVar[int]
    SPARSITY_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    SPARSITY_BLOCKS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    kv_cache_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evictions_by_policy: _containers.ScalarMap[str, int]
    eviction_policy: str
    recomputed_tokens: int
    cache_preemptions: int
    num_seqs: int
    epoch: int
    plan_calls: int
    attached_epoch: int
    tier_hit_tokens: _containers.ScalarMap[str, int]
    tier_blocks: _containers.ScalarMap[str, int]
    tier_capacity_blocks: _containers.ScalarMap[str, int]
    tier_moved_blocks: _containers.ScalarMap[str, int]
    tier_moved_bytes: _containers.ScalarMap[str, int]
    tier_health: _containers.ScalarMap[str, int]
    sparsity_blocks_dropped: int
    sparsity_blocks_demoted: int
    def __init__(self, kv_cache_usage: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_queries_tokens: _Optional[int] = ..., prefix_hits_tokens: _Optional[int] = ..., evictions_by_policy: _Optional[_Mapping[str, int]] = ..., eviction_policy: _Optional[str] = ..., recomputed_tokens: _Optional[int] = ..., cache_preemptions: _Optional[int] = ..., num_seqs: _Optional[int] = ..., epoch: _Optional[int] = ..., plan_calls: _Optional[int] = ..., attached_epoch: _Optional[int] = ..., tier_hit_tokens: _Optional[_Mapping[str, int]] = ..., tier_blocks: _Optional[_Mapping[str, int]] = ..., tier_capacity_blocks: _Optional[_Mapping[str, int]] = ..., tier_moved_blocks: _Optional[_Mapping[str, int]] = ..., tier_moved_bytes: _Optional[_Mapping[str, int]] = ..., tier_health: _Optional[_Mapping[str, int]] = ..., sparsity_blocks_dropped: _Optional[int] = ..., sparsity_blocks_demoted: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("clear_stats",)
    CLEAR_STATS_FIELD_NUMBER: _ClassVar[int]
    clear_stats: bool
    def __init__(self, clear_stats: _Optional[bool] = ...) -> None: ...

class GhostScores(_message.Message):
    __slots__ = ("hits", "queries", "pair_sq")
    class HitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HITS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    PAIR_SQ_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.ScalarMap[str, float]
    queries: float
    pair_sq: _containers.RepeatedCompositeFieldContainer[PairSq]
    def __init__(self, hits: _Optional[_Mapping[str, float]] = ..., queries: _Optional[float] = ..., pair_sq: _Optional[_Iterable[_Union[PairSq, _Mapping]]] = ...) -> None: ...

class PairSq(_message.Message):
    __slots__ = ("a", "b", "sq")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    SQ_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    sq: float
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., sq: _Optional[float] = ...) -> None: ...

class GhostWindowReply(_message.Message):
    __slots__ = ("empty", "window", "recent")
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    empty: bool
    window: GhostScores
    recent: GhostScores
    def __init__(self, empty: _Optional[bool] = ..., window: _Optional[_Union[GhostScores, _Mapping]] = ..., recent: _Optional[_Union[GhostScores, _Mapping]] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class LayerErrors(_message.Message):
    __slots__ = ("layer", "rms_by_bits")
    class RmsByBitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    LAYER_FIELD_NUMBER: _ClassVar[int]
    RMS_BY_BITS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    rms_by_bits: _containers.ScalarMap[int, float]
    def __init__(self, layer: _Optional[int] = ..., rms_by_bits: _Optional[_Mapping[int, float]] = ...) -> None: ...

class ProbeErrorsReply(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerErrors]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerErrors, _Mapping]]] = ...) -> None: ...

class RepoolRequest(_message.Message):
    __slots__ = ("num_blocks", "layer_bits")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYER_BITS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    layer_bits: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., layer_bits: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "eos_token_ids", "max_position_embeddings", "num_blocks", "block_size", "device", "dtype", "model", "epoch", "layer_bits", "max_num_seqs", "max_num_batched_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYER_BITS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_position_embeddings: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    model: str
    epoch: int
    layer_bits: _containers.RepeatedScalarFieldContainer[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_position_embeddings: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., model: _Optional[str] = ..., epoch: _Optional[int] = ..., layer_bits: _Optional[_Iterable[int]] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    include_stop_str_in_output: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class SeqParams(_message.Message):
    __slots__ = ("seq_id", "params")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    params: SamplingParams
    def __init__(self, seq_id: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "seq_ids", "num_computed", "num_new", "num_prefills", "tokens", "sample_rows", "tables", "new_seqs", "finished", "preempted", "epoch", "gateway_id", "copies", "demotions")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: bytes
    num_computed: bytes
    num_new: bytes
    num_prefills: int
    tokens: bytes
    sample_rows: bytes
    tables: _containers.RepeatedCompositeFieldContainer[TableDelta]
    new_seqs: _containers.RepeatedCompositeFieldContainer[SeqParams]
    finished: bytes
    preempted: bytes
    epoch: int
    gateway_id: str
    copies: bytes
    demotions: bytes
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[bytes] = ..., num_computed: _Optional[bytes] = ..., num_new: _Optional[bytes] = ..., num_prefills: _Optional[int] = ..., tokens: _Optional[bytes] = ..., sample_rows: _Optional[bytes] = ..., tables: _Optional[_Iterable[_Union[TableDelta, _Mapping]]] = ..., new_seqs: _Optional[_Iterable[_Union[SeqParams, _Mapping]]] = ..., finished: _Optional[bytes] = ..., preempted: _Optional[bytes] = ..., epoch: _Optional[int] = ..., gateway_id: _Optional[str] = ..., copies: _Optional[bytes] = ..., demotions: _Optional[bytes] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "token_ids", "has_logprobs", "logprobs", "logprob_rows", "forward_ns", "block_scores")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SCORES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    token_ids: bytes
    has_logprobs: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    logprob_rows: _containers.RepeatedScalarFieldContainer[bool]
    forward_ns: int
    block_scores: _containers.RepeatedCompositeFieldContainer[BlockScores]
    def __init__(self, step_id: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., has_logprobs: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., logprob_rows: _Optional[_Iterable[bool]] = ..., forward_ns: _Optional[int] = ..., block_scores: _Optional[_Iterable[_Union[BlockScores, _Mapping]]] = ...) -> None: ...

class ComputeStats(_message.Message):
    __slots__ = ("compression_error", "compute_steps", "forward_s", "num_seqs", "epoch", "device_free_bytes", "kv_bytes_per_block")
    class CompressionErrorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    COMPRESSION_ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    compression_error: _containers.ScalarMap[int, float]
    compute_steps: int
    forward_s: float
    num_seqs: int
    epoch: int
    device_free_bytes: int
    kv_bytes_per_block: int
    def __init__(self, compression_error: _Optional[_Mapping[int, float]] = ..., compute_steps: _Optional[int] = ..., forward_s: _Optional[float] = ..., num_seqs: _Optional[int] = ..., epoch: _Optional[int] = ..., device_free_bytes: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ...) -> None: ...

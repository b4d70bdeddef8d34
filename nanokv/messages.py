"""The messages between the services, as plain dataclasses (no torch, no grpc).

One step crosses two seams:

  gateway --PlanRequest--> cache service --PlanReply--> gateway       (which blocks, one call)
  gateway --StepRequest--> compute service --StepResult--> gateway    (which tokens, one call)

The in-process transport hands these objects to the services directly; the gRPC transport turns
them into the protobuf messages of protos/internal.proto (nanokv.protos.codec) and back, so both
run the same service code. Everything here is a delta against state the receiver keeps: a
sequence's prompt travels once (PlanRequest.new_seqs), its sampling params once
(StepRequest.new_seqs), its block table as the entries that changed (TableDelta).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from nanokv.sampling import SamplingParams

PLACEHOLDER = -1  # an input token the compute service takes from its previous step's samples
# KV copies between the device pool (L1) and the host tier (L2), (kind, L1 block, L2 slot), run by the
# compute service in the order given, before the step's forward pass (cache_service/tiers/serving.py)
COPY_SAVE, COPY_LOAD = 0, 1  # L1 block -> L2 slot (write-back of a victim), L2 slot -> L1 block (a hit)


@dataclass
class NewSeq:
    seq_id: int
    token_ids: list[int]
    cache_salt: str | None = None


@dataclass
class TableDelta:
    """The receiver's table for `seq_id` becomes table[:start] + blocks."""
    seq_id: int
    start: int
    blocks: list[int]


@dataclass
class PlanRequest:
    """One scheduling step's block work, applied by the cache service as one transaction.

    First the news since the last plan: new sequences, tokens sampled, blocks computed (published
    to the prefix cache), sequences ended. Then the step: `grows` are the running sequences the
    gateway's scheduler picked, in its order, with the token count each must hold; when blocks run
    out the newest running sequence is preempted (its blocks freed, cached ones kept). If nothing
    was preempted, `waiting` candidates are admitted in order with their prefix-cache hit while the
    token budget, `max_num_seqs` and the blocks last."""
    new_seqs: list[NewSeq] = field(default_factory=list)
    appended: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, token id)
    commits: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, tokens computed so far)
    finished: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)  # every running sequence, oldest first
    grows: list[tuple[int, int, int]] = field(default_factory=list)  # (seq_id, tokens to hold, new tokens)
    # (seq_id, num_tokens, tokens computed before a preemption: counted as recomputed when redone)
    waiting: list[tuple[int, int, int]] = field(default_factory=list)
    token_budget: int = 0
    max_num_seqs: int = 0
    chunked_prefill: bool = True
    epoch: int = 0  # the pool planned against (0: unchecked, e.g. a tool driving the planner directly)
    gateway_id: str = ""  # the sequences' holder (its lease: EngineConfig.gateway_lease_s)
    copies_done: int = 0  # the last PlanReply.copy_seq whose copies a finished step ran (tiers/serving.py)
    # block sparsity (attention / hybrid): (seq_id, attention mass per logical block) of a step, as the
    # compute service reported it (StepResult.block_scores); news, like the commits
    block_scores: list[tuple[int, list[float]]] = field(default_factory=list)

    @property
    def is_news_only(self) -> bool:
        return not self.grows and not self.waiting


@dataclass
class PlanReply:
    preempted: list[int] = field(default_factory=list)  # in preemption order
    admitted: list[tuple[int, int, int]] = field(default_factory=list)  # (seq_id, prefix-hit tokens, new tokens)
    tables: list[TableDelta] = field(default_factory=list)  # for every sequence that runs this step
    used_blocks: int = 0  # blocks referenced by sequences after the plan (the adaptive controller's gauge)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (COPY_*, L1 block, L2 slot), in order
    # (seq_id, prompt tokens from L2, from L3, from the shared tier) of each admission that loaded some
    loaded: list[tuple[int, int, int, int]] = field(default_factory=list)
    copy_seq: int = 0  # this plan's number when it has copies (the gateway reports it back: copies_done)
    # hybrid sparsity: (pool block, demotion-store slot) copies INT8 -> INT4 the compute service makes
    # before the next forward pass (the block went back to the pool in this plan; StepRequest.demotions)
    demotions: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StepRequest:
    """One forward pass. Rows are the scheduled sequences, prefills first; `tokens` holds each
    row's `num_new` input tokens back to back (PLACEHOLDER: the token the previous step sampled
    for that sequence, still on the device)."""
    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    num_prefills: int = 0
    tokens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    tables: list[TableDelta] = field(default_factory=list)
    new_seqs: list[tuple[int, SamplingParams]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # forget tables and sampler state
    preempted: list[int] = field(default_factory=list)  # forget tables (blocks went back to the cache)
    epoch: int = 0  # the pool the plan was made on (0: unchecked)
    gateway_id: str = ""
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # PlanReply.copies, run before the forward
    # hybrid sparsity: (pool block, store slot) copies to make before this step's forward pass, in
    # order: every plan's PlanReply.demotions since the last step request
    demotions: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StepResult:
    step_id: int
    token_ids: list[int] = field(default_factory=list)  # one per sample row
    logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    forward_ns: int = 0
    # block sparsity (attention / hybrid): (seq_id, attention mass per logical block) of every row the
    # step measured, reduced over the row's queries by the policy's score_mode (PlanRequest.block_scores)
    block_scores: list[tuple[int, list[float]]] = field(default_factory=list)


@dataclass
class PoolLayout:
    """What the compute service asks the cache service to allocate: every layer's KV tensors
    (codes, scales, int4 staging) carved from one flat byte segment in a fixed order."""
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    layer_bits: list[int]
    dtype: str  # torch dtype name of full-precision KV ("float32", "bfloat16", ...)
    stage_slots: int = 0  # int4 staging slots (0 without int4 layers)
    device: str = "cpu"
    # tensor parallelism: this layout is rank 0's; ranks 1..N-1 hold these KV heads on these
    # devices, and the cache service allocates and exports one pool for each (PoolHandle.ranks)
    rank_kv_heads: list[int] = field(default_factory=list)
    rank_devices: list[str] = field(default_factory=list)


@dataclass
class PoolTerms:
    """What the compute service was started with that the cache service's config must match, sent
    with every attach (nanokv.agreement): the configured KV format, not the live pool's (a repool
    may widen a layer), and the model whose KV the pool will hold."""
    block_size: int
    layer_bits: list[int]
    model: str = ""
    sparsity: str = ""  # block sparsity's settings (SparsityParams.describe(); "": off)


@dataclass
class CudaIpcHandle:
    """A CUDA IPC export of the pool's device segment (nanokv.kv.cuda_ipc): the
    cudaIpcMemHandle of its allocation, where the segment sits in it, and PyTorch's shared
    reference count. The GPU is named by UUID: indices differ under different CUDA_VISIBLE_DEVICES."""
    device_uuid: str
    device_index: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass
class PoolHandle:
    """How the compute service maps the pool: `kind` "local" (same process: `buffer` is the
    tensor), "shm" (a shared-memory file at `path` of `nbytes`) or "cuda_ipc" (`cuda`, a device
    segment of another process). `epoch` numbers allocations; every step names the one it writes."""
    kind: str
    nbytes: int
    epoch: int
    path: str = ""
    buffer: object = None
    cuda: CudaIpcHandle | None = None
    ranks: list[PoolHandle] = field(default_factory=list)  # ranks 1..N-1's pools (tensor parallelism)
    # the host tier (L2): a segment of `host_tier_blocks` blocks in the pool's layout, on the host
    host_tier: PoolHandle | None = None
    host_tier_blocks: int = 0


@dataclass
class ModelInfo:
    """What the gateway needs to know of the model (the compute service's answer to Info)."""
    name: str
    vocab_size: int
    eos_token_ids: list[int]
    max_position_embeddings: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    model: str | None = None  # the path the compute service loaded (the gateway's tokenizer reads it too)
    epoch: int = 0  # the pool the compute service has mapped (0: none)
    layer_bits: list[int] = field(default_factory=list)  # the pool's KV format per layer (16: full precision)
    # the batch the compute service sized its buffers for (0: unknown): a gateway's may not exceed it
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0


@dataclass(frozen=True)
class GhostScores:
    """Evidence over some horizon: block hits per ghost over the same queries, and for every pair of
    ghosts the sum of squared per-request hit differences (for a paired test)."""

    hits: dict[str, float]
    queries: float
    pair_sq: dict[tuple[str, str], float]

    @property
    def ratios(self) -> dict[str, float]:
        return {p: h / self.queries for p, h in self.hits.items()}

    def z(self, a: str, b: str) -> float:
        """How many standard deviations ``a`` leads ``b`` by: both ghosts saw the very same requests,
        so the per-request differences d_i are paired and sum(d_i) / sqrt(sum(d_i^2)) is the
        statistic of a paired test; a lead made of a few lucky requests scores low."""
        d = self.hits[a] - self.hits[b]
        sq = self.pair_sq.get((a, b), self.pair_sq.get((b, a), 0.0))
        return d / sq**0.5 if sq > 0 else 0.0


class CacheServiceStats(TypedDict):
    """The cache service's counters (CacheAPI.stats; the Cache.Stats reply, field for field)."""
    kv_cache_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evictions_by_policy: dict[str, int]
    eviction_policy: str  # the live one (the adaptive controller may switch it)
    recomputed_tokens: int
    cache_preemptions: int
    num_seqs: int
    epoch: int  # the last pool allocated
    attached_epoch: int  # the pool a compute service holds now (0: none)
    plan_calls: int
    # the memory hierarchy (absent without lower tiers): per tier "L1", "L2", ...; moves "L1->L2", ...
    tier_hit_tokens: NotRequired[dict[str, int]]
    tier_blocks: NotRequired[dict[str, int]]
    tier_capacity_blocks: NotRequired[dict[str, int]]
    tier_moved_blocks: NotRequired[dict[str, int]]
    tier_moved_bytes: NotRequired[dict[str, int]]
    tier_health: NotRequired[dict[str, int]]  # disk_tier_* / remote_tier_* by name
    sparsity_blocks_dropped: int  # block sparsity: blocks dropped since start (0 with sparsity off)
    sparsity_blocks_demoted: int  # hybrid: blocks moved INT8 -> INT4 into the demotion store


class ComputeServiceStats(TypedDict):
    """The compute service's counters (ComputeAPI.stats; the Compute.Stats reply)."""
    compression_error: dict[int, float]  # layer -> running relative K/V quantization error
    compute_steps: int
    forward_s: float
    num_seqs: int  # sequences whose tables the service keeps
    epoch: int  # the pool it has mapped
    device_free_bytes: int  # free device memory now (CUDA; 0 elsewhere)
    kv_bytes_per_block: int  # one block in every layer at its current width

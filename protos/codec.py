"""nanokv.messages dataclasses <-> the protobuf messages of internal.proto (no torch).

Integer arrays are packed little-endian int64 (array('q')): one bytes field instead of a Python
object per element. Every decoder checks lengths and ranges it relies on and raises
ValueError naming the field, which the servers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import chain

from nanokv.messages import (
    CacheServiceStats,
    ComputeServiceStats,
    CudaIpcHandle,
    GhostScores,
    ModelInfo,
    NewSeq,
    PlanReply,
    PlanRequest,
    PoolHandle,
    PoolLayout,
    PoolTerms,
    StepRequest,
    StepResult,
    TableDelta,
)
from nanokv.protos import internal_pb2 as pb
from nanokv.sampling import SamplingParams
from nanokv.service_config import CacheConfig

_SWAP = sys.byteorder != "little"


def pack(values: Iterable[int]) -> bytes:
    a = array("q", values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack(data: bytes, field: str, group: int = 1) -> list[int]:
    if len(data) % (8 * group):
        raise ValueError(f"{field}: {len(data)} bytes is not a whole number of {group} int64 values")
    a = array("q")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def pack_tuples(rows: Sequence[tuple[int, ...]]) -> bytes:
    # chain.from_iterable, not a generator expression: it runs in C (a step's plan packs ~1,000 ints)
    return pack(chain.from_iterable(rows))


def unpack_pairs(data: bytes, field: str) -> list[tuple[int, int]]:
    it = iter(unpack(data, field, 2))
    return list(zip(it, it))  # consecutive pairs, built in C


def unpack_triples(data: bytes, field: str) -> list[tuple[int, int, int]]:
    it = iter(unpack(data, field, 3))
    return list(zip(it, it, it))


def unpack_quads(data: bytes, field: str) -> list[tuple[int, int, int, int]]:
    it = iter(unpack(data, field, 4))
    return list(zip(it, it, it, it))


# ---- cache service ------------------------------------------------------------------------------
def layout_to_pb(x: PoolLayout) -> pb.PoolLayout:
    return pb.PoolLayout(num_blocks=x.num_blocks, block_size=x.block_size, num_kv_heads=x.num_kv_heads,
                         head_dim=x.head_dim, layer_bits=x.layer_bits, dtype=x.dtype, stage_slots=x.stage_slots,
                         device=x.device, rank_kv_heads=x.rank_kv_heads, rank_devices=x.rank_devices)


def layout_from_pb(m: pb.PoolLayout) -> PoolLayout:
    return PoolLayout(m.num_blocks, m.block_size, m.num_kv_heads, m.head_dim, list(m.layer_bits), m.dtype,
                      m.stage_slots, m.device, list(m.rank_kv_heads), list(m.rank_devices))


def terms_to_pb(t: PoolTerms) -> pb.PoolTerms:
    return pb.PoolTerms(block_size=t.block_size, layer_bits=t.layer_bits, model=t.model, sparsity=t.sparsity)


def terms_from_pb(m: pb.PoolTerms) -> PoolTerms:
    return PoolTerms(m.block_size, list(m.layer_bits), m.model, sparsity=m.sparsity)


def cache_info_to_pb(c: CacheConfig, model: str = "") -> pb.CacheInfo:
    spec = c.quantization_bitwidth
    return pb.CacheInfo(
        block_size=c.block_size, enable_compression=c.enable_compression, default_bits=spec["default"],
        layer_bits={int(k): b for k, b in spec["layers"].items()}, eviction_policy=c.eviction_policy,
        enable_prefix_caching=c.enable_prefix_caching, lru_k=c.lru_k,
        prefix_caching_hash_algo=c.prefix_caching_hash_algo, adaptive=c.adaptive,
        adaptive_policy_candidates=c.adaptive_policy_candidates, device=c.device,
        gateway_lease_s=c.gateway_lease_s, metrics_port=c.metrics_port, model=model,
        compression_sparsity=c.compression_sparsity, sparsity_policy=c.sparsity_policy,
        sparsity_options=c.sparsity_options)


def cache_info_from_pb(m: pb.CacheInfo) -> tuple[CacheConfig, str]:
    """(the cache service's config, validated again here; the attached model, "" if none)."""
    spec = {"default": m.default_bits, "layers": {str(k): b for k, b in sorted(m.layer_bits.items())}}
    return CacheConfig(
        block_size=m.block_size, enable_compression=m.enable_compression, quantization_bitwidth=spec,
        eviction_policy=m.eviction_policy, enable_prefix_caching=m.enable_prefix_caching, lru_k=m.lru_k,
        prefix_caching_hash_algo=m.prefix_caching_hash_algo, adaptive=m.adaptive,
        adaptive_policy_candidates=m.adaptive_policy_candidates, device=m.device,
        gateway_lease_s=m.gateway_lease_s, metrics_port=m.metrics_port,
        compression_sparsity=m.compression_sparsity, sparsity_policy=m.sparsity_policy or "streaming",
        sparsity_options=m.sparsity_options), m.model


def handle_to_pb(h: PoolHandle) -> pb.PoolHandle:
    m = pb.PoolHandle(kind=h.kind, nbytes=h.nbytes, epoch=h.epoch, path=h.path)
    if h.cuda is not None:
        c = h.cuda
        m.cuda.CopyFrom(pb.CudaIpcHandle(
            device_uuid=c.device_uuid, device_index=c.device_index, handle=c.handle, storage_bytes=c.storage_bytes,
            storage_offset=c.storage_offset, ref_counter_handle=c.ref_counter_handle,
            ref_counter_offset=c.ref_counter_offset, event_handle=c.event_handle,
            event_sync_required=c.event_sync_required))
    m.ranks.extend(handle_to_pb(r) for r in h.ranks)
    if h.host_tier is not None:
        m.host_tier.CopyFrom(handle_to_pb(h.host_tier))
        m.host_tier_blocks = h.host_tier_blocks
    return m


def handle_from_pb(m: pb.PoolHandle) -> PoolHandle:
    cuda = None
    if m.HasField("cuda"):
        c = m.cuda
        cuda = CudaIpcHandle(c.device_uuid, c.device_index, c.handle, c.storage_bytes, c.storage_offset,
                             c.ref_counter_handle, c.ref_counter_offset, c.event_handle, c.event_sync_required)
    return PoolHandle(m.kind, m.nbytes, m.epoch, path=m.path, cuda=cuda, ranks=[handle_from_pb(r) for r in m.ranks],
                      host_tier=handle_from_pb(m.host_tier) if m.HasField("host_tier") else None,
                      host_tier_blocks=m.host_tier_blocks)


def plan_request_to_pb(r: PlanRequest) -> pb.PlanRequest:
    return pb.PlanRequest(
        new_seqs=[pb.NewSeq(seq_id=s.seq_id, token_ids=pack(s.token_ids), cache_salt=s.cache_salt)
                  for s in r.new_seqs],
        appended=pack_tuples(r.appended), commits=pack_tuples(r.commits), finished=pack(r.finished),
        running=pack(r.running), grows=pack_tuples(r.grows), waiting=pack_tuples(r.waiting),
        token_budget=r.token_budget, max_num_seqs=r.max_num_seqs, chunked_prefill=r.chunked_prefill,
        epoch=r.epoch, gateway_id=r.gateway_id, copies_done=r.copies_done,
        block_scores=_scores_to_pb(r.block_scores))


def plan_request_from_pb(m: pb.PlanRequest) -> PlanRequest:
    return PlanRequest(
        new_seqs=[NewSeq(s.seq_id, unpack(s.token_ids, "new_seqs.token_ids"),
                         s.cache_salt if s.HasField("cache_salt") else None) for s in m.new_seqs],
        appended=unpack_pairs(m.appended, "appended"), commits=unpack_pairs(m.commits, "commits"),
        finished=unpack(m.finished, "finished"), running=unpack(m.running, "running"),
        grows=unpack_triples(m.grows, "grows"), waiting=unpack_triples(m.waiting, "waiting"),
        token_budget=m.token_budget, max_num_seqs=m.max_num_seqs, chunked_prefill=m.chunked_prefill,
        epoch=m.epoch, gateway_id=m.gateway_id, copies_done=m.copies_done,
        block_scores=_scores_from_pb(m.block_scores))


def _scores_to_pb(scores: Sequence[tuple[int, list[float]]]) -> list[pb.BlockScores]:
    return [pb.BlockScores(seq_id=s, mass=mass) for s, mass in scores]


def _scores_from_pb(scores: Iterable[pb.BlockScores]) -> list[tuple[int, list[float]]]:
    return [(m.seq_id, list(m.mass)) for m in scores]


def _deltas_to_pb(deltas: Sequence[TableDelta]) -> list[pb.TableDelta]:
    return [pb.TableDelta(seq_id=d.seq_id, start=d.start, blocks=pack(d.blocks)) for d in deltas]


def _deltas_from_pb(deltas: Iterable[pb.TableDelta]) -> list[TableDelta]:
    return [TableDelta(d.seq_id, d.start, unpack(d.blocks, "tables.blocks")) for d in deltas]


def plan_reply_to_pb(r: PlanReply) -> pb.PlanReply:
    return pb.PlanReply(preempted=pack(r.preempted), admitted=pack_tuples(r.admitted), tables=_deltas_to_pb(r.tables),
                        used_blocks=r.used_blocks, copies=pack_tuples(r.copies), loaded=pack_tuples(r.loaded),
                        copy_seq=r.copy_seq, demotions=pack_tuples(r.demotions))


def plan_reply_from_pb(m: pb.PlanReply) -> PlanReply:
    return PlanReply(unpack(m.preempted, "preempted"), unpack_triples(m.admitted, "admitted"),
                     _deltas_from_pb(m.tables), m.used_blocks, unpack_triples(m.copies, "copies"),
                     unpack_quads(m.loaded, "loaded"), m.copy_seq, demotions=unpack_pairs(m.demotions, "demotions"))


def cache_stats_to_pb(s: CacheServiceStats) -> pb.CacheStats:
    return pb.CacheStats(**s)


def cache_stats_from_pb(m: pb.CacheStats) -> CacheServiceStats:
    out = CacheServiceStats(
        kv_cache_usage=m.kv_cache_usage, kv_blocks_total=m.kv_blocks_total, kv_blocks_free=m.kv_blocks_free,
        kv_blocks_cached=m.kv_blocks_cached, prefix_queries_tokens=m.prefix_queries_tokens,
        prefix_hits_tokens=m.prefix_hits_tokens, evictions_by_policy=dict(m.evictions_by_policy),
        eviction_policy=m.eviction_policy, recomputed_tokens=m.recomputed_tokens,
        cache_preemptions=m.cache_preemptions, num_seqs=m.num_seqs, epoch=m.epoch, attached_epoch=m.attached_epoch,
        plan_calls=m.plan_calls, sparsity_blocks_dropped=m.sparsity_blocks_dropped,
        sparsity_blocks_demoted=m.sparsity_blocks_demoted)
    if m.tier_capacity_blocks:  # lower tiers
        out["tier_hit_tokens"] = dict(m.tier_hit_tokens)
        out["tier_blocks"] = dict(m.tier_blocks)
        out["tier_capacity_blocks"] = dict(m.tier_capacity_blocks)
        out["tier_moved_blocks"] = dict(m.tier_moved_blocks)
        out["tier_moved_bytes"] = dict(m.tier_moved_bytes)
        out["tier_health"] = dict(m.tier_health)
    return out


def ghost_scores_to_pb(g: GhostScores) -> pb.GhostScores:
    return pb.GhostScores(hits=g.hits, queries=g.queries,
                          pair_sq=[pb.PairSq(a=a, b=b, sq=sq) for (a, b), sq in g.pair_sq.items()])


def ghost_scores_from_pb(m: pb.GhostScores) -> GhostScores:
    return GhostScores(dict(m.hits), m.queries, {(p.a, p.b): p.sq for p in m.pair_sq})


def ghost_window_to_pb(w: tuple[GhostScores, GhostScores] | None) -> pb.GhostWindowReply:
    if w is None:
        return pb.GhostWindowReply(empty=True)
    return pb.GhostWindowReply(window=ghost_scores_to_pb(w[0]), recent=ghost_scores_to_pb(w[1]))


def ghost_window_from_pb(m: pb.GhostWindowReply) -> tuple[GhostScores, GhostScores] | None:
    return None if m.empty else (ghost_scores_from_pb(m.window), ghost_scores_from_pb(m.recent))


# ---- compute service ----------------------------------------------------------------------------
def info_to_pb(i: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(name=i.name, vocab_size=i.vocab_size, eos_token_ids=i.eos_token_ids,
                        max_position_embeddings=i.max_position_embeddings, num_blocks=i.num_blocks,
                        block_size=i.block_size, device=i.device, dtype=i.dtype, model=i.model, epoch=i.epoch,
                        layer_bits=i.layer_bits, max_num_seqs=i.max_num_seqs,
                        max_num_batched_tokens=i.max_num_batched_tokens)


def info_from_pb(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(m.name, m.vocab_size, list(m.eos_token_ids), m.max_position_embeddings, m.num_blocks,
                     m.block_size, m.device, m.dtype, m.model if m.HasField("model") else None, m.epoch,
                     list(m.layer_bits), m.max_num_seqs, m.max_num_batched_tokens)


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
        max_tokens=p.max_tokens, stop=p.stop, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, include_stop_str_in_output=p.include_stop_str_in_output)


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Validated like any SamplingParams (RequestError names the field)."""
    return SamplingParams(
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None, max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
        stop=list(m.stop), stop_token_ids=list(m.stop_token_ids), ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        include_stop_str_in_output=m.include_stop_str_in_output)


def step_request_to_pb(r: StepRequest) -> pb.StepRequest:
    return pb.StepRequest(
        step_id=r.step_id, seq_ids=pack(r.seq_ids), num_computed=pack(r.num_computed), num_new=pack(r.num_new),
        num_prefills=r.num_prefills, tokens=pack(r.tokens), sample_rows=pack(r.sample_rows),
        tables=_deltas_to_pb(r.tables),
        new_seqs=[pb.SeqParams(seq_id=s, params=params_to_pb(p)) for s, p in r.new_seqs],
        finished=pack(r.finished), preempted=pack(r.preempted), epoch=r.epoch, gateway_id=r.gateway_id,
        copies=pack_tuples(r.copies), demotions=pack_tuples(r.demotions))


def step_request_from_pb(m: pb.StepRequest) -> StepRequest:
    r = StepRequest(
        m.step_id, unpack(m.seq_ids, "seq_ids"), unpack(m.num_computed, "num_computed"),
        unpack(m.num_new, "num_new"), m.num_prefills, unpack(m.tokens, "tokens"),
        unpack(m.sample_rows, "sample_rows"), _deltas_from_pb(m.tables),
        [(s.seq_id, params_from_pb(s.params)) for s in m.new_seqs],
        unpack(m.finished, "finished"), unpack(m.preempted, "preempted"), m.epoch, m.gateway_id,
        unpack_triples(m.copies, "copies"), demotions=unpack_pairs(m.demotions, "demotions"))
    B = len(r.seq_ids)
    if len(r.num_computed) != B or len(r.num_new) != B:
        raise ValueError(f"num_computed, num_new: one value per row of seq_ids ({B})")
    if any(n < 1 for n in r.num_new) or any(c < 0 for c in r.num_computed):
        raise ValueError("num_new: every row runs at least one token; num_computed: >= 0")
    if sum(r.num_new) != len(r.tokens):
        raise ValueError(f"tokens: {len(r.tokens)} given, num_new adds up to {sum(r.num_new)}")
    if not 0 <= r.num_prefills <= B or any(not 0 <= x < B for x in r.sample_rows):
        raise ValueError(f"num_prefills, sample_rows: row indices in [0, {B})")
    return r


def step_result_to_pb(r: StepResult) -> pb.StepResult:
    m = pb.StepResult(step_id=r.step_id, token_ids=pack(r.token_ids), forward_ns=r.forward_ns,
                      block_scores=_scores_to_pb(r.block_scores))
    if r.logprobs is not None:
        m.has_logprobs = True
        for lp in r.logprobs:
            m.logprob_rows.append(lp is not None)
            if lp is None:
                m.logprobs.add()
            else:
                m.logprobs.add(logprob=lp[0], top_ids=list(lp[1]), top_logprobs=list(lp[1].values()))
    return m


def step_result_from_pb(m: pb.StepResult) -> StepResult:
    lps: list[tuple[float, dict[int, float]] | None] | None = None
    if m.has_logprobs:
        lps = [(x.logprob, dict(zip(x.top_ids, x.top_logprobs))) if asked else None
               for x, asked in zip(m.logprobs, m.logprob_rows)]
    return StepResult(m.step_id, unpack(m.token_ids, "token_ids"), lps, m.forward_ns,
                      block_scores=_scores_from_pb(m.block_scores))


def compute_stats_to_pb(s: ComputeServiceStats) -> pb.ComputeStats:
    return pb.ComputeStats(compression_error={int(k): float(v) for k, v in s["compression_error"].items()},
                           compute_steps=s["compute_steps"], forward_s=s["forward_s"], num_seqs=s["num_seqs"],
                           epoch=s["epoch"], device_free_bytes=s["device_free_bytes"],
                           kv_bytes_per_block=s["kv_bytes_per_block"])


def compute_stats_from_pb(m: pb.ComputeStats) -> ComputeServiceStats:
    return ComputeServiceStats(
        compression_error=dict(sorted(m.compression_error.items())), compute_steps=m.compute_steps,
        forward_s=m.forward_s, num_seqs=m.num_seqs, epoch=m.epoch, device_free_bytes=m.device_free_bytes,
        kv_bytes_per_block=m.kv_bytes_per_block)


def probe_errors_to_pb(errors: dict[int, dict[int, float]]) -> pb.ProbeErrorsReply:
    return pb.ProbeErrorsReply(layers=[pb.LayerErrors(layer=i, rms_by_bits=e) for i, e in sorted(errors.items())])


def probe_errors_from_pb(m: pb.ProbeErrorsReply) -> dict[int, dict[int, float]]:
    return {e.layer: dict(e.rms_by_bits) for e in m.layers}

"""Block sparsity's fields on the wire: scores (float32, exact), INT4 copies, the settings the services
compare at attach and the cache service's config as a gateway reads it back; malformed ones name the field."""

from __future__ import annotations

import struct

import pytest

from nanokv.messages import PlanReply, PlanRequest, PoolTerms, StepRequest, StepResult
from nanokv.protos import codec
from nanokv.service_config import CacheConfig


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_sparsity_fields_round_trip():
    mass = [_f32(v) for v in (0.0, 1.5, 0.123456789, 3e-8)]  # what a float32 probe reports
    req = codec.plan_request_from_pb(codec.plan_request_to_pb(PlanRequest(block_scores=[(3, mass), (7, [])])))
    assert req.block_scores == [(3, mass), (7, [])]
    reply = codec.plan_reply_from_pb(codec.plan_reply_to_pb(PlanReply(demotions=[(5, 0), (9, 2)])))
    assert reply.demotions == [(5, 0), (9, 2)]
    step = codec.step_request_from_pb(codec.step_request_to_pb(StepRequest(4, demotions=[(5, 0)])))
    assert step.demotions == [(5, 0)]
    res = codec.step_result_from_pb(codec.step_result_to_pb(StepResult(4, [11], block_scores=[(3, mass)])))
    assert res.block_scores == [(3, mass)] and res.token_ids == [11]
    terms = codec.terms_from_pb(codec.terms_to_pb(PoolTerms(16, [8, 8], "m", sparsity="hybrid@0.5 (...)")))
    assert terms.sparsity == "hybrid@0.5 (...)"
    cfg = CacheConfig(compression_sparsity=0.25, sparsity_policy="interval", sparsity_options="recent_blocks=4")
    back, _ = codec.cache_info_from_pb(codec.cache_info_to_pb(cfg))
    assert (back.compression_sparsity, back.sparsity_policy, back.sparsity_options) == (0.25, "interval",
                                                                                        "recent_blocks=4")
    assert back.sparsity_params == cfg.sparsity_params
    assert codec.cache_info_from_pb(codec.cache_info_to_pb(CacheConfig()))[0].sparsity_params is None


def test_malformed_demotions_name_the_field():
    m = codec.plan_reply_to_pb(PlanReply())
    m.demotions = codec.pack([1, 2, 3])  # not whole (block, slot) pairs
    with pytest.raises(ValueError, match="demotions"):
        codec.plan_reply_from_pb(m)

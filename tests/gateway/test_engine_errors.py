"""Bad input: clear errors naming the field; a bad request fails alone and leaks no blocks."""

from __future__ import annotations

import pytest

from nanokv.config import EngineConfig
from nanokv.errors import ConfigError, NanoKVError, RequestError
from nanokv.sampling import SamplingParams


def test_unknown_config_key_named():
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(block_sise=16)
    assert e.value.field == "block_sise" and "block_size" in str(e.value)


@pytest.mark.parametrize("key,value,allowed", [
    ("block_size", 12, "power of two"),
    ("block_size", 512, "8 to 256"),
    ("eviction_policy", "mru", "lru, lru_k, clock"),
    ("gpu_memory_utilization", 1.5, "(0, 1]"),
    ("lru_k", 5, "between 2 and 3"),
    ("quantization_bitwidth", 3, "4, 8, 16"),
    ("compression_sparsity", 1.0, "[0, 1)"),
    ("max_num_seqs", 0, "between 1"),
])
def test_out_of_range_config_named(key, value, allowed):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**{key: value})
    assert e.value.field == key
    assert allowed in str(e.value)


@pytest.mark.parametrize("kwargs,expected", [
    ({}, 16),
    ({"enable_compression": True, "quantization_bitwidth": 8}, 16),
    ({"enable_compression": True, "quantization_bitwidth": 4}, 32),
    ({"enable_compression": True, "quantization_bitwidth": {"default": 8, "layers": {"3": 4}}}, 32),
    ({"enable_compression": False, "quantization_bitwidth": 4}, 16),
    ({"enable_compression": True, "quantization_bitwidth": 4, "block_size": 16}, 16),
    ({"block_size": 64}, 64),
])
def test_block_size_auto(kwargs, expected):
    """block_size 0 (the default) is 32 where any layer is stored in 4 bits, 16 otherwise; a given size stays."""
    assert EngineConfig.from_kwargs(**kwargs).block_size == expected


def test_block_size_bool_rejected():
    with pytest.raises(ConfigError, match="or 0 \\(auto\\)"):
        EngineConfig.from_kwargs(block_size=True)


def test_per_layer_bits_validated():
    cfg = EngineConfig.from_kwargs(enable_compression=True,
                                   quantization_bitwidth={"default": 4, "layers": {"0": 8, "-1": 8}})
    bits = cfg.layer_bits(30)
    assert bits[0] == 8 and bits[-1] == 8 and bits[1:-1] == [4] * 28
    with pytest.raises(ConfigError, match="layer 40 out of range"):
        cfg2 = EngineConfig.from_kwargs(enable_compression=True, quantization_bitwidth={"layers": {"40": 8}})
        cfg2.layer_bits(30)
    with pytest.raises(ConfigError, match="allowed bit widths"):
        EngineConfig.from_kwargs(quantization_bitwidth={"default": 4, "layers": {"1": 2}})


@pytest.mark.parametrize("kw,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kw, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_prompt_longer_than_context(llm):
    too_long = [100] * llm.engine.max_model_len
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("long", too_long, SamplingParams(max_tokens=1))
    assert e.value.field == "prompt" and str(llm.engine.max_model_len) in str(e.value)
    with pytest.raises(RequestError) as e2:
        llm.engine.add_request("long2", [100] * 10, SamplingParams(max_tokens=llm.engine.max_model_len))
    assert e2.value.field == "max_tokens"
    assert not llm.engine.has_unfinished_requests()


def test_bad_request_in_batch_fails_alone(llm, chat_ids):
    V = llm.engine.model_config.vocab_size
    prompts = [chat_ids[0], [V + 5, 1, 2], chat_ids[1], [], "Hello there"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].finish_reason == "error" and "prompt" in outs[1].error
    assert outs[3].finish_reason == "error"
    for i in (0, 2, 4):
        assert outs[i].error is None and len(outs[i].token_ids) >= 1
    cm = llm.engine.cache_manager
    assert cm.num_used_blocks() == 0
    assert cm.num_free_blocks() == cm.num_blocks


def test_abort_frees_blocks(llm, chat_ids):
    eng = llm.engine
    eng.add_request("a1", chat_ids[0], SamplingParams(max_tokens=50))
    eng.add_request("a2", chat_ids[1], SamplingParams(max_tokens=50))
    eng.step()
    assert eng.cache_manager.num_used_blocks() > 0
    eng.abort("a1")
    eng.abort("a2")
    eng.abort("never-existed")
    assert not eng.has_unfinished_requests()
    assert eng.cache_manager.num_used_blocks() == 0


def test_error_is_value_error_subclass():
    assert issubclass(NanoKVError, ValueError)

"""The memory hierarchy end to end (cache_service/tiers/serving.py): a tiny device pool (L1) above a
host tier (L2) gives the greedy tokens of HF transformers, and of a single-tier pool large enough
for everything, token for token, with preemption and chunked prefill, in one process and with the
services as three processes (L2 then lives in a shared-memory segment both map); the repeat round
is served from L2 (hits counted there, copies both ways); nothing stays pinned and no block leaks."""

from __future__ import annotations

import pytest

from nanokv.config import ConfigError, EngineConfig
from nanokv.gateway.llm import LLM
from nanokv.launch import start_services
from nanokv.sampling import SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * 16  # SmolLM2-135M, fp32 on the CPU, 16-token blocks: 737,280 bytes
# 12 L1 blocks cannot keep four ~40-token prompts and their answers: the first round preempts and
# evicts, the second round (the same prompts) finds its prefixes in L2, not L1
TIERED = dict(num_gpu_blocks=12, block_size=16, max_num_batched_tokens=48, max_num_seqs=4,
              eviction_policy="lru", cpu_offload_bytes=48 * BLOCK_BYTES)


@pytest.fixture(scope="module")
def reference(hf_model, chat_ids):
    return [hf_greedy(hf_model, ids, GREEDY.max_tokens) for ids in chat_ids[:4]]


def _two_rounds(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.token_ids for o in first + second]


def _check_tiers(stats: dict, rounds: list[list[int]], reference: list[list[int]]) -> None:
    assert rounds == reference + reference
    assert stats["tier_hit_tokens"]["L2"] > 0  # the second round's prefixes came back from L2
    moved = stats["tier_moved_blocks"]
    assert moved["L1->L2"] > 0 and moved["L2->L1"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every L1 block back
    assert stats["tier_blocks"]["L2"] <= stats["tier_capacity_blocks"]["L2"]


@pytest.fixture(scope="module")
def tiered_services():
    """One cache + compute process pair for both schedulings (the scheduling is the gateway's)."""
    with start_services(EngineConfig.from_kwargs(**TIERED).to_dict()) as svc:
        yield svc


def _since(before: dict, after: dict) -> dict:
    """`after` with the tier counters (which have no reset) counted from `before`, zeros left out."""
    out = dict(after)
    for key in ("tier_hit_tokens", "tier_moved_blocks"):
        out[key] = {k: v - before[key].get(k, 0) for k, v in after[key].items() if v != before[key].get(k, 0)}
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_host_tier_in_process_and_split_equal_hf(chat_ids, reference, tiered_services, async_scheduling):
    kw = dict(TIERED, async_scheduling=async_scheduling)
    prompts = chat_ids[:4]
    local = LLM(**kw)
    local_rounds = _two_rounds(local, prompts)
    local_stats = local.engine.cache.stats()
    assert local.engine.cache.tiers is not None and local.engine.cache.tiers.pinned() == 0
    _check_tiers(local_stats, local_rounds, reference)
    assert local.engine.stats()["preemptions"] > 0  # the tiny pool preempted: recomputed prefixes too
    svc = tiered_services
    split = LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address)
    # the pair may have served the other scheduling's gateway: nothing cached in L1 or L2, the
    # cache's counters at zero, the tier counters read as differences
    split.engine.cache.reset_prefix_cache(clear_stats=True)
    before = split.engine.cache.stats()
    split_rounds = _two_rounds(split, prompts)
    split_stats = _since(before, split.engine.cache.stats())
    split.engine.shutdown()
    _check_tiers(split_stats, split_rounds, reference)
    # one cache code behind both transports: the same moves
    assert split_stats["prefix_hits_tokens"] == local_stats["prefix_hits_tokens"]
    for key in ("tier_hit_tokens", "tier_moved_blocks"):
        assert split_stats[key] == {k: v for k, v in local_stats[key].items() if v}, key


def test_single_tier_reference_has_no_tier_stats(chat_ids, reference):
    # the same prompts on one large pool: the tokens the tiered runs must give, and no tier counters
    llm = LLM(num_gpu_blocks=64, block_size=16, max_num_batched_tokens=48, max_num_seqs=4)
    assert _two_rounds(llm, chat_ids[:4]) == reference + reference
    assert "tier_hit_tokens" not in llm.engine.cache.stats()


def test_per_request_tier_split_of_cached_tokens(chat_ids):
    # one request at a time: the five after the first push its blocks out of the 8 of L1 into L2
    llm = LLM(**dict(TIERED, num_gpu_blocks=8))
    for ids in chat_ids[:6]:
        llm.generate([ids], GREEDY, use_tqdm=False)
    again = llm.generate([chat_ids[0]], GREEDY, use_tqdm=False)[0]
    tiers = again.cached_tokens_by_tier
    assert tiers is not None and tiers["L2"] > 0 and tiers["L3"] == 0, tiers
    assert sum(tiers.values()) == again.num_cached_tokens
    assert again.num_cached_tokens >= len(chat_ids[0]) - 16  # all but the tail block came back
    # and Prometheus sees the tiers
    import re

    from nanokv.gateway.metrics import EngineMetrics

    metrics = EngineMetrics()
    metrics.update(llm.engine.stats())
    text = metrics.render().decode()
    l2_hits = re.search(r'^nanokv_tier_hit_tokens_total\{tier="L2"\} (\S+)$', text, re.M)
    assert l2_hits is not None and float(l2_hits.group(1)) >= tiers["L2"], text[-2000:]
    assert re.search(r'^nanokv_tier_moved_blocks_total\{dst="L2",src="L1"\} [1-9]', text, re.M), text[-2000:]
    assert 'nanokv_tier_capacity_blocks{tier="L1"} 8.0' in text
    moved = re.search(r'^nanokv_tier_moved_bytes_total\{dst="L1",src="L2"\} (\S+)$', text, re.M)
    l2_loads = re.search(r'^nanokv_tier_moved_blocks_total\{dst="L1",src="L2"\} (\S+)$', text, re.M)
    assert moved is not None and l2_loads is not None, text[-2000:]
    # bytes: the blocks at the L2 format's size (fp32 here: L1's own)
    assert float(moved.group(1)) == float(l2_loads.group(1)) * BLOCK_BYTES
    onload = re.search(r'^nanokv_tier_onload_seconds_count (\S+)$', text, re.M)
    assert onload is not None and float(onload.group(1)) >= 1, text[-2000:]


@pytest.mark.parametrize("kw, field", [
    (dict(cpu_offload_bytes=-1), "cpu_offload_bytes"),
    (dict(cpu_offload_policy="fifo"), "cpu_offload_policy"),
    (dict(disk_cache_dir="/nonexistent-nanokv", disk_cache_bytes=0), "disk_cache_bytes"),
    (dict(disk_cache_dir="x", disk_cache_bytes=1 << 20), "disk_cache_dir"),  # no L2 above it
    (dict(cpu_offload_bytes=1 << 20, enable_prefix_caching=False), "cpu_offload_bytes"),
])
def test_bad_tier_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**kw)
    assert e.value.field == field


def test_a_budget_holding_no_block_is_refused_at_attach():
    with pytest.raises(Exception, match="cpu_offload_bytes"):
        LLM(num_gpu_blocks=8, cpu_offload_bytes=1000)


def _disk_kw(tmp_path, **kw):
    # L1 8 blocks, L2 only 4: the first prompts' blocks go on down to the disk
    return dict(TIERED, num_gpu_blocks=8, cpu_offload_bytes=4 * BLOCK_BYTES + (1 << 16),
                disk_cache_dir=str(tmp_path / "kv"), disk_cache_bytes=64 * (BLOCK_BYTES + 8192), **kw)


@pytest.fixture(scope="module")
def plain_ids(llm):
    """Six prompts without the chat template: no block in common, so later ones push the first
    one's blocks out of L1 and L2 (the template's shared head would stay hot in L1)."""
    from tests.conftest import PROMPTS

    return [llm.engine._tokenize(" ".join([p] * 5)) for p in PROMPTS[:6]]


def test_disk_tier_serves_after_a_restart(hf_model, plain_ids, tmp_path):
    import stat

    kw = _disk_kw(tmp_path)
    cfg = EngineConfig.from_kwargs(**kw).to_dict()
    want = hf_greedy(hf_model, plain_ids[0], GREEDY.max_tokens)
    with start_services(cfg) as svc:
        llm = LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address)
        for ids in plain_ids:  # one at a time: each pushes the ones before down the tiers
            llm.generate([ids], GREEDY, use_tqdm=False)
        stats = llm.engine.cache.stats()
        llm.engine.shutdown()
    assert stats["tier_moved_blocks"].get("L2->L3", 0) > 0
    files = list((tmp_path / "kv").glob("*.kvb"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    # a fresh stack on the same directory: the first prompt's blocks come back from the disk
    with start_services(cfg) as svc:
        llm = LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address)
        out = llm.generate([plain_ids[0]], GREEDY, use_tqdm=False)[0]
        llm.engine.shutdown()
    assert out.token_ids == want
    assert out.cached_tokens_by_tier is not None and out.cached_tokens_by_tier["L3"] > 0, out.cached_tokens_by_tier


def test_disk_tier_drops_corrupt_and_foreign_files(hf_model, plain_ids, tmp_path):
    kw = _disk_kw(tmp_path)
    want = [hf_greedy(hf_model, ids, GREEDY.max_tokens) for ids in plain_ids[:2]]
    llm = LLM(**kw)
    for ids in plain_ids:
        llm.generate([ids], GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    files = sorted((tmp_path / "kv").glob("*.kvb"))
    assert len(files) >= 3
    for f in files[:-1]:  # every payload but one flipped: the checksum catches it at the read
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))
    files[-1].write_bytes(files[-1].read_bytes()[:100])  # truncated: the re-index drops it
    again = LLM(**kw)
    outs = again.generate(plain_ids[:2], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want  # never a wrong token from a bad file
    assert not files[-1].exists()
    st = again.engine.cache.stats()
    assert st["tier_hit_tokens"].get("L3", 0) == 0
    # each bad read is counted where Prometheus sees it (the log line is the store's warning)
    assert _metric(again, "nanokv_disk_tier_read_failed_total") >= 1
    assert _metric(again, "nanokv_disk_tier_admitting") == 1.0
    again.engine.shutdown()
    # a store of another KV format's fingerprint drops every file it finds at start-up
    survivors = list((tmp_path / "kv").glob("*.kvb"))
    other = LLM(**dict(kw, quantization_bitwidth=8, enable_compression=True))
    other.generate([plain_ids[0]], GREEDY, use_tqdm=False)
    assert all(not f.exists() for f in survivors)
    other.engine.shutdown()


def test_shared_tier_serves_another_replica(hf_model, plain_ids, tmp_path):
    """Two replicas (two engines) on one real Valkey/Redis server: what the first pushed out of its
    L2 the second loads instead of prefilling, with HF's greedy tokens; another tenant gets none of it;
    a dead server costs a request nothing but the hit."""
    from tests.helpers_valkey import Server, require_server

    server = Server(require_server(), tmp_path / "valkey", password="s3cret").start()
    try:
        kw = dict(TIERED, num_gpu_blocks=8, cpu_offload_bytes=4 * BLOCK_BYTES + (1 << 16),
                  remote_cache_url=server.url)
        a = LLM(**kw)
        for ids in plain_ids:  # one at a time: the first prompts' blocks leave L2 for the server
            a.generate([ids], GREEDY, use_tqdm=False)
        a.engine.shutdown()  # its writer offers every queued block first
        want = hf_greedy(hf_model, plain_ids[0], GREEDY.max_tokens)
        b = LLM(**kw)
        other = b.generate([plain_ids[0]], GREEDY, use_tqdm=False, cache_salt="tenant-b")[0]
        assert other.num_cached_tokens == 0  # another tenant's salt: no key in common
        out = b.generate([plain_ids[0]], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == want == other.token_ids
        assert out.cached_tokens_by_tier is not None and out.cached_tokens_by_tier["remote"] > 0, \
            out.cached_tokens_by_tier
        assert b.engine.cache.stats()["tier_hit_tokens"]["remote"] >= out.cached_tokens_by_tier["remote"]
        b.engine.shutdown()
    finally:
        server.stop()
    # the server is gone: a replica pointed at it serves, only without the shared hits
    c = LLM(**kw)
    t0 = __import__("time").monotonic()
    out = c.generate([plain_ids[0]], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == want and (out.cached_tokens_by_tier or {}).get("remote", 0) == 0
    assert __import__("time").monotonic() - t0 < 30
    assert _metric(c, "nanokv_remote_tier_available") == 0.0  # the metric says what the warning said
    c.engine.shutdown()


def _metric(llm: LLM, name: str) -> float:
    """One sample of the engine's Prometheus text, as /metrics renders it."""
    import re

    from nanokv.gateway.metrics import EngineMetrics

    metrics = EngineMetrics()
    metrics.update(llm.engine.stats())
    text = metrics.render().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m is not None, f"{name} not in\n{text[-3000:]}"
    return float(m.group(1))


def test_openai_usage_splits_cached_tokens_by_tier(chat_ids):
    """The OpenAI response's prompt_tokens_details carries the per-tier split."""
    import httpx

    from nanokv.gateway.http import build_app
    from nanokv.gateway.http.testing import serve_in_thread, shared_engine

    engine = shared_engine(**dict(TIERED, num_gpu_blocks=8))
    app = build_app(engine)
    with serve_in_thread(app) as url:
        body = {"model": engine.model_name, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        for ids in chat_ids[:6]:  # the first prompt's blocks go down to L2
            assert httpx.post(url + "/v1/completions", json=dict(body, prompt=ids), timeout=120).status_code == 200
        r = httpx.post(url + "/v1/completions", json=dict(body, prompt=chat_ids[0]), timeout=120).json()
        details = r["usage"]["prompt_tokens_details"]
        assert details["cached_tokens_by_tier"]["L2"] > 0, details
        assert sum(details["cached_tokens_by_tier"].values()) == details["cached_tokens"]

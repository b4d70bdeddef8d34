"""The shared KV tier end to end over TLS: two engines (two replicas) on one real Valkey/Redis server
that requires TLS, a client certificate and a password (tests/helpers_valkey.py). What the first
pushed out of its host tier the second loads from the server, with the first's greedy tokens; a
replica with the wrong password serves the same tokens, only without the shared hits."""

from __future__ import annotations

from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams
from tests.conftest import PROMPTS
from tests.helpers_valkey import Server, make_certs, require_tls

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * 16  # SmolLM2-135M, fp32 on the CPU, 16-token blocks
# 8 device blocks and 4 host blocks: six prompts of ~5 blocks push the first one's out of both, to the server
TIERED = dict(num_gpu_blocks=8, block_size=16, max_num_batched_tokens=48, max_num_seqs=4, eviction_policy="lru",
              cpu_offload_bytes=4 * BLOCK_BYTES + (1 << 16))


def test_shared_tier_over_mutual_tls_with_a_password(tmp_path):
    server = Server(require_tls(), tmp_path / "valkey", password="tls-pw", certs=make_certs(tmp_path / "certs"),
                    client_auth=True).start()
    try:
        assert server.url.startswith("rediss://") and "ssl_certfile=" in server.url
        a = LLM(**TIERED, remote_cache_url=server.url)
        prompts = [a.engine._tokenize(" ".join([p] * 5)) for p in PROMPTS[:6]]  # no block in common
        want = [a.generate([ids], GREEDY, use_tqdm=False)[0].token_ids for ids in prompts]  # one at a time
        a.engine.shutdown()  # its writer offers every queued block first
        b = LLM(**TIERED, remote_cache_url=server.url)
        out = b.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == want[0]
        assert out.cached_tokens_by_tier is not None and out.cached_tokens_by_tier["remote"] > 0, \
            out.cached_tokens_by_tier
        b.engine.shutdown()
        # the wrong password: every request served, none from the server (the store is skipped after
        # its first refusal: tests/cache_service/test_remote_store_tls.py)
        c = LLM(**TIERED, remote_cache_url=server.url.replace(":tls-pw@", ":wrong@"))
        out = c.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == want[0] and (out.cached_tokens_by_tier or {}).get("remote", 0) == 0
        c.engine.shutdown()
    finally:
        server.stop()

"""A Node.js client (@grpc/grpc-js + @grpc/proto-loader, tests/node/client.js) streams a generation
from a real `nanokv serve` and gets the same greedy tokens, text and usage as the Python client.

Runs wherever `node` and `npm` are on PATH; `npm ci` installs the locked packages into
tests/node/node_modules once (gitignored) and later runs reuse them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from nanokv.protos import nanokv_v1_pb2 as pb
from tests.helpers_grpc import KEY_A, ROOT, auth, collect, free_blocks_settle, shared_server

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
PROMPT = ("The three primary colours of paint are red, blue and yellow. Mixing red and yellow gives orange, "
          "and mixing red and blue gives")
MAX_TOKENS = 12

needs_node = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node and npm are not on PATH (the Node.js gRPC client test needs both)")


def node_modules() -> None:
    """`npm ci` unless node_modules already holds exactly what package-lock.json pins."""
    installed = NODE_DIR / "node_modules" / ".package-lock.json"
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())["packages"]
    if installed.exists():
        have = json.loads(installed.read_text())["packages"]
        if all(have.get(k, {}).get("version") == v.get("version") for k, v in lock.items() if k):
            return
    r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"npm ci failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def test_docs_show_the_client_the_test_runs():
    docs = (ROOT / "docs" / "grpc-api.md").read_text()
    block = docs.split("```javascript\n", 1)[1].split("```", 1)[0]
    assert block == (NODE_DIR / "client.js").read_text()


@needs_node
def test_node_client_streams_the_same_answer():
    node_modules()
    server = shared_server()
    with server.channel() as ch:
        stub = server.stub(ch)
        req = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        collect(stub.Generate(req, metadata=auth(), timeout=120))  # warms the prefix cache for both clients
        r = subprocess.run(["node", "client.js", server.grpc_address, str(ROOT / "protos"), PROMPT, str(MAX_TOKENS),
                            KEY_A], cwd=NODE_DIR, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        ids, text, last = collect(stub.Generate(req, metadata=auth(), timeout=120))  # the same cache state
        info = free_blocks_settle(stub)

    ok = got["ok"]
    assert got["model"] == "SmolLM2-135M-Instruct"
    assert ok["error"] is None and ok["token_ids"] == ids and ok["text"] == text
    assert ok["chunks"] == len(ids) and ok["finish_reason"] == last.finish_reason
    usage = {"prompt_tokens": last.usage.prompt_tokens, "completion_tokens": last.usage.completion_tokens,
             "cached_prompt_tokens": last.usage.cached_prompt_tokens,
             "cached_prompt_tokens_by_tier": dict(last.usage.cached_prompt_tokens_by_tier)}  # {}: no lower tiers
    assert ok["usage"] == usage and usage["cached_prompt_tokens"] >= 16  # a warm prefix, counted for Node too
    bad = got["bad"]
    assert bad["error"]["code"] == got["invalid_argument"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "sampling_params.top_p" in bad["error"]["details"] and "(0, 1]" in bad["error"]["details"]
    assert bad["chunks"] == 0
    assert info.num_running == 0 and info.kv_blocks_free == info.kv_blocks_total

"""Existing Triton clients work unchanged: `tritonclient.grpc` (PyPI) talks to a real `nanokv serve`.

The client runs in a subprocess (tests/helpers_tritonclient.py says why: its KServe stubs and
nanokv's cannot share one protobuf descriptor pool). Its answers are checked against the native
nanokv.v1 API of the same server: greedy, so the same tokens through either protocol.
"""

from __future__ import annotations

import json
import subprocess
import sys

from nanokv.protos import nanokv_v1_pb2 as pb
from tests.helpers_grpc import KEY_A, ROOT, auth, collect, free_blocks_settle

PROMPT = "Water boils at 100 degrees Celsius. Water freezes at"
MAX_TOKENS = 10


def test_tritonclient_live_ready_metadata_infer_and_stream(grpc_server):
    with grpc_server.channel() as ch:
        stub = grpc_server.stub(ch)
        req = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        ids, text, last = collect(stub.Generate(req, metadata=auth(), timeout=120))
        r = subprocess.run([sys.executable, "-m", "tests.helpers_tritonclient", grpc_server.grpc_address, KEY_A, PROMPT,
                            str(MAX_TOKENS)], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout)
        info = free_blocks_settle(stub)

    assert got["live"] is True and got["ready"] is True and got["model_ready"] is True
    nf = got["unknown_model_ready"]
    assert nf["status"] == "StatusCode.NOT_FOUND" and "no-such-model" in nf["message"]
    md = got["metadata"]
    assert md["name"] == "SmolLM2-135M-Instruct"
    assert [(t["name"], t["datatype"]) for t in md["inputs"]] == [("text_input", "BYTES")]
    assert [(t["name"], t["datatype"]) for t in md["outputs"]] == [("text_output", "BYTES"), ("output_ids", "INT32")]

    assert got["infer"] == {"text": text, "ids": ids, "finish_reason": last.finish_reason}

    chunks = got["stream"]
    assert all("error" not in c for c in chunks), chunks
    assert [c["final"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c["id"] == "stream-1" for c in chunks)
    assert sum((c["ids"] for c in chunks), []) == ids and "".join(c["text"] for c in chunks) == text
    assert len(chunks) == len(ids)  # one response per token
    assert info.num_running == 0 and info.kv_blocks_free == info.kv_blocks_total

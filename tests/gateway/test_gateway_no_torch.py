"""The gateway process never imports torch: it needs only grpcio, protobuf and a tokenizer. A fresh
interpreter starts the cache and compute services (their own processes import torch), generates
through them, and checks its own modules."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
from nanokv.gateway.llm import LLM
from nanokv.gateway.http.app import build_app  # the HTTP API the gateway serves
from nanokv.launch import start_services
from nanokv.sampling import SamplingParams

cfg = {"num_gpu_blocks": 64}
with start_services(dict(cfg)) as svc:
    llm = LLM(**cfg, cache_address=svc.cache_address, compute_address=svc.compute_address)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    build_app(llm.engine)
    llm.engine.shutdown()
mods = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"text": out[0].text, "torch": mods[:5]}))
"""


def test_gateway_process_never_imports_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in res["text"]
    assert res["torch"] == []

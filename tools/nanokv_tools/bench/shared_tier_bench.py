"""What the shared tier's bandwidth costs against a prefill: one KV block put to and got from a real
Valkey/Redis server through the cache service's own client (RemoteStore), beside the CPU prefill of
the same tokens by the embedded model.

    python -m nanokv_tools.bench.shared_tier_bench [--url redis://host:port/0] [--blocks 64] [--out r.json]

Without --url a throwaway valkey-server or redis-server is started on a free loopback port. Blocks are
the embedded model's (SmolLM2-135M: 30 layers, 3 KV heads of 64) at --block-size tokens and --dtype-bytes
per element (4: the CPU build's fp32). Gets go as the serving path sends them: --run blocks per round
trip (one admission's leading run, RemoteStore.get_many). The prefill is LLM.generate of --blocks x
--block-size distinct tokens with one output token, after a warm-up, prefix caching off.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

from nanokv_tools.bench import write_json

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M


def _server() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("valkey-server") or shutil.which("redis-server")
    if exe is None:
        raise SystemExit("no valkey-server or redis-server on PATH: pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", tempfile.mkdtemp(prefix="nanokv-valkey-"), "--maxmemory", "512mb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


def measure_store(url: str, blocks: int, payload_bytes: int, run: int) -> dict[str, float]:
    from nanokv.cache_service.tiers.remote_store import RemoteStore

    store = RemoteStore(url, "shared-tier-bench", timeout_s=5.0)
    hashes = [hashlib.sha256(f"bench-{os.getpid()}-{i}".encode()).digest() for i in range(blocks)]
    payload = os.urandom(payload_bytes)
    t0 = time.perf_counter()
    assert all(store.put(h, payload) for h in hashes), store.status
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = 0
    for i in range(0, blocks, run):
        got += sum(p is not None for p in store.get_many(hashes[i:i + run]))
    get_s = time.perf_counter() - t0
    assert got == blocks, f"{got} of {blocks} blocks came back"
    store.close()
    mb = blocks * payload_bytes / 1e6
    return {"payload_bytes": payload_bytes, "put_ms_per_block": 1e3 * put_s / blocks, "put_MBps": mb / put_s,
            "get_ms_per_block": 1e3 * get_s / blocks, "get_MBps": mb / get_s}


def measure_prefill(tokens: int, block_size: int) -> float:
    """Seconds of one CPU prefill of `tokens` distinct tokens (the second of two: the first warms up)."""
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    llm = LLM(device="cpu", dtype="float32", block_size=block_size, enable_prefix_caching=False,
              max_num_batched_tokens=max(tokens, 4096))
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for k in range(2):
        ids = [(1000 + 7 * i + k) % 40000 + 100 for i in range(tokens)]
        t0 = time.perf_counter()
        llm.generate([ids], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    llm.engine.shutdown()
    return times[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--dtype-bytes", type=int, default=4, help="bytes per KV element (4: fp32 on the CPU)")
    ap.add_argument("--run", type=int, default=8, help="blocks per get round trip")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in ("blocks", "block_size", "dtype_bytes", "run"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: got {getattr(a, name)}; must be >= 1")
    payload = LAYERS * 2 * KV_HEADS * HEAD_DIM * a.block_size * a.dtype_bytes
    proc, url = (None, a.url) if a.url else _server()
    try:
        res = measure_store(url, a.blocks, payload, a.run)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    prefill_s = measure_prefill(a.blocks * a.block_size, a.block_size)
    res["prefill_ms_per_block"] = 1e3 * prefill_s / a.blocks
    res["get_vs_prefill"] = res["get_ms_per_block"] / res["prefill_ms_per_block"]
    res.update(blocks=a.blocks, block_size=a.block_size, run=a.run)
    for k, v in res.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The memory hierarchy on the GPU: onload bandwidth against pinned copies, then a multi-turn workload
served with L1 only, L1+L2 and L1+L2+L3, side by side in one run (docs/hierarchy.md).

    python -m nanokv_tools.bench.gpu_tiers --out out/tiers.json [--model random:llama3-8b]

1. Bandwidth: N blocks of the model's bf16 KV layout go host tier -> device pool through the very copy
   path the compute service runs (runner/tier_copies.run_copies), against one pinned host-to-device
   copy of the same bytes (the link's practical ceiling, measured in the same process).
2. Serving: for each tier configuration, `nanokv serve` (or `nanokv up`: --launch-command up) starts
   on the same random-weight model with the same small device pool, and `nanokv bench serve` replays
   the same closed-loop multi-turn chat workload at a fixed request rate; TTFT, TPOT, output tok/s and
   the prefix hit ratio come from its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any


def bandwidth(model: str, blocks: int, block_size: int = 16, tier_format: str = "pool",
              device: str = "cuda") -> dict[str, Any]:
    """Loads and write-backs of `blocks` scattered blocks between a bf16 pool and a host tier in
    `tier_format` (pool: bytes copied, checked exactly; int8 / int4: re-quantized on the way, timed only),
    and one pinned host-to-device copy of the tier's bytes (CUDA only)."""
    import torch

    from nanokv.compute_service.model.config import ModelConfig
    from nanokv.compute_service.runner.tier_copies import HostTier, run_copies
    from nanokv.kv.segment import carve_layer_caches, pool_nbytes
    from nanokv.kv.tier_transcode import tier_layer_bits
    from nanokv.messages import COPY_LOAD, COPY_SAVE, PoolHandle, PoolLayout

    mc = ModelConfig.preset(model.removeprefix("random:"))
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    layout = PoolLayout(blocks, block_size, mc.num_key_value_heads, mc.head_dim, [16] * mc.num_hidden_layers,
                        "bfloat16", 0, device)
    l1 = carve_layer_caches(layout, torch.zeros(pool_nbytes(layout), dtype=torch.uint8, device=dev))
    host = dict(layout.__dict__, device="cpu", layer_bits=tier_layer_bits(layout.layer_bits, tier_format))
    hbuf = torch.randint(0, 256, (pool_nbytes(PoolLayout(**host)),), dtype=torch.uint8)
    same = tier_format == "pool"
    handle = PoolHandle("local", 0, 1, buffer=None, host_tier=PoolHandle("local", hbuf.numel(), 1, buffer=hbuf),
                        host_tier_blocks=blocks)
    l2 = HostTier(handle, layout, dev)
    if not same:  # random bytes are not valid scales: finite ones, so the decode does real arithmetic
        for h in l2.caches:
            for f in h.block_fields:
                t = getattr(h, f)
                if t.is_floating_point():
                    t.copy_(torch.rand(t.shape, dtype=torch.float32).to(t.dtype))
    copies = [(COPY_LOAD, b, (b * 7) % blocks) for b in range(blocks)]  # scattered slots, like a real hit
    saves = [(COPY_SAVE, (b * 5) % blocks, b) for b in range(blocks)]
    nbytes = hbuf.numel()
    reps = 5

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(batch: list[tuple[int, int, int]]) -> float:
        run_copies(batch, l1, l2, blocks)
        l2.flush()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            run_copies(batch, l1, l2, blocks)
        l2.flush()
        sync()
        return (time.perf_counter() - t0) / reps

    tier_s = timed(copies)
    exact: bool | None = None  # (re-quantized blocks are not bytes to compare)
    src = torch.tensor([(b * 7) % blocks for b in range(blocks)])
    if same:  # the loads put slot (b*7)%n into block b: check every tensor's bytes before timing the saves
        exact = all(torch.equal(getattr(d, f).view(torch.uint8).cpu(), getattr(h, f)[src].view(torch.uint8))
                    for d, h in zip(l1, l2.caches) for f in d.block_fields)
    save_s = timed(saves)
    back = torch.tensor([(b * 5) % blocks for b in range(blocks)])
    if same:
        exact = exact and all(torch.equal(getattr(h, f).view(torch.uint8),
                                          getattr(d, f)[back].view(torch.uint8).cpu())
                              for d, h in zip(l1, l2.caches) for f in d.block_fields)
    device_access = l2.device_access
    out: dict[str, Any] = {"tier_format": tier_format, "blocks": blocks, "bytes": nbytes,
                           "onload_GBps": nbytes / tier_s / 1e9, "writeback_GBps": nbytes / save_s / 1e9,
                           "onload_ms": 1e3 * tier_s, "writeback_ms": 1e3 * save_s, "bytes_exact": exact,
                           "in_place_kernel": device_access}
    if not cuda:
        l2.close()
        return out
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    pinned_s = (time.perf_counter() - t0) / reps
    l2.close()
    out["pinned_h2d_GBps"] = nbytes / pinned_s / 1e9
    out["onload_vs_pinned"] = out["onload_GBps"] / out["pinned_h2d_GBps"]
    return out


CONFIGS: dict[str, str] = {
    "L1": "",
    "L1+L2": "--cpu-offload-bytes {l2}",
    "L1+L2(int8)": "--cpu-offload-bytes {l2} --cpu-offload-kv-format int8",
    "L1+L2+L3": "--cpu-offload-bytes {l3_l2} --disk-cache-dir {dir} --disk-cache-bytes {l3}",
}


SUMMARY_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput",
                "prefix_hit_ratio", "completed", "failed", "duration")


def chat_bench_args(args: argparse.Namespace, path: str) -> list[str]:
    """`nanokv bench serve`'s flags for the multi-turn chat workload these GPU benches replay."""
    return ["--workload", "chat", "--chat-turns", str(args.turns), "--chat-systems", str(args.systems),
            "--chat-system-len", str(args.system_len), "--chat-user-len", str(args.user_len),
            "--random-output-len", str(args.output_len), "--max-output-tokens", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rates", str(args.rate),
            "--token-range", args.token_range, "--out", path, "--no-plot"]


def read_summaries(path: str) -> list[dict[str, Any]]:
    """Each rate's summary figures of a `nanokv bench serve` JSON, in run order ([] if it wrote none),
    with the TTFT p50 of the requests that found at least half their prompt cached and of the rest."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        runs = json.load(f)["runs"]
    rows = []
    for r in runs:
        row = {"rate": r.get("label"), **{k: r["summary"][k] for k in SUMMARY_KEYS if k in r["summary"]}}
        reqs = [q for q in r.get("requests", []) if q.get("success")]
        for name, keep in (("hits", lambda q: 2 * q["cached_tokens"] >= q["prompt_tokens"]),
                           ("misses", lambda q: 2 * q["cached_tokens"] < q["prompt_tokens"])):
            ttfts = sorted(q["ttft_s"] * 1e3 for q in reqs if keep(q))
            row[f"{name}"] = len(ttfts)
            if ttfts:
                row[f"median_ttft_ms_{name}"] = ttfts[len(ttfts) // 2]
        rows.append(row)
    return rows


def read_summary(path: str) -> dict[str, Any]:
    """The first rate's summary figures ({} if the run wrote none)."""
    rows = read_summaries(path)
    return rows[0] if rows else {}


def serve(args: argparse.Namespace, name: str, extra: str, out_dir: str, command: str) -> list[dict[str, Any]]:
    label = name if command == "serve" else f"{name} ({command})"
    path = os.path.join(out_dir, f"serve_{name.replace('+', '_').replace('(', '_').replace(')', '')}_{command}.json")
    server = (f"--model {args.model} --num-gpu-blocks {args.l1_blocks} --max-num-seqs {args.max_num_seqs} "
              f"{args.server_args} {extra}")
    # nanokv.v1 gRPC: its chunks carry token ids (a model without a tokenizer streams no OpenAI text)
    cmd = [sys.executable, "-m", "nanokv_tools.bench.serve", "--launch", "--launch-command", command,
           "--backend", "grpc", "--launch-args", server, *chat_bench_args(args, path)]
    print("===", label, shlex.join(cmd), flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd)
    print(f"=== {label} rc={rc} {time.monotonic() - t0:.0f}s", flush=True)
    rows = read_summaries(path) or [{}]
    return [{"config": label, "rc": rc, **row} for row in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--out", default="tiers.json")
    p.add_argument("--bandwidth-blocks", type=int, default=512)
    p.add_argument("--l1-blocks", type=int, default=1536, help="the device pool, in 16-token blocks")
    p.add_argument("--l2-gib", type=float, default=24.0)
    p.add_argument("--l3-gib", type=float, default=16.0, help="the disk tier (with an L2 of half --l2-gib)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--rate", default="4", help="request rates, comma-separated: each is a run of its own "
                   "(fresh prompt content) against the same server")
    p.add_argument("--server-args", default="", help="more `nanokv serve` flags for every configuration")
    p.add_argument("--systems", type=int, default=4, help="system prompts the conversations share")
    p.add_argument("--configs", default=",".join(CONFIGS), help="served in one process (nanokv serve)")
    p.add_argument("--up-configs", default="", help="served by the three services (nanokv up)")
    p.add_argument("--token-range", default="1000:120000", help="LO:HI token ids (within the vocabulary)")
    p.add_argument("--skip-bandwidth", action="store_true")
    p.add_argument("--bandwidth-formats", default="pool",
                   help="host tier formats of the bandwidth section, comma-separated (pool, int8, int4): int8 and "
                        "int4 time the re-quantizing loads and write-backs")
    args = p.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args)}
    from nanokv.kv.tier_transcode import TIER_FORMAT_BITS  # (torch: imported where it is used, as in bandwidth)

    formats = [f for f in args.bandwidth_formats.split(",") if f]
    bad = [f for f in formats if f not in TIER_FORMAT_BITS]
    if bad:
        p.error(f"--bandwidth-formats: {bad}; allowed: {', '.join(TIER_FORMAT_BITS)}")
    if not args.skip_bandwidth:
        rows = [bandwidth(args.model, args.bandwidth_blocks, tier_format=f) for f in formats]
        result["bandwidth"] = rows[0] if len(rows) == 1 else rows
        for row in rows:
            print("bandwidth", json.dumps(row), flush=True)
    gib = 1 << 30
    with tempfile.TemporaryDirectory(prefix="nanokv-l3-") as d:
        fill = {"l2": int(args.l2_gib * gib), "l3_l2": int(args.l2_gib * gib / 2), "l3": int(args.l3_gib * gib),
                "dir": d}
        runs = [(n, "serve") for n in args.configs.split(",") if n]
        runs += [(n, "up") for n in args.up_configs.split(",") if n]
        result["serve"] = []
        for name, command in runs:
            result["serve"] += serve(args, name, CONFIGS[name].format(**fill), out_dir, command)
            write(args.out, result)  # a run cut short by a time limit still leaves every finished row
    for r in result["serve"]:
        base = next((b for b in result["serve"] if b["config"] == "L1" and b.get("rate") == r.get("rate")
                     and b.get("median_ttft_ms")), None)
        if base is not None and r.get("median_ttft_ms"):
            r["ttft_p50_speedup_vs_L1"] = base["median_ttft_ms"] / r["median_ttft_ms"]
            r["output_tok_s_vs_L1"] = r["output_throughput"] / base["output_throughput"]
        same = next((b for b in result["serve"] if b["config"] == r["config"].removesuffix(" (up)")
                     and b.get("rate") == r.get("rate")), None)
        split = r["config"].endswith(" (up)")
        if split and same is not None and same.get("median_ttft_ms") and r.get("median_ttft_ms"):
            r["ttft_p50_in_process_over_split"] = same["median_ttft_ms"] / r["median_ttft_ms"]
        print(json.dumps(r), flush=True)
    write(args.out, result)
    return 0


def write(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())

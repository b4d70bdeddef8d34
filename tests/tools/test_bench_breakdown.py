"""run_breakdown's accounting (a GPU benchmark; its arithmetic is checked here on made-up kernel
intervals): kernel kinds by name, device idle split at the last prefill kernel, busy fractions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from nanokv_tools.bench.run_breakdown import decode_kv_bytes, idle_profile, kind_of, largest_gaps


def _prof(spans):
    evs = [SimpleNamespace(time_range=SimpleNamespace(start=s, end=e), device_type=SimpleNamespace(name=d), name=n)
           for s, e, n, d in spans]
    return SimpleNamespace(events=lambda: evs)


@pytest.mark.parametrize("name,kind", [
    ("_decode_kernel", "decode_attention"), ("decode_int4_kernel", "decode_attention"),
    ("_reduce_kernel", "decode_attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "prefill_attention"),
    ("_prefill_kernel", "prefill_attention"), ("nvjet_sm90_tst_192x192_64x4", "matmul"),
    ("_readback_kernel", "prefill_attention"), ("_store_kernel", "kv_write"), ("_fill_quant_kernel", "kv_write"),
    ("triton_poi_fused_mul_silu_split_0", "other"),
])
def test_kernel_kinds(name, kind):
    assert kind_of(name) == kind


def test_idle_split_at_the_last_prefill_kernel_and_busy_fractions():
    # us: flash 0-100, gap 50, flash 150-300, gemm 300-400, gap 100, decode 500-1000 with an
    # overlapping kernel 900-950 (counted once), and a CPU event that must be ignored
    prof = _prof([(0, 100, "flash_fwd", "CUDA"), (150, 300, "flash_fwd", "CUDA"), (300, 400, "nvjet", "CUDA"),
                  (500, 1000, "_decode_kernel", "CUDA"), (900, 950, "x", "CUDA"), (0, 1000, "aten::mm", "CPU")])
    r = idle_profile(prof, windows=4)
    assert r["prefill_phase_s"] == pytest.approx(50e-6) and r["decode_phase_s"] == pytest.approx(100e-6)
    assert r["prefill_phase_end_s"] == pytest.approx(150e-6)
    assert r["busy_fraction_per_window"] == [0.8, 0.6, 1.0, 1.0]


def test_decode_kv_bytes_counts_prompt_plus_generated_tokens_per_step():
    # 2 steps over a 3-token prompt read 3 + 4 tokens; 1 step over 5 tokens reads 5
    assert decode_kv_bytes([[0] * 3, [0] * 5], [2, 1], 10) == (3 + 4 + 5) * 10


def test_largest_gaps_name_the_kernels_around_them_and_the_host_ops_inside():
    # gaps: 50 us after the first flash, 100 us before decode (overlapping kernels counted once);
    # host: a copy fully inside the long gap, a launch overlapping it by 30 us, one op outside both
    prof = _prof([(0, 100, "flash_fwd", "CUDA"), (150, 300, "flash_fwd", "CUDA"), (300, 400, "nvjet", "CUDA"),
                  (350, 380, "small", "CUDA"), (500, 1000, "_decode_kernel", "CUDA"),
                  (410, 470, "aten::copy_", "CPU"), (470, 530, "cudaLaunchKernel", "CPU"),
                  (600, 700, "aten::mm", "CPU")])
    g = largest_gaps(prof, n=5)
    assert [x["idle_s"] for x in g] == [pytest.approx(100e-6), pytest.approx(50e-6)]
    assert g[0]["at_s"] == pytest.approx(400e-6) and (g[0]["before"], g[0]["after"]) == ("nvjet", "_decode_kernel")
    assert g[0]["host"] == [("aten::copy_", pytest.approx(60e-6)), ("cudaLaunchKernel", pytest.approx(30e-6))]
    assert (g[1]["before"], g[1]["after"], g[1]["host"]) == ("flash_fwd", "flash_fwd", [])
    assert largest_gaps(_prof([]), n=3) == []

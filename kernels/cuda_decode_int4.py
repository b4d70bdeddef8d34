"""The int4 paged decode as a CUDA C++ kernel (cuda/decode_int4.cu), compiled at run time by NVRTC.

Why not Triton here: the transposed int4 kernel (triton_decode_swap4) spends its registers on what
Triton's layouts impose (the per-tile scaled query replicated in the B-operand layout, a shared-memory
round trip per tile) and runs ~500 instructions per 16-token tile. Written against the MMA fragments,
every code word goes from one global load into operand registers, and the bias q . z comes out of
the tensor cores from the zero row as loaded (docs/kernels.md, "The int4 decode").

It computes what triton_decode_swap4 computes (same folds, same staging, same split merge with the
same scratch and counters) for the layouts the engine allocates: head dim 128, at most 8 query heads
per KV head, block size a multiple of 16, contiguous cache tensors. `supported` says when it applies;
everywhere else (on CPU, where torch lacks its NVRTC hook or NVRTC fails) the Triton kernels run;
TritonConfig.quant_cuda4 turns it off. Beyond the Triton kernel it can also quantize the blocks a
decode step completes (fill_slots, cuda/fill_int4.cuh) and start its programs longest sequence first
(order). There is no interpreter for it: CI builds it with nvcc where
nvcc exists (tests/kernels/test_kernels_compile_sm90.py: no spills), and tests/kernels/test_kernels_cuda.py checks it
against the torch reference on a GPU.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from nanokv.kv.cache import Int4KV, LayerKV

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("cuda") / "decode_int4.cu"
_16BIT = (torch.float16, torch.bfloat16)
_BROKEN: list[str] = []  # why NVRTC failed, once: the Triton kernels serve from then on


def supported(q: torch.Tensor, out: torch.Tensor, cache: LayerKV) -> bool:
    """Whether the CUDA kernel can serve this decode: int4 cache in the engine's layouts, 16-bit q and out."""
    if (q.device.type != "cuda" or not hasattr(torch.cuda, "_compile_kernel") or not isinstance(cache, Int4KV)
            or _BROKEN):
        return False
    _, Hq, D = q.shape
    H, bs = cache.num_kv_heads, cache.block_size
    tensors = (cache.k, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero, cache.k_stage, cache.v_stage)
    return (D == 128 and Hq % H == 0 and Hq // H <= 8 and bs % 16 == 0 and q.dtype in _16BIT and out.dtype in _16BIT
            and cache.k_stage.dtype in _16BIT and q.stride(-1) == 1 and out.stride(-1) == 1
            and all(t.is_contiguous() for t in tensors)
            and cache.v.stride(2) == 1 and cache.v.stride(3) == bs and cache.v.transpose(2, 3).is_contiguous())


def source() -> str:
    """decode_int4.cu with its local `#include "x.cuh"` lines replaced by the files (NVRTC is handed
    a string, so it has no folder to search; nvcc builds the file as it is)."""
    out = []
    for line in _SOURCE.read_text().splitlines():
        name = line.removeprefix('#include "').removesuffix('"')
        out.append((_SOURCE.parent / name).read_text() if line.startswith('#include "') else line)
    return "\n".join(out) + "\n"


@cache
def _kernel(G: int, H: int, bs: int, q_bf16: bool, st_bf16: bool, out_bf16: bool, maxnreg: int, stages: int,
            tiles: int = 1):
    """The compiled kernel for one configuration (NVRTC, PTX loaded by the driver; ~0.3 s each)."""
    defs = dict(G=G, NKV=H, BS=bs, Q_BF16=int(q_bf16), ST_BF16=int(st_bf16), OUT_BF16=int(out_bf16),
                MAXNREG=maxnreg, NSTAGE=stages, NT=tiles)
    opts = [f"-D{k}={v}" for k, v in defs.items()]
    try:
        kern = torch.cuda._compile_kernel(source(), "nanokv_decode_int4", nvcc_options=opts)
    except Exception as e:  # no NVRTC library, it rejected the source, or torch's private hook changed
        _BROKEN.append(str(e))
        log.warning("CUDA int4 decode unavailable (%s); using the Triton kernels", e)
        return None
    BUILT[", ".join(f"{k} {v}" for k, v in defs.items())] = kern
    return kern


BUILT: dict[str, object] = {}  # every configuration compiled in this process (for the probes' reports)


def programs_per_sm(kern) -> int:
    """How many of the kernel's one-warp programs fit on one SM at once (the driver's occupancy
    calculator: registers, shared memory, program limits)."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    n = ctypes.c_int(0)
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), kern.func, 32, ctypes.c_size_t(0))
    return n.value


class _Launcher:
    """cuLaunchKernel with its argument array built once per kernel. torch's launcher
    (`_compile_kernel`'s callable) makes a ctypes object per argument, a new array type and a cast
    per argument at every call (~27 arguments here): in a prefill step's decode rows, eager, that is
    host time per layer, which counts wherever the host sets the pace (a first run's prefill steps;
    docs/kernels.md, "Host time").
    Here each argument has a fixed ctypes cell whose address the array holds; a call only stores the
    values (cuLaunchKernel copies them at the launch, so graph capture records them as well)."""

    def __init__(self, kern, args: list) -> None:
        self.func = kern.func
        self.lib = torch.cuda._utils._get_gpu_runtime_library()
        kinds = (ctypes.c_void_p if isinstance(a, torch.Tensor) else ctypes.c_double if isinstance(a, float)
                 else ctypes.c_int for a in args)
        self.cells = [k() for k in kinds]
        self.argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(c) for c in self.cells))
        self.kinds = [type(a) for a in args]

    def __call__(self, grid: tuple[int, int, int], args: list) -> None:
        if [type(a) for a in args] != self.kinds:
            raise TypeError("argument kinds changed between launches")
        for cell, a in zip(self.cells, args):
            cell.value = a.data_ptr() if isinstance(a, torch.Tensor) else a
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc = self.lib.cuLaunchKernel(self.func, grid[0], grid[1], grid[2], 32, 1, 1, 0, stream, self.argv, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {rc}")


_LAUNCHERS: dict[int, _Launcher] = {}


def _launch(kern, grid: tuple[int, int, int], args: list, direct: bool) -> None:
    """Launch with one warp per program: through _Launcher (direct) or torch's launcher."""
    if direct and hasattr(kern, "func"):
        fast = _LAUNCHERS.get(id(kern))
        if fast is None:
            fast = _LAUNCHERS[id(kern)] = _Launcher(kern, args)
        fast(grid, args)
    else:
        kern(grid=grid, block=(32, 1, 1), args=args)


def try_decode(q: torch.Tensor, cache: Int4KV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               out: torch.Tensor, qk_scale: float, num_splits: int, part_o: torch.Tensor, part_ml: torch.Tensor,
               counts: torch.Tensor, maxnreg: int = 0, stages: int = 2,
               fill_slots: torch.Tensor | None = None, order: torch.Tensor | None = None, tiles: int = 1,
               direct_launch: bool = True) -> bool:
    """As triton_decode.paged_decode for an int4 cache, if `supported` accepts it and NVRTC builds the
    kernel: q [B, Hq, 128], block_tables [B, max_blocks] int32, seq_lens [B] int32, out [B, Hq, 128]
    written in place; qk_scale: the softmax scale times log2(e) (the kernels' softmax is base 2).
    part_o / part_ml / counts: paged_decode's split scratch and merge counters (unused at one split;
    counts zero between launches). maxnreg: register cap (0 = none); stages: depth of the
    shared-memory ring the tiles stream through (cp.async, stages - 1 tiles ahead). fill_slots:
    [B] int64, this step's slot of each row's token (-1 = none): the block a token completes is
    quantized from staging into the pool by the same launch (cuda/fill_int4.cuh). order: [B] int64,
    the rows longest first (argsort of seq_lens, descending): the programs of longer sequences start
    first. tiles: 16-token tiles per loop step (sharing the block's key scales; fewer where the block
    is smaller). direct_launch: through _Launcher, else torch's launcher. True when it launched (and
    so filled, given fill_slots); False (nothing launched) where it does not apply."""
    if not supported(q, out, cache):
        return False
    B, Hq, _ = q.shape
    H = cache.num_kv_heads
    nt = max(1, tiles)
    while cache.block_size % (16 * nt):
        nt //= 2
    kern = _kernel(Hq // H, H, cache.block_size, q.dtype == torch.bfloat16, cache.k_stage.dtype == torch.bfloat16,
                   out.dtype == torch.bfloat16, maxnreg, stages, nt)
    if kern is None:
        return False
    args = [q, cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero, cache.k_stage,
            cache.v_stage, cache.stage.stage_of, block_tables, seq_lens, out, part_o, part_ml, counts,
            float(qk_scale), int(num_splits), q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), block_tables.stride(0), int(fill_slots is not None),
            seq_lens if fill_slots is None else fill_slots,  # (an unread tensor where there is none)
            int(order is not None), seq_lens if order is None else order]
    for name, t in (("fill_slots", fill_slots), ("order", order)):
        if t is not None and (t.dtype != torch.int64 or t.shape[0] != B):
            raise ValueError(f"{name} must be int64, one per row: got {t.dtype} {tuple(t.shape)} for {B} rows")
    _launch(kern, (B, H, num_splits) if order is None else (num_splits, H, B), args, direct_launch)
    return True

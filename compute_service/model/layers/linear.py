"""Tensor-parallel linear layers (weights [out, in], as torch and HF store them).

Every Parameter carries `weight_loader(param, full_tensor, shard_id=None)`: the loader hands it
the *full* checkpoint tensor and the layer copies out this rank's slice, so the same loading code
serves tp 1 and tp N. Column-parallel layers split the output dim (no communication); row-parallel
layers split the input dim and all-reduce their partial sums.

A full tensor may also be a GGUF 4-bit matrix (qlinear.Q4Rows, weight_quantization="gguf"): the same
loader places it in the layer's Q4Rows and, dequantized, in its weight; pack_weights() then gives a
layer whose every shard came in 4 bits torch's packed int4 product for small batches (int4_rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.compute_service.distributed import all_reduce, get_tp_rank, get_tp_size, head_ranges
from nanokv.compute_service.model.layers.qlinear import Int4Linear, Q4Rows
from nanokv.errors import NanoKVError
from nanokv.kv.metadata import current_context

WeightLoader = Callable[..., None]
_CPU_PANEL_ROWS = 768  # output rows per sgemm for small CPU batches (MergedColumnParallelLinear.forward)


def invariant_rows(m: int) -> int:
    """Rows a CPU matmul of m rows is padded to (batch_invariant) so that each row's result is the
    one it gets in a matmul of any number of rows. Measured (MKL sgemm, one thread, SmolLM2's
    shapes, 1 to 2076 rows): on one of this project's CPUs 4, 8 and 12 or more rows give the same
    bits, on another (AVX-512 with FP16) 16 or more do, 2-15 another and 1 a third.
    tests/kernels/test_batch_invariant.py checks it on the machine it runs on."""
    return max(m, 16)


def _invariant(x: torch.Tensor) -> bool:
    ctx = current_context()
    return ctx is not None and ctx.batch_invariant and x.device.type == "cpu" and x.dim() == 2


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [m, in] with zero rows appended up to invariant_rows(m) when the forward in progress is
    batch-invariant (the engine's batch_invariant, CPU only)."""
    if not _invariant(x):
        return x
    r = invariant_rows(x.shape[0])
    return x if r == x.shape[0] else torch.cat([x, x.new_zeros(r - x.shape[0], x.shape[1])])


@contextmanager
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# (rows, out, in, dtype, bias, threads) -> whether MKL's multi-threaded product gave the one-thread bits
_THREADS_AGREE: dict[tuple, bool] = {}


def invariant_sgemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the bits of one thread. With two threads MKL splits the sum over `in` between
    them for some shapes (the AVX-512 FP16 CPU: the 1536-wide down projection at 57-192 rows), which
    changes the bits; one thread keeps one summation order per row count, at about twice the time.
    So the first product of each shape runs both ways: where they agree bit for bit (every element
    of a real product summed in another order would not), that shape runs on all threads after."""
    n = torch.get_num_threads()
    if n == 1:
        return F.linear(x, w, b)
    key = (x.shape[0], w.shape[0], w.shape[1], x.dtype, b is None, n)
    agree = _THREADS_AGREE.get(key)
    if agree:
        return F.linear(x, w, b)
    with _one_thread():
        y = F.linear(x, w, b)
    if agree is None:
        _THREADS_AGREE[key] = torch.equal(F.linear(x, w, b), y)
    return y


def matmul_for(x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The product to use on x's rows: invariant_sgemm when the forward is batch-invariant (CPU)."""
    return invariant_sgemm if _invariant(x) else F.linear


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           panel_rows: int | None = None) -> torch.Tensor:
    """F.linear; under batch_invariant (CPU) its rows padded (pad_rows) and one thread's bits
    (invariant_sgemm). panel_rows: on the CPU, a batch of 4 to 64 rows multiplies `panel_rows`
    output rows of w at a time (each output is the same dot product, so the result is unchanged;
    MergedColumnParallelLinear says when it pays)."""
    if not _invariant(x):  # (the GPU path: one context lookup)
        return _linear(x, w, b, panel_rows, F.linear)
    xp = pad_rows(x)
    y = _linear(xp, w, b, panel_rows, invariant_sgemm)
    return y if xp is x else y[: x.shape[0]]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, panel_rows: int | None,
            mm: Callable[..., torch.Tensor]) -> torch.Tensor:
    if panel_rows and x.device.type == "cpu" and b is None and 4 <= x.shape[0] <= 64:
        return torch.cat([mm(x, wp) for wp in w.split(panel_rows)], dim=-1)
    return mm(x, w, b)


INT4_MAX_ROWS = 16  # packed int4 products up to this many rows (see int4_rows)


def int4_rows(x: torch.Tensor) -> bool:
    """Whether x's rows go to a packed layer's int4 product (weight_quantization="gguf"). Decode batches
    are bound by reading the weights, where int4 reads 1/6 of fp32's bytes (2.5x faster at 1 row);
    from ~16 rows on the product is bound by arithmetic, and the bf16 int4 kernel is 2-4x slower
    than MKL's fp32 sgemm at 128-512 rows, so prefill chunks and large batches use the float weight.
    Under batch_invariant every row takes int4, whose row results never depend on the batch."""
    return x.shape[0] <= INT4_MAX_ROWS or _invariant(x)


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise NanoKVError("tensor_parallel_size", f"{tp} does not divide {what} ({n})")
    return n // tp


def _copy(param: nn.Parameter, src: torch.Tensor, name: str) -> None:
    if param.shape != src.shape:
        raise NanoKVError("weights", f"{name}: checkpoint shard has shape {tuple(src.shape)}, "
                          f"model expects {tuple(param.shape)}")
    param.data.copy_(src)


class LinearBase(nn.Module):
    def __init__(self, in_local: int, out_local: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.qrows: Q4Rows | None = None  # this rank's 4-bit rows while loading (weight_quantization="gguf")
        self.shards_q4: set[object] = set()  # shard ids that came in 4 bits / as float tensors
        self.shards_float: set[object] = set()
        self.qlinear: Int4Linear | None = None  # set by pack_weights

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def _load_weight(self, param: nn.Parameter, full: torch.Tensor | Q4Rows, shard_id: object = None) -> None:
        if isinstance(full, Q4Rows):
            if self.qrows is None:
                self.qrows = Q4Rows.empty(*param.shape)
            self.weight_loader(self.qrows, full, shard_id)  # type: ignore[arg-type]
            self.shards_q4.add(shard_id)
            full = full.dequantize()
        else:
            self.shards_float.add(shard_id)
        self.weight_loader(param, full, shard_id)

    def pack_weights(self) -> bool:
        """After loading: a layer whose shards all came as 4-bit GGUF rows (and one TP rank) gets them
        packed for small batches (int4_rows); the float weight stays for large ones. Returns whether it did."""
        rows, self.qrows = self.qrows, None
        if rows is None or self.shards_float or self.tp_size > 1:
            return False
        self.qlinear = Int4Linear.from_q4(rows)
        return True

    def _matmul(self, x: torch.Tensor, b: torch.Tensor | None, panel_rows: int | None = None) -> torch.Tensor:
        if self.qlinear is not None and int4_rows(x):
            return self.qlinear(x, b)
        return linear(x, self.weight, b, panel_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Same full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        _copy(param, full, "replicated linear")


class ColumnParallelLinear(LinearBase):
    """y[:, rank's slice] = x @ W[rank's rows].T; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_size()
        super().__init__(input_size, _divide(output_size, tp, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        n = param.shape[0]
        _copy(param, full.narrow(0, self.tp_rank * n, n), "column-parallel linear")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): [gate_r | up_r] per rank."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        for n in self.output_sizes:
            _divide(n, get_tp_size(), "merged output features")
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index into {self.output_sizes}, got {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        dst = param.data.narrow(0, offset, size)
        if full.shape[0] != self.output_sizes[shard_id] or full.shape[1:] != dst.shape[1:]:
            raise NanoKVError("weights", f"merged linear shard {shard_id}: checkpoint shape "
                              f"{tuple(full.shape)} does not fit this model")
        dst.copy_(full.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(output_sizes) / tp]. Decode-sized batches on the CPU: the fused
        gate_up sgemm (SmolLM2: 3072 x 576) runs ~20% faster as 768-row panels (measured, 1 thread,
        4 to 64 rows; no gain at 1-2 rows or at 512)."""
        return self._matmul(x, self.bias, panel_rows=_CPU_PANEL_ROWS)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; per rank the output is [q_r | k_r | v_r].

    Heads are dealt out by GQA group (`distributed.head_ranges`), possibly unevenly: each rank
    holds a contiguous run of query heads and the kv heads they attend with (replicated on
    several ranks when tp > num_kv_heads). Rank 0 holds the most.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        self.head_dim = head_dim
        kv_rows = num_kv_heads * head_dim
        self.total_rows = {"q": num_heads * head_dim, "k": kv_rows, "v": kv_rows}  # full checkpoint rows
        (self.q_start, self.num_heads), (self.kv_start, self.num_kv_heads) = head_ranges(
            num_heads, num_kv_heads, get_tp_size(), get_tp_rank())  # first head and head count on this rank
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.q_start * self.head_dim
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, start = self.kv_size, self.kv_start * self.head_dim
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        if full.shape[0] != self.total_rows[str(shard_id)] or full.shape[1:] != dst.shape[1:]:
            raise NanoKVError("weights", f"qkv shard {shard_id}: checkpoint shape {tuple(full.shape)} "
                              f"does not fit this model")
        dst.copy_(full.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """y = all_reduce(x[:, rank's slice] @ W[:, rank's cols].T) + b; input arrives sharded.

    The input is split evenly unless `input_range` = (first feature, count) names this rank's
    slice (o_proj after an uneven head split)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_range: tuple[int, int] | None = None):
        tp = get_tp_size()
        if input_range is None:
            n = _divide(input_size, tp, "input features")
            input_range = (get_tp_rank() * n, n)
        self.input_size, self.input_start = input_size, input_range[0]
        super().__init__(input_range[1], output_size, bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: full on every rank, added once after the reduction
            _copy(param, full, "row-parallel bias")
            return
        n = param.shape[1]
        if full.dim() != 2 or full.shape[1] != self.input_size:
            raise NanoKVError("weights", f"row-parallel linear: checkpoint shape {tuple(full.shape)} "
                              "does not fit this model")
        _copy(param, full.narrow(1, self.input_start, n), "row-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.tp_size > 1:
            y = all_reduce(y)
        return y if self.bias is None else y + self.bias

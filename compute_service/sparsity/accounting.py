"""Live KV bytes of one sequence: each live block-table entry counted at the bytes that hold it.

"Live" = the entries that hold data the sequence can still read: not holes (-1), and covering
computed tokens (the open tail block counts whole: it is allocated). A pool block (>= 0) counts at
its format's bytes in every layer (bytes_per_block, scales and zero points included); a demoted
entry (<= -2, hybrid sparsity) is a slot of the INT4 demotion store, which it holds instead of a
pool block (nanokv.kv.demote: the INT8 block went back to the pool), counted at the store's bytes
per slot in every layer (slot_bytes). Both are the bytes the tensors really take.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanokv.kv.cache import bytes_per_block
from nanokv.kv.demote import slot_bytes


class KVBytes:
    def __init__(self, layer_bits: Sequence[int], num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """layer_bits: the per-layer plan; 16-bit layers counted in `dtype` (bf16 as in docs/quality.md)."""
        self.block_size = block_size
        self.block_bytes = sum(bytes_per_block(b, num_kv_heads, block_size, head_dim, dtype) for b in layer_bits)
        # one demoted entry: a store slot in every layer (hybrid needs every layer int8)
        self.demoted_block_bytes = len(layer_bits) * slot_bytes(num_kv_heads, block_size, head_dim)

    def live(self, table: Sequence[int], num_computed_tokens: int) -> int:
        """table: logical -> physical entries (>= 0 pool block, -1 hole, <= -2 demotion-store slot)."""
        n = -(-num_computed_tokens // self.block_size)
        total = 0
        for b in table[:n]:
            if b >= 0:
                total += self.block_bytes
            elif b <= -2:
                total += self.demoted_block_bytes
        return total

"""Live KV bytes of one sequence: each live block counted at the bytes of its format in each layer.

"Live" = the block-table entries that hold data the sequence can still read: not holes, and
covering computed tokens (the open tail block counts whole: it is allocated). An int8 block
demoted in place (nanokv.kv.demote) counts as an int4 block, bytes_per_block(4): that is what it
needs, though its slot stays int8-sized (see nanokv.kv.demote). Scales and zero points included.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch

from nanokv.kv.cache import bytes_per_block


class KVBytes:
    def __init__(self, layer_bits: Sequence[int], num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """layer_bits: the per-layer plan; 16-bit layers counted in `dtype` (bf16 as in docs/quality.md)."""
        self.block_size = block_size
        per = [bytes_per_block(b, num_kv_heads, block_size, head_dim, dtype) for b in layer_bits]
        self.block_bytes = sum(per)  # one block, all layers, as stored
        int4 = bytes_per_block(4, num_kv_heads, block_size, head_dim, dtype)
        # one demoted block: int8 layers at int4 bytes, the others unchanged
        self.demoted_block_bytes = sum(int4 if b == 8 else p for b, p in zip(layer_bits, per))

    def live(self, table: Sequence[int], num_computed_tokens: int, demoted: AbstractSet[int] = frozenset()) -> int:
        """table: logical -> physical block ids (-1 = hole); demoted: logical indices held as int4."""
        n = -(-num_computed_tokens // self.block_size)
        total = 0
        for i, b in enumerate(table[:n]):
            if b >= 0:
                total += self.demoted_block_bytes if i in demoted else self.block_bytes
        return total

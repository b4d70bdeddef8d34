"""Full-precision staging of open blocks, for formats quantized once per block (int4: KIVI keys).

Keys quantized per channel need all of a block's tokens before the block can be quantized, and a
block is quantized exactly once (never requantized). Until then its K/V live here, in one of S
staging slots of full precision ([S, H, bs, D] per layer, allocated by nanokv.kv.cache):

  * before a step (ModelRunner.build_metadata -> plan): every block the step writes gets a staging
    slot (the same slot in every layer; block ids mean the same in every layer);
  * during the step: the store writes K/V into the block's staging slot, and attention reads a staged
    block from staging, any other block from the quantized pool. So the step's own tokens and each
    sequence's open (still filling) block are read in full precision;
  * after attention, in each layer (nanokv.kv.hooks.after_attention): every block whose last slot
    this step wrote is quantized from staging into the pool;
  * after the step (finish): those blocks give their staging slots back.

So the quantized pool only ever holds full blocks, and a full block - the only kind the prefix cache
shares - is always stored compressed. Staging holds about one block per running sequence (plus the
blocks a prefill chunk fills in one step); its bytes are not part of the pool's bytes per token.

A block freed while still open (a sequence that ended mid-block) keeps its slot until the block id
is written again (a new fill starts at offset 0 and reuses it) or until the slot pool runs dry, when
slots of blocks the cache manager reports free (`block_free`) are reclaimed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def _to_device(x: np.ndarray | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host array on the device without waiting: from pinned memory, non-blocking on CUDA.
    A pageable copy would block the host until every kernel queued before it ran (the copy is
    stream-ordered), so one per step serialized the host with the device and undid async scheduling.
    The pinned block is not reused before its copy completes (torch's caching host allocator)."""
    t = torch.as_tensor(np.asarray(x, dtype=np.int64)).to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class StageTable:
    """Host bookkeeping block id -> staging slot, mirrored in a device map read by store/attention."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, device: torch.device | str):
        self.block_size = block_size
        self.num_slots = num_slots
        # [N] int32: staging slot of each block, -1 = not staged (read from the quantized pool)
        self.stage_of = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self._host = np.full(num_blocks, -1, dtype=np.int64)
        self._free = list(range(num_slots - 1, -1, -1))
        self._filling: np.ndarray = np.empty(0, dtype=np.int64)  # blocks this step fills
        # the same on the device, with their staging slots: [F] int64 each (read by quantize_filled)
        self.fill_blocks = torch.empty(0, dtype=torch.int64, device=device)
        self.fill_slots = torch.empty(0, dtype=torch.int64, device=device)
        self.block_free: Callable[[int], bool] | None = None  # set by the owner of the cache manager

    @property
    def num_staged(self) -> int:
        return self.num_slots - len(self._free)

    def plan(self, slots: np.ndarray) -> None:
        """slots: [T] this step's cache slots (block * bs + offset; -1 = not stored)."""
        bs = self.block_size
        written = slots[slots >= 0]
        if written.size == 0:
            self._set_filling(np.empty(0, dtype=np.int64))
            return
        blocks = np.unique(written // bs)
        new = blocks[self._host[blocks] < 0]
        if new.size:
            ids = [self._take() for _ in range(new.size)]
            self._host[new] = ids
            dev = self.stage_of.device
            self.stage_of[_to_device(new, torch.int64, dev)] = _to_device(ids, torch.int32, dev)
        self._set_filling(np.unique(written[written % bs == bs - 1] // bs))

    def _set_filling(self, blocks: np.ndarray) -> None:
        self._filling = blocks
        dev = self.stage_of.device
        self.fill_blocks = _to_device(blocks, torch.int64, dev)
        self.fill_slots = _to_device(self._host[blocks], torch.int64, dev)

    def finish(self) -> None:
        """After the step: blocks filled by it are now in the quantized pool; free their slots."""
        done = self._filling
        if done.size == 0:
            return
        self._free.extend(int(s) for s in self._host[done])
        self._host[done] = -1
        self.stage_of[_to_device(done, torch.int64, self.stage_of.device)] = -1
        self._set_filling(np.empty(0, dtype=np.int64))

    def resize(self, num_blocks: int) -> None:
        """KV pool resize (nanokv.adaptive pool rule): ids below both sizes keep their slots; slots
        of removed ids (only free blocks are removed) go back to the free list."""
        n = min(num_blocks, self._host.shape[0])
        self._free.extend(int(x) for x in self._host[n:] if x >= 0)
        host = np.full(num_blocks, -1, dtype=np.int64)
        host[:n] = self._host[:n]
        self._host = host
        dev = torch.full((num_blocks,), -1, dtype=torch.int32, device=self.stage_of.device)
        dev[:n] = self.stage_of[:n]
        self.stage_of = dev

    def _take(self) -> int:
        if not self._free and self.block_free is not None:
            stale = [b for b in np.nonzero(self._host >= 0)[0].tolist()
                     if b not in set(self._filling.tolist()) and self.block_free(b)]
            for b in stale:
                self._free.append(int(self._host[b]))
                self._host[b] = -1
            if stale:
                self.stage_of[_to_device(stale, torch.int64, self.stage_of.device)] = -1
        if not self._free:
            raise RuntimeError(
                f"KV staging full: {self.num_slots} open blocks staged at once; raise max_num_seqs-based "
                "staging (nanokv.kv.staging) or lower max_num_batched_tokens")
        return self._free.pop()


def staging_slots(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Slots enough for any step: each running sequence's open block, plus every block one step's
    tokens can touch (a chunk of n tokens spans at most n / bs + 1 blocks)."""
    return max_num_seqs + -(-max_num_batched_tokens // block_size) + max_num_seqs

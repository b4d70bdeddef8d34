"""Full-precision staging of open blocks, for formats quantized once per block (int4: KIVI keys).

Keys quantized per channel need all of a block's tokens before the block can be quantized, and a
block is quantized exactly once (never requantized). Until then its K/V live here, in one of S
staging slots of full precision ([S, H, bs, D] per layer, allocated by nanokv.kv.cache):

  * before a step (ModelRunner.build_metadata -> plan): every block the step writes gets a staging
    slot (the same slot in every layer; block ids mean the same in every layer);
  * during the step: the store writes K/V into the block's staging slot, and attention reads a staged
    block from staging, any other block from the quantized pool. So the step's own tokens and each
    sequence's open (still filling) block are read in full precision;
  * after attention, in each layer (nanokv.compute_service.kv_hooks.after_attention): every block whose last slot
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


class StageTable:
    """Host bookkeeping block id -> staging slot, mirrored in a device map read by store/attention.

    Changed blocks are queued and sent as (blocks to clear, blocks to set, their slots), each block
    with its current host state: at once by default, or, for the runner (`defer=True`), sent with the
    step's metadata in its one pinned copy (`pending` then `apply`), so a step costs no extra copy
    and never waits for the device."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, device: torch.device | str):
        self.block_size = block_size
        self.num_slots = num_slots
        # [N] int32: staging slot of each block, -1 = not staged (read from the quantized pool)
        self.stage_of = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self._host = np.full(num_blocks, -1, dtype=np.int64)
        self._free = list(range(num_slots - 1, -1, -1))
        self._filling: np.ndarray = np.empty(0, dtype=np.int64)  # blocks this step fills
        self._clear: list[np.ndarray] = []  # queued device-map updates, see the class doc
        self._set: list[np.ndarray] = []
        self.block_free: Callable[[int], bool] | None = None  # set by the owner of the cache manager

    @property
    def num_staged(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def fill_blocks(self) -> torch.Tensor:
        """[F] int64 on the device: the blocks this step fills (read by the eager quantize_filled)."""
        return torch.from_numpy(self._filling).to(self.stage_of.device)

    @property
    def fill_slots(self) -> torch.Tensor:
        """[F] int64 on the device: their staging slots."""
        return torch.from_numpy(self._host[self._filling]).to(self.stage_of.device)

    def last_slots(self) -> np.ndarray:
        """[F] int64: the last cache slot of each block this step fills, a compact slot mapping for
        the device's quantize-on-fill kernel (it quantizes the blocks whose last slot it is given)."""
        return self._filling * self.block_size + self.block_size - 1

    def first_fill(self) -> int | None:
        """Staging slot of the first block this step fills (host bookkeeping), None if it fills none."""
        return int(self._host[self._filling[0]]) if self._filling.size else None

    def plan(self, slots: np.ndarray, defer: bool = False) -> None:
        """slots: [T] this step's cache slots (block * bs + offset; -1 = not stored)."""
        bs = self.block_size
        written = slots[slots >= 0]
        if written.size == 0:
            self._filling = np.empty(0, dtype=np.int64)
        else:
            blocks = np.unique(written // bs)
            new = blocks[self._host[blocks] < 0]
            if new.size:
                self._host[new] = [self._take() for _ in range(new.size)]
                self._set.append(new)
            self._filling = np.unique(written[written % bs == bs - 1] // bs)
        if not defer:
            self.flush()

    def finish(self, defer: bool = False) -> None:
        """After the step: blocks filled by it are now in the quantized pool; free their slots."""
        done = self._filling
        if done.size:
            self._free.extend(int(s) for s in self._host[done])
            self._host[done] = -1
            self._clear.append(done)
            self._filling = np.empty(0, dtype=np.int64)
        if not defer:
            self.flush()

    def pending(self) -> list[np.ndarray]:
        """The queued device-map updates as int64 arrays [clear blocks, set blocks, their slots], and
        the queue emptied; the caller brings them to the device and hands them to `apply`."""
        touched = np.unique(np.concatenate([np.empty(0, dtype=np.int64), *self._clear, *self._set]))
        self._clear, self._set = [], []
        # every touched block gets the host's current state, whatever the order of the changes
        slot = self._host[touched]
        return [touched[slot < 0], touched[slot >= 0], slot[slot >= 0]]

    def apply(self, clear: torch.Tensor, put: torch.Tensor, slot: torch.Tensor) -> None:
        """Device tensors from `pending` (disjoint block sets): stream-ordered updates, no host sync
        (not `stage_of[clear] = -1`: torch 2.11 makes the scalar a CPU tensor and copies it over with a
        stream sync, which stalled every int4 step's host on the previous step: 15% device idle)."""
        if clear.numel():
            self.stage_of.index_fill_(0, clear, -1)
        if put.numel():
            self.stage_of.index_copy_(0, put, slot.to(torch.int32))

    def flush(self) -> None:
        """Apply the queue now, with plain copies (outside the runner's steps: tests, resize, reads)."""
        if self._clear or self._set:
            self.apply(*(torch.from_numpy(a).to(self.stage_of.device) for a in self.pending()))

    def resize(self, num_blocks: int) -> None:
        """KV pool resize (nanokv.gateway.adaptive pool rule): ids below both sizes keep their slots; slots
        of removed ids (only free blocks are removed) go back to the free list."""
        self.flush()
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
                self._clear.append(np.asarray(stale, dtype=np.int64))
        if not self._free:
            raise RuntimeError(
                f"KV staging full: {self.num_slots} open blocks staged at once; raise max_num_seqs-based "
                "staging (nanokv.kv.staging) or lower max_num_batched_tokens")
        return self._free.pop()


def staging_slots(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Slots enough for any step: each running sequence's open block, plus every block one step's
    tokens can touch (a chunk of n tokens spans at most n / bs + 1 blocks)."""
    return max_num_seqs + -(-max_num_batched_tokens // block_size) + max_num_seqs

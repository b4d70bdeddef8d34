"""The copies between the device pool (L1) and the cache service's host tier (L2), run before a step.

The cache service decides them (cache_service/tiers/serving.py) and owns both segments; this side
maps the host segment once per pool (PoolHandle.host_tier, a layout of the pool's formats with
``host_tier_blocks`` blocks) and moves the bytes. Copies run in the order given: consecutive ones
of one kind with distinct destinations are batched into one gather and one scatter per tensor
(per layer: K and V, and their scales for int8/int4), since per-block copies are launch-bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from nanokv.errors import NanoKVError
from nanokv.kv.cache import LayerKV
from nanokv.kv.segment import carve_layer_caches, map_handle
from nanokv.messages import COPY_LOAD, COPY_SAVE, PoolHandle, PoolLayout


class HostTier:
    """The host tier's layer tensors, carved from the cache service's segment: [slots, ...] each."""

    def __init__(self, handle: PoolHandle, layout: PoolLayout):
        if handle.host_tier is None:
            raise ValueError("the pool handle carries no host tier")
        self.epoch = handle.epoch
        self.num_slots = handle.host_tier_blocks
        l2 = dataclasses.replace(layout, num_blocks=self.num_slots, device="cpu", rank_kv_heads=[], rank_devices=[])
        self.caches = carve_layer_caches(l2, map_handle(handle.host_tier))


def _runs(copies: Sequence[tuple[int, int, int]]) -> list[tuple[int, list[int], list[int]]]:
    """(kind, L1 blocks, L2 slots) batches of consecutive copies of one kind whose destinations
    differ: within a batch the order does not matter, across batches it is kept."""
    out: list[tuple[int, list[int], list[int]]] = []
    dests: set[int] = set()
    for kind, block, slot in copies:
        dst = slot if kind == COPY_SAVE else block
        if not out or out[-1][0] != kind or dst in dests:
            out.append((kind, [], []))
            dests = set()
        out[-1][1].append(block)
        out[-1][2].append(slot)
        dests.add(dst)
    return out


def run_copies(copies: Sequence[tuple[int, int, int]], l1: list[LayerKV], l2: HostTier | None,
               num_blocks: int) -> None:
    """Run a step's copies (kind, L1 block, L2 slot). A copy out of range is a protocol error."""
    if not copies:
        return
    if l2 is None:
        raise NanoKVError("copies", "the step carries tier copies but the pool has no host tier")
    for kind, block, slot in copies:
        if kind not in (COPY_SAVE, COPY_LOAD) or not 0 <= block < num_blocks or not 0 <= slot < l2.num_slots:
            raise NanoKVError("copies", f"({kind}, {block}, {slot}): kind 0 or 1, block in [0, {num_blocks}), "
                                        f"slot in [0, {l2.num_slots})")
    device = l1[0].k.device
    for kind, blocks, slots in _runs(copies):
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        s = torch.tensor(slots, dtype=torch.long)
        for dev, host in zip(l1, l2.caches):
            for name in dev.block_fields:
                d, h = getattr(dev, name), getattr(host, name)
                if kind == COPY_SAVE:  # [n, ...] gathered on the device, then one copy to the host
                    h.index_copy_(0, s, d.index_select(0, b).to("cpu"))
                else:
                    d.index_copy_(0, b, h.index_select(0, s).to(device, non_blocking=True))

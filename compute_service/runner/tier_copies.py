"""The copies between the device pool (L1) and the cache service's host tier (L2), run before a step.

The cache service decides them (cache_service/tiers/serving.py) and owns both segments; this side
maps the host segment once per pool (PoolHandle.host_tier, a layout of the pool's formats with
``host_tier_blocks`` blocks) and moves the bytes. Copies run in the order given: consecutive ones
of one kind with distinct destinations are batched into one gather and one scatter per tensor
(per layer: K and V, and their scales for int8/int4), since per-block copies are launch-bound.

On a GPU whose host segment is page-locked, a kernel moves the rows in place over the link
(kernels/triton_tier_copy.py): one launch per tensor and direction, ordered on the step's stream
before the forward pass, with no host work; a write-back's slots are settled once the step's event
has completed (``flush`` waits for it). Where the segment could not be page-locked (or the kernel
cannot reach it: checked once when mapped) the host does it:
  * a load gathers its slots on the host into a pinned bounce buffer, then one non-blocking copy
    per tensor goes up and a scatter puts the blocks in place, all queued before the forward pass;
  * a write-back (save) gathers its blocks on the device into a buffer, copies it non-blocking into
    a pinned bounce buffer, and the host-side scatter into the slots waits (``flush``) until that
    copy's event completes: at the next step's launch, or when a step's result is collected, which
    is when the gateway may tell the cache service those slots are settled. A load of a slot
    whose save is still pending flushes first.
The host segment is page-locked once when mapped (cudaHostRegister for a shared-memory segment,
pinned memory in process), which a non-blocking copy needs.

A host tier may store a narrower format than the pool (cpu_offload_kv_format int8 or int4;
nanokv.kv.tier_transcode): a layer whose formats differ is quantized on the device before it goes
down (fewer bytes cross the bus) and dequantized on the device after it comes up; on the CPU the
same happens straight between the pool and the slots. Layers of one format copy bytes as before.
The handle names no format: the segment's size does (`tier_layout`), the three candidate layouts
of a pool differ in size.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from nanokv.errors import NanoKVError
from nanokv.kv import tier_transcode as tt
from nanokv.kv.cache import LayerKV
from nanokv.kv.segment import carve_layer_caches, map_handle, pool_nbytes
from nanokv.messages import COPY_LOAD, COPY_SAVE, PoolHandle, PoolLayout

log = logging.getLogger("nanokv.compute_service")


def tier_layout(layout: PoolLayout, slots: int, nbytes: int) -> PoolLayout:
    """The host tier's layout: the pool's on the host, `slots` blocks, in the tier format whose
    segment is `nbytes` long (cache_service/storage.py host_layout made it)."""
    base = dataclasses.replace(layout, num_blocks=slots, device="cpu", rank_kv_heads=[], rank_devices=[])
    found: list[PoolLayout] = []
    for fmt in tt.TIER_FORMAT_BITS:
        cand = dataclasses.replace(base, layer_bits=tt.tier_layer_bits(layout.layer_bits, fmt))
        if cand not in found and pool_nbytes(cand) == nbytes:
            found.append(cand)
    if len(found) != 1:
        raise NanoKVError("host_tier", f"a host segment of {nbytes} bytes for {slots} slots is "
                                       f"{'no' if not found else 'more than one'} tier format of this pool")
    return found[0]


class HostTier:
    """The host tier's layer tensors, carved from the cache service's segment: [slots, ...] each."""

    def __init__(self, handle: PoolHandle, layout: PoolLayout, device: torch.device | None = None):
        if handle.host_tier is None:
            raise ValueError("the pool handle carries no host tier")
        self.epoch = handle.epoch
        self.num_slots = handle.host_tier_blocks
        buf = map_handle(handle.host_tier)
        self._registered = None
        if device is not None and device.type == "cuda" and not buf.is_pinned():
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
            if int(rc) == 0:  # page-locked: non-blocking copies from and to it
                self._registered = buf
        self.buffer = buf
        self.layout = tier_layout(layout, self.num_slots, handle.host_tier.nbytes)
        self.caches = carve_layer_caches(self.layout, buf)
        # the device reaches the segment in place (unified addressing) only if it is page-locked
        self.device_access = device is not None and device.type == "cuda" and (
            self._registered is not None or buf.is_pinned()) and _kernel_reaches(self.caches[0].k, device)
        self._pending: list[tuple[torch.cuda.Event, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []
        self._pending_slots: set[int] = set()

    @torch.inference_mode()  # (called from collect too: the slots' views were made in inference mode)
    def flush(self) -> None:
        """Finish the write-backs whose device-to-host copies are queued: scatter them into their slots."""
        for event, scatters, slots in self._pending:
            event.synchronize()
            for dst, src in scatters:
                dst.index_copy_(0, slots, src)
        self._pending.clear()
        self._pending_slots.clear()

    def close(self) -> None:
        self.flush()
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered.data_ptr())
            self._registered = None


def _kernel_reaches(host: torch.Tensor, device: torch.device) -> bool:
    """Whether the copy kernel reads this page-locked host tensor in place and gets its bytes (one
    row, to a scratch row on the device); if not, the host-side copies serve instead."""
    from nanokv.kernels.triton_tier_copy import copy_rows

    try:
        row = torch.empty_like(host[:1], device=device)
        idx = torch.zeros(1, dtype=torch.long, device=device)
        copy_rows(host, row, idx, idx)
        torch.cuda.synchronize(device)
        ok = torch.equal(row.cpu().view(torch.uint8), host[:1].view(torch.uint8))
    except Exception as e:  # noqa: BLE001 - the host path is the fallback, with the reason logged
        log.warning("host tier: the in-place copy kernel cannot reach the page-locked segment (%s); "
                    "copies go through host-side gathers", e)
        return False
    if not ok:
        log.warning("host tier: the in-place copy kernel read other bytes; copies go through host-side gathers")
    return ok


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
    cuda = device.type == "cuda"
    if cuda and l2.device_access:
        _run_on_device(copies, l1, l2, device)
        return
    for kind, blocks, slots in _runs(copies):
        b = torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True)
        s = torch.tensor(slots, dtype=torch.long)
        if kind == COPY_LOAD and l2._pending_slots.intersection(slots):
            l2.flush()  # a slot written back moments ago is read again
        scatters: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dev, host in zip(l1, l2.caches):
            names = host.block_fields
            if kind == COPY_SAVE:  # [n, ...] per field on the device, one copy each to the host
                if tt.same_format(dev, host):
                    rows = {n: getattr(dev, n).index_select(0, b) for n in names}
                else:
                    rows = tt.encode(*tt.read_blocks(dev, b), tt.basis(dev), host.bits)
                for n in names:
                    h = getattr(host, n)
                    if not cuda:
                        h.index_copy_(0, s, rows[n])
                        continue
                    bounce = torch.empty(rows[n].shape, dtype=h.dtype, pin_memory=True)
                    bounce.copy_(rows[n], non_blocking=True)
                    scatters.append((h, bounce))
                continue
            up = {n: _gather_up(getattr(host, n), s, device, cuda) for n in names}
            if tt.same_format(dev, host):
                for n in names:
                    getattr(dev, n).index_copy_(0, b, up[n])
            else:  # dequantized on the device, into L1's format
                tt.write_blocks(dev, b, *tt.decode(up, host.bits, tt.basis(dev)))
        if scatters:
            event = torch.cuda.Event()
            event.record()
            l2._pending.append((event, scatters, s))
            l2._pending_slots.update(slots)


def _gather_up(h: torch.Tensor, s: torch.Tensor, device: torch.device, cuda: bool) -> torch.Tensor:
    """Host rows `s` of one field [n, ...] on `device`: on a GPU gathered straight into pinned memory
    and sent up in one non-blocking copy."""
    if not cuda:
        return h.index_select(0, s)
    rows = torch.empty((len(s), *h.shape[1:]), dtype=h.dtype, pin_memory=True)
    torch.index_select(h, 0, s, out=rows)
    return rows.to(device, non_blocking=True)


def _run_on_device(copies: Sequence[tuple[int, int, int]], l1: list[LayerKV], l2: HostTier,
                   device: torch.device) -> None:
    """The copies as kernels reading or writing the page-locked host rows in place, in order. A layer
    of another tier format is encoded into (or decoded from) device rows laid out like the host's."""
    from nanokv.kernels.triton_tier_copy import copy_rows

    for kind, blocks, slots in _runs(copies):
        b = torch.tensor(blocks, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
        s = torch.tensor(slots, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
        seq = torch.arange(len(slots), device=device)
        for dev, host in zip(l1, l2.caches):
            names = host.block_fields
            same = tt.same_format(dev, host)
            if kind == COPY_SAVE:
                if same:
                    for n in names:
                        copy_rows(getattr(dev, n), getattr(host, n), b, s)
                    continue
                rows = tt.encode(*tt.read_blocks(dev, b), tt.basis(dev), host.bits)
                for n in names:
                    h = getattr(host, n)
                    staged = torch.empty_like(h[:len(slots)], device=device)  # the host rows' strides
                    staged.copy_(rows[n])
                    copy_rows(staged, h, seq, s)
                continue
            if same:
                for n in names:
                    copy_rows(getattr(host, n), getattr(dev, n), s, b)
                continue
            up = {}
            for n in names:
                h = getattr(host, n)
                up[n] = torch.empty_like(h[:len(slots)], device=device)
                copy_rows(h, up[n], s, seq)
            tt.write_blocks(dev, b, *tt.decode(up, host.bits, tt.basis(dev)))
        if kind == COPY_SAVE:  # the slots are settled when this event has completed (flush)
            event = torch.cuda.Event()
            event.record()
            l2._pending.append((event, [], s))
            l2._pending_slots.update(slots)

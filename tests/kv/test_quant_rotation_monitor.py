"""Key rotation (scores preserved, int4 error reduced) and the compression monitor + outlier test hook."""

from __future__ import annotations

import torch
from helpers_model import SeqStep, build_metadata

from nanokv.compute_service import kv_hooks as hooks
from nanokv.kernels import reference
from nanokv.kv.cache import Int4KV, allocate_layer_cache
from nanokv.kv.monitor import CompressionMonitor, relative_error, roundtrip
from nanokv.kv.rotation import hadamard, joint_view, maybe_rotate, rotation_matrix


def test_rotation_is_orthonormal_and_preserves_scores():
    for d in (16, 64, 128, 80):  # 80: not a power of two -> seeded random orthogonal
        r = rotation_matrix(d, torch.float64)
        assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    h = hadamard(8)
    assert torch.equal(h @ h.T, 8 * torch.eye(8))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 9, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    qr, kr = maybe_rotate(q, k, 4)
    s = torch.einsum("thd,shd->tsh", q[:, :3], k)
    sr = torch.einsum("thd,shd->tsh", qr[:, :3], kr)
    assert torch.allclose(s, sr, atol=1e-4)
    q16, k16 = maybe_rotate(q, k, 16)
    assert q16 is q and k16 is k  # full-precision layers are never rotated


def test_rotation_of_q_and_k_in_one_buffer_is_one_product_with_the_same_result():
    """q and k as adjacent heads of one buffer (what the compiled RoPE returns on a GPU) are rotated by
    one product over both: same values as rotating each; anything else is rotated separately."""
    g = torch.Generator().manual_seed(2)
    qk = torch.randn(6, 12, 64, generator=g)
    q, k = qk[:, :9], qk[:, 9:]
    assert joint_view(q, k) is not None and joint_view(q, k).data_ptr() == qk.data_ptr()
    qr, kr = maybe_rotate(q, k, 8)
    assert qr.data_ptr() + 9 * 64 * 4 == kr.data_ptr()  # still one buffer: one product made both
    r = rotation_matrix(64)
    assert torch.allclose(qr, q.contiguous() @ r, atol=1e-6) and torch.allclose(kr, k.contiguous() @ r, atol=1e-6)
    for a, b in ((q.contiguous(), k.contiguous()), (k, q), (qk[:, :9], qk[:, 10:]), (qk[:5, :9], qk[1:, 9:])):
        assert joint_view(a, b) is None


def test_rotation_shrinks_int4_error_of_outlier_keys():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(512, 3, 64, generator=g)
    k[..., 3] *= 20.0
    plain = relative_error(k, roundtrip(k, 4, torch.float32))
    _, kr = maybe_rotate(k[:, :1], k, 4, rotate=True)
    rotated = relative_error(kr, roundtrip(kr, 4, torch.float32))
    assert rotated < 0.6 * plain


def _attached(monitor: CompressionMonitor, caches: list) -> list[hooks.LayerHooks]:
    """Each layer's hooks, the monitor attached to them (the runner keeps such a list)."""
    layer_hooks = [hooks.LayerHooks() for _ in caches]
    monitor.attach(layer_hooks)
    return layer_hooks


def _store(hook: hooks.LayerHooks, layer: int, cache, k, v, q=None):
    """One step of len(k) tokens into blocks 0, 1, ... through the layer's hooks; int4 (sampled by the
    monitor as its blocks are quantized, when they fill, after attention) stores and quantizes them as
    the runner does."""
    q = k.repeat(1, 3, 1) if q is None else q
    md = build_metadata([SeqStep(0, k.shape[0], list(range(cache.num_blocks)))], cache.block_size)
    q, k, v = hooks.before_store(layer, cache, hook, md, q, k, v)
    if isinstance(cache, Int4KV):
        cache.stage.plan(md.slot_mapping.numpy())
        reference.store_kvcache(k, v, cache, md.slot_mapping)
        hooks.after_attention(layer, cache, hook, md, torch.zeros_like(q))
        cache.stage.finish()
    return q, k, v


def test_monitor_reports_zero_for_full_precision_and_error_for_int4():
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(64, 3, 64, generator=g), torch.randn(64, 3, 64, generator=g)
    mon = CompressionMonitor(every=1)
    caches = [allocate_layer_cache(b, 4, 3, 16, 64, torch.float32, "cpu") for b in (16, 8, 4)]
    layer_hooks = _attached(mon, caches)
    for layer, c in enumerate(caches):
        _store(layer_hooks[layer], layer, c, k, v)
    snap = mon.snapshot()
    assert snap[0] == 0.0
    assert 0.0 < snap[1] < 0.02 < snap[2] < 0.2
    assert set(mon.snapshot_kv()[2]) == {"k", "v"}


def test_monitor_samples_every_nth_call_only():
    mon = CompressionMonitor(every=3, rows=4)
    c = allocate_layer_cache(8, 4, 3, 16, 64, torch.float32, "cpu")
    hook, = _attached(mon, [c])
    calls = []
    mon.record = lambda *a, **kw: calls.append(a[0])  # type: ignore[method-assign]
    for _ in range(7):
        _store(hook, 0, c, torch.randn(8, 3, 64), torch.randn(8, 3, 64))
    assert len(calls) == 3  # calls 0, 3, 6


def test_monitor_staggers_its_samples_across_layers():
    """Each layer is sampled at its first call and then one call in `every`, but not all layers at
    the same call: a step (one call per layer) pays at most ceil(layers / every) samples after the
    first, for int4 blocks (record_blocks) as for stores (maybe_record)."""
    L, every, steps = 6, 4, 13
    mon = CompressionMonitor(every=every, rows=4)
    caches = [allocate_layer_cache(8, 4, 3, 16, 64, torch.float32, "cpu") for _ in range(L)]
    layer_hooks = _attached(mon, caches)
    calls: list[tuple[int, int]] = []  # (step, layer) of each sample
    step = [0]
    mon.record = lambda layer, *a, **kw: calls.append((step[0], layer))  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(4)
    for step[0] in range(steps):
        for layer, c in enumerate(caches):
            _store(layer_hooks[layer], layer, c, torch.randn(16, 3, 64, generator=g),
                   torch.randn(16, 3, 64, generator=g))
    per_step = [sum(1 for s, _ in calls if s == t) for t in range(steps)]
    assert per_step[0] == L  # every layer's first call
    assert max(per_step[1:]) <= -(-L // every) and min(per_step[1:]) >= 1
    for layer in range(L):
        mine = [s for s, lay in calls if lay == layer]
        assert mine[0] == 0 and all(b - a == every for a, b in zip(mine[1:], mine[2:]))
        assert len(mine) >= 1 + (steps - every) // every
    blocks: list[tuple[int, int]] = []  # int4: record_blocks samples the blocks it is handed, on the same schedule
    mon4 = CompressionMonitor(every=every, rows=4)
    mon4._fold = lambda layer, *a: blocks.append((step[0], layer))  # type: ignore[method-assign]
    for step[0] in range(steps):
        for layer in range(L):
            mon4.record_blocks(layer, torch.randn(1, 3, 16, 64, generator=g), torch.randn(1, 3, 16, 64, generator=g))
    assert [sum(1 for s, _ in blocks if s == t) for t in range(steps)] == per_step


def test_outlier_hook_raises_error_of_that_layer_and_rotation_absorbs_it():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(64, 3, 64, generator=g), torch.randn(64, 3, 64, generator=g)
    q = torch.randn(64, 9, 64, generator=g)

    def run(rotate: bool, outliers: bool) -> dict[int, float]:
        mon = CompressionMonitor(every=1)
        # int8 (per token): a few outlier channels set every row's range. (int4 keys are per channel
        # over a block, which an outlier channel barely disturbs: there is nothing to absorb.)
        caches = [allocate_layer_cache(8, 4, 3, 16, 64, torch.float32, "cpu", rotate=rotate)
                  for _ in range(2)]
        layer_hooks = _attached(mon, caches)
        if outliers:
            hooks.set_key_outliers(1, factor=30.0, channels=(0, 1))
        try:
            for layer, c in enumerate(caches):
                q2, k2, _ = _store(layer_hooks[layer], layer, c, k, v, q)
                s = torch.einsum("thd,shd->tsh", q2[:, :3], k2)
                assert torch.allclose(s, torch.einsum("thd,shd->tsh", q[:, :3], k), atol=1e-3)
        finally:
            hooks.clear_key_outliers()
        return {i: e["k"] for i, e in mon.snapshot_kv().items()}

    base, hit = run(False, False), run(False, True)
    assert abs(hit[0] - base[0]) < 1e-9  # other layers untouched
    assert hit[1] > 1.3 * base[1]  # the hooked layer's keys are harder to quantize
    assert run(True, True)[1] < base[1]  # rotation spreads the outlier channels


def test_spread_rows_samples_distinct_rows_that_move_between_calls():
    from nanokv.kv.monitor import spread_rows
    assert spread_rows(50, 64, 0, torch.device("cpu")) is None  # few rows: all of them
    a, b = (spread_rows(131072, 64, t, torch.device("cpu")) for t in (0, 1))
    assert a is not None and b is not None
    assert a.unique().numel() == 64 and int(a.max()) < 131072 and int(a.min()) >= 0
    assert not set(a.tolist()) & set(b.tolist())  # the next sample visits other rows

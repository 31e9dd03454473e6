"""A worker that keeps its requests' multimodal inputs as views of the slot
(the pinned GPU path, where the decoded tensor is the slot; simulated on a
CPU with ``PINSHM_VLLM_ZERO_COPY=1``), through vLLM's own unchanged
``ShmObjectStoreSenderCache`` and ``ShmObjectStoreReceiverCache``. Needs
vLLM and torch: skipped without them (CI has neither)."""

import types

import pytest

from pinshm.vllm import plugin

ITEM_FLOATS = 16 * 1024  # 64 KiB of float32: travels out of band, by view


def _item(torch, seed):
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(ITEM_FLOATS, generator=g)
    return MultiModalKwargsItem(
        {"pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField())}
    ), pixels


def test_a_zero_copy_worker_holds_200_items_and_1000_more_are_all_cached_around_40_held(
    monkeypatch, unique_name
):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    import threading

    import vllm.envs as envs
    import vllm.multimodal.cache.shm as shm
    import vllm.v1.serial_utils as serial_utils

    monkeypatch.setenv("PINSHM_VLLM_ZERO_COPY", "1")
    monkeypatch.setattr(serial_utils, "PIN_MEMORY", False)  # no GPU here
    for name in plugin.REBOUND:
        monkeypatch.setattr(shm, name, getattr(shm, name))  # undone at teardown
    plugin.register(shm)
    monkeypatch.setattr(envs, "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", unique_name())
    # A 32 MiB ring: 200 items of 64 KiB (12.5 MiB) held fit, a lap is ~450.
    mm = types.SimpleNamespace(mm_processor_cache_gb=1 / 32, mm_shm_cache_max_object_size_mb=4)
    cfg = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(world_size=1),
        model_config=types.SimpleNamespace(get_multimodal_config=lambda: mm),
    )
    sender = shm.ShmObjectStoreSenderCache(cfg)
    receiver = shm.ShmObjectStoreReceiverCache(cfg, threading.Lock())
    try:
        # 200 requests in flight on the worker: their inputs are kept.
        held = []
        for i in range(200):
            item, pixels = _item(torch, i)
            sent, _ = sender.get_and_update_item((item, []), f"h{i}")
            assert set(sent) == {"address", "monotonic_id", "signature"}, f"item {i} uncached"
            got = receiver.get_and_update_item(sent, f"h{i}")["pixel_values"].data
            assert torch.equal(got, pixels)
            held.append((got, pixels))
        # The tensors alias the slot: a second read of a hit views the same bytes.
        again, _ = sender.get_and_update_item(None, "h0")
        view = receiver.get_and_update_item(again, "h0")["pixel_values"].data
        assert view.data_ptr() == held[0][0].data_ptr(), "a copy, not the slot"
        del view
        # 160 requests finish; 40 stay for the whole of what follows.
        held = held[:40]
        for i in range(200, 1200):
            item, pixels = _item(torch, i)
            sent, _ = sender.get_and_update_item((item, []), f"h{i}")
            assert set(sent) == {"address", "monotonic_id", "signature"}, f"item {i} uncached"
            got = receiver.get_and_update_item(sent, f"h{i}")["pixel_values"].data
            assert torch.equal(got, pixels)
            del got
        for got, pixels in held:
            assert torch.equal(got, pixels), "a held input changed"
        del held
    finally:
        receiver._shm_cache.close()
        sender.close()

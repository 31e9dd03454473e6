"""The vllm.general_plugins entry point: against a stand-in for vLLM's
cache module always, and against vLLM itself where it is installed."""

import importlib.metadata
import logging
import os
import subprocess
import sys
import types

import pytest

from pinshm.vllm import plugin, storage


def stand_in():
    m = types.ModuleType("fake_vllm_cache_shm")
    for name in plugin.REBOUND:
        setattr(m, name, object())
    return m


def test_register_rebinds_the_names_the_cache_looks_up_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(plugin, "_registered", False)
    # vLLM's own loggers may not propagate to pytest's handler.
    monkeypatch.setattr(plugin, "_logger", lambda: logging.getLogger("pinshm-test"))
    m = stand_in()
    with caplog.at_level(logging.INFO):
        plugin.register(m)
        plugin.register(m)  # vLLM may load plugins twice
    for name in plugin.REBOUND:
        assert getattr(m, name) is getattr(storage, name)
    lines = [r for r in caplog.records if "pinshm" in r.getMessage() and "in use" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


def test_register_leaves_a_module_that_is_not_vllm_033s_alone_and_warns(caplog, monkeypatch):
    monkeypatch.setattr(plugin, "_logger", lambda: logging.getLogger("pinshm-test"))
    m = stand_in()
    del m.MsgpackSerde
    before = {name: getattr(m, name) for name in plugin.REBOUND if hasattr(m, name)}
    with caplog.at_level(logging.WARNING):
        plugin.register(m)  # never raises: vLLM calls plugins unguarded
    assert {name: getattr(m, name) for name in before} == before
    assert any("not in use" in r.getMessage() and "MsgpackSerde" in r.getMessage() for r in caplog.records)


def test_the_message_queue_switch_installs_it(monkeypatch):
    calls = []
    import pinshm.vllm.message_queue as mq

    monkeypatch.setattr(mq, "install", lambda: calls.append(1))
    m = stand_in()
    monkeypatch.delenv("PINSHM_VLLM_MESSAGE_QUEUE", raising=False)
    plugin.register(m)
    assert calls == [], "off unless asked for"
    monkeypatch.setenv("PINSHM_VLLM_MESSAGE_QUEUE", "1")
    plugin.register(m)
    assert calls == [1]


def test_the_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [e.value for e in eps if e.name == "pinshm"] == ["pinshm.vllm.plugin:register"]


PROBE = """
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # as vLLM's processes do
import vllm.plugins, vllm.multimodal.cache.shm as shm
vllm.plugins.load_general_plugins()
print(shm.SingleWriterShmObjectStorage.__module__)
"""


@pytest.mark.parametrize(
    "allow, want",
    [
        (None, "pinshm.vllm.storage"),
        ("pinshm", "pinshm.vllm.storage"),
        ("other", "vllm.distributed.device_communicators.shm_object_storage"),
    ],
)
def test_vllm_loads_it_unless_vllm_plugins_leaves_it_out(allow, want):
    pytest.importorskip("vllm")
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if allow is not None:
        env["VLLM_PLUGINS"] = allow
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == want
    in_use = "pinshm" in out.stderr + out.stdout and "in use" in out.stderr + out.stdout
    assert in_use == (want == "pinshm.vllm.storage"), out.stderr[-3000:]


def test_vllms_own_cache_classes_run_on_pinshm(monkeypatch, unique_name):
    """vLLM 0.33's ShmObjectStoreSenderCache and ShmObjectStoreReceiverCache,
    unchanged, after register(): an item goes through the store, a hit
    sends only a signed handle, and a forged handle is refused."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    import vllm.envs as envs
    import vllm.multimodal.cache.shm as shm
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    import vllm.v1.serial_utils as serial_utils

    # vLLM's decoder pins large tensors when it thinks CUDA is there; this
    # test runs without a GPU.
    monkeypatch.setattr(serial_utils, "PIN_MEMORY", False)
    for name in plugin.REBOUND:
        monkeypatch.setattr(shm, name, getattr(shm, name))  # undone at teardown
    plugin.register(shm)
    monkeypatch.setattr(envs, "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", unique_name())
    mm = types.SimpleNamespace(mm_processor_cache_gb=1 / 64, mm_shm_cache_max_object_size_mb=4)
    cfg = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(world_size=1),
        model_config=types.SimpleNamespace(get_multimodal_config=lambda: mm),
    )
    sender = shm.ShmObjectStoreSenderCache(cfg)
    receiver = None
    try:
        assert isinstance(sender._shm_cache, storage.SingleWriterShmObjectStorage)
        receiver = shm.ShmObjectStoreReceiverCache(cfg, threading_lock())
        pixels = torch.rand(3, 16, 16)
        item = MultiModalKwargsItem(
            {"pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField())}
        )
        sent, _ = sender.get_and_update_item((item, ["updates"]), "hash0")
        assert set(sent) == {"address", "monotonic_id", "signature"}
        got = receiver.get_and_update_item(sent, "hash0")
        assert torch.equal(got["pixel_values"].data, pixels)
        # A hit: only the handle travels again, and it reads.
        assert sender.is_cached_item("hash0")
        again, updates = sender.get_and_update_item(None, "hash0")
        assert updates == ["updates"]
        sender.validate_input_item(again, "hash0")
        receiver.touch_receiver_cache_item("hash0", again)
        assert torch.equal(receiver.get_and_update_item(again, "hash0")["pixel_values"].data, pixels)
        forged = MultiModalKwargsItem(dict(again))
        forged["signature"] = MultiModalFieldElem(
            data=[0] * 32, field=MultiModalBatchedField()
        )
        with pytest.raises(ValueError, match="Invalid SHM handle signature"):
            receiver.get_and_update_item(forged, "hash0")
        with pytest.raises(ValueError, match="Invalid SHM handle signature"):
            sender.validate_input_item(forged, "hash0")
        sender.clear_cache()
        assert not sender.is_cached_item("hash0")
    finally:
        if receiver is not None:
            receiver._shm_cache.close()
        sender.close()


def threading_lock():
    import threading

    return threading.Lock()

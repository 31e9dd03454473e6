"""The vllm.general_plugins entry point: against a stand-in for vLLM's
cache module always, and against vLLM itself where it is installed."""

import importlib.metadata
import logging
import os
import subprocess
import sys
import types

import pytest

from pinshm.vllm import _status, plugin
from pinshm.vllm.cache import storage
from _small_shm import run_in_small_dev_shm
from _vllm_stand_in import write_stand_in


def stand_in():
    m = types.ModuleType("fake_vllm_cache_shm")
    for name in plugin.REBOUND:
        setattr(m, name, object())
    return m


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin as in a new process: nothing announced or pending."""
    monkeypatch.setattr(_status, "_announced", False)
    monkeypatch.setattr(_status, "_pending", None)
    monkeypatch.setattr(plugin, "rebound", {})
    # vLLM's own loggers may not propagate to pytest's handler.
    monkeypatch.setattr(_status, "_logger", lambda: logging.getLogger("pinshm-test"))
    monkeypatch.delenv("PINSHM_VLLM_MESSAGE_QUEUE", raising=False)


def test_register_rebinds_the_names_the_cache_looks_up_and_logs_once(caplog, fresh_plugin):
    m = stand_in()
    with caplog.at_level(logging.INFO):
        plugin.register(m)
        plugin.register(m)  # vLLM may load plugins twice
    for name in plugin.REBOUND:
        assert getattr(m, name) is getattr(storage, name)
    lines = [r for r in caplog.records if "pinshm" in r.getMessage() and "in use" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


def test_register_leaves_a_module_that_is_not_vllm_033s_alone_and_warns(caplog, fresh_plugin):
    m = stand_in()
    del m.MsgpackSerde
    before = {name: getattr(m, name) for name in plugin.REBOUND if hasattr(m, name)}
    with caplog.at_level(logging.WARNING):
        plugin.register(m)  # never raises: vLLM calls plugins unguarded
    assert {name: getattr(m, name) for name in before} == before
    assert any("stays vLLM's" in r.getMessage() and "MsgpackSerde" in r.getMessage() for r in caplog.records)
    assert not any("in use" in r.getMessage() for r in caplog.records)


def test_the_message_queue_switch_chooses_auto_by_default(monkeypatch, fresh_plugin):
    calls = []
    monkeypatch.setattr(plugin, "install_message_queue", lambda mode="1": calls.append(mode))
    m = stand_in()
    plugin.register(m)
    assert calls == ["auto"], "auto unless told otherwise"
    monkeypatch.setenv("PINSHM_VLLM_MESSAGE_QUEUE", "0")
    plugin.register(m)
    assert calls == ["auto"], "0: vLLM's queue, nothing rebound"
    monkeypatch.setenv("PINSHM_VLLM_MESSAGE_QUEUE", "1")
    plugin.register(m)
    assert calls == ["auto", "1"]


def test_a_queue_that_cannot_be_rebound_leaves_the_cache_rebound(caplog, monkeypatch, fresh_plugin):
    def broken():
        raise NameError("name 'ObjectRef' is not defined")

    monkeypatch.setattr(plugin, "install_message_queue", lambda mode="1": broken())
    monkeypatch.setenv("PINSHM_VLLM_MESSAGE_QUEUE", "1")
    m = stand_in()
    with caplog.at_level(logging.INFO):
        plugin.register(m)
    assert m.SingleWriterShmObjectStorage is storage.SingleWriterShmObjectStorage
    msgs = [r.getMessage() for r in caplog.records]
    assert any("MessageQueue stays vLLM's: NameError" in x for x in msgs), msgs
    in_use = [x for x in msgs if "in use" in x]
    assert len(in_use) == 1 and "cache" in in_use[0] and "MessageQueue" not in in_use[0], msgs


PROBE_STAND_IN = """
import logging, sys, warnings
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
warnings.simplefilter("always")
import vllm.multimodal.cache.shm as shm
from pinshm.vllm import plugin
plugin.register()
print("CACHE", shm.SingleWriterShmObjectStorage.__module__)
try:
    import vllm.v1.executor.multiproc_executor as mp
    print("QUEUE", mp.MessageQueue.__module__)
except NameError:
    print("QUEUE cannot import")
print("REBOUND", sorted(plugin.rebound.get("queue", [])))
"""


def run_stand_in(tmp_path, mode, broken=None):
    env = write_stand_in(tmp_path, {broken: "def f(x: ObjectRef): pass\n"} if broken else None)
    env["PINSHM_VLLM_MESSAGE_QUEUE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", PROBE_STAND_IN, mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, out.stderr


def test_an_executor_module_raising_name_error_leaves_both_rebindings_done(tmp_path):
    stdout, stderr = run_stand_in(tmp_path, "configured")
    assert "CACHE pinshm.vllm.cache.storage" in stdout, stdout + stderr
    assert "QUEUE pinshm.vllm.queue.message_queue" in stdout, stdout + stderr
    assert "ray_executor_v2" not in stdout.split("REBOUND", 1)[1]
    in_use = [x for x in stdout.splitlines() if x.startswith("LOG") and "in use" in x]
    assert len(in_use) == 1 and "cache" in in_use[0] and "MessageQueue" in in_use[0], stdout
    assert "stays vLLM's" not in stdout + stderr


def test_a_queue_module_raising_name_error_leaves_the_cache_rebound_and_says_so(tmp_path):
    stdout, stderr = run_stand_in(
        tmp_path, "configured", broken="vllm/distributed/device_communicators/shm_broadcast.py"
    )
    assert "CACHE pinshm.vllm.cache.storage" in stdout, stdout + stderr
    assert "QUEUE pinshm.vllm.queue.message_queue" not in stdout
    warn = [x for x in stdout.splitlines() if x.startswith("LOG WARNING")]
    assert len(warn) == 1 and "MessageQueue stays vLLM's" in warn[0] and "NameError" in warn[0], stdout
    in_use = [x for x in stdout.splitlines() if "in use" in x]
    assert len(in_use) == 1 and "cache" in in_use[0] and "MessageQueue" not in in_use[0], stdout


def test_before_logging_is_configured_a_failure_still_prints_and_the_in_use_line_waits(tmp_path):
    stdout, stderr = run_stand_in(
        tmp_path, "unconfigured", broken="vllm/distributed/device_communicators/shm_broadcast.py"
    )
    assert "CACHE pinshm.vllm.cache.storage" in stdout, stdout + stderr
    # Through warnings, so it is seen without any logging handler.
    assert "RuntimeWarning: pinshm: MessageQueue stays vLLM's: " in stderr, stderr
    assert "in use" not in stdout + stderr, "held back until a store or queue is built"


def test_the_held_back_in_use_line_comes_when_a_store_is_built(caplog, monkeypatch, fresh_plugin, unique_name):
    monkeypatch.setattr(_status, "_logging_ready", lambda: False)
    plugin.register(stand_in())
    assert _status.pending() is not None
    monkeypatch.setattr(_status, "_logging_ready", lambda: True)
    with caplog.at_level(logging.INFO):
        ring = storage.SingleWriterShmRingBuffer(1 << 20, name=unique_name(), create=True)
        st = storage.SingleWriterShmObjectStorage(1 << 16, 1, ring)
        st.close()
        st2 = storage.SingleWriterShmObjectStorage(
            1 << 16, 1, storage.SingleWriterShmRingBuffer(1 << 20, name=unique_name(), create=True)
        )
        st2.close()
    in_use = [r.getMessage() for r in caplog.records if "in use" in r.getMessage()]
    assert len(in_use) == 1, in_use


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
        (None, "pinshm.vllm.cache.storage"),
        ("pinshm", "pinshm.vllm.cache.storage"),
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
    assert in_use == (want == "pinshm.vllm.cache.storage"), out.stderr[-3000:]


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


def test_auto_takes_vllms_own_check_to_choose_the_queue(monkeypatch):
    from pinshm.vllm.queue import _auto

    mib = 1 << 20
    monkeypatch.setattr(_auto, "shm_free_bytes", lambda path=_auto.SHM_PATH: 64 * mib)
    # vLLM's executor queue on a container's 64 MiB: 10 chunks of 16 MiB.
    use, why = _auto.choose(2, 16 * mib, 10, False)
    assert use and why == "pinshm queue in use: vLLM's needs 160 MiB of /dev/shm, 64 MiB free"
    assert not _auto.choose(2, 1 * mib, 10, False)[0], "10 MiB fits: vLLM's"
    assert _auto.choose(2, 1 * mib, 10, True)[0], "with the tensor arena it does not"
    assert not _auto.choose(0, 16 * mib, 10, False)[0], "no local readers, no ring"
    # vLLM's arithmetic to the byte: chunks plus 1 + n_reader metadata bytes each.
    assert _auto.vllm_queue_bytes(2, 1000, 10, False) == 10 * (1000 + 3)


AUTO_STAND_IN_QUEUE = """
class Handle:
    pass


class MessageQueue:
    # vLLM's, in the part the chooser uses: its check refuses what does
    # not fit, its group helper builds through the module's name.
    def __init__(self, n_reader, n_local_reader, local_reader_ranks=None,
                 max_chunk_bytes=24 << 20, max_chunks=10, connect_ip=None,
                 enable_shm_tensor_arena=False):
        import shutil
        need = (max_chunk_bytes + 1 + n_local_reader) * max_chunks
        if need > shutil.disk_usage("/dev/shm").free:
            raise RuntimeError("Insufficient space in /dev/shm")
        self.handle = Handle()

    def export_handle(self):
        return self.handle

    @staticmethod
    def create_from_handle(handle, rank):
        # As vLLM 0.33's: a bare instance through the module's name.
        self = MessageQueue.__new__(MessageQueue)
        self.rank = rank
        return self

    @staticmethod
    def recv(socket, timeout):
        return ("vllm recv", socket)

    def dequeue(self):
        # As vLLM 0.33's overflow path: its static recv, through the name.
        return MessageQueue.recv("local", None)

    @staticmethod
    def create_from_process_group(pg, max_chunk_bytes, max_chunks):  # pg: the group's size
        writer = MessageQueue(pg, pg, None, max_chunk_bytes, max_chunks)
        return writer, MessageQueue.create_from_handle(writer.export_handle(), 0)
"""

PROBE_AUTO = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
from pinshm.vllm import plugin
plugin.register()
import vllm.distributed.device_communicators.shm_broadcast as sb
import vllm.v1.executor.multiproc_executor as ex
mib = 1 << 20
print("SAME", ex.MessageQueue is sb.MessageQueue)
big = sb.MessageQueue(2, 2, max_chunk_bytes=16 * mib, max_chunks=10)
print("BIG", type(big).__module__)
small = sb.MessageQueue(2, 2, max_chunk_bytes=1 * mib, max_chunks=10)
print("SMALL", type(small).__module__)
print("READ_BIG", type(sb.MessageQueue.create_from_handle(big.export_handle(), 0)).__module__)
small_reader = sb.MessageQueue.create_from_handle(small.export_handle(), 1)
print("READ_SMALL", type(small_reader).__module__, small_reader.rank)
print("DEQUEUE", small_reader.dequeue())
w, r = sb.MessageQueue.create_from_process_group(2, 16 * mib, 10)
print("GROUP", type(w).__module__, type(r).__module__)
for q in (big, w, r):
    q.close()
"""


def test_auto_uses_pinshms_queue_where_vllms_would_not_fit_a_container(tmp_path):
    # A stand-in for vLLM whose queue refuses, as
    # vLLM's does, what /dev/shm cannot hold, on a container's 64 MiB.
    env = write_stand_in(tmp_path, {"vllm/distributed/device_communicators/shm_broadcast.py": AUTO_STAND_IN_QUEUE})
    env["PINSHM_VLLM_MESSAGE_QUEUE"] = ""
    out = run_in_small_dev_shm(PROBE_AUTO, size="64m", env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    pinshm_mq = "pinshm.vllm.queue.message_queue"
    assert "SAME True" in text, text
    assert f"BIG {pinshm_mq}" in text, text
    assert "SMALL vllm.distributed.device_communicators.shm_broadcast" in text, text
    assert f"READ_BIG {pinshm_mq}" in text, "a reader follows its handle"
    assert "READ_SMALL vllm.distributed.device_communicators.shm_broadcast 1" in text, text
    assert "DEQUEUE ('vllm recv', 'local')" in text, "vLLM's statics reached through the name"
    assert f"GROUP {pinshm_mq} {pinshm_mq}" in text, "vLLM's group helper goes through the chooser"
    assert "pinshm queue in use: vLLM's needs 160 MiB of /dev/shm, 64 MiB free" in text, text

"""The CUDA path of `pinshm.device.put_tensor(..., wait=False)` with
torch's CUDA calls stood in (no GPU here; torch needed, so CI skips it):
the copy is queued, never waited for, and published by its event; a copy
that raises waits for what was queued, then frees its slot and key; on a
side stream the copy is ordered after an event on the current stream and
its source lives until the copy's event; the encoder-cache connector
saves on pinshm's own stream."""

import time

import pytest
from test_saves import LONG, StandInEvent, cache_store

import pinshm
import pinshm.device


class _RecordedEvent(StandInEvent):
    """A stand-in for torch.cuda.Event: `record()` notes it, and
    `synchronize()` notes that the caller waited (it never blocks)."""

    def __init__(self, log):
        super().__init__()
        self._log = log

    def record(self, stream=None):
        self._log.append(("record", self, stream if stream is not None else _current[-1]))

    def synchronize(self):
        self._log.append(("synchronize", self))


def _stand_in_cuda(monkeypatch, torch, pinned=True):
    """torch.cuda.Event and torch.cuda.device stood in (no GPU here), the
    slot taken for pinned memory or not, and pinned staging for plain host
    memory; returns the log of what put_tensor did."""
    import contextlib

    log = []
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _RecordedEvent(log))
    monkeypatch.setattr(torch.cuda, "device", lambda _d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_a: _current[-1])

    @contextlib.contextmanager
    def on(stream):
        _current.append(stream)
        log.append(("enter", stream))
        try:
            yield
        finally:
            _current.pop()
            log.append(("leave", stream))

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(pinshm.device, "_is_pinned", lambda _t: pinned)

    def staging(torch_, shape, dtype):
        log.append(("staging", None))
        return torch_.empty(shape, dtype=dtype)

    monkeypatch.setattr(pinshm.device, "_pinned_empty", staging)
    return log


class _StandInStream:
    """A stand-in for torch.cuda.Stream: `wait_event` is noted."""

    def __init__(self, name, log=None):
        self.name = name
        self._log = log

    def wait_event(self, event):
        self._log.append(("wait_event", self, event))

    def __repr__(self):
        return self.name


_current = [_StandInStream("current")]


class _AsIfOnCuda:
    """A CPU tensor that says it is on a GPU: what `put_tensor` asks of a
    tensor, so that its CUDA path runs with stand-in events."""

    __module__ = "torch.stand_in"
    is_cuda = True
    device = "cuda:0"

    def __init__(self, t):
        self._t = t
        self.dtype = t.dtype
        self.shape = t.shape

    def detach(self):
        return self._t.detach()


@pytest.mark.parametrize("pinned", [True, False], ids=["into a pinned slot", "staged for a pageable slot"])
def test_a_cuda_save_without_waiting_queues_its_copy_and_is_published_by_its_event(
    unique_name, closing, monkeypatch, pinned
):
    torch = pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    log = _stand_in_cuda(monkeypatch, torch, pinned)
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    t = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    save = pinshm.device.put_tensor(store, "k", _AsIfOnCuda(t), wait=False)
    queued = ["record"] if pinned else ["staging", "record"]
    assert [what for what, *_ in log] == queued, "the save waited for its copy"
    assert save.state == "pending" and store.is_pending("k") and reader.lookup("k") is None
    assert pinshm.device.put_tensor(store, "k", _AsIfOnCuda(t), wait=False) is None
    assert len(log) == len(queued), "a second save of a pending key queued a copy"
    log[-1][1].complete()
    h = save.wait(timeout=LONG)
    assert torch.equal(pinshm.device.get_tensor(reader, h, "cpu"), t)


def test_a_cuda_save_whose_copy_raises_waits_for_what_was_queued_then_frees_its_slot_and_key(
    unique_name, closing, monkeypatch
):
    torch = pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    log = _stand_in_cuda(monkeypatch, torch)
    store = closing(cache_store(unique_name(), n_readers=1))
    objects = store.stats()["objects"]
    wrong = _AsIfOnCuda(torch.zeros(8, 8))
    wrong.detach = lambda: torch.zeros(3, 3)  # a copy torch refuses
    with pytest.raises(RuntimeError):
        pinshm.device.put_tensor(store, "k", wrong, wait=False)
    assert [what for what, *_ in log] == ["record", "synchronize"]
    assert len(log) == 2
    assert not store.is_pending("k") and store.stats()["objects"] == objects
    assert pinshm.device.put_tensor(store, "k", torch.ones(4), wait=False).state == "published"


def test_a_cuda_save_on_a_side_stream_copies_after_the_current_streams_work_and_keeps_its_source_alive(
    unique_name, closing, monkeypatch
):
    import gc
    import weakref

    torch = pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    log = _stand_in_cuda(monkeypatch, torch)
    side = _StandInStream("side", log)
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    t = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    held = [t.detach()]  # the caller's only reference to the source
    gone = weakref.ref(held[0])
    on_gpu = _AsIfOnCuda(t)
    on_gpu.detach = lambda: held[0]
    save = pinshm.device.put_tensor(store, "k", on_gpu, wait=False, stream=side)
    # Ordered: an event on the current stream (after the output's
    # producer), the side stream waits for it, the copy and its completion
    # event on the side stream; nothing waited for.
    produced, entered, waited, done, left = log
    assert produced[0] == "record" and produced[2] is _current[0]
    assert entered == ("enter", side)
    assert waited == ("wait_event", side, produced[1])
    assert done[0] == "record" and done[2] is side
    assert left == ("leave", side)
    assert _current == [_current[0]], "the current stream is the engine's again"
    assert save.state == "pending" and reader.lookup("k") is None
    # The source outlives every reference of the caller until the copy's
    # event completes: the allocator cannot reuse its memory meanwhile.
    held.clear()
    del on_gpu
    gc.collect()
    assert gone() is not None, "the source was dropped before its copy completed"
    done[1].complete()
    h = save.wait(timeout=LONG)
    assert torch.equal(pinshm.device.get_tensor(reader, h, "cpu"), t)
    deadline = time.monotonic() + LONG
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert gone() is None, "the source is kept after its copy completed"


def test_the_encoder_cache_saves_a_cuda_output_on_pinshm_s_own_stream_of_its_device(unique_name, monkeypatch):
    from pinshm.vllm.ec import _worker
    from pinshm.vllm.ec._config import ECSettings

    torch = pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    calls = []
    monkeypatch.setattr(_worker, "copy_stream", lambda device: ("stream of", device))
    monkeypatch.setattr(_worker, "put_tensor", lambda store, key, value, **kw: calls.append(kw))
    settings = ECSettings.from_extra({"store": unique_name(), "size": "4m"})
    side = _worker.WorkerSide(settings, producer=True, consumer=False, writes=True)
    try:
        assert side.store is not None
        side.save({"gpu": _AsIfOnCuda(torch.zeros(4, 4)), "cpu": torch.zeros(4, 4)}, "gpu")
        side.save({"cpu": torch.zeros(4, 4)}, "cpu")
        assert calls == [
            {"wait": False, "stream": ("stream of", "cuda:0")},
            {"wait": False, "stream": None},
        ]
    finally:
        side.close()

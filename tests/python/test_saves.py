"""Saves that never stall a step (`ObjectStore.publish_after`,
`pinshm.device.put_tensor(..., wait=False)`), with stand-in events the
test completes or breaks itself: a pending save is a miss everywhere,
in other processes too, until its event completes; a forked child never
sees or publishes its parent's; a copy that fails frees its key and slot
at once; a second save of a pending key copies nothing. And reservations
given back free their key at once. No assertion depends on timing: each
waits on the event it tests, with a generous bound."""

import multiprocessing as mp
import threading

import numpy as np
import pytest

import pinshm
import pinshm.device

KIB = 1 << 10
LONG = 60.0  # seconds: a bound that only turns a hang into a failure


class StandInEvent:
    """A copy's event that completes, or fails, only when the test says
    so (`complete()`, `fail()`): `query()` is what pinshm's poller calls."""

    def __init__(self):
        self._done = threading.Event()
        self._error = None
        self.queries = 0

    def complete(self):
        self._done.set()

    def fail(self, error):
        self._error = error
        self._done.set()

    def query(self):
        self.queries += 1
        if self._error is not None:
            raise self._error
        return self._done.is_set()

    def synchronize(self):
        self._done.wait()


def cache_store(name, slots=8, size=4 * KIB, n_readers=2):
    cap = slots * pinshm.ObjectStore.slot_len(n_readers, size + 256)
    return pinshm.ObjectStore(cap, size + 256, n_readers, name=name, reserve=False, cache=True, key_index=4 * slots)


def pending_save(store, key, data):
    """A save of `data` (uint8) under `key` whose copy "completes" when
    the returned event does: the bytes are written, the publish waits."""
    r = store.reserve_tensor(key, "uint8", [len(data)])
    view = np.frombuffer(r, dtype=np.uint8)
    view[:] = np.frombuffer(data, dtype=np.uint8)
    del view
    event = StandInEvent()
    return store.publish_after(r, event), event


def assert_a_miss_everywhere(store, reader, key):
    assert store.is_pending(key)
    assert not store.is_cached(key)
    assert store.get_cached(key) is None
    assert store.lookup(key) is None
    assert reader.lookup(key) is None
    assert reader.lease_key(key) is None


# ---- aborted reservations ----------------------------------------------


def test_an_aborted_reservation_frees_its_key_at_once_and_its_slot_when_given_back_by_the_store(unique_name, closing):
    store = closing(cache_store(unique_name(), slots=4, n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    r = store.reserve_tensor("k", "uint8", [4 * KIB])
    assert store.is_pending("k")
    r.abort()
    assert not store.is_pending("k")
    h = store.put("k", b"saved again")  # no lap of the allocator needed
    assert reader.get_copy(h) == b"saved again"
    objects = store.stats()["objects"]
    r = store.reserve_tensor("j", "uint8", [4 * KIB])
    store.abort(r)
    store.abort(r)
    assert store.stats()["objects"] == objects, "the store's abort frees the slot at once"
    store.put("j", b"j again")


def test_an_abort_with_a_view_alive_frees_the_key_at_once_and_keeps_the_view_apart(unique_name, closing):
    store = closing(cache_store(unique_name(), slots=4, n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    r = store.reserve_tensor("k", "uint8", [64])
    view = np.frombuffer(r, dtype=np.uint8)
    store.abort(r)
    h = store.put("k", b"n" * 64)
    view[:] = 1  # still ours to write, in a slot nobody sees
    assert reader.get_copy(h) == b"n" * 64
    del view


# ---- saves that wait for an event ----------------------------------------


def _poll_by_key(name, key, rounds, out, go):
    """A reader process: looks `key` up `rounds` times (reporting how many
    found it), then, once told the save is published, once more."""
    r = pinshm.StoreReader.attach_by_name(name)
    try:
        found = 0
        for _ in range(rounds):
            if r.lookup(key) is not None or r.lease_key(key) is not None:
                found += 1
        out.put(("before", found))
        if not go.wait(LONG):
            out.put(("after", "never told"))
            return
        h = r.lookup(key)
        out.put(("after", None if h is None else r.get_tensor(h).tobytes()))
    finally:
        r.close()


def test_a_pending_save_is_a_miss_for_a_reader_in_another_process_until_its_event_completes(unique_name, closing, ctx):
    store = closing(cache_store(unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    data = bytes(range(256)) * 8
    save, event = pending_save(store, "img", data)
    assert save.state == "pending" and not save.done and save.handle is None
    assert_a_miss_everywhere(store, reader, "img")
    out, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_poll_by_key, args=(store.name, "img", 2000, out, go))
    p.start()
    try:
        assert out.get(timeout=LONG) == ("before", 0), "seen before its event completed"
        assert not save.done
        event.complete()
        h = save.wait(timeout=LONG)
        assert save.state == "published" and save.handle == h
        assert not store.is_pending("img") and store.lookup("img") == h
        go.set()
        assert out.get(timeout=LONG) == ("after", data)
    finally:
        go.set()
        p.join(LONG)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def _in_forked_child(store, reader_name, save, event, out):
    """The forked child: completes its copy of the event, flushes, and
    reports what it sees of the parent's pending save."""
    seen = {"pending_here": pinshm.flush_releases()}
    event.complete()  # the child's own copy of the stand-in
    seen["pending_after_flush"] = pinshm.flush_releases()
    for name, call in [
        ("is_pending", lambda: store.is_pending("k")),
        ("flush_pending", lambda: store.flush_pending(timeout=0)),
        ("save.done", lambda: save.done),
        ("save.wait", lambda: save.wait(timeout=0)),
    ]:
        try:
            seen[name] = ("returned", call())
        except pinshm.PinshmError as e:
            seen[name] = ("raised", type(e).__name__)
    r = pinshm.StoreReader.attach_by_name(reader_name)
    seen["lookup"] = r.lookup("k")
    r.close()
    out.put(seen)


def test_a_forked_child_never_sees_nor_publishes_its_parents_pending_save(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=3))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    data = b"parent's bytes" * 64
    save, event = pending_save(store, "k", data)
    fork = mp.get_context("fork")
    out = fork.Queue()
    p = fork.Process(target=_in_forked_child, args=(store, store.name, save, event, out))
    p.start()
    try:
        seen = out.get(timeout=LONG)
    finally:
        p.join(LONG)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert seen["pending_here"] == 0 and seen["pending_after_flush"] == 0, seen
    for name in ("is_pending", "flush_pending", "save.done", "save.wait"):
        assert seen[name][0] == "raised", (name, seen[name])
    assert seen["lookup"] is None
    # The child published nothing; the parent's save is still its own.
    assert_a_miss_everywhere(store, reader, "k")
    assert not event._done.is_set()  # the child's complete() was its copy's
    event.complete()
    h = save.wait(timeout=LONG)
    assert reader.get_tensor(h).tobytes() == data


def test_a_save_whose_event_raises_frees_its_slot_and_key_at_once(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    objects = store.stats()["objects"]
    save, event = pending_save(store, "k", b"x" * 512)
    assert store.stats()["objects"] == objects + 1
    event.fail(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(pinshm.PinshmError, match="illegal memory access"):
        save.wait(timeout=LONG)
    assert save.state == "failed" and "illegal memory access" in save.error
    assert save.handle is None
    assert not store.is_pending("k") and not store.is_cached("k")
    assert reader.lookup("k") is None
    assert store.stats()["objects"] == objects, "the failed save's slot is freed at once"
    again = pinshm.device.put_tensor(store, "k", np.full(8, 7, dtype=np.uint8), wait=False)
    assert again is not None and again.state == "published"
    assert reader.get_tensor(again.handle).tobytes() == b"\x07" * 8


def test_a_save_whose_copy_raises_frees_its_slot_and_key_at_once(unique_name, closing, monkeypatch):
    store = closing(cache_store(unique_name(), n_readers=1))
    objects = store.stats()["objects"]

    def copy_half_then_fail(np_, r, array):
        memoryview(r)[: len(r) // 2] = b"\xff" * (len(r) // 2)
        raise RuntimeError("the copy failed half way")

    with monkeypatch.context() as m:
        m.setattr(pinshm.device, "_fill_numpy", copy_half_then_fail)
        with pytest.raises(RuntimeError, match="half way"):
            pinshm.device.put_tensor(store, "k", np.zeros(64, dtype=np.uint8), wait=False)
    assert not store.is_pending("k") and not store.is_cached("k")
    assert store.stats()["objects"] == objects, "the failed save's slot is freed at once"
    save = pinshm.device.put_tensor(store, "k", np.ones(64, dtype=np.uint8), wait=False)
    assert save.state == "published"


def test_a_second_save_of_a_pending_key_is_a_no_op(unique_name, closing, monkeypatch):
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    first = b"first" * 100
    save, event = pending_save(store, "k", first)

    def no_copy(*_args):
        raise AssertionError("a second save of a pending key copied")

    monkeypatch.setattr(pinshm.device, "_fill_numpy", no_copy)
    objects = store.stats()["objects"]
    assert pinshm.device.put_tensor(store, "k", np.zeros(500, dtype=np.uint8), wait=False) is None
    assert store.stats()["objects"] == objects, "nothing reserved"
    # A put that does not know it is pending says why it cannot.
    with pytest.raises(pinshm.InvalidArgumentError, match="in flight"):
        store.put("k", b"other")
    event.complete()
    h = save.wait(timeout=LONG)
    assert reader.get_tensor(h).tobytes() == first


def test_a_host_tensor_saved_without_waiting_is_published_at_once(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    save = pinshm.device.put_tensor(store, "a", a, wait=False)
    assert save.done and save.state == "published" and save.key == "a"
    assert store.lookup("a") == save.handle == save.wait(timeout=0)
    np.testing.assert_array_equal(reader.get_tensor(save.handle), a)


def test_a_staged_save_copies_its_staged_bytes_into_the_slot_only_once_its_event_completes(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    r = store.reserve_tensor("k", "uint8", [256])
    with pytest.raises(ValueError, match="staged"):
        store.publish_after(r, StandInEvent(), np.zeros(255, dtype=np.uint8))
    staged = np.zeros(256, dtype=np.uint8)
    event = StandInEvent()
    save = store.publish_after(r, event, staged)
    # What the (stand-in) copy writes into the staging buffer meanwhile is
    # what the slot gets: its bytes are taken only after the event.
    staged[:] = np.arange(256, dtype=np.uint8)
    assert reader.lookup("k") is None
    event.complete()
    h = save.wait(timeout=LONG)
    assert reader.get_tensor(h).tobytes() == bytes(range(256))


def test_flush_pending_publishes_every_save_and_gives_up_after_its_timeout(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    saves = [pending_save(store, f"k{i}", bytes([i]) * 64) for i in range(3)]
    assert store.flush_pending(timeout=0.01) == 3  # none complete: the bound ends it
    with pytest.raises(pinshm.WaitTimeoutError):
        saves[0][0].wait(timeout=0)
    for _, event in saves:
        event.complete()
    assert store.flush_pending(timeout=LONG) == 0
    for i, (save, _) in enumerate(saves):
        assert save.state == "published" and store.lookup(f"k{i}") == save.handle


def test_closing_a_store_with_a_save_pending_publishes_nothing_and_waits_for_nothing(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    save, event = pending_save(store, "k", b"k" * 64)
    store.close()  # returns although the event never completes meanwhile
    event.complete()
    with pytest.raises(pinshm.PinshmError, match="discarded"):
        save.wait(timeout=LONG)
    assert save.state == "discarded" and save.handle is None


def test_a_save_pending_when_the_store_is_cleared_is_never_published(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    save, event = pending_save(store, "k", b"k" * 64)
    store.clear()
    assert not store.is_pending("k")
    event.complete()
    with pytest.raises(pinshm.PinshmError):
        save.wait(timeout=LONG)
    assert save.state == "failed" and not store.is_cached("k")
    store.put("k", b"after the clear")

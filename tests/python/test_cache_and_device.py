"""Cache stores through the binding: readers that look keys up without the
writer (in other processes), leases that outlive laps of puts and die with
their holder, reservations written in place, and tensors into and out of
slots (`pinshm.device`: numpy here; torch where it is installed)."""

import os
import signal

import numpy as np
import pytest

import pinshm
import pinshm.device

KIB = 1 << 10


def cache_store(name, slots=8, size=4 * KIB, n_readers=2):
    cap = slots * pinshm.ObjectStore.slot_len(n_readers, size + 256)
    return pinshm.ObjectStore(
        cap, size + 256, n_readers, name=name, reserve=False, cache=True, key_index=4 * slots
    )


def _look_up(name, keys, out):
    """A child process: attaches by name and looks every key up."""
    r = pinshm.StoreReader.attach_by_name(name)
    found = {}
    for k in keys:
        h = r.lookup(k)
        if h is not None:
            found[k] = (h.address, h.monotonic_id, bytes(r.get(h))[:8])
    r.close()
    out.put(found)


def test_a_reader_in_another_process_finds_keys_the_writer_stored(unique_name, closing, ctx):
    store = closing(cache_store(unique_name(), slots=8))
    for i in range(20):
        store.put(f"img{i}", bytes([i]) * 4 * KIB)
    q = ctx.Queue()
    p = ctx.Process(target=_look_up, args=(store.name, [f"img{i}" for i in range(20)], q))
    p.start()
    found = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    # Exactly the keys the writer still has, each with its own bytes.
    assert set(found) == {k for k in (f"img{i}" for i in range(20)) if store.is_cached(k)}
    assert 0 < len(found) < 20
    for k, (addr, mid, head) in found.items():
        h = store.lookup(k)
        assert (h.address, h.monotonic_id) == (addr, mid)
        assert head == bytes([int(k[3:])]) * 8


def test_a_store_without_a_key_index_says_so(unique_name, closing):
    store = closing(pinshm.ObjectStore(1 << 20, 1 << 16, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    with pytest.raises(pinshm.PinshmError, match="key_index"):
        reader.lookup("k")


def test_a_lease_keeps_an_unread_object_through_laps_of_puts(unique_name, closing):
    store = closing(cache_store(unique_name(), slots=8, n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    store.put("kept", b"k" * 4 * KIB)
    lease = reader.lease_key("kept")
    assert lease is not None and not lease.released
    for i in range(80):
        store.put(f"f{i}", bytes([i % 256]) * 4 * KIB)
    assert store.is_cached("kept")
    assert bytes(reader.get(lease.handle))[:4] == b"kkkk"
    with lease:
        pass
    assert lease.released
    for i in range(16):
        store.put(f"g{i}", b"g" * 4 * KIB)
    assert not store.is_cached("kept")
    with pytest.raises(pinshm.StaleError):
        reader.lease(lease.handle)
    assert reader.lease_key("kept") is None


def _lease_and_wait(name, keys, ready):
    r = pinshm.StoreReader.attach_by_name(name)
    leases = [r.lease_key(k) for k in keys]
    assert all(lease is not None for lease in leases)
    ready.set()
    signal.pause()


def test_a_killed_leaseholders_leases_are_ignored(unique_name, closing, ctx):
    store = closing(cache_store(unique_name(), slots=4, n_readers=1))
    keys = [f"held{i}" for i in range(4)]
    for k in keys:
        store.put(k, b"h" * 4 * KIB)
    ready = ctx.Event()
    p = ctx.Process(target=_lease_and_wait, args=(store.name, keys, ready))
    p.start()
    try:
        assert ready.wait(60)
        # Every object of the ring is leased: nothing may go.
        with pytest.raises(pinshm.FullError):
            store.put("more", b"m" * 4 * KIB)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
    for i in range(8):
        store.put(f"after{i}", b"a" * 4 * KIB)
    assert not any(store.is_cached(k) for k in keys)
    assert store.stats()["dead_readers_reaped"] >= 1


def test_a_cache_reclaims_objects_no_reader_read(unique_name, closing):
    store = closing(cache_store(unique_name(), slots=4, n_readers=2))
    closing(pinshm.StoreReader.attach(store.handle()))
    for i in range(100):
        store.put(f"k{i}", b"x" * 4 * KIB)
    assert store.stats()["evictions"] >= 96


def test_a_reservation_is_invisible_until_published_and_refused_while_viewed(
    unique_name, closing
):
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    r = store.reserve_tensor("t", "float32", [4, 8])
    assert (r.dtype, r.shape, len(r)) == ("float32", (4, 8), 128)
    view = np.frombuffer(r, dtype=np.float32).reshape(4, 8)
    view[...] = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert reader.lookup("t") is None
    with pytest.raises(BufferError):
        store.publish(r)
    del view
    h = store.publish(r)
    assert reader.lookup("t") == h
    np.testing.assert_array_equal(
        reader.get_tensor(h), np.arange(32, dtype=np.float32).reshape(4, 8)
    )
    with pytest.raises(ValueError):
        store.publish(r)
    with pytest.raises(pinshm.InvalidArgumentError):
        store.reserve_tensor("t", "float32", [1])
    with pytest.raises(ValueError, match="complex64"):
        store.reserve_tensor("c", "complex64", [1])


def test_a_byte_reservation_stores_what_a_put_of_its_bytes_stores(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    r = store.reserve_bytes("b", 100)
    assert (r.dtype, r.shape, len(r)) == ("uint8", (100,), 100)
    view = np.frombuffer(r, dtype=np.uint8)
    view[...] = np.arange(100, dtype=np.uint8)
    with pytest.raises(BufferError):
        store.publish(r)
    assert reader.lookup("b") is None
    del view
    h = store.publish(r)
    assert reader.get_copy(h) == bytes(range(100))
    with pytest.raises(pinshm.InvalidArgumentError):
        store.reserve_bytes("b", 1)  # the key is taken
    assert reader.get_copy(store.publish(store.reserve_bytes("empty", 0))) == b""


def test_an_aborted_reservation_frees_its_slot_in_turn(unique_name, closing):
    store = closing(cache_store(unique_name(), slots=4, n_readers=1))
    r = store.reserve_tensor("gone", "uint8", [4 * KIB])
    r.abort()
    r.abort()
    for i in range(8):
        store.put(f"k{i}", b"k" * 4 * KIB)
    store.put("gone", b"the key is free again")


def test_numpy_arrays_go_in_and_come_out_of_slots(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    a = np.arange(24, dtype=np.int16).reshape(2, 3, 4)[:, ::-1]  # not contiguous
    h = pinshm.device.put_tensor(store, "a", a)
    if "torch" in __import__("sys").modules:
        pytest.skip("torch is imported: get_tensor returns torch tensors")
    out = pinshm.device.get_tensor(reader, h)
    np.testing.assert_array_equal(out, a)
    out[0, 0, 0] = 99  # a copy: the slot is not written
    np.testing.assert_array_equal(pinshm.device.get_tensor(reader, h), a)
    # The read was released: nothing holds the object.
    assert store.free_unused() == 1
    with pytest.raises(pinshm.StaleError):
        pinshm.device.get_tensor(reader, h)


def test_a_put_that_fails_publishes_nothing(unique_name, closing):
    store = closing(cache_store(unique_name(), n_readers=1))
    pinshm.device.put_tensor(store, "k", np.zeros(4, dtype=np.float32))
    with pytest.raises(pinshm.InvalidArgumentError):
        pinshm.device.put_tensor(store, "k", np.zeros(4, dtype=np.float32))
    with pytest.raises(pinshm.InvalidArgumentError):
        pinshm.device.put_tensor(store, "huge", np.zeros(1 << 20, dtype=np.float32))
    assert not store.is_cached("huge")


def test_torch_tensors_round_trip_with_bfloat16(unique_name, closing):
    torch = pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    store = closing(cache_store(unique_name(), n_readers=1))
    reader = closing(pinshm.StoreReader.attach(store.handle()))
    t = torch.randn(16, 32).to(torch.bfloat16)
    h = pinshm.device.put_tensor(store, "t", t.t())  # strided
    out = pinshm.device.get_tensor(reader, h, "cpu")
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (32, 16)
    assert torch.equal(out, t.t())
    assert store.free_unused() == 1


def test_an_abort_with_a_view_alive_closes_when_the_view_goes(unique_name, closing):
    store = closing(cache_store(unique_name(), slots=4, n_readers=1))
    r = store.reserve_tensor("t", "uint8", [4 * KIB])
    view = np.frombuffer(r, dtype=np.uint8)
    r.abort()
    view[:] = 1  # still ours to write, and nobody sees it
    with pytest.raises(ValueError, match="published or aborted"):
        store.publish(r)
    del view
    for i in range(8):
        store.put(f"k{i}", b"k" * 4 * KIB)
    store.put("t", b"the key is free again")


def test_a_reservation_of_another_store_stays_open_in_its_own(unique_name, closing):
    a = closing(cache_store(unique_name("a"), n_readers=1))
    b = closing(cache_store(unique_name("b"), n_readers=1))
    r = a.reserve_tensor("t", "uint8", [8])
    with pytest.raises(ValueError, match="another store"):
        b.publish(r)
    h = a.publish(r)
    assert a.lookup("t") == h


def test_a_torch_copy_that_fails_gives_the_slot_and_key_back(unique_name, closing):
    torch = pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    store = closing(cache_store(unique_name(), slots=4, n_readers=1))
    with pytest.raises((NotImplementedError, RuntimeError)):
        pinshm.device.put_tensor(store, "meta", torch.empty(16, device="meta"))
    assert not store.is_cached("meta")
    for i in range(8):
        store.put(f"k{i}", b"k" * 4 * KIB)
    pinshm.device.put_tensor(store, "meta", torch.zeros(16))

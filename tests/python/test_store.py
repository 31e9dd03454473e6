"""The store's native API: puts, reads, accounting, errors."""

import gc
import threading

import numpy as np
import pytest

import pinshm

KIB = 1024


# The `store` fixture (conftest): 1 MiB for objects up to 64 KiB, one reader.
STORE_SHAPE = (1 << 20, 64 * KIB, 1)


def test_bytes_put_by_the_writer_are_read_back_by_a_reader(store, reader):
    h = store.put("k", b"hello")
    with reader.get(h) as g:
        assert bytes(g) == b"hello"
        assert len(g) == 5
        assert g.handle == h
    assert reader.get_copy(h) == b"hello"


@pytest.mark.parametrize(
    "data",
    [
        b"bytes",
        bytearray(b"bytearray"),
        memoryview(b"a memoryview"),
        np.arange(100, dtype=np.float32),
        np.zeros((3, 4), dtype=np.int64),
    ],
    ids=["bytes", "bytearray", "memoryview", "float32", "int64_2d"],
)
def test_any_contiguous_buffer_can_be_put(store, reader, data):
    h = store.put("k", data)
    assert reader.get_copy(h) == memoryview(data).tobytes()


def test_a_non_contiguous_array_is_refused(store):
    with pytest.raises((BufferError, ValueError)):
        store.put("k", np.arange(10)[::2])


def test_an_empty_object_round_trips(store, reader):
    h = store.put("empty", b"")
    assert reader.get_copy(h) == b""
    with reader.get(h) as g:
        assert memoryview(g).nbytes == 0


def test_get_copy_into_fills_a_writable_buffer_and_returns_the_length(store, reader):
    h = store.put("k", b"0123456789")
    out = bytearray(16)
    assert reader.get_copy_into(h, out) == 10
    assert out[:10] == b"0123456789"
    arr = np.zeros(10, dtype=np.uint8)
    h2 = store.put("k2", b"abcdefghij")
    assert reader.get_copy_into(h2, arr) == 10
    assert arr.tobytes() == b"abcdefghij"


def test_get_copy_into_refuses_a_read_only_or_too_small_buffer(store, reader):
    h = store.put("k", b"0123456789")
    with pytest.raises(BufferError):
        reader.get_copy_into(h, b"\0" * 16)
    with pytest.raises(ValueError, match="too small"):
        reader.get_copy_into(h, bytearray(4))


def test_cached_keys_are_found_referenced_and_protected(store):
    h = store.put("k", b"v")
    assert store.is_cached("k")
    assert not store.is_cached("other")
    assert store.get_cached("k") == h
    assert store.get_cached("other") is None
    store.add_reference("k")
    with pytest.raises(KeyError):
        store.add_reference("other")
    store.protect("k")
    store.release_protections()
    assert store.stats()["hits"] >= 1


def test_free_unused_reclaims_only_what_every_reader_has_read(store, reader):
    h = store.put("k", b"v")
    assert store.free_unused() == 0
    reader.acknowledge(h)
    assert store.free_unused() == 1
    assert not store.is_cached("k")


def test_clear_forgets_keys_and_clear_hard_makes_handles_stale(store, reader):
    h = store.put("k", b"v")
    store.clear()
    assert not store.is_cached("k")
    assert reader.get_copy(h) == b"v"  # a soft clear keeps old bytes readable
    store.clear_hard()
    with pytest.raises(pinshm.StaleError):
        reader.get_copy(h)


def test_stale_error_is_a_value_error_with_the_reference_message(store, reader):
    h = store.put("k", b"v")
    store.clear_hard()
    with pytest.raises(pinshm.StaleError) as e:
        reader.get(h)
    assert isinstance(e.value, ValueError)
    assert str(e.value) == (
        f"Data for address:id '{h.address}:{h.monotonic_id}' has been modified or is invalid."
    )
    with pytest.raises(pinshm.StaleError):
        reader.validate(h)


def test_a_handle_that_never_existed_is_stale(store, reader):
    with pytest.raises(pinshm.StaleError):
        reader.get_copy(pinshm.ObjectHandle(0, 12345, 0))


def test_a_full_ring_raises_full_error_a_memory_error(unique_name, closing):
    store = closing(pinshm.ObjectStore(64 * KIB, 16 * KIB, 1, name=unique_name()))
    with pytest.raises(pinshm.FullError) as e:
        for i in range(10):
            store.put(f"k{i}", bytes(16 * KIB))
    assert isinstance(e.value, MemoryError)
    assert "store full" in str(e.value)
    assert store.stats()["full_errors"] == 1


def test_a_duplicate_key_or_a_too_large_object_raises_value_error(store):
    store.put("k", b"v")
    with pytest.raises(ValueError, match="already exists"):
        store.put("k", b"w")
    with pytest.raises(ValueError, match="exceeds max object size"):
        store.put("big", bytes(64 * KIB + 1))


def test_an_invalid_configuration_raises_value_error(unique_name):
    with pytest.raises(ValueError, match="n_readers"):
        pinshm.ObjectStore(1 << 20, 1024, 0, name=unique_name())


def test_the_layout_sizes_bound_from_rust_size_a_ring_exactly(unique_name, closing):
    cap, n = 1 << 16, 3
    largest = pinshm.ObjectStore.largest_object(cap, n)
    assert pinshm.ObjectStore.slot_len(n, largest) + pinshm.ObjectStore.SLOT_ALIGN == cap
    s = closing(pinshm.ObjectStore(cap, largest, n, name=unique_name()))
    s.put("k", bytes(largest))
    assert s.stats()["bytes_in_use"] == pinshm.ObjectStore.slot_len(n, largest)
    with pytest.raises(ValueError, match="max_object_size"):
        pinshm.ObjectStore(cap, largest + 1, n, name=unique_name())
    # The same error as creating a store with that many readers.
    for bad in (0, 1025):
        with pytest.raises(pinshm.InvalidArgumentError, match="n_readers"):
            pinshm.ObjectStore(cap, 1024, bad, name=unique_name())
        with pytest.raises(pinshm.InvalidArgumentError, match="n_readers"):
            pinshm.ObjectStore.slot_len(bad, 1)
        with pytest.raises(pinshm.InvalidArgumentError, match="n_readers"):
            pinshm.ObjectStore.largest_object(cap, bad)


def test_attaching_to_a_missing_segment_raises_pinshm_error(unique_name):
    with pytest.raises(pinshm.PinshmError, match="no shared memory segment"):
        pinshm.StoreReader.attach_by_name(unique_name())


def test_signatures_verify_on_both_sides(store, reader):
    h = store.put("k", b"v")
    sig = store.signature("k")
    assert isinstance(sig, bytes) and len(sig) == 32
    assert store.signature("other") is None
    assert store.verify("k", h, sig)
    assert reader.verify("k", h, sig)
    assert not reader.verify("other", h, sig)
    assert not reader.verify("k", h, sig[:-1] + bytes([sig[-1] ^ 1]))


def test_a_reader_attaches_by_name_alone(store, closing):
    h = store.put("k", b"by name")
    r = closing(pinshm.StoreReader.attach_by_name(store.name))
    assert r.get_copy(h) == b"by name"
    assert pinshm.StoreHandle.of(store.name) == store.handle()


def test_aggregate_reads_count_reads_from_any_reader(unique_name, closing):
    store = closing(
        pinshm.ObjectStore(1 << 20, 1024, 2, name=unique_name(), aggregate_reads=True)
    )
    r = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("k", b"v")
    r.acknowledge(h)
    assert store.free_unused() == 0
    r.acknowledge(h)  # two reads by one reader cover both readers' share
    assert store.free_unused() == 1


def test_a_key_index_with_aggregate_reads_is_refused_and_says_what_to_use(unique_name):
    # In aggregate mode one reader's hits by key would count as the reads
    # other readers owe, and free objects they have not read.
    with pytest.raises(pinshm.InvalidArgumentError, match="key_index with aggregate_reads") as e:
        pinshm.ObjectStore(1 << 20, 1024, 2, name=unique_name(), aggregate_reads=True, key_index=64)
    assert "cache" in str(e.value) and isinstance(e.value, ValueError)


def test_stats_is_a_dict_of_counters(store):
    store.put("k", b"v")
    st = store.stats()
    assert st["puts"] == 1 and st["objects"] == 1
    assert st["oldest_unread"] is not None  # the reader owes a read


def test_a_closed_store_raises_value_error_and_closes_twice(unique_name):
    with pinshm.ObjectStore(1 << 20, 1024, 1, name=unique_name()) as store:
        store.put("k", b"v")
    assert store.closed
    with pytest.raises(ValueError, match="closed"):
        store.put("k2", b"v")
    store.close()


def test_a_closed_reader_raises_value_error(store):
    reader = pinshm.StoreReader.attach(store.handle())
    h = store.put("k", b"v")
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.get(h)


def test_closing_a_reader_frees_its_index_for_another(store):
    with pinshm.StoreReader.attach(store.handle(), 0) as r:
        assert r.index == 0
        with pytest.raises(pinshm.PinshmError):
            pinshm.StoreReader.attach(store.handle(), 0)
    with pinshm.StoreReader.attach(store.handle(), 0) as again:
        assert again.index == 0


def test_one_reader_used_from_two_threads_reads_every_object(store, reader):
    handles = [store.put(f"k{i}", bytes([i]) * (100 * KIB // 4)) for i in range(4)]
    errors = []

    def work(n):
        try:
            for _ in range(50):
                for i, h in enumerate(handles):
                    assert reader.get_copy(h)[:1] == bytes([i])
                    with reader.get(h) as g:
                        assert memoryview(g)[0] == i
        except Exception as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    gc.collect()


def test_closing_a_reader_while_another_thread_is_inside_a_copy_on_it_works(
    unique_name, closing
):
    mib = 1 << 20
    store = closing(pinshm.ObjectStore(64 * mib, 32 * mib, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("big", bytes(32 * mib))
    store.protect("big")  # never freed by the reads below
    ended = []
    copying = threading.Event()

    def copy_until_closed():
        # Copies of 32 MiB run with the GIL released: the main thread's
        # close() lands while one is in flight.
        try:
            while True:
                reader.get_copy_into(h, buf)
                copying.set()
        except ValueError as e:
            ended.append(str(e))

    buf = bytearray(32 * mib)
    t = threading.Thread(target=copy_until_closed, daemon=True)
    t.start()
    assert copying.wait(30)  # copies are under way, back to back
    reader.close()  # not RuntimeError('Already borrowed')
    t.join(30)
    assert ended and "closed" in ended[0]
    with reader:  # __exit__ closes again: nothing
        pass


def test_the_touch_aliases_are_gone(store, reader):
    # add_reference (writer) and acknowledge (reader) are the only names.
    assert not hasattr(store, "touch")
    assert not hasattr(reader, "touch")


def test_pin_modes_are_chosen_per_process_and_checked(unique_name, closing):
    # A writer that must stay CUDA-free (vLLM's API server) says "off".
    store = closing(pinshm.ObjectStore(1 << 20, 4096, 1, name=unique_name(), pin="off"))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0, pin="auto"))
    assert not reader.is_pinned  # no GPU here (or a build without cuda)
    assert reader.pinning is None
    with pytest.raises(pinshm.PinshmError, match="pinning required"):
        pinshm.StoreReader.attach_by_name(store.name, pin="require")
    with pytest.raises(ValueError, match="pin must be"):
        pinshm.ObjectStore(1 << 20, 4096, 1, name=unique_name(), pin="sometimes")
    with pytest.raises(ValueError, match="pin must be"):
        pinshm.StoreReader.attach(store.handle(), pin="maybe")

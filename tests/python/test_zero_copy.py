"""Zero-copy reads: a guard exports the slot; views keep it; release rules."""

import ctypes
import gc

import numpy as np
import pytest

import pinshm

KIB = 1024


@pytest.fixture
def store(unique_name, closing):
    # Room for three objects of 16 KiB: a fourth needs the oldest slot back.
    return closing(pinshm.ObjectStore(64 * KIB, 16 * KIB, 1, name=unique_name()))


@pytest.fixture
def reader(store, closing):
    return closing(pinshm.StoreReader.attach(store.handle(), 0))


def stream_around(store, reader, held_key):
    """Puts 20 objects of 16 KiB, each read at once: more than six laps of
    the ring, every one placed around the held slot, which stays."""
    for i in range(20):
        reader.touch(store.put(f"fill-{i}", bytes(16 * KIB)))
    assert store.is_cached(held_key), "the held slot was reclaimed"


def reclaimed_once_released(store, reader, key):
    """A lap of puts (read at once by `reader`, unless it is None: closed)
    reclaims `key`."""
    for i in range(4):
        h = store.put(f"after-{i}", bytes(16 * KIB))
        if reader is not None:
            reader.touch(h)
    assert not store.is_cached(key), "the released slot was not reused"


def test_a_numpy_view_reads_the_slot_in_place(store, reader):
    data = np.arange(1000, dtype=np.float32)
    h = store.put("a", data)
    g = reader.get(h)
    arr = np.frombuffer(g, dtype=np.float32)
    assert np.array_equal(arr, data)
    assert not arr.flags.writeable
    # The same memory, not a copy: two views share their address.
    assert np.frombuffer(g, dtype=np.uint8).ctypes.data == arr.ctypes.data
    del arr
    g.release()


def test_a_numpy_view_keeps_its_slot_until_released(store, reader):
    payload = np.full(16 * KIB, 7, dtype=np.uint8)
    h = store.put("held", payload)
    g = reader.get(h)
    arr = np.frombuffer(g, dtype=np.uint8)
    del g  # only the array keeps the guard now
    reader.touch(h)  # the read is owed no more: only the view holds the slot
    stream_around(store, reader, "held")
    assert np.array_equal(arr, payload)  # never overwritten
    del arr
    gc.collect()
    reclaimed_once_released(store, reader, "held")


def test_the_exported_buffer_is_read_only(store, reader):
    h = store.put("a", b"abc")
    with reader.get(h) as g:
        mv = memoryview(g)
        assert mv.readonly
        with pytest.raises(TypeError):
            mv[0] = 1
        mv.release()


def test_release_with_a_live_memoryview_raises_buffer_error(store, reader):
    h = store.put("a", b"abc")
    g = reader.get(h)
    mv = memoryview(g)
    with pytest.raises(BufferError, match="1 exported view"):
        g.release()
    assert not g.released
    assert mv.tobytes() == b"abc"
    mv.release()
    g.release()
    assert g.released
    g.release()  # twice: nothing


def test_release_with_a_live_numpy_array_raises_buffer_error(store, reader):
    h = store.put("a", b"abcd")
    g = reader.get(h)
    arr = np.frombuffer(g, dtype=np.uint8)
    with pytest.raises(BufferError):
        g.release()
    del arr
    gc.collect()
    g.release()


def test_a_with_block_releases_the_read(store, reader):
    h = store.put("a", b"abc")
    with reader.get(h) as g:
        assert bytes(g) == b"abc"
        assert store.free_unused() == 0
    assert g.released
    assert store.free_unused() == 1


def test_a_with_block_refuses_to_end_while_a_view_lives(store, reader):
    h = store.put("a", b"abc")
    with pytest.raises(BufferError):
        with reader.get(h) as g:
            mv = memoryview(g)
    mv.release()
    g.release()


def test_garbage_collection_releases_the_read(store, reader):
    h = store.put("a", b"abc")
    g = reader.get(h)
    assert store.free_unused() == 0
    del g
    gc.collect()
    assert store.free_unused() == 1


def test_a_released_guard_exports_nothing(store, reader):
    h = store.put("a", b"abc")
    g = reader.get(h)
    g.release()
    with pytest.raises(BufferError, match="released"):
        memoryview(g)
    with pytest.raises(ValueError, match="released"):
        bytes(g)


def test_a_guard_keeps_its_reader_attached_after_close(store, reader):
    h = store.put("a", b"abc")
    g = reader.get(h)
    arr = np.frombuffer(g, dtype=np.uint8)
    reader.close()
    assert arr.tobytes() == b"abc"
    del arr
    g.release()


def test_bytes_of_a_large_guard_is_a_copy_made_with_the_gil_released(unique_name, closing):
    store = closing(pinshm.ObjectStore(1 << 20, 256 * KIB, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    payload = bytes(range(256)) * 1024  # 256 KiB: over the GIL-release size
    h = store.put("a", payload)
    with reader.get(h) as g:
        assert bytes(g) == payload
        assert not g.released
    out = bytearray(len(payload))
    assert reader.get_copy_into(h, out) == len(payload) and out == payload
    assert reader.get_copy(h) == payload


def test_a_guard_copied_in_one_thread_is_not_released_under_the_copy_by_another(
    unique_name, closing
):
    import threading

    store = closing(pinshm.ObjectStore(1 << 20, 256 * KIB, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("a", bytes(256 * KIB))  # copies release the GIL
    g = reader.get(h)
    barrier = threading.Barrier(2)
    out = []

    def copy_many():
        barrier.wait()
        for _ in range(200):
            try:
                out.append(len(bytes(g)))
            except ValueError:  # released by the main thread: no bytes
                out.append(None)

    t = threading.Thread(target=copy_many)
    t.start()
    barrier.wait()
    while True:
        try:
            g.release()
            break
        except BufferError:  # a copy is in flight: it counts as a view
            pass
    t.join()
    assert set(out) <= {256 * KIB, None}


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def export_and_release_keeping_obj(exporter):
    """What torch.frombuffer does: gets the buffer, keeps `view.obj` and the
    address, releases the buffer at once. Returns (obj, address, length)."""
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    get.restype = ctypes.c_int
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.POINTER(_PyBuffer)]
    release.restype = None
    view = _PyBuffer()
    assert get(exporter, ctypes.byref(view), 0) == 0  # PyBUF_SIMPLE
    obj = ctypes.cast(ctypes.c_void_p(view.obj), ctypes.py_object).value  # a new reference
    address, length = view.buf, view.len
    release(ctypes.byref(view))
    return obj, address, length


def test_an_export_whose_buffer_is_released_but_whose_obj_is_kept_holds_the_read(
    store, reader
):
    payload = bytes(range(256)) * 64  # 16 KiB
    h = store.put("kept", payload)
    g = reader.get(h)
    obj, address, length = export_and_release_keeping_obj(g)
    assert length == len(payload)
    with pytest.raises(BufferError):
        g.release()
    del g
    gc.collect()
    reader.touch(h)  # owed no more: only the kept obj holds the slot
    stream_around(store, reader, "kept")
    reader.close()
    assert ctypes.string_at(address, length) == payload  # never overwritten
    del obj
    gc.collect()
    reclaimed_once_released(store, None, "kept")


def test_a_tensor_array_whose_guard_export_was_released_early_still_holds_the_read(
    store, reader
):
    data = np.arange(1024, dtype=np.int32)
    h = store.put_tensor("t", data)
    arr = reader.get_tensor(h)
    obj, address, length = export_and_release_keeping_obj(arr)
    del arr
    gc.collect()
    reader.touch(h)
    stream_around(store, reader, "t")
    reader.close()
    assert ctypes.string_at(address, length) == data.tobytes()
    del obj
    gc.collect()
    reclaimed_once_released(store, None, "t")


def test_an_exception_leaving_a_with_block_while_a_view_lives_is_not_replaced(store, reader):
    h = store.put("a", b"abc")
    with pytest.raises(KeyError, match="mine"):
        with reader.get(h) as g:
            mv = memoryview(g)
            raise KeyError("mine")
    assert g.released  # the guard's own hold is gone ...
    assert mv.tobytes() == b"abc"  # ... the view still holds the read
    assert store.free_unused() == 0
    mv.release()
    assert store.free_unused() == 1  # acknowledged when the view went

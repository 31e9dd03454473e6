"""Tensors: numpy arrays in, numpy arrays over the slot out."""

import gc

import numpy as np
import pytest



@pytest.mark.parametrize(
    "dtype",
    ["u1", "i1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "?"],
)
def test_a_tensor_of_every_dtype_round_trips_with_its_shape(store, reader, dtype):
    a = (np.arange(2 * 3 * 5) % 7).astype(dtype).reshape(2, 3, 5)
    h = store.put_tensor("t", a)
    b = reader.get_tensor(h)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.array_equal(a, b)
    assert not b.flags.writeable


def test_a_tensor_is_read_in_place_and_its_array_holds_the_read(store, reader):
    h = store.put_tensor("t", np.ones((256, 256), dtype=np.float32))
    b = reader.get_tensor(h)
    assert b.ctypes.data % 64 == 0  # 64-byte aligned elements, in the slot
    assert store.free_unused() == 0
    del b
    gc.collect()
    assert store.free_unused() == 1


def test_a_raw_object_is_not_a_tensor(store, reader):
    h = store.put("raw", b"not a tensor")
    with pytest.raises(TypeError, match="kind"):
        reader.get_tensor(h)


def test_big_endian_and_non_contiguous_arrays_are_refused(store):
    with pytest.raises(ValueError, match="little-endian"):
        store.put_tensor("be", np.arange(4, dtype=">i4"))
    with pytest.raises((BufferError, ValueError)):
        store.put_tensor("strided", np.arange(16, dtype=np.int32).reshape(4, 4).T)


def test_a_tensor_put_as_a_tensor_is_also_readable_as_bytes(store, reader):
    a = np.arange(10, dtype=np.int64)
    h = store.put_tensor("t", a)
    raw = reader.get_copy(h)
    assert raw.endswith(a.tobytes())  # header first, then the elements

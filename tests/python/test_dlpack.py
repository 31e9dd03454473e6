"""torch.from_dlpack over get_tensor's array: no copy, and the tensor holds
the read. Skipped where torch is not installed (CI never installs it)."""

import gc

import numpy as np
import pytest


torch = pytest.importorskip("torch")


def test_torch_from_dlpack_shares_the_slot_with_no_copy(store, reader):
    a = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    h = store.put_tensor("t", a)
    arr = reader.get_tensor(h)
    t = torch.from_dlpack(arr)
    assert t.data_ptr() == arr.ctypes.data  # the slot's address: no copy
    assert t.dtype == torch.float32 and tuple(t.shape) == a.shape
    assert torch.equal(t, torch.from_numpy(a))
    del t, arr


def test_the_tensor_holds_the_read_after_the_array_is_gone(store, reader):
    a = np.arange(1000, dtype=np.int64)
    h = store.put_tensor("t", a)
    arr = reader.get_tensor(h)
    t = torch.from_dlpack(arr)
    del arr
    gc.collect()
    assert store.free_unused() == 0  # the tensor still holds the read
    assert torch.equal(t, torch.from_numpy(a))
    del t
    gc.collect()
    assert store.free_unused() == 1


def test_an_item_field_goes_to_torch_with_no_copy(store, reader):
    h = store.put_item("k", {"px": np.ones((4, 16), np.float16), "ids": np.arange(5)})
    fields, _ = reader.get_item(h)
    t = torch.from_dlpack(fields["px"])
    assert t.data_ptr() == fields["px"].ctypes.data
    del fields
    gc.collect()
    assert store.free_unused() == 0  # held by the tensor
    assert torch.equal(t, torch.ones((4, 16), dtype=torch.float16))
    del t
    gc.collect()
    assert store.free_unused() == 1

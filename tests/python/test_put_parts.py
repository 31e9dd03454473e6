"""put_parts: several buffers written one after the other into one object."""

import numpy as np
import pytest


KIB = 1024


def test_parts_of_every_buffer_kind_are_stored_as_their_join(store, reader):
    parts = [
        b"head",
        bytearray(b"-bytearray-"),
        memoryview(b"0123456789")[2:7],
        np.arange(10, dtype=np.float32),
        np.zeros((3, 4), dtype=np.int64),
        b"",
        np.arange(7, dtype=np.uint8)[1:5],  # a contiguous slice
    ]
    h = store.put_parts("k", parts)
    assert reader.get_copy(h) == b"".join(memoryview(p).tobytes() for p in parts)


def test_large_parts_are_joined_byte_for_byte(store, reader):
    # Past the size at which the copy runs with the GIL released.
    parts = [np.random.default_rng(7).bytes(300 * KIB), b"x" * (200 * KIB)]
    h = store.put_parts("big", parts)
    assert reader.get_copy(h) == b"".join(parts)


def test_a_tuple_or_a_generator_of_parts_works_too(store, reader):
    h1 = store.put_parts("t", (b"a", b"b"))
    h2 = store.put_parts("g", (bytes([i]) for i in range(3)))
    assert reader.get_copy(h1) == b"ab"
    assert reader.get_copy(h2) == b"\x00\x01\x02"


def test_an_empty_list_stores_an_empty_object(store, reader):
    h = store.put_parts("empty", [])
    assert reader.get_copy(h) == b""
    assert store.is_cached("empty")


def test_a_non_contiguous_array_part_is_refused_naming_the_part(store):
    strided = np.arange(16, dtype=np.int32).reshape(4, 4).T
    with pytest.raises((BufferError, ValueError), match=r"part 1 \(ndarray\).*contiguous"):
        store.put_parts("k", [b"ok", strided])
    assert not store.is_cached("k")  # nothing was stored


def test_a_part_that_is_not_a_buffer_raises_type_error(store):
    with pytest.raises(TypeError, match="part 0"):
        store.put_parts("k", ["a str is not bytes"])
    with pytest.raises(TypeError):
        store.put_parts("k", 42)  # not a sequence at all


def test_an_existing_key_raises_value_error(store):
    store.put("k", b"first")
    with pytest.raises(ValueError, match="already exists"):
        store.put_parts("k", [b"again"])


def test_parts_larger_than_the_largest_object_raise_value_error(store):
    with pytest.raises(ValueError):
        store.put_parts("k", [bytes(600 * KIB), bytes(600 * KIB)])


def test_put_parts_counts_one_reference_like_put(store, reader):
    h = store.put_parts("k", [b"a", b"b"])
    assert store.free_unused() == 0  # owed one read
    reader.acknowledge(h)
    assert store.free_unused() == 1

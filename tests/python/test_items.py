"""Items: named numpy arrays plus string metadata in one object, in the
format Rust's put_item writes (src/codec/item.rs), read back in place."""

import gc
import struct

import numpy as np
import pytest


KIB = 1024


def fields_of_several_dtypes():
    rng = np.random.default_rng(3)
    return {
        "pixel_values": rng.random((3, 8, 8), dtype=np.float32),
        "image_grid_thw": np.array([[1, 16, 16]], dtype=np.int64),
        "mask": rng.random(13) > 0.5,
        "half": np.arange(5, dtype=np.float16),
        "bytes": np.arange(7, dtype=np.uint8),
        "scalar": np.array(2.5, dtype=np.float64),  # 0-d
        "empty": np.zeros((0, 4), dtype=np.int32),
        "i16": np.arange(-3, 3, dtype=np.int16).reshape(2, 3),
    }


def test_an_item_round_trips_fields_in_order_with_dtypes_shapes_and_meta(store, reader):
    fields = fields_of_several_dtypes()
    meta = {"modality": "image", "hash": "9f2c", "empty value": ""}
    h = store.put_item("img", fields, meta=meta)
    got, got_meta = reader.get_item(h)
    assert list(got) == list(fields)
    for name, a in fields.items():
        b = got[name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert np.array_equal(a, b), name
        assert not b.flags.writeable
    assert got_meta == meta and list(got_meta) == list(meta)


def test_meta_is_optional_and_read_back_as_an_empty_dict(store, reader):
    h = store.put_item("k", {"a": np.ones(3, dtype=np.float32)})
    assert reader.get_item(h)[1] == {}
    h2 = store.put_item("k2", {}, meta={"only": "meta"})
    assert reader.get_item(h2) == ({}, {"only": "meta"})


def test_item_arrays_are_64_byte_aligned_views_of_the_slot(store, reader):
    h = store.put_item("k", {"a": np.ones(100, dtype=np.float32), "b": np.ones(3, np.int64)})
    with reader.get(h) as g:
        start = np.frombuffer(g, dtype=np.uint8).ctypes.data
        fields, _ = reader.get_item(h)
        for a in fields.values():
            assert a.ctypes.data % 64 == 0
            assert start < a.ctypes.data < start + len(g)  # inside the slot: no copy
        del fields, a


def test_item_arrays_hold_the_read_until_the_last_is_collected(store, reader):
    h = store.put_item("k", {"a": np.ones(256, np.float32), "b": np.zeros(8, np.int64)})
    fields, _ = reader.get_item(h)
    a, b = fields["a"], fields["b"]
    del fields
    gc.collect()
    assert store.free_unused() == 0
    del a
    gc.collect()
    assert store.free_unused() == 0  # b still holds the read
    assert np.array_equal(b, np.zeros(8, np.int64))
    del b
    gc.collect()
    assert store.free_unused() == 1


def test_the_stored_bytes_follow_the_rust_item_layout(store, reader):
    fields = {"px": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.arange(3, dtype=np.int64)}
    h = store.put_item("k", fields, meta={"modality": "image"})
    raw = reader.get_copy(h)
    # ItemPrefix (16 B): magic "PITM", codec version 1 (u16 LE), 2 zero
    # bytes, header length (u32 LE), 4 zero bytes; then the MessagePack header.
    magic, version, pad1, hlen, pad2 = struct.unpack_from("<4sHHII", raw)
    assert (magic, version, pad1, pad2) == (b"PITM", 1, 0, 0)
    header, end = unpack_msgpack(raw, 16)
    assert end == 16 + hlen
    assert header["meta"] == [["modality", "image"]]
    assert [f["name"] for f in header["fields"]] == ["px", "ids"]
    assert header["fields"][0]["dtype"] == "F32" and header["fields"][1]["dtype"] == "I64"
    assert header["fields"][0]["shape"] == [2, 3] and header["fields"][1]["shape"] == [3]
    prev_end = 16 + hlen
    for f, a in zip(header["fields"], fields.values()):
        assert f["offset"] % 64 == 0 and f["offset"] >= prev_end
        assert f["len"] == a.nbytes
        assert raw[f["offset"] : f["offset"] + f["len"]] == a.tobytes()
        prev_end = f["offset"] + f["len"]


def test_a_non_item_object_raises_type_error(store, reader):
    h = store.put("raw", b"not an item")
    with pytest.raises(TypeError, match="kind"):
        reader.get_item(h)
    ht = store.put_tensor("t", np.ones(3, np.float32))
    with pytest.raises(TypeError, match="kind"):
        reader.get_item(ht)


def test_bad_fields_and_meta_are_refused_with_the_field_named(store):
    with pytest.raises((BufferError, ValueError), match='field "strided"'):
        store.put_item("k", {"strided": np.arange(16, dtype=np.int32).reshape(4, 4).T})
    with pytest.raises(ValueError, match='field "be".*little-endian'):
        store.put_item("k", {"be": np.arange(4, dtype=">i4")})
    with pytest.raises(TypeError, match="meta keys and values must be str"):
        store.put_item("k", {"a": np.ones(1)}, meta={"n": 3})
    with pytest.raises(TypeError, match="field names must be str"):
        store.put_item("k", {1: np.ones(1)})
    assert not store.is_cached("k")


def test_an_existing_key_raises_value_error(store):
    store.put("k", b"x")
    with pytest.raises(ValueError, match="already exists"):
        store.put_item("k", {"a": np.ones(2)})


def test_a_large_item_round_trips(store, reader):
    # Past the size at which the copy runs with the GIL released.
    big = np.random.default_rng(5).random(100_000)  # 800 KB of float64
    h = store.put_item("big", {"big": big, "small": np.ones(2, np.int8)})
    fields, _ = reader.get_item(h)
    assert np.array_equal(fields["big"], big)
    del fields


def unpack_msgpack(buf, at):
    """A minimal MessagePack decoder (what the item header uses): returns
    (value, offset after it)."""
    b = buf[at]
    if b <= 0x7F:
        return b, at + 1
    if 0x80 <= b <= 0x8F:
        return _map(buf, at + 1, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _array(buf, at + 1, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return buf[at + 1 : at + 1 + n].decode(), at + 1 + n
    if b == 0xC0:
        return None, at + 1
    if b in (0xC2, 0xC3):
        return b == 0xC3, at + 1
    widths = {0xCC: "B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
    if b in widths:
        fmt = widths[b]
        return struct.unpack_from(fmt, buf, at + 1)[0], at + 1 + struct.calcsize(fmt)
    strs = {0xD9: "B", 0xDA: ">H", 0xDB: ">I"}
    if b in strs:
        fmt = strs[b]
        n = struct.unpack_from(fmt, buf, at + 1)[0]
        start = at + 1 + struct.calcsize(fmt)
        return buf[start : start + n].decode(), start + n
    if b in (0xDC, 0xDD):
        fmt = ">H" if b == 0xDC else ">I"
        n = struct.unpack_from(fmt, buf, at + 1)[0]
        return _array(buf, at + 1 + struct.calcsize(fmt), n)
    if b in (0xDE, 0xDF):
        fmt = ">H" if b == 0xDE else ">I"
        n = struct.unpack_from(fmt, buf, at + 1)[0]
        return _map(buf, at + 1 + struct.calcsize(fmt), n)
    raise AssertionError(f"unexpected MessagePack byte {b:#x} at {at}")


def _array(buf, at, n):
    out = []
    for _ in range(n):
        v, at = unpack_msgpack(buf, at)
        out.append(v)
    return out, at


def _map(buf, at, n):
    out = {}
    for _ in range(n):
        k, at = unpack_msgpack(buf, at)
        out[k], at = unpack_msgpack(buf, at)
    return out, at

"""pinshm.vllm.cache: vLLM 0.33.0's SingleWriterShmObjectStorage API and
semantics over a pinshm store (runs without vLLM; with vLLM installed the
serde is vLLM's own)."""

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import _vllm_workers
import pinshm
from pinshm.vllm.cache import _wire as W
from pinshm.vllm.cache import storage as S

MIB = 1 << 20
STALE = "Data for address:id '{}:{}' has been modified or is invalid."
INVALID = "Invalid SHM handle signature for cache key."
MISSING = "Missing SHM handle signature for cache key."


@pytest.fixture
def make(unique_name):
    """make(n_readers, size, max_object) -> (writer storage, reader factory);
    everything is closed at teardown."""
    opened = []

    def build(n_readers=1, size=4 * MIB, max_object=MIB):
        ring = S.SingleWriterShmRingBuffer(size, name=unique_name(), create=True)
        writer = S.SingleWriterShmObjectStorage(max_object, n_readers, ring)
        opened.append(writer)

        def reader():
            r = S.SingleWriterShmObjectStorage.create_from_handle(
                _with_lock(writer.handle())
            )
            opened.append(r)
            return r

        return writer, reader

    yield build
    for s in reversed(opened):
        s.close()


def _with_lock(handle):
    handle.reader_lock = threading.Lock()
    return handle


def test_put_get_roundtrip_of_arrays_bytes_and_str(make):
    w, reader = make()
    r = reader()
    value = {"pixels": np.arange(12, dtype=np.float32).reshape(3, 4), "b": b"xy", "s": "z"}
    address, mid = w.put("k", value)
    sig = w.get_signature("k")
    got = r.get(address, mid, sig, "k")
    np.testing.assert_array_equal(got["pixels"], value["pixels"])
    assert got["pixels"].dtype == np.float32 and got["pixels"].shape == (3, 4)
    assert (got["b"], got["s"]) == (b"xy", "z")
    # The writer reads its own objects too, counting nothing.
    np.testing.assert_array_equal(w.get(address, mid)["pixels"], value["pixels"])


def test_wire_handles_pass_vllms_checks_and_carry_the_whole_id():
    for offset, mid in [(0, 1), (4096, 2**32 - 1), (2**47, 2**32), (123, 2**48 - 1)]:
        h = pinshm.ObjectHandle(offset, mid, 7)
        address, wire_id = W.to_wire(h)
        assert type(address) is int and 0 <= address < 2**64
        assert type(wire_id) is int and 0 <= wire_id < 2**32
        assert W.from_wire(address, wire_id, 7) == h
    # vLLM's ids count from 0: pinshm's first id (1) is vLLM's first (0).
    assert W.to_wire(pinshm.ObjectHandle(0, 1, 7)) == (0, 0)
    for bad in [(-1, 0), (2**64, 0), (0, 2**32), (0, -1), ("0", 0), (0, 1.0)]:
        with pytest.raises(pinshm.StaleError, match="has been modified or is invalid"):
            W.from_wire(*bad, 7)


def test_a_reader_without_a_lock_is_refused(make):
    w, _ = make()
    handle = w.handle()
    with pytest.raises(ValueError, match=r"^Lock must be provided for readers\.$"):
        S.SingleWriterShmObjectStorage.create_from_handle(handle)


def test_aggregate_accounting_frees_after_refs_times_readers_reads_from_anyone(make):
    w, reader = make(n_readers=2)
    r = reader()
    a, i = w.put("k", b"x" * 1000)
    sig = w.get_signature("k")
    assert w.get_cached("k") == (a, i)  # two references: 2 x 2 reads
    for n in range(3):
        r.get(a, i, sig, "k")
        w.free_unused()
        assert w.is_cached("k"), f"freed after {n + 1} of 4 reads"
    r.get(a, i, sig, "k")
    w.free_unused()
    assert not w.is_cached("k")


def test_a_writer_given_a_reader_lock_counts_its_own_gets_as_reads(unique_name):
    """As vLLM's storage: its tests read through the writer, n_readers times."""
    ring = S.SingleWriterShmRingBuffer(4 * MIB, name=unique_name(), create=True)
    w = S.SingleWriterShmObjectStorage(MIB, 2, ring, reader_lock=threading.Lock())
    try:
        a, i = w.put("k", b"x" * 1000)
        assert w.get(a, i) == b"x" * 1000
        w.free_unused()
        assert w.is_cached("k"), "freed after 1 of 2 reads"
        assert w.get(a, i) == b"x" * 1000
        w.free_unused()
        assert not w.is_cached("k")
    finally:
        w.close()


def test_a_writer_without_a_reader_lock_counts_nothing(make):
    w, _ = make(n_readers=1)
    a, i = w.put("k", b"x" * 1000)
    for _ in range(3):
        assert w.get(a, i) == b"x" * 1000
    w.free_unused()
    assert w.is_cached("k")


def test_writer_touch_protects_until_get_cached_or_release_touches(make):
    w, reader = make()
    r = reader()
    a, i = w.put("k", b"x")
    sig = w.get_signature("k")
    r.get(a, i, sig, "k")
    w.touch("k")
    w.touch("absent")  # nothing to protect: no error, as in vLLM
    w.free_unused()
    assert w.is_cached("k")
    w.release_touches()
    w.free_unused()
    assert not w.is_cached("k")

    a, i = w.put("k2", b"y")
    r.get(a, i, w.get_signature("k2"), "k2")
    w.touch("k2")
    w.get_cached("k2")  # ends the protection, and expects one more read
    r.get(a, i, w.get_signature("k2"), "k2")
    w.free_unused()
    assert not w.is_cached("k2")


def test_reader_touch_validates_and_counts_nothing(make):
    w, reader = make()
    r = reader()
    a, i = w.put("k", b"x")
    sig = w.get_signature("k")
    r.touch("k", a, i, sig)
    w.free_unused()
    assert w.is_cached("k"), "a touch is not a read"
    with pytest.raises(ValueError, match=INVALID):
        r.touch("other", a, i, sig)


def test_stale_handles_raise_vllms_exact_message(make):
    w, reader = make(size=64 << 10, max_object=16 << 10)
    r = reader()
    a, i = w.put("k", b"x" * 1000)
    sig = w.get_signature("k")
    r.get(a, i, sig, "k")
    w.clear()
    # Fill the ring until k's slot is reused.
    for n in range(200):
        h = w.put(f"f{n}", b"y" * 1000)
        r.get(*h, w.get_signature(f"f{n}"), f"f{n}")
    with pytest.raises(pinshm.StaleError) as e:
        r.get(a, i, sig, "k")
    assert str(e.value) == STALE.format(a, i)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError) as e:
        r.touch("k", a, i, sig)
    assert str(e.value) == STALE.format(a, i)
    with pytest.raises(ValueError) as e:
        w.get(a, i)
    assert str(e.value) == STALE.format(a, i)


def test_soft_clear_forgets_keys_keeps_ids_and_old_handles_read(make):
    w, reader = make()
    r = reader()
    a, i = w.put("k", b"old")
    sig = w.get_signature("k")
    w.clear()
    assert not w.is_cached("k") and len(w.key_index) == 0
    assert r.get(a, i, sig, "k") == b"old", "an old handle reads until its slot is reused"
    # As in vLLM, the next put goes from the first byte: the old slot.
    a2, i2 = w.put("k", b"new")
    assert i2 > i, "ids keep increasing across a clear"
    assert a2 == a
    with pytest.raises(pinshm.StaleError, match="has been modified or is invalid"):
        r.get(a, i, sig, "k")
    assert r.get(a2, i2, w.get_signature("k"), "k") == b"new"
    r.clear()  # a reader's clear does nothing


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a, i, s, k: (a, i, [s[0] ^ 1] + s[1:], k), INVALID),
        (lambda a, i, s, k: (a, i, s, k + "x"), INVALID),
        (lambda a, i, s, k: (a + 64, i, s, k), INVALID),
        (lambda a, i, s, k: (a, i + 1, s, k), INVALID),
        (lambda a, i, s, k: (a, i, s[:31], k), INVALID),
        (lambda a, i, s, k: (a, i, s + [0], k), INVALID),
        (lambda a, i, s, k: (a, i, [256] + s[1:], k), INVALID),
        (lambda a, i, s, k: (a, i, bytes(s), k), INVALID),
        (lambda a, i, s, k: (a, i, None, k), MISSING),
        (lambda a, i, s, k: (a, i, s, None), MISSING),
    ],
)
def test_signatures_refuse_anything_not_issued_for_the_key(make, mutate, message):
    w, reader = make()
    r = reader()
    a, i = w.put("key", b"x")
    w.put("key2", b"y")
    args = mutate(a, i, w.get_signature("key"), "key")
    for side in (r, w):
        with pytest.raises(ValueError) as e:
            side.verify_signature(args[3], args[0], args[1], args[2])
        # As in vLLM, the writer checks the key's handle first.
        want = INVALID if side is w and args[3] is None else message
        assert str(e.value) == want
    with pytest.raises(ValueError) as e:
        r.get(*args)
    assert str(e.value) == message
    r.verify_signature("key", a, i, w.get_signature("key"))
    w.verify_signature("key", a, i, w.get_signature("key"))


def test_writer_verify_needs_the_keys_current_handle(make):
    w, _ = make()
    a, i = w.put("key", b"x")
    sig = w.get_signature("key")
    w.clear()
    w.put("key", b"y")
    with pytest.raises(ValueError, match=INVALID):
        w.verify_signature("key", a, i, sig)


def test_put_errors_are_vllms(make):
    w, _ = make(size=256 << 10, max_object=64 << 10)
    w.put("k", b"x")
    with pytest.raises(ValueError, match=r"^Key 'k' already exists in the storage\.$"):
        w.put("k", b"y")
    with pytest.raises(
        ValueError, match=r"^Serialized object size \(\d+ bytes\) exceeds max object size \(65536 bytes\)$"
    ):
        w.put("big", b"z" * (64 << 10))
    with pytest.raises(MemoryError):
        for n in range(100):  # nobody reads: the ring fills
            w.put(f"f{n}", b"z" * (60 << 10))


def test_key_index_is_a_live_read_only_mapping(make):
    w, reader = make()
    handles = {k: w.put(k, k.encode()) for k in ("a", "b", "c")}
    assert dict(w.key_index) == handles
    assert "a" in w.key_index and "zz" not in w.key_index and 5 not in w.key_index
    assert len(w.key_index) == 3 and set(w.key_index.keys()) == {"a", "b", "c"}
    # vLLM's sender does set(...) - key_index.keys().
    assert {"a", "x"} - w.key_index.keys() == {"x"}
    assert w.id_index[handles["b"][1]] == "b"
    with pytest.raises(TypeError):
        w.key_index["d"] = (0, 0)
    with pytest.raises(KeyError):
        w.get_cached("zz")
    with pytest.raises(KeyError):
        w.get_signature("zz")


def test_key_index_lists_keys_in_the_order_they_were_put_as_vllms_dict(make):
    w, _ = make()
    # Names whose hashes scatter them, put in an order that is not sorted.
    order = ["image_C", "image_A", "zeta", "image_B", "alpha", "m"]
    for k in order:
        w.put(k, k.encode())
    assert list(w.key_index) == order
    # A key put again after it was cleared goes to the end, as in a dict.
    w.clear()
    for k in ("b", "a"):
        w.put(k, k.encode())
    assert list(w.key_index) == ["b", "a"]


def test_the_raw_ring_api_is_not_offered_and_missing_segments_are_not_found(unique_name):
    ring = S.SingleWriterShmRingBuffer(MIB, name=unique_name(), create=True)
    try:
        assert ring.is_writer and ring.handle() == (MIB, ring.name)
        for call in (
            lambda: ring.allocate_buf(10),
            lambda: ring.access_buf(0),
            lambda: ring.free_buf(lambda i, b: True),
            ring.get_auth_secret,
        ):
            with pytest.raises(NotImplementedError):
                call()
    finally:
        ring.close()
    with pytest.raises(FileNotFoundError):
        S.SingleWriterShmRingBuffer(MIB, name=unique_name(), create=False)
    with pytest.raises(ValueError):
        S.SingleWriterShmRingBuffer(0, create=True)


@pytest.mark.parametrize("reserve", [None, "1"])
def test_sparse_as_vllm_by_default_reserved_on_request(make, monkeypatch, reserve):
    if reserve is None:
        monkeypatch.delenv("PINSHM_VLLM_RESERVE", raising=False)
    else:
        monkeypatch.setenv("PINSHM_VLLM_RESERVE", reserve)
    w, reader = make(size=64 * MIB)
    r = reader()
    a, i = w.put("k", b"x")
    assert r.get(a, i, w.get_signature("k"), "k") == b"x"
    taken = os.stat(f"/dev/shm/{w.ring_buffer.name}").st_blocks * 512
    if reserve:
        assert taken >= 64 * MIB
    else:
        # What the data touches, and at most one step backed ahead of it.
        ahead = pinshm.ObjectStore.DEFAULT_BACK_AHEAD
        assert taken < 8 * MIB + ahead, f"{taken} bytes taken for a sparse 64 MiB ring"


@pytest.mark.parametrize(
    "size, max_object", [(1_000_003, 500_000), (MIB, MIB), (MIB, 4 * MIB), (107374182, 128 * MIB)]
)
def test_any_size_vllm_takes_works(make, size, max_object):
    """vLLM accepts any --mm-processor-cache-gb (0.1 GiB is not a multiple
    of 64 bytes) and an object limit as large as the ring or larger."""
    w, reader = make(size=size, max_object=max_object)
    r = reader()
    a, i = w.put("k", b"v" * 1000)
    assert r.get(a, i, w.get_signature("k"), "k") == b"v" * 1000


def test_a_second_live_writer_of_a_name_gets_file_exists(unique_name):
    name = unique_name()
    first = S.SingleWriterShmObjectStorage(MIB, 1, S.SingleWriterShmRingBuffer(4 * MIB, name, True))
    try:
        with pytest.raises(FileExistsError):
            S.SingleWriterShmObjectStorage(MIB, 1, S.SingleWriterShmRingBuffer(4 * MIB, name, True))
        assert first.put("k", b"still mine") is not None
    finally:
        first.close()


KILLED_WRITER = """
import os, signal, sys
from pinshm.vllm.cache import _wire as W
from pinshm.vllm.cache import storage as S
ring = S.SingleWriterShmRingBuffer(4 << 20, name=sys.argv[1], create=True)
s = S.SingleWriterShmObjectStorage(1 << 20, 1, ring)
s.put("k", b"x")
print("up", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_leaves_no_segment(unique_name):
    """As with vLLM's SharedMemory, the resource tracker of the writer's
    process removes the segment when the writer dies without closing."""
    name = unique_name()
    path = f"/dev/shm/{name}"
    try:
        out = subprocess.run(
            [sys.executable, "-c", KILLED_WRITER, name],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.stdout.strip() == "up", out.stderr
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path), "the killed writer's segment is still in /dev/shm"
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_spawned_readers_read_every_byte_and_free_the_ring(make):
    """vLLM's shape: the handle (with a multiprocessing lock) goes to worker
    processes; the objects come back byte for byte, and once every worker
    read them the writer can free them all."""
    ctx = mp.get_context("spawn")
    w, _ = make(n_readers=2, size=64 * MIB, max_object=8 * MIB)
    rng = np.random.default_rng(5)
    values = [
        {"a": rng.integers(0, 255, size=n, dtype=np.uint8), "meta": f"v{n}"}
        for n in (1, 4096, 1 << 20, 5 << 20)
    ]
    sent = []
    for n, v in enumerate(values):
        key = f"mm{n}"
        sent.append((key, *w.put(key, v), w.get_signature(key)))
    handle = w.handle()
    handle.reader_lock = ctx.Lock()
    pickle.dumps(handle.ring_buffer_handle)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_vllm_workers.read_storage, args=(handle, sent, results))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    want = [_vllm_workers.digest(v) for v in values]
    assert got == [want, want]
    w.free_unused()
    assert len(w.key_index) == 0, "every object was read by both workers"


def test_vllms_own_serde_carries_tensors_and_multimodal_items(make):
    """Where vLLM is installed, MsgpackSerde is vLLM's: a tensor and a
    MultiModalKwargsItem come back equal."""
    torch = pytest.importorskip("torch")
    inputs = pytest.importorskip("vllm.multimodal.inputs")
    w, reader = make()
    r = reader()
    assert type(w.ser_de._inner).__module__.startswith("vllm.")
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    a, i = w.put("t", t)
    assert torch.equal(r.get(a, i, w.get_signature("t"), "t"), t)
    elem = inputs.MultiModalFieldElem(
        data=torch.ones(3, 5), field=inputs.MultiModalBatchedField()
    )
    item = inputs.MultiModalKwargsItem({"pixel_values": elem})
    a, i = w.put("mm", item)
    got = r.get(a, i, w.get_signature("mm"), "mm")
    assert torch.equal(got["pixel_values"].data, torch.ones(3, 5))


def test_the_cache_leaves_a_headroom_of_dev_shm(monkeypatch):
    # The cache is /dev/shm's elastic user.
    from pinshm.vllm.cache import storage

    monkeypatch.setenv("PINSHM_VLLM_SHM_HEADROOM", "12345")
    assert storage.shm_headroom() == 12345
    monkeypatch.delenv("PINSHM_VLLM_SHM_HEADROOM")
    # The node budget's: vLLM's own 8 MiB, and a quarter of /dev/shm (at
    # most 1 GiB) for the queues' overflow.
    st = os.statvfs("/dev/shm")
    size = st.f_blocks * st.f_frsize
    assert storage.shm_headroom() == min(8 << 20, size // 8) + min(size // 4, 1 << 30)

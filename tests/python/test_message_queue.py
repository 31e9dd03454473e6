"""pinshm.vllm.queue.MessageQueue: vLLM 0.33.0's MessageQueue over a pinshm
broadcast channel and object store. The core tests need numpy alone;
torch, vLLM and pyzmq tests are skipped where those are not installed."""

import pickle
import socket

import numpy as np
import pytest

import _mq_workers as w
import pinshm
from pinshm.vllm.queue import MessageQueue

from _gates import in_call
from _procs import JOIN_S, finish, start


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _boom(what):
    raise ValueError(f"boom: {what}")


class RaisesWhenRead:
    """Pickles fine; unpickling it raises (in the reader's read)."""

    def __reduce__(self):
        return _boom, ("the reader's code raised",)


def test_three_reader_processes_check_every_byte_of_ten_thousand_messages(ctx, unique_name, closing):
    n = 10_000
    mq = closing(MessageQueue(3, 3, max_chunk_bytes=2 * w.MIB, max_chunks=8, name=unique_name()))
    results = ctx.Queue()
    procs = [start(ctx, w.read_stream, mq.export_handle(), r, n, r == 2, results) for r in range(3)]
    mq.wait_until_ready()
    w.base()
    for i in range(n):
        mq.enqueue(w.make_message(i, n), timeout=JOIN_S)
    got = sorted(results.get(timeout=JOIN_S) for _ in procs)
    for p in procs:
        finish(p)
    # Every reader checked every message; no ZMQ was loaded for them.
    assert got == [(0, n, False), (1, n, False), (2, n, False)]
    # Arrays of 1 MiB and more went through the store, which grew (was
    # replaced) for the 4 MiB and the 64 MiB ones; every object was read.
    assert mq._overflow.generation >= 2
    mq._overflow.store.free_unused()
    assert mq._overflow.store.stats()["objects"] == 0


def test_shutdown_from_another_thread_wakes_a_blocked_reader(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    outcome = []

    def blocked():
        try:
            rd.dequeue()
        except BaseException as e:  # noqa: BLE001 - the outcome is the test
            outcome.append(e)

    t, entered = in_call("recv", blocked)
    assert entered.wait(JOIN_S)  # the reader is in the channel's wait
    rd.shutdown()
    t.join(JOIN_S)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert str(outcome[0]) == "cancelled"
    with pytest.raises(RuntimeError, match="cancelled"):
        rd.dequeue(timeout=1)


@pytest.mark.parametrize("where", ["a slot", "store room"])
def test_shutdown_from_another_thread_wakes_a_blocked_writer(unique_name, closing, where):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=8, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    if where == "a slot":
        # Unread messages fill the ring: the next waits on the futex (its
        # second send_parts; the first only tries).
        for i in range(8):
            mq.enqueue(i, timeout=10)
        blocked_call, nth, msg = "send_parts", 2, 8
    else:
        # Unread messages fill the overflow store (made for a few of the
        # largest message) before the ring: the next put waits for room.
        big = np.zeros(1 << 20, dtype=np.uint8)
        need = pinshm.ObjectStore.slot_len(1, big.nbytes)
        mq.enqueue(big, timeout=10)
        while mq._overflow.store.stats()["largest_free_block"] >= need:
            mq.enqueue(big, timeout=10)
        blocked_call, nth, msg = "sleep", 1, big
    outcome = []

    def blocked():
        try:
            mq.enqueue(msg)
        except BaseException as e:  # noqa: BLE001 - the outcome is the test
            outcome.append(e)

    t, entered = in_call(blocked_call, blocked, nth)
    assert entered.wait(JOIN_S)  # the writer is at its wait
    mq.shutdown()
    t.join(JOIN_S)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert str(outcome[0]) == "cancelled"
    # The reader still gets what was sent before.
    assert rd.dequeue(timeout=10) is not None


@pytest.mark.parametrize("zero_copy", [False, True])
def test_arrays_inside_and_beyond_a_chunk_never_alias_memory_that_is_reused(unique_name, closing, zero_copy):
    """Arrays kept from earlier messages keep their bytes while later
    messages reuse the slots and the store: owned copies by default, and
    with zero_copy=True views of the store that hold their objects (the
    last three messages': what a reader holds must leave the store room
    for the next message, or the writer waits for it)."""
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    sizes = [1 << 10, 40 << 10, 1 << 20, 3 << 20]  # two in a chunk, two beyond

    def check(got):
        tag = got["tag"]
        assert got["a"].size == sizes[tag % len(sizes)]
        assert np.all(got["a"] == tag % 251), f"message {tag}: its array changed"

    kept = []
    for round_ in range(6):  # more rounds than slots, and the store reused
        for j, size in enumerate(sizes):
            tag = round_ * len(sizes) + j
            mq.enqueue({"a": np.full(size, tag % 251, dtype=np.uint8), "tag": tag}, timeout=10)
            got = rd.dequeue(timeout=10, zero_copy=zero_copy)
            assert got["tag"] == tag
            kept.append(got)
            if zero_copy and len(kept) > 3:
                check(kept.pop(0))  # checked after later messages, then let go
    for got in kept:
        check(got)
    if not zero_copy:
        # Owned, writable: writing one changes no other.
        kept[0]["a"][:] = 0
        assert np.all(kept[len(sizes)]["a"] == len(sizes) % 251)


def test_torch_tensors_inside_and_beyond_a_chunk_are_owned_copies(unique_name, closing):
    torch = pytest.importorskip("torch")
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    kept = []
    for i in range(8):
        n = 1 << 8 if i % 2 == 0 else 1 << 19  # 1 KiB inline, 2 MiB stored
        mq.enqueue(torch.full((n,), float(i)), timeout=10)
        kept.append(rd.dequeue(timeout=10))
    for i, t in enumerate(kept):
        assert t.dtype == torch.float32 and t.numel() == (1 << 8 if i % 2 == 0 else 1 << 19)
        assert bool((t == float(i)).all()), f"tensor {i} changed"
    kept[0].add_(1)  # writable, and no other tensor shares its memory
    assert bool((kept[2] == 2.0).all())


def test_the_overflow_store_rewinds_once_every_object_was_read(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    big = np.arange(1 << 18, dtype=np.uint32)  # 1 MiB: beyond a chunk
    for _ in range(3):
        mq.enqueue(big, timeout=10)
        # Unread, its objects start at the store's first byte: the previous
        # message's pages are reused, not the next ones of the ring.
        assert min(h.address for _, h in mq._overflow.store.keys()) == 0
        np.testing.assert_array_equal(rd.dequeue(timeout=10), big)
    assert mq._overflow.generation == 1


def test_a_message_that_could_not_go_in_leaves_the_overflow_store_in_use(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=8, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    blob = b"x" * (3 << 20)  # in band: one object, beyond a chunk
    mq.enqueue(blob, timeout=10)
    mq.enqueue(blob, timeout=10)
    store = mq._overflow.store
    with pytest.raises(TimeoutError, match="the store is full"):
        mq.enqueue(blob, timeout=0.2)
    # Nothing of it went in: the store is not retired, nothing leaks.
    assert mq._overflow.store is store and mq._overflow.generation == 1
    assert [rd.dequeue(timeout=10) for _ in range(2)] == [blob, blob]
    mq.enqueue(blob, timeout=10)
    assert rd.dequeue(timeout=10) == blob
    assert mq._overflow.store is store


def test_enqueue_after_shutdown_puts_nothing_in_the_overflow_store(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, name=unique_name()))
    closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    mq.enqueue(np.zeros(1 << 20, dtype=np.uint8), timeout=10)
    mq.shutdown()
    for _ in range(3):
        with pytest.raises(RuntimeError, match="cancelled"):
            mq.enqueue(np.zeros(1 << 20, dtype=np.uint8), timeout=10)
    assert mq._overflow.generation == 1 and len(mq._overflow.store) == 1


def test_dequeue_with_a_short_timeout_raises_timeout_error(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    with pytest.raises(TimeoutError):
        rd.dequeue(timeout=0.01)
    mq.enqueue("after")
    assert rd.dequeue(timeout=0.01) == "after"


def test_enqueue_into_a_full_ring_raises_timeout_error_naming_the_reader(unique_name, closing):
    mq = closing(MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=2, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    mq.enqueue(1)
    mq.enqueue(2)
    with pytest.raises(TimeoutError, match=r"reader rank 0 \(pid \d+\), reader rank 1 \(not attached yet\)"):
        mq.enqueue(3, timeout=0.05)
    assert rd.dequeue() == 1


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_reader_that_raises_inside_its_read_still_releases_its_slot(unique_name, closing, zero_copy):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    big = np.arange(1 << 20, dtype=np.uint32)  # 4 MiB: through the store
    small = np.arange(1 << 10, dtype=np.uint32)  # in the channel
    for round_ in range(4):  # more rounds than slots: a leak would block
        for payload in (small, big):
            mq.enqueue([payload, RaisesWhenRead()], timeout=10)
            with pytest.raises(ValueError, match="boom"):
                rd.dequeue(timeout=10, zero_copy=zero_copy)
            mq.enqueue(payload, timeout=10)
            got = rd.dequeue(timeout=10, zero_copy=zero_copy)
            np.testing.assert_array_equal(got, payload)
            del got
    # Every object of the store was released by the reader, raise or not.
    assert mq._overflow.store.free_unused() >= 0
    assert mq._overflow.store.stats()["objects"] == 0


def test_a_zero_copy_array_holds_its_object_until_it_is_gone(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    big = np.arange(1 << 20, dtype=np.uint32)
    mq.enqueue(big)
    got = rd.dequeue(zero_copy=True)
    assert not got.flags.writeable
    np.testing.assert_array_equal(got, big)
    mq._overflow.store.free_unused()
    assert mq._overflow.store.stats()["objects"] == 1  # the array holds its object
    del got
    mq._overflow.store.free_unused()
    assert mq._overflow.store.stats()["objects"] == 0
    mq.enqueue(big)
    copy = rd.dequeue()  # the default: an owned, writable copy
    assert copy.flags.writeable
    np.testing.assert_array_equal(copy, big)


def test_a_killed_reader_stops_blocking_the_writer(ctx, unique_name, closing):
    slots = 4
    mq = closing(MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=slots, name=unique_name()))
    results = ctx.Queue()
    # The stalled reader reports on a queue of its own: SIGKILLed, it may
    # die holding that queue's write lock (its feeder thread's), which
    # would block every later put on a shared one.
    stall_report = ctx.Queue()
    children = []
    try:
        stalled = start(ctx, w.attach_and_stall, mq.export_handle(), 1, stall_report)
        children.append(stalled)
        mq.enqueue(-1, timeout=JOIN_S)
        kind, pid = stall_report.get(timeout=JOIN_S)
        assert kind == "stalled"
        n = 5 * slots
        reader = start(ctx, w.read_count, mq.export_handle(), 0, n + 1, results)
        children.append(reader)
        w.kill(pid)
        # The event the writer's reaping rests on: the process is gone
        # (its liveness lock with it). Waited for, not assumed.
        stalled.join(JOIN_S)
        assert stalled.exitcode == -9, stalled.exitcode
        # Without the reaping, the ring would fill after `slots` messages
        # (JOIN_S: a guard against a hang; the reader may still be starting).
        for i in range(n):
            mq.enqueue(i, timeout=JOIN_S)
        kind, got = results.get(timeout=JOIN_S)
        finish(reader)
        assert got == [-1, *range(n)]
    finally:
        # A failing test still ends its children (pytest would wait for
        # a live one at exit).
        for p in children:
            if p.exitcode is None:
                p.kill()
                p.join(JOIN_S)


def test_objects_vllm_sends_round_trip(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    objs = [
        None,
        ("execute_model", (1, 2), {"k": b"x" * 100}, 0),
        {"ids": list(range(1000)), "mask": np.ones((8, 8), dtype=bool)},
        np.zeros(0, dtype=np.float32),
        b"y" * ((1 << 20) - 1),  # in band, larger than a chunk: the store
    ]
    for o in objs:
        assert mq.broadcast_object(o) is o
        got = rd.broadcast_object()
        assert pickle.dumps(got) == pickle.dumps(o)


def test_a_writer_or_a_non_reader_cannot_do_the_others_job(unique_name, closing):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    with pytest.raises(RuntimeError, match="Only readers"):
        mq.dequeue()
    with pytest.raises(RuntimeError, match="Only writers"):
        rd.enqueue(1)


def test_the_module_imports_nothing_optional():
    import subprocess
    import sys

    code = (
        "import sys, pinshm.vllm.queue.message_queue as m\n"
        "bad = [x for x in ('torch', 'vllm', 'zmq') if x in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- with torch / vLLM / pyzmq (skipped where they are not installed) ----


def test_four_processes_in_a_gloo_group_check_every_byte(ctx):
    pytest.importorskip("torch")
    n, world = 10_000, 4
    port = free_port()
    results = ctx.Queue()
    procs = [start(ctx, w.gloo_rank, r, world, port, n, results) for r in range(world)]
    got = sorted(results.get(timeout=JOIN_S) for _ in procs)
    for p in procs:
        finish(p)
    assert got == [(r, n) for r in range(world)]


def test_four_processes_in_a_stateless_process_group_check_every_byte(ctx):
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    n, world = 10_000, 4
    port = free_port()
    results = ctx.Queue()
    procs = [start(ctx, w.stateless_rank, r, world, port, n, results) for r in range(world)]
    got = sorted(results.get(timeout=JOIN_S) for _ in procs)
    for p in procs:
        finish(p)
    assert got == [(r, n) for r in range(world)]


def test_a_remote_reader_over_loopback_zmq_gets_every_byte(ctx, unique_name, closing):
    pytest.importorskip("zmq")
    n = 1_000
    # Rank 0 reads through shared memory, rank 1 through ZMQ over TCP.
    mq = closing(MessageQueue(2, 1, [0], max_chunk_bytes=2 * w.MIB, max_chunks=8, connect_ip="127.0.0.1", name=unique_name()))
    h = mq.export_handle()
    assert h.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    results = ctx.Queue()
    procs = [start(ctx, w.read_stream, h, 0, n, False, results), start(ctx, w.remote_reader, h, 1, n, results)]
    mq.wait_until_ready()
    w.base()
    for i in range(n):
        mq.enqueue(w.make_message(i, n), timeout=JOIN_S)
    got = sorted(r[:2] for r in (results.get(timeout=JOIN_S) for _ in procs))
    for p in procs:
        finish(p)
    assert got == [(0, n), (1, n)]


def test_install_rebinds_message_queue_inside_vllm():
    pytest.importorskip("vllm")
    import importlib

    from pinshm.vllm import plugin

    names = []
    for n in plugin.QUEUE_MODULES:
        try:
            importlib.import_module(n)
            names.append(n)
        except Exception:  # an optional dependency of that vLLM module (NameError without ray)
            pass
    assert "vllm.distributed.device_communicators.shm_broadcast" in names
    before = {n: importlib.import_module(n).MessageQueue for n in names}
    try:
        done = plugin.install_message_queue()
        for name in names:
            assert name in done
            assert importlib.import_module(name).MessageQueue is MessageQueue
        # parallel_state imports it from shm_broadcast when it makes a queue.
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as looked_up

        assert looked_up is MessageQueue
    finally:
        for n, cls in before.items():
            importlib.import_module(n).MessageQueue = cls


@pytest.mark.parametrize("pickle_bytes", [0, 37, 100])
def test_zero_copy_arrays_of_a_stored_message_start_64_byte_aligned(unique_name, closing, pickle_bytes):
    """A stored message is one object: its buffers are padded to 64
    bytes from the object's start, so views of them are aligned whatever
    the pickle's length."""
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    a, b = np.arange(1 << 17, dtype=np.float64), np.arange(300_001, dtype=np.int32)
    mq.enqueue({"pad": b"x" * pickle_bytes, "a": a, "b": b}, timeout=10)
    got = rd.dequeue(timeout=10, zero_copy=True)
    assert got["a"].ctypes.data % 64 == 0 and got["b"].ctypes.data % 64 == 0
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)

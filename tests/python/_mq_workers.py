"""Functions run in spawned processes by test_message_queue.py (importable
by name from the children, which get the parent's sys.path)."""

import os
import signal
import sys
import time

import numpy as np

from pinshm.vllm.queue import MessageQueue

from _procs import JOIN_S

KIB = 1 << 10
MIB = 1 << 20

_base = None


def base():
    """64 MiB + 64 KiB of random bytes, the same in every process."""
    global _base
    if _base is None:
        _base = np.random.default_rng(1234).integers(0, 256, 64 * MIB + 64 * KIB, dtype=np.uint8)
    return _base


def message_size(i, n):
    """The schedule of the stream of `n` messages: mostly 1 to 16 KiB,
    every 100th 1 MiB, every 1000th 4 MiB, and the last one 64 MiB (those
    carry an array out of band, through the store; the rest travel in the
    channel)."""
    if i == n - 1:
        return 64 * MIB
    if i % 1000 == 999:
        return 4 * MIB
    if i % 100 == 50:
        return MIB
    return KIB + (i * 37 % 16) * KIB


def make_message(i, n, torch_tensors=False):
    """Message `i`: its bytes are a slice of base() chosen by `i`; large
    ones as a numpy array (out of band), small ones as bytes (in band)."""
    size = message_size(i, n)
    off = (i * 7919) % (64 * KIB)
    data = base()[off : off + size]
    msg = {"i": i, "tag": f"message {i}", "ints": np.arange(i % 5, dtype=np.int64)}
    if size >= MIB:
        msg["array"] = data.copy()
        if torch_tensors:
            import torch

            msg["tensor"] = torch.from_numpy(data[: size // 2].copy())
    else:
        msg["blob"] = data.tobytes()
    return msg


def check_message(msg, i, n, torch_tensors=False):
    """Checks every byte of message `i`."""
    assert msg["i"] == i, (msg["i"], i)
    assert msg["tag"] == f"message {i}"
    np.testing.assert_array_equal(msg["ints"], np.arange(i % 5, dtype=np.int64))
    size = message_size(i, n)
    off = (i * 7919) % (64 * KIB)
    want = base()[off : off + size]
    if size >= MIB:
        assert msg["array"].dtype == np.uint8 and msg["array"].shape == (size,)
        assert np.array_equal(msg["array"], want), f"message {i}: bytes differ"
        if torch_tensors:
            t = msg["tensor"]
            assert t.numel() == size // 2 and np.array_equal(t.numpy(), want[: size // 2])
    else:
        assert msg["blob"] == want.tobytes(), f"message {i}: bytes differ"


def read_stream(handle, rank, n, zero_copy, results):
    """Attaches as `rank`, checks `n` messages, reports (rank, count,
    whether zmq was imported)."""
    base()
    mq = MessageQueue.create_from_handle(handle, rank)
    try:
        mq.wait_until_ready()
        for i in range(n):
            msg = mq.dequeue(timeout=120, zero_copy=zero_copy)
            check_message(msg, i, n)
            del msg
    finally:
        mq.close()
    results.put((rank, n, "zmq" in sys.modules))


def attach_and_stall(handle, rank, results):
    """Attaches, receives one message, then stops reading (to be killed)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.dequeue(timeout=JOIN_S)
    results.put(("stalled", os.getpid()))
    # Until killed; a parent that dies first (a failed test's) ends it too.
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)


def read_count(handle, rank, n, results):
    """Receives `n` messages (each its index) and reports them."""
    mq = MessageQueue.create_from_handle(handle, rank)
    try:
        got = [mq.dequeue(timeout=JOIN_S) for _ in range(n)]
    finally:
        mq.close()
    results.put(("read", got))


def gloo_rank(rank, world, port, n, results):
    """One rank of a gloo process group over loopback: rank 0 broadcasts
    the stream (torch tensors included) with create_from_process_group,
    the others check every byte."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        base()
        mq = MessageQueue.create_from_process_group(dist.group.WORLD, 2 * MIB, 8, writer_rank=0)
        try:
            for i in range(n):
                if rank == 0:
                    mq.broadcast_object(make_message(i, n, torch_tensors=True))
                else:
                    check_message(mq.broadcast_object(), i, n, torch_tensors=True)
            dist.barrier()
        finally:
            mq.close()
    finally:
        dist.destroy_process_group()
    results.put((rank, n))


def stateless_rank(rank, world, port, n, results):
    """As gloo_rank, over vLLM's StatelessProcessGroup."""
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=world)
    base()
    mq = MessageQueue.create_from_process_group(pg, 2 * MIB, 8, writer_rank=0)
    try:
        for i in range(n):
            if rank == 0:
                mq.broadcast_object(make_message(i, n, torch_tensors=True))
            else:
                check_message(mq.broadcast_object(), i, n, torch_tensors=True)
        pg.barrier()
    finally:
        mq.close()
    results.put((rank, n))


def remote_reader(handle, rank, n, results):
    """A reader through ZMQ (rank not among the local readers)."""
    base()
    mq = MessageQueue.create_from_handle(handle, rank)
    try:
        mq.wait_until_ready()
        for i in range(n):
            check_message(mq.dequeue(timeout=60), i, n)
    finally:
        mq.close()
    results.put((rank, n))


def kill(pid):
    os.kill(pid, signal.SIGKILL)

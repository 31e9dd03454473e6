"""pinshm's MessageQueue and /dev/shm: little of it used by vLLM-sized
queues, and nothing left when its writer is SIGKILLed, as vLLM's API
server kills its engine core and workers (real processes, started the way
vLLM starts them: multiprocessing, spawn)."""

import os
import select
import subprocess
import sys

import pytest

from pinshm.vllm.queue import MessageQueue

# Process A starts the resource tracker (as vLLM's API server does by
# spawning), then spawns B, which creates a queue with a reader attached
# and one large message in its store, prints the names, and waits to be
# killed. A SIGKILLs B, prints the tracker's pid, and (with "kill-a") is
# SIGKILLed itself.
SCRIPT = r"""
import multiprocessing as mp, os, signal, sys

def writer(name, conn):
    from pinshm._node import tracker as _tracker
    from pinshm.vllm.queue import MessageQueue
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name=name)
    rd = MessageQueue.create_from_handle(mq.export_handle(), 0)
    mq.enqueue(b"x" * (1 << 20))  # larger than a chunk: through the store
    assert rd.dequeue() == b"x" * (1 << 20)
    mq.enqueue(b"y" * (1 << 20))  # left unread in the store
    names = [mq._tx.name] + ([mq._overflow.store.name] if mq._overflow.store is not None else [])
    conn.send((names, _tracker.reaper_pid()))
    signal.pause()

if __name__ == "__main__":
    name, how = sys.argv[1], sys.argv[2]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=writer, args=(name, b))
    p.start()
    names, reaper = a.recv()
    print("NAMES", *names, flush=True)
    exists = all(os.path.exists("/dev/shm/" + n) for n in names)
    print("EXISTED", exists, flush=True)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    print("REAPER", reaper, flush=True)
    if how == "kill-a":
        os.kill(os.getpid(), signal.SIGKILL)
"""


def wait_exit(pid):
    """Blocks until `pid` (not our child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["a-exits", "kill-a"])
def test_a_sigkilled_writer_leaves_no_segment(tmp_path, unique_name, how):
    if not hasattr(os, "pidfd_open"):
        pytest.skip("needs os.pidfd_open (Linux 5.3, Python 3.9)")
    script = tmp_path / "a.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), unique_name(), how], capture_output=True, text=True, timeout=120
    )
    lines = dict(x.split(" ", 1) for x in out.stdout.splitlines() if " " in x)
    assert "REAPER" in lines, out.stdout + out.stderr[-3000:]
    names = lines["NAMES"].split()
    try:
        assert len(names) == 2, names  # the channel and the queue's store
        assert lines["EXISTED"] == "True"
        wait_exit(int(lines["REAPER"]))
        left = [n for n in names if os.path.exists("/dev/shm/" + n)]
        assert left == [], f"left in /dev/shm after SIGKILL: {left}"
    finally:
        for n in names:
            if os.path.exists("/dev/shm/" + n):
                os.unlink("/dev/shm/" + n)


def test_a_queue_closed_cleanly_is_no_longer_tracked(unique_name):
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name=unique_name())
    rd = MessageQueue.create_from_handle(mq.export_handle(), 0)
    assert mq._tracked.names == [mq._tx.name]
    mq.enqueue(b"x" * (1 << 20))
    assert len(mq._tracked.names) == 2
    assert rd.dequeue() == b"x" * (1 << 20)
    rd.close()
    mq.close()
    assert mq._tracked.names == []


def test_shutdown_ends_a_writer_blocked_on_a_reader_that_is_gone(unique_name):
    import threading

    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 10, max_chunks=1, name=unique_name())
    rd = MessageQueue.create_from_handle(mq.export_handle(), 0)
    try:
        mq.enqueue(1)  # fills the only slot; the reader never reads it
        err = []

        def blocked():
            try:
                mq.enqueue(2)
            except RuntimeError as e:
                err.append(str(e))

        t = threading.Thread(target=blocked)
        t.start()
        mq.shutdown()
        t.join()
        assert err == ["cancelled"]
    finally:
        rd.close()
        mq.close()


def resident(name):
    return os.stat("/dev/shm/" + name).st_blocks * 512


def test_vllm_sized_queues_take_little_dev_shm_and_still_carry_large_messages(unique_name):
    # vLLM's default queue: 10 chunks of 24 MiB (a 240 MiB ring, of which
    # vLLM's SharedMemory touches what its messages do). pinshm backs each
    # queue's slots at start, within the queue's share (at most 8 MiB).
    queues = [MessageQueue(1, 1, max_chunk_bytes=24 << 20, max_chunks=10, name=unique_name()) for _ in range(3)]
    readers = [MessageQueue.create_from_handle(q.export_handle(), 0) for q in queues]
    try:
        for q, r in zip(queues, readers):
            for i in range(100):
                q.enqueue(("small", i))
                assert r.dequeue() == ("small", i)
            big = os.urandom(3 << 20)
            q.enqueue(big)
            assert r.dequeue() == big
            assert r.max_chunk_bytes == 24 << 20
        used = sum(resident(n) for q in queues for n in q._tracked.names)
        assert used <= 3 * 12 << 20, f"{used / 2**20:.1f} MiB resident for 3 queues"
    finally:
        for r in readers:
            r.close()
        for q in queues:
            q.close()


def test_the_channel_name_goes_once_every_reader_attached_and_messages_still_flow(unique_name):
    import threading

    mq = MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=3, name=unique_name())
    name = mq._tx.name
    readers = [MessageQueue.create_from_handle(mq.export_handle(), r) for r in (0, 1)]
    try:
        # Collective, as in vLLM: the writer and each reader call it.
        threads = [threading.Thread(target=r.wait_until_ready) for r in readers]
        for t in threads:
            t.start()
        mq.wait_until_ready()
        for t in threads:
            t.join()
        assert not os.path.exists("/dev/shm/" + name), "unlinked once both readers attached"
        assert name not in mq._tracked.names
        for i in range(10):  # more than the slots: READY took one and left the rest
            mq.enqueue(("m", i))
            assert [r.dequeue() for r in readers] == [("m", i)] * 2
    finally:
        for r in readers:
            r.close()
        mq.close()


def test_the_handshake_works_from_one_thread_as_in_vllm(unique_name):
    # vLLM's writer-side wait_until_ready returns once every local reader
    # exists (its subscription arrived), not once each has called its own;
    # vLLM's tests/distributed/test_shm_broadcast.py calls them in turn from
    # one thread.
    import threading

    mq = MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=3, name=unique_name())
    name = mq._tx.name
    readers = [MessageQueue.create_from_handle(mq.export_handle(), r) for r in (0, 1)]
    done = threading.Event()
    try:
        # A guard against a hang (the test fails instead of blocking pytest).
        t = threading.Thread(target=lambda: (mq.wait_until_ready(), done.set()), daemon=True)
        t.start()
        assert done.wait(10), "the writer's wait_until_ready waited for the readers' calls"
        assert not os.path.exists("/dev/shm/" + name), "unlinked once both readers attached"
        for r in readers:
            r.wait_until_ready()
        for i in range(5):
            mq.enqueue(("m", i))
            assert [r.dequeue() for r in readers] == [("m", i)] * 2
    finally:
        mq.shutdown()
        for r in readers:
            r.close()
        mq.close()


def test_the_writer_waits_for_a_reader_that_has_not_attached(unique_name):
    import threading

    mq = MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=3, name=unique_name())
    first = MessageQueue.create_from_handle(mq.export_handle(), 0)
    done = threading.Event()
    t = threading.Thread(target=lambda: (mq.wait_until_ready(), done.set()), daemon=True)
    late = None
    try:
        t.start()
        assert not done.wait(0.3), "returned with reader 1 not attached"
        assert os.path.exists("/dev/shm/" + mq._tx.name), "the name stays until all attach"
        late = MessageQueue.create_from_handle(mq.export_handle(), 1)
        assert done.wait(10)
        for r in (first, late):
            r.wait_until_ready()
        mq.enqueue("x")
        assert first.dequeue() == "x" and late.dequeue() == "x"
    finally:
        mq.shutdown()
        t.join(5)
        for r in (first, late):
            if r is not None:
                r.close()
        mq.close()

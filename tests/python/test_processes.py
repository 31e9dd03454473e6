"""Readers and channel receivers in other processes (spawn start method)."""

import hashlib
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

import _workers
import pinshm
from _procs import JOIN_S, finish
from _procs import start as run

def test_two_spawned_readers_read_every_byte(ctx, unique_name, closing):
    store = closing(pinshm.ObjectStore(8 << 20, 1 << 20, 2, name=unique_name()))
    objects = [os.urandom(n) for n in (0, 1, 4096, 100_000, 1 << 20)]
    handles = [store.put(f"k{i}", o) for i, o in enumerate(objects)]
    want = [hashlib.sha256(o).hexdigest() for o in objects]
    results = ctx.Queue()
    procs = [run(ctx, _workers.read_objects, store.handle(), i, handles, results) for i in range(2)]
    got = dict(results.get(timeout=JOIN_S) for _ in procs)
    for p in procs:
        finish(p)
    assert got == {0: want, 1: want}
    # Both readers read each object twice (guard, copy): nothing is owed.
    assert store.free_unused() == len(objects)


def test_a_spawned_receiver_gets_every_message_in_order(ctx, unique_name, closing):
    tx = closing(pinshm.Broadcast(1, 8, 256, name=unique_name()))
    results = ctx.Queue()
    p = run(ctx, _workers.receive_messages, tx.handle(), results)
    sent = [f"message {i}".encode() * (i % 7 + 1) for i in range(200)]
    for m in sent:
        tx.send(m)  # blocks (GIL released) while the ring is full
    tx.send(b"eos")
    assert results.get(timeout=JOIN_S) == sent
    finish(p)


def test_a_spawned_worker_reads_objects_whose_handles_come_over_the_channel(
    ctx, unique_name, closing
):
    store = closing(pinshm.ObjectStore(4 << 20, 256 << 10, 1, name=unique_name("store")))
    tx = closing(pinshm.Broadcast(1, 4, 256, name=unique_name("chan")))
    results = ctx.Queue()
    p = run(ctx, _workers.serve_objects, tx.handle(), store.handle(), results)
    want = []
    for i in range(64):  # more than the ring holds: reads free the slots
        data = os.urandom(200 << 10)
        want.append(hashlib.sha256(data).hexdigest())
        while True:
            try:
                h = store.put(f"obj-{i}", data)
                break
            except pinshm.FullError:
                # The worker is behind; wait for it on the channel (send
                # blocks until the worker has taken its messages).
                tx.send(b"")
        tx.send(pickle.dumps(h))
    tx.send(b"eos")
    got = results.get(timeout=JOIN_S)
    finish(p)
    assert got == want


_WRITER = """
import sys, time
import pinshm
name = sys.argv[1]
store = pinshm.ObjectStore(1 << 20, 1 << 16, 1, name=name + "-store", reserve=False)
store.put("k", b"v")
chan = pinshm.Broadcast(1, 4, 1024, name=name + "-chan")
keep = pinshm.ObjectStore(1 << 20, 1 << 16, 1, name=name + "-keep", reap=False)
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_python_writer_leaves_nothing_but_what_it_kept(unique_name, sig):
    """A plain Python writer (no engine) killed by SIGKILL or SIGTERM: its
    store and channel are removed by its reaper; the store made with
    reap=False stays (it asked to outlive its writer) until gc."""
    name = unique_name()
    p = subprocess.Popen([sys.executable, "-c", _WRITER, name], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "READY"
        for tail in ("-store", "-chan", "-keep"):
            assert os.path.exists(f"/dev/shm/{name}{tail}")
        p.send_signal(sig)
        p.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(os.path.exists(f"/dev/shm/{name}{t}") for t in ("-store", "-chan")):
            time.sleep(0.05)
        assert not os.path.exists(f"/dev/shm/{name}-store"), "a killed writer's store stayed"
        assert not os.path.exists(f"/dev/shm/{name}-chan"), "a killed writer's channel stayed"
        assert os.path.exists(f"/dev/shm/{name}-keep"), "reap=False: the store outlives its writer"
        assert [a.name for a in pinshm.gc_segments(name, dry_run=False)] == [f"{name}-keep"]
    finally:
        p.kill()
        p.wait()
        for t in ("-store", "-chan", "-keep"):
            if os.path.exists(f"/dev/shm/{name}{t}"):
                os.unlink(f"/dev/shm/{name}{t}")

"""Reads held as long as their consumer needs, and sparse segments that
cost what their data touches and never raise SIGBUS, through the binding."""

import os
import subprocess
import sys
import textwrap

import pytest

import pinshm

MIB = 1 << 20


def allocated(name):
    """Bytes of /dev/shm the segment's file has allocated."""
    return os.stat(f"/dev/shm/{name}").st_blocks * 512


def test_one_held_view_does_not_stall_the_ring(unique_name, closing):
    store = closing(pinshm.ObjectStore(64 * MIB, MIB, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    held = reader.get(store.put("held", b"h" * MIB))
    view = memoryview(held)
    for i in range(1000):
        h = store.put(f"k{i}", bytes([i % 256]) * MIB)
        reader.get(h).release()
    assert bytes(view[:4]) == b"hhhh", "the held object never changed"
    assert store.is_cached("held")
    view.release()
    held.release()


def test_a_reader_holds_ten_thousand_views_at_once(unique_name, closing):
    store = closing(pinshm.ObjectStore(16 * MIB, 4096, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    handles = [store.put(f"k{i}", bytes([i % 251]) * 100) for i in range(1000)]
    guards = [reader.get(handles[i % 1000]) for i in range(10_000)]
    assert all(bytes(guards[j])[0] == (j % 1000) % 251 for j in range(0, 10_000, 97))
    # Every object is held: nothing can be freed until the guards go.
    assert store.free_unused() == 0
    for g in guards:
        g.release()
    assert store.free_unused() == 1000


def test_nine_vllm_sized_queues_cost_a_few_mib(unique_name, closing):
    """Nine channels of vLLM's default queue size (10 slots of 24 MiB), the
    queues of a TP=8 engine, each carrying 100 small messages."""
    names = []
    for q in range(9):
        tx = closing(pinshm.Broadcast(1, 10, 24 * MIB, name=unique_name(f"q{q}")))
        rx = closing(pinshm.BroadcastReader.attach(tx.handle(), 0))
        for i in range(100):
            tx.send(b"m" * 300)
            assert rx.recv() == b"m" * 300
        names.append(tx.name)
    total = sum(allocated(n) for n in names)
    assert total <= 16 * MIB, f"nine queues allocated {total} bytes"


def _run_in_small_dev_shm(code):
    """Runs `code` in a fresh interpreter whose /dev/shm is a 32 MiB tmpfs
    (a private mount namespace); skips where that is not allowed."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot create a mount namespace here (needs root and unshare)")
    script = "mount -t tmpfs -o size=32m pinshm-test /dev/shm && exec \"$0\" -c \"$1\""
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_sparse_store_on_a_small_dev_shm_raises_nospace_not_sigbus():
    out = _run_in_small_dev_shm(
        """
        import pinshm
        MIB = 1 << 20
        # vLLM's default cache is 4 GiB; here 256 MiB on a 32 MiB /dev/shm.
        store = pinshm.ObjectStore(256 * MIB, 4 * MIB, 1, name="pinshm-py-small", reserve=False)
        reader = pinshm.StoreReader.attach(store.handle(), 0)
        held, err = [], None
        for i in range(100):
            try:
                held.append(reader.get(store.put(f"k{i}", b"x" * (4 * MIB))))
            except MemoryError as e:
                err = e
                break
        assert isinstance(err, pinshm.NoSpaceError), repr(err)
        assert "/dev/shm" in str(err)
        for g in held:
            g.release()
        # Space is back: the store works again.
        reader.get(store.put("after", b"y" * (4 * MIB))).release()
        print("OK", len(held), err)
        """
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert out.stdout.startswith("OK"), out.stdout


def test_a_sparse_channel_on_a_small_dev_shm_raises_nospace_not_sigbus():
    out = _run_in_small_dev_shm(
        """
        import pinshm
        MIB = 1 << 20
        tx = pinshm.Broadcast(1, 10, 24 * MIB, name="pinshm-py-small-q")
        rx = pinshm.BroadcastReader.attach(tx.handle(), 0)
        for i in range(100):
            tx.send(b"s" * 1000)
            assert rx.recv() == b"s" * 1000
        err = None
        for i in range(10):
            try:
                tx.send(b"b" * (20 * MIB))
                assert len(rx.recv()) == 20 * MIB
            except MemoryError as e:
                err = e
                break
        assert isinstance(err, pinshm.NoSpaceError), repr(err)
        tx.send(b"small again")
        assert rx.recv() == b"small again"
        print("OK", err)
        """
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert out.stdout.startswith("OK"), out.stdout

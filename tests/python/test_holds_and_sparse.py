"""Reads held as long as their consumer needs, and sparse segments that
cost what their data touches and never raise SIGBUS, through the binding."""

import os

import pytest

import pinshm
from _small_shm import run_in_small_dev_shm

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
            assert rx.recv_bytes() == b"m" * 300
        names.append(tx.name)
    total = sum(allocated(n) for n in names)
    assert total <= 16 * MIB, f"nine queues allocated {total} bytes"


def test_a_sparse_store_on_a_small_dev_shm_raises_nospace_not_sigbus():
    out = run_in_small_dev_shm(
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
    out = run_in_small_dev_shm(
        """
        import pinshm
        MIB = 1 << 20
        tx = pinshm.Broadcast(1, 10, 24 * MIB, name="pinshm-py-small-q")
        rx = pinshm.BroadcastReader.attach(tx.handle(), 0)
        for i in range(100):
            tx.send(b"s" * 1000)
            assert rx.recv_bytes() == b"s" * 1000
        err = None
        for i in range(10):
            try:
                tx.send(b"b" * (20 * MIB))
                assert len(rx.recv_bytes()) == 20 * MIB
            except MemoryError as e:
                err = e
                break
        assert isinstance(err, pinshm.NoSpaceError), repr(err)
        tx.send(b"small again")
        assert rx.recv_bytes() == b"small again"
        print("OK", err)
        """
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert out.stdout.startswith("OK"), out.stdout


class FakeEvent:
    """Stands for a torch.cuda.Event: `query()` is True once `done` is set."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


@pytest.fixture
def gate():
    """A release gate handing out FakeEvents (cleared at teardown)."""
    events = []

    def make():
        ev = FakeEvent()
        events.append(ev)
        return ev

    pinshm.set_release_gate(make)
    yield events
    pinshm.set_release_gate(None)
    for ev in events:
        ev.done = True
    pinshm.flush_releases()


def test_a_gated_slot_is_not_reused_while_its_event_is_pending(unique_name, closing, gate):
    # Room for three objects: a lap of puts would reuse `a`'s slot.
    store = closing(pinshm.ObjectStore(3 * 64 * 1024, 60 * 1024, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("a", b"a" * 60 * 1024)
    g = reader.get(h)
    view = memoryview(g)
    del view
    g.release()  # the last view is gone: the gate's event decides now
    assert len(gate) == 1
    for i in range(10):  # laps of puts, each read at once
        reader.get(store.put(f"k{i}", b"k" * 60 * 1024)).release()
        gate[-1].done = True  # their own events complete at once
    assert store.is_cached("a"), "reused while its copy may be in flight"
    assert pinshm.flush_releases() == 1
    gate[0].done = True
    assert pinshm.flush_releases() == 0
    for i in range(10, 14):
        reader.get(store.put(f"k{i}", b"k" * 60 * 1024)).release()
        gate[-1].done = True
    assert not store.is_cached("a"), "released, its slot is reused"


def test_a_gate_returning_none_releases_at_once(unique_name, closing):
    store = closing(pinshm.ObjectStore(1 << 20, 4096, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    pinshm.set_release_gate(lambda: None)
    try:
        reader.get(store.put("a", b"x")).release()
        assert pinshm.flush_releases() == 0
        assert store.free_unused() == 1
    finally:
        pinshm.set_release_gate(None)


def test_the_torch_gate_releases_at_once_without_cuda():
    from pinshm import cuda_release

    assert cuda_release.torch_cuda_event() is None


def test_handles_past_what_the_writer_wrote_are_stale_and_allocate_nothing(unique_name, closing):
    # A stale, foreign or corrupted handle at an address
    # the writer never wrote is refused before any byte there is touched (a
    # read fault on a hole of /dev/shm allocates a page, or raises SIGBUS
    # when /dev/shm is full).
    name = unique_name()
    mib = 1 << 20
    # No backer: its pages ahead would change the count below meanwhile.
    store = closing(pinshm.ObjectStore(64 * mib, mib, 1, name=name, reserve=False, back_ahead=0))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("a", b"x" * 4096)
    assert reader.get_copy(h) == b"x" * 4096

    def allocated():
        return os.stat(f"/dev/shm/{name}").st_blocks * 512

    before = allocated()
    out = bytearray(mib)
    for i in range(192):
        f = pinshm.ObjectHandle(mib + i * (63 * mib // 192) // 64 * 64, h.monotonic_id + 1 + i, h.epoch)
        for read in (reader.get, reader.get_copy, reader.validate, reader.acknowledge,
                     lambda f: reader.get_copy_into(f, out)):
            with pytest.raises(pinshm.StaleError):
                read(f)
    assert allocated() == before

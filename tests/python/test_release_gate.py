"""Gated releases (`pinshm.set_release_gate`): a read
whose event has completed is released with no further call on its reader
(the release poller), `close()` and dropping a reader release its
completed reads and keep the rest until their events complete, and copies
out are never gated. Events are fakes with a controllable `query()`; the
torch gate is checked against a torch-free fake of `torch.cuda`."""

import gc
import sys
import threading
import time
import types

import pytest

import pinshm
from pinshm import cuda_release

KIB = 1024
OBJ = 60 * KIB
# Long enough for any loaded machine; the poller needs about a millisecond.
DEADLINE_S = 10.0


class FakeEvent:
    """Stands for a torch.cuda.Event: `query()` is True once `done` is set;
    `queries` counts the calls, `threads` records who made them."""

    def __init__(self):
        self.done = False
        self.queries = 0
        self.threads = set()

    def query(self):
        self.queries += 1
        self.threads.add(threading.get_ident())
        return self.done


@pytest.fixture
def gate():
    """A release gate handing out FakeEvents (cleared at teardown, every
    event completed and flushed, so no read outlives the test)."""
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


def small_store(unique_name, closing, objects=3):
    """A store with room for `objects` objects of OBJ bytes, one reader."""
    return closing(pinshm.ObjectStore(objects * 64 * KIB, OBJ, 1, name=unique_name()))


def eventually(cond, what):
    """Polls `cond` until it holds or DEADLINE_S passes (then fails)."""
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.005)


def gated_read(store, reader, key):
    """Puts `key`, reads it with a view, lets the view and guard go: the
    read is now pending on the gate's newest event."""
    h = store.put(key, b"a" * OBJ)
    g = reader.get(h)
    view = memoryview(g)
    del view
    g.release()
    return h


def test_a_completed_read_is_released_while_its_reader_stays_idle(unique_name, closing, gate):
    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    gated_read(store, reader, "a")
    assert len(gate) == 1
    assert store.free_unused() == 0, "released before its event completed"
    gate[0].done = True
    # No call on the reader from here on: only the writer asks.
    eventually(lambda: store.free_unused() == 1, "the writer reclaims the read's slot")
    assert threading.get_ident() not in gate[0].threads, "polled by another thread"


def test_close_releases_the_completed_reads_at_once(unique_name, closing, gate):
    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    gated_read(store, reader, "a")
    gate[0].done = True
    reader.close()
    # The only reader is gone and its read released: a lap of puts fits.
    for i in range(4):
        store.put(f"k{i}", b"k" * OBJ)
    assert not store.is_cached("a")


def test_close_keeps_a_pending_read_until_its_event_completes(unique_name, closing, gate):
    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    gated_read(store, reader, "a")
    reader.close()
    # Its copy may be in flight: the slot is kept (the reader stays
    # attached for it, as for a guard still held).
    with pytest.raises(pinshm.FullError):
        for i in range(4):
            store.put(f"k{i}", b"k" * OBJ)
    assert store.is_cached("a")
    gate[0].done = True

    def lap_fits():
        try:
            store.put("after", b"z" * OBJ)
            return True
        except pinshm.FullError:
            return False

    eventually(lap_fits, "the read is released once its event completes")


def test_dropping_the_reader_releases_its_completed_reads(unique_name, closing, gate):
    store = small_store(unique_name, closing)
    reader = pinshm.StoreReader.attach(store.handle(), 0)
    gated_read(store, reader, "a")
    gate[0].done = True
    del reader
    gc.collect()
    tries = iter(range(1 << 30))

    def lap_fits():
        t = next(tries)
        try:
            for i in range(4):
                store.put(f"k{t}-{i}", b"k" * OBJ)
            return True
        except pinshm.FullError:
            return False

    eventually(lap_fits, "a lap of puts fits once the dropped reader's read is released")


@pytest.mark.parametrize("how", ["get_copy", "get_copy_into"])
def test_copies_out_are_never_gated(unique_name, closing, gate, how):
    # Events that never complete: a gated read would hold its slot forever.
    store = small_store(unique_name, closing, objects=16)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    buf = bytearray(OBJ)
    for i in range(5 * 16):  # five laps of the ring
        h = store.put(f"k{i}", bytes([i % 256]) * OBJ)
        if how == "get_copy":
            assert reader.get_copy(h) == bytes([i % 256]) * OBJ
        else:
            assert reader.get_copy_into(h, buf) == OBJ
            assert buf == bytes([i % 256]) * OBJ
    assert gate == [], "the gate was asked about a copy"
    assert pinshm.flush_releases() == 0


def test_a_poll_from_inside_query_neither_deadlocks_nor_miscounts(unique_name, closing):
    # query() is Python code: it may call back into pinshm (a get, which
    # polls, or flush_releases) from within a poll, which counts the read
    # being polled as still pending.
    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("b", b"b" * OBJ)
    seen = []

    class Reentrant(FakeEvent):
        def query(self):
            seen.append(pinshm.flush_releases())
            reader.get_copy(h)
            return super().query()

    ev = Reentrant()
    pinshm.set_release_gate(lambda: ev)
    try:
        gated_read(store, reader, "a")
    finally:
        pinshm.set_release_gate(None)
    ev.done = True
    eventually(lambda: pinshm.flush_releases() == 0, "the reentrant event's read is released")
    assert seen and all(n >= 1 for n in seen)


class _Stream:
    def __init__(self, name):
        self.name = name
        self.done = True  # nothing queued


class _FakeCudaEvent:
    def __init__(self, cuda):
        self._cuda = cuda
        self._stream = None

    def record(self, stream=None):
        self._stream = stream if stream is not None else self._cuda.current

    def query(self):
        return self._stream.done


def _fake_torch():
    """A torch-free stand-in for the bits of torch.cuda the gate uses."""
    cuda = types.SimpleNamespace()
    cuda.current = _Stream("default")
    cuda.is_initialized = lambda: True
    cuda.current_stream = lambda: cuda.current
    cuda.Event = lambda: _FakeCudaEvent(cuda)
    return types.SimpleNamespace(cuda=cuda)


def test_the_torch_gate_waits_for_a_copy_on_a_side_stream(unique_name, closing, monkeypatch):
    torch = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    side = _Stream("side")
    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    cuda_release.install(streams=[side])
    try:
        side.done = False  # a copy from the slot queued on the side stream
        gated_read(store, reader, "a")  # its view dropped on the default stream
    finally:
        cuda_release.uninstall()
    time.sleep(0.05)  # the poller polls meanwhile: the side stream is busy
    assert pinshm.flush_releases() == 1, "released before the side stream's copy ended"
    assert store.free_unused() == 0
    side.done = True
    eventually(lambda: store.free_unused() == 1, "released once the side stream's copy ended")


def test_the_torch_gate_records_on_the_current_stream_by_default(unique_name, closing, monkeypatch):
    torch = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    cuda_release.install()
    try:
        torch.cuda.current = copying = _Stream("copying")
        copying.done = False
        gated_read(store, reader, "a")
    finally:
        cuda_release.uninstall()
    assert pinshm.flush_releases() == 1
    copying.done = True
    eventually(lambda: store.free_unused() == 1, "released once the current stream's copy ended")


EXIT_CHILD = r"""
import sys, threading, time
import pinshm

class Ev:
    def __init__(self):
        self.done = False
    def query(self):
        return self.done

events = []
def make():
    events.append(Ev())
    return events[-1]

pinshm.set_release_gate(make)
store = pinshm.ObjectStore(3 * 64 * 1024, 60 * 1024, 1, name=sys.argv[1])
reader = pinshm.StoreReader.attach(store.handle(), 0)

def gated_read(key):
    g = reader.get(store.put(key, b"a" * 60 * 1024))
    m = memoryview(g)
    del m
    g.release()

gated_read("a")
events[0].done = True
end = time.monotonic() + 10
while store.free_unused() != 1 and time.monotonic() < end:
    time.sleep(0.005)
print("released" if not store.is_cached("a") else "held", flush=True)
gated_read("b")  # never completes: polled until the interpreter exits
threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(int, 1)], daemon=True).start()
time.sleep(0.05)
print("exiting", flush=True)
"""


def test_the_poller_releases_in_a_process_and_lets_it_exit(unique_name):
    # A process whose reader is idle gets its completed read released, and
    # exits cleanly (no abort, no hang) while the poller still polls one.
    import os
    import subprocess

    for run in range(3):
        name = unique_name()
        try:
            out = subprocess.run(
                [sys.executable, "-c", EXIT_CHILD, name], capture_output=True, text=True, timeout=60
            )
        finally:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
        assert out.returncode == 0, (run, out.returncode, out.stdout, out.stderr)
        assert out.stdout.split() == ["released", "exiting"], (run, out.stdout, out.stderr)


def test_the_poller_comes_back_after_it_ended_idle(unique_name, closing, gate):
    # The poller's thread ends after a second with nothing pending; a read
    # pended later starts another, which releases it as the first did.
    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    for round in range(2):
        gated_read(store, reader, f"a{round}")
        gate[-1].done = True
        eventually(lambda: store.free_unused() == 1, f"round {round}: released, the reader idle")
        time.sleep(1.5)  # past the poller's idle end


def raises(exc):
    raise exc


def test_a_reader_dropped_while_an_exception_unwinds_keeps_pending_reads(
    unique_name, closing, gate
):
    # The reader's drop runs with the exception pending: a query() made
    # there would fail for it (and count as completed, ending a read whose
    # copy may still be in flight) and the exception would be lost.
    store = small_store(unique_name, closing)

    def pending_reader():
        reader = pinshm.StoreReader.attach(store.handle(), 0)
        gated_read(store, reader, "a")
        return reader

    with pytest.raises(KeyError, match="goes on"):
        # The reader lives only on the value stack, which the unwind pops
        # (dropping it) with the KeyError pending.
        print(pending_reader(), raises(KeyError("goes on")))
    gc.collect()
    time.sleep(0.05)  # the poller polls meanwhile: its queries see no exception
    assert store.free_unused() == 0, "a read ended while its event had not completed"
    gate[0].done = True
    eventually(lambda: store.free_unused() == 1, "the read, once its event completed")


def test_a_view_dropped_while_an_exception_unwinds_calls_the_gate_cleanly(
    unique_name, closing
):
    # The last view going during an unwind calls the gate with the
    # exception pending: the gate's call must neither fail for it (then
    # the read would be released at once) nor swallow it.
    events = []

    def make():
        events.append(FakeEvent())
        return events[-1]

    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("a", b"a" * OBJ)
    pinshm.set_release_gate(make)
    try:

        with pytest.raises(KeyError, match="goes on"):
            # The view (holding the read) lives only on the value stack,
            # which the unwind pops with the KeyError pending.
            print(memoryview(reader.get(h)), raises(KeyError("goes on")))
        gc.collect()
        assert len(events) == 1, "the gate was not asked (or failed)"
        time.sleep(0.05)
        assert store.free_unused() == 0, "released before its event completed"
        events[0].done = True
        eventually(lambda: store.free_unused() == 1, "the read, once its event completed")
    finally:
        pinshm.set_release_gate(None)
        for ev in events:
            ev.done = True
        pinshm.flush_releases()

"""A forked child keeps nothing of its parent's alive, and reads nothing of
its parent's that changes under it.

A child made by fork shares its parent's open file descriptions, and the
liveness locks are on those: without care, a child that does nothing with
pinshm keeps a killed parent alive in its peers' eyes. This is vLLM's
process model (a process builds a store or queue, then forks workers), so
every party here is a real process, forked with os.fork or multiprocessing's
fork start method, and SIGKILLed as vLLM kills its workers."""

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest

import pinshm
from _fork import WAIT_S

KIB = 1024
# A dead party's peers see it gone within about two liveness periods (half
# a second); this is a guard against a hang, not a timing assertion.
GONE_WITHIN_S = 5.0


def _idle(ready):
    ready.set()
    time.sleep(60)


def _start_idle_child(how):
    """Forks a child that does nothing with pinshm (os.fork, or a
    multiprocessing fork-context Process) and returns its pid once it runs."""
    if how == "os.fork":
        rx, tx = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(tx, b"r")
            time.sleep(60)
            os._exit(0)
        os.close(tx)
        assert os.read(rx, 1) == b"r"
        os.close(rx)
        return pid
    # Returned once the child runs: until then it may not have dropped the
    # liveness locks it inherited (its fork handler runs in the child), and
    # a test that kills the parent first would see the parent still alive.
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_idle, args=(ready,), daemon=False)
    p.start()
    assert ready.wait(WAIT_S)
    return p.pid


class Party:
    """A process forked from the test that runs `build()` (returning
    something to report), forks an idle child the chosen way, reports, and
    waits to be SIGKILLed. Kills both at the end, whatever the outcome."""

    def __init__(self, build, how):
        rx, tx = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(rx)
                keep = build()
                idle = _start_idle_child(how)
                # One line: the idle child holds the pipe open too (it was
                # forked with it), so the test reads a line, not to EOF.
                os.write(tx, pickle.dumps((keep[1], idle)).hex().encode() + b"\n")
                time.sleep(120)
            finally:
                os._exit(1)
        os.close(tx)
        with os.fdopen(rx, "rb") as f:
            line = f.readline()
        if not line:
            raise AssertionError("the party died before it reported")
        self.report, self.idle = pickle.loads(bytes.fromhex(line.decode()))

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pid = None
        # The idle child is alive: the point of the test.
        os.kill(self.idle, 0)

    def close(self):
        for pid in (self.pid, self.idle):
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # the idle child is the party's, reaped by init


HOW = ["os.fork", "multiprocessing-fork"]


@pytest.mark.parametrize("how", HOW)
def test_a_killed_writer_is_gone_to_its_reader_though_its_forked_child_lives(
    how, unique_name, closing
):
    name = unique_name()

    def build():
        b = pinshm.Broadcast(1, 8, 256, name=name)
        b.send(b"before")
        return b, b.handle()

    party = closing(Party(build, how))
    try:
        r = closing(pinshm.BroadcastReader.attach(party.report, 0))
        assert r.recv_bytes(timeout=WAIT_S) == b"before"
        party.kill()
        with pytest.raises(pinshm.WriterGoneError):
            r.recv_bytes(timeout=GONE_WITHIN_S)
    finally:
        # The killed writer could not remove its segment.
        if os.path.exists(f"/dev/shm/{name}"):
            os.remove(f"/dev/shm/{name}")


@pytest.mark.parametrize("how", HOW)
def test_a_killed_store_reader_is_reaped_within_a_lap_though_its_forked_child_lives(
    how, unique_name, closing
):
    size = 16 * KIB
    store = closing(pinshm.ObjectStore(8 * size, size, 1, name=unique_name()))
    handle = store.handle()

    def build():
        r = pinshm.StoreReader.attach(handle, 0)
        return r, None

    party = closing(Party(build, how))
    party.kill()
    for i in range(3 * 8):
        store.put(f"k{i}", bytes([i]) * size)


@pytest.mark.parametrize("how", HOW)
def test_a_killed_channel_reader_stops_blocking_the_writer_though_its_forked_child_lives(
    how, unique_name, closing
):
    b = closing(pinshm.Broadcast(1, 8, 64, name=unique_name()))
    handle = b.handle()

    def build():
        return pinshm.BroadcastReader.attach(handle, 0), None

    party = closing(Party(build, how))
    party.kill()
    for i in range(3 * 8):
        b.send(bytes([i]) * 8, timeout=GONE_WITHIN_S)


STORE_SHAPE = (64 * KIB, 16 * KIB, 1)


@pytest.mark.parametrize("view", ["memoryview", "numpy"])
def test_a_forked_child_faults_on_an_inherited_view_instead_of_reading_a_reused_slot(
    view, store, reader
):
    np = pytest.importorskip("numpy")
    old = bytes(range(256)) * 64  # 16 KiB
    h = store.put("a", old)
    g = reader.get(h)
    v = memoryview(g) if view == "memoryview" else np.frombuffer(g, dtype=np.uint8)
    go_rx, go_tx = os.pipe()

    def child():
        # The fault is the answer: keep pytest's faulthandler from printing
        # a traceback for it.
        faulthandler.disable()
        os.read(go_rx, 1)
        return 0 if bytes(v) == old else 1

    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    try:
        # The parent lets go of its read and the writer reuses every slot.
        if view == "memoryview":
            v.release()
        del v
        g.release()
        reader.close()  # nothing it has not read holds the ring
        for i in range(8):
            store.put(f"n{i}", bytes([i]) * len(old))
        assert not store.is_cached("a")
        os.write(go_tx, b"x")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(go_tx)
        os.close(go_rx)
    code = os.waitstatus_to_exitcode(status)
    assert code != 1, "the child read the reused slot's new bytes"
    assert code == -signal.SIGSEGV, f"the child ended with {code}"

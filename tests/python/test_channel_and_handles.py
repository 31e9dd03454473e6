"""The broadcast channel in one process, and handles that pickle."""

import builtins
import os
import pickle
import subprocess
import sys

import pytest

import pinshm


def test_messages_arrive_in_order_as_bytes(channel):
    tx, rx = channel
    tx.send(b"one")
    tx.send(bytearray(b"two"))
    assert rx.recv_bytes() == b"one"
    assert rx.recv_bytes(timeout=10) == b"two"
    assert rx.try_recv() is None
    assert tx.sent == 2


def test_wait_stats_count_each_receive_by_how_it_found_its_message(channel):
    tx, rx = channel
    assert rx.wait_stats() == dict.fromkeys(["ready", "spin", "early", "window", "sleep", "gave_up"], 0)
    tx.send(b"one")
    assert rx.recv_bytes(timeout=10) == b"one"
    with pytest.raises(pinshm.WaitTimeoutError):
        rx.recv_bytes(timeout=0.01)
    assert rx.try_recv() is None  # not a wait: not counted
    s = rx.wait_stats()
    assert (s["ready"], s["gave_up"], sum(s.values())) == (1, 1, 2)


def test_a_full_channel_refuses_try_send_and_times_out_send(channel):
    tx, rx = channel
    assert tx.try_send(b"a") and tx.try_send(b"b")
    assert not tx.try_send(b"c")
    with pytest.raises(pinshm.WaitTimeoutError) as e:
        tx.send(b"c", timeout=0)
    assert isinstance(e.value, builtins.TimeoutError)
    assert rx.recv_bytes() == b"a"
    assert tx.try_send(b"c")


def test_an_empty_channel_times_out_recv(channel):
    _, rx = channel
    with pytest.raises(pinshm.WaitTimeoutError, match="recv"):
        rx.recv_bytes(timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        rx.recv_bytes(timeout=-1)


def test_a_message_larger_than_a_slot_raises(channel):
    tx, _ = channel
    with pytest.raises(ValueError, match="exceeds"):
        tx.send(bytes(65))


def test_receivers_drain_then_see_the_writer_gone(channel):
    tx, rx = channel
    tx.send(b"last")
    tx.close()
    assert rx.recv_bytes() == b"last"
    with pytest.raises(pinshm.WriterGoneError):
        rx.recv_bytes()


@pytest.mark.parametrize("proto", [2, pickle.HIGHEST_PROTOCOL])
def test_handles_pickle_and_compare_equal(unique_name, closing, proto):
    store = closing(pinshm.ObjectStore(1 << 20, 1024, 1, name=unique_name()))
    tx = closing(pinshm.Broadcast(1, 2, 64, name=unique_name()))
    h = store.put("k", b"v")
    for obj in (h, store.handle(), tx.handle()):
        back = pickle.loads(pickle.dumps(obj, protocol=proto))
        assert back == obj and hash(back) == hash(obj)
        assert type(back) is type(obj)
    assert h == pinshm.ObjectHandle(h.address, h.monotonic_id, h.epoch)
    assert repr(h).startswith("ObjectHandle(address=")
    assert {h, pinshm.ObjectHandle(h.address, h.monotonic_id, h.epoch)} == {h}


_EXIT_WITH_BLOCKED_DAEMONS = r"""
import sys, threading, time
import pinshm

b = pinshm.Broadcast(1, 2, 64, name=sys.argv[1] + "-one")
r = pinshm.BroadcastReader.attach(b.handle(), 0)
full = pinshm.Broadcast(1, 2, 64, name=sys.argv[1] + "-two")
stuck = pinshm.BroadcastReader.attach(full.handle(), 0)
full.send(b"1")
full.send(b"2")
threading.Thread(target=r.recv, daemon=True).start()
threading.Thread(target=lambda: full.send(b"3"), daemon=True).start()
time.sleep(0.3)


class SlowToFinalize:
    # Stands for a large program's slow teardown: the daemon threads' waits
    # end (100 ms steps) while the interpreter is finalizing.
    def __del__(self):
        time.sleep(0.5)


slow = SlowToFinalize()
print("exiting", flush=True)
"""


def test_the_interpreter_exits_cleanly_while_daemon_threads_wait_in_recv_and_send(
    unique_name,
):
    for _ in range(3):
        name = unique_name()
        try:
            p = subprocess.run(
                [sys.executable, "-c", _EXIT_WITH_BLOCKED_DAEMONS, name],
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            # The channels die with the process, unclosed (that is the
            # point): their names are ours to remove.
            for tag in ("-one", "-two"):
                try:
                    os.unlink(f"/dev/shm/{name}{tag}")
                except FileNotFoundError:
                    pass
        assert p.returncode == 0, p.stderr
        assert p.stdout == "exiting\n"


_EXIT_WITH_COPYING_DAEMONS = r"""
import os, sys, threading, time
import pinshm

store = pinshm.ObjectStore(64 << 20, 8 << 20, 1, name=sys.argv[1])
h = store.put("k", os.urandom(4 << 20))
reader = pinshm.StoreReader.attach(store.handle(), 0)


def copy_forever():
    while True:
        reader.get_copy(h)  # 4 MiB: the copy runs with the GIL released


for _ in range(3):
    threading.Thread(target=copy_forever, daemon=True).start()
time.sleep(0.05)
print("exiting", flush=True)
"""


def test_the_interpreter_exits_cleanly_while_daemon_threads_copy(unique_name):
    """Daemon threads whose GIL-released copies end while the interpreter
    exits: none may retake the GIL during finalization (it aborted every
    time before gil::released)."""
    for _ in range(5):
        name = unique_name()
        try:
            p = subprocess.run(
                [sys.executable, "-c", _EXIT_WITH_COPYING_DAEMONS, name],
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout == "exiting\n"


def test_cancel_ends_a_blocked_recv_and_a_blocked_send(unique_name, closing):
    import threading

    tx = closing(pinshm.Broadcast(1, 1, 16, name=unique_name()))
    rx = closing(pinshm.BroadcastReader.attach(tx.handle(), 0))
    assert tx.blocking_readers() == []
    outcome = []

    def run(f):
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - the outcome is the test
            outcome.append(e)

    t = threading.Thread(target=run, args=(rx.recv,))
    t.start()
    rx.cancel()
    t.join(60)
    tx.send(b"a")  # the ring (one slot) is full now
    assert tx.blocking_readers() == [(0, os.getpid())]
    t2 = threading.Thread(target=run, args=(lambda: tx.send(b"b"),))
    t2.start()
    tx.cancel()
    t2.join(60)
    assert [type(e) for e in outcome] == [pinshm.CancelledError, pinshm.CancelledError]
    with pytest.raises(pinshm.CancelledError):
        rx.recv_bytes(timeout=1)


def test_star_import_does_not_shadow_the_builtin_timeout_error():
    scope = {}
    exec("from pinshm import *", scope)
    assert "TimeoutError" not in scope
    assert issubclass(pinshm.WaitTimeoutError, TimeoutError)
    assert not hasattr(pinshm, "TimeoutError"), "no alias of WaitTimeoutError"

"""`BroadcastReader.recv`: a channel message in place, exported
through the buffer protocol with no copy, holding its slot until released;
and `cancel()` as a futex wake."""

import os
import pickle
import threading

import pytest

import pinshm
from _fork import in_child

# A guard against a hang, not a timing assumption.
WAIT_S = 20


# The `channel` fixture (conftest): one reader, two slots of 4 KiB.
CHANNEL_SHAPE = (1, 2, 4096)


def test_a_view_exports_the_messages_bytes_read_only(channel):
    tx, rx = channel
    obj = {"step": 7, "tokens": list(range(100))}
    data = pickle.dumps(obj, protocol=5)
    tx.send(data)
    with rx.recv() as v:
        assert len(v) == len(data) and v.seq == 0
        m = memoryview(v)
        assert m.readonly and bytes(m) == data and bytes(v) == data
        assert pickle.loads(m) == obj
        with pytest.raises(TypeError):
            m[0] = 0
        m.release()
    assert v.released


def test_the_writer_cannot_reuse_a_slot_while_its_view_lives_and_release_frees_it(channel):
    tx, rx = channel
    tx.send(b"held")
    tx.send(b"copied")
    v = rx.recv()
    assert rx.recv_bytes() == b"copied"  # released at once: its slot is free
    # Both slots were used; the next send needs slot 0, which the view holds.
    assert not tx.try_send(b"third")
    assert tx.blocking_readers() == [(0, os.getpid())]
    assert bytes(v) == b"held"
    v.release()
    assert tx.try_send(b"third")
    assert rx.recv_bytes() == b"third"


def test_release_is_refused_while_an_export_lives_and_the_export_keeps_the_slot(channel):
    tx, rx = channel
    tx.send(b"abc")
    tx.send(b"def")
    v = rx.recv()
    rx.recv_bytes()
    m = memoryview(v)
    with pytest.raises(BufferError, match="1 exported view"):
        v.release()
    assert not tx.try_send(b"x"), "the export holds the slot"
    m.release()
    v.release()
    assert tx.try_send(b"x")


def test_a_view_outlives_close_of_its_reader(channel):
    tx, rx = channel
    tx.send(b"kept")
    v = rx.recv()
    rx.close()
    assert bytes(v) == b"kept"
    with pytest.raises(ValueError, match="closed"):
        rx.recv(timeout=0)
    v.release()


def test_a_view_inherited_by_a_forked_child_refuses_to_read(channel):
    tx, rx = channel
    tx.send(b"parent's")
    v = rx.recv()

    def body():
        try:
            bytes(v)
            code = 1
        except pinshm.PinshmError:
            code = 0
        try:
            memoryview(v)
            code += 10
        except pinshm.PinshmError:
            pass
        return code

    assert in_child(body) == 0
    assert bytes(v) == b"parent's"  # the parent's view still reads
    v.release()


def test_a_view_released_while_another_thread_waits_in_recv_frees_its_slot(channel):
    tx, rx = channel
    tx.send(b"a")
    v = rx.recv()
    got = []
    started = threading.Event()

    def receive():
        started.set()
        got.append(rx.recv_bytes(timeout=WAIT_S))

    t = threading.Thread(target=receive)
    t.start()
    started.wait(WAIT_S)
    # The receiver may be waiting in recv, holding the reader: the release
    # takes no lock of it, and frees the slot at once.
    v.release()
    tx.send(b"b", timeout=WAIT_S)  # slot 1: free anyway
    t.join(WAIT_S)
    assert got == [b"b"]
    # Slot 0 is free only if the view's release was applied.
    tx.send(b"c", timeout=WAIT_S)
    assert rx.recv_bytes() == b"c"


@pytest.mark.parametrize("side", ["recv", "recv_bytes", "send"])
def test_cancel_ends_a_blocked_call_at_once(unique_name, closing, side):
    tx = closing(pinshm.Broadcast(1, 1, 16, name=unique_name()))
    rx = closing(pinshm.BroadcastReader.attach(tx.handle(), 0))
    if side == "send":
        tx.send(b"full")  # one slot, never released
        call, target = (lambda: tx.send(b"blocked")), tx
    else:
        call, target = getattr(rx, side), rx
    outcome = []
    started = threading.Event()

    def run():
        started.set()
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - the outcome is the test
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(WAIT_S)
    target.cancel()
    t.join(WAIT_S)
    assert not t.is_alive(), "cancel did not end the blocked call"
    assert [type(e) for e in outcome] == [pinshm.CancelledError]


def test_send_parts_gathers_every_part_into_one_message(channel):
    tx, rx = channel
    tx.send_parts([b"head", bytearray(b"-"), memoryview(b"tail")])
    tx.send_parts([])
    assert rx.recv_bytes() == b"head-tail"
    assert rx.recv_bytes() == b""
    with pytest.raises(ValueError, match="exceeds"):
        tx.send_parts([bytes(4000), bytes(97)])

"""The broadcast channel in one process, and handles that pickle."""

import builtins
import pickle

import pytest

import pinshm


@pytest.fixture
def channel(unique_name, closing):
    tx = closing(pinshm.Broadcast(1, 2, 64, name=unique_name()))
    rx = closing(pinshm.BroadcastReader.attach(tx.handle(), 0))
    return tx, rx


def test_messages_arrive_in_order_as_bytes(channel):
    tx, rx = channel
    tx.send(b"one")
    tx.send(bytearray(b"two"))
    assert rx.recv() == b"one"
    assert rx.recv(timeout=10) == b"two"
    assert rx.try_recv() is None
    assert tx.sent == 2


def test_a_full_channel_refuses_try_send_and_times_out_send(channel):
    tx, rx = channel
    assert tx.try_send(b"a") and tx.try_send(b"b")
    assert not tx.try_send(b"c")
    with pytest.raises(pinshm.TimeoutError) as e:
        tx.send(b"c", timeout=0)
    assert isinstance(e.value, builtins.TimeoutError)
    assert rx.recv() == b"a"
    assert tx.try_send(b"c")


def test_an_empty_channel_times_out_recv(channel):
    _, rx = channel
    with pytest.raises(pinshm.TimeoutError, match="recv"):
        rx.recv(timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        rx.recv(timeout=-1)


def test_a_message_larger_than_a_slot_raises(channel):
    tx, _ = channel
    with pytest.raises(ValueError, match="exceeds"):
        tx.send(bytes(65))


def test_receivers_drain_then_see_the_writer_gone(channel):
    tx, rx = channel
    tx.send(b"last")
    tx.close()
    assert rx.recv() == b"last"
    with pytest.raises(pinshm.WriterGoneError):
        rx.recv()


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

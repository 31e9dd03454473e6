"""Objects inherited by a forked child: the child reads and locks nothing of
the parent's (PinshmError, as the core's Error::Forked), and never hangs."""



import pinshm
from _fork import WAIT_S, in_child
from _gates import in_call

KIB = 1024


def refuses(call):
    """0 if `call()` raises PinshmError, 1 if it succeeds, 2 otherwise."""
    try:
        call()
    except pinshm.PinshmError:
        return 0
    except BaseException:
        return 2
    return 1


# The `store` fixture (conftest): 64 KiB for objects up to 16 KiB.
STORE_SHAPE = (64 * KIB, 16 * KIB, 1)


def test_a_guard_inherited_by_a_forked_child_refuses_to_read_the_slot(store, reader):
    h = store.put("a", b"abc")
    g = reader.get(h)

    def child():
        return refuses(lambda: bytes(g)) * 10 + refuses(lambda: memoryview(g))

    assert in_child(child) == 0
    assert bytes(g) == b"abc"  # the parent's guard still reads
    g.release()


def test_a_forked_child_refuses_at_once_where_a_parent_thread_held_a_lock_at_the_fork(
    unique_name, closing
):
    # Channel 1: a thread blocked in recv() (its reader's mutex held while
    # it waits). Channel 2: a thread blocked in send() on a full ring.
    b1 = closing(pinshm.Broadcast(1, 2, 64, name=unique_name("one")))
    r1 = closing(pinshm.BroadcastReader.attach(b1.handle(), 0))
    b2 = closing(pinshm.Broadcast(1, 2, 64, name=unique_name("two")))
    r2 = closing(pinshm.BroadcastReader.attach(b2.handle(), 0))
    b2.send(b"1")
    b2.send(b"2")
    got = []
    receiver, receiving = in_call("recv_bytes", lambda: got.append(r1.recv_bytes()))
    sender, sending = in_call("send", lambda: b2.send(b"3"))
    # Both are in their waits (nothing to receive, no free slot).
    assert receiving.wait(WAIT_S) and sending.wait(WAIT_S)
    assert receiver.is_alive() and sender.is_alive()

    def child():
        code = refuses(r1.try_recv) * 1000 + refuses(lambda: r1.recv(timeout=0.1)) * 100
        code += refuses(lambda: b2.try_send(b"x")) * 10 + refuses(lambda: b2.sent)
        r1.close()  # nothing, and at once: the reader is the parent's
        b2.close()
        return min(code, 98)

    assert in_child(child) == 0
    b1.send(b"wake")
    assert [r2.recv_bytes(timeout=5) for _ in range(3)] == [b"1", b"2", b"3"]
    receiver.join(5)
    sender.join(5)
    assert got == [b"wake"]


def test_dropping_an_inherited_guard_in_a_forked_child_leaves_the_parents_read_alone(
    store, reader
):
    h = store.put("a", b"abc")
    g = reader.get(h)

    def child():
        nonlocal g
        del g
        return 0

    assert in_child(child) == 0
    assert store.free_unused() == 0  # the parent's read still holds it
    g.release()
    assert store.free_unused() == 1

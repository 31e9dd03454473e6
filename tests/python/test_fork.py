"""Objects inherited by a forked child: the child reads and locks nothing of
the parent's (PinshmError, as the core's Error::Forked), and never hangs."""

import os
import threading
import time

import pytest

import pinshm

KIB = 1024
# A guard against a hang, not a timing assumption.
WAIT_S = 60


def in_child(body):
    """Runs `body()` in a forked child; returns its exit code (the child
    reports through it: body returns the code; an exception gives 99)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = body()
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


def refuses(call):
    """0 if `call()` raises PinshmError, 1 if it succeeds, 2 otherwise."""
    try:
        call()
    except pinshm.PinshmError:
        return 0
    except BaseException:
        return 2
    return 1


@pytest.fixture
def store(unique_name, closing):
    return closing(pinshm.ObjectStore(64 * KIB, 16 * KIB, 1, name=unique_name()))


@pytest.fixture
def reader(store, closing):
    return closing(pinshm.StoreReader.attach(store.handle(), 0))


def test_a_guard_inherited_by_a_forked_child_refuses_to_read_the_slot(store, reader):
    h = store.put("a", b"abc")
    g = reader.get(h)

    def child():
        return refuses(lambda: bytes(g)) * 10 + refuses(lambda: memoryview(g))

    assert in_child(child) == 0
    assert bytes(g) == b"abc"  # the parent's guard still reads
    g.release()
